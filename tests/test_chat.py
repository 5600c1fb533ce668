"""`hyspec chat` and chat templates: HF-style rendering, the plain fallback, and a session
saved by one process and loaded by another (bitwise the same state, the same reply)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyspec.chat_template import PLAIN_TEMPLATE, TemplateError, load_template, render_chat

ROOT = Path(__file__).resolve().parents[1]

CHATML = ("{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
          "{{ raise_exception('system message must come first') }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_hf_template_rendering(tmp_path):
    cfg = {"chat_template": "{{ bos_token }}" + CHATML, "bos_token": {"content": "<s>", "special": True},
           "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}]
    want = ("<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
            "<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(msgs, tmp_path) == want
    assert render_chat(msgs, tmp_path, add_generation_prompt=False) == want[: -len("<|im_start|>assistant\n")]
    with pytest.raises(TemplateError, match="system message must come first"):
        render_chat(msgs + [{"role": "system", "content": "x"}], tmp_path)
    transformers = pytest.importorskip("transformers")
    tok_dir = tmp_path / "hf"
    tok_dir.mkdir()
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": "<s>",
                                                               "tokenizer_class": "PreTrainedTokenizerFast"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == render_chat(msgs, tok_dir)


def test_template_sources(tmp_path):
    assert load_template(tmp_path)[1] == "plain"
    assert load_template(tmp_path)[0] == PLAIN_TEMPLATE
    assert render_chat([{"role": "user", "content": "def f():\n"}, {"role": "assistant", "content": "  pass"}],
                       tmp_path) == "def f():\n  pass"
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    assert load_template(tmp_path)[1] == "chat_template.jinja"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]}))
    src, where, _ = load_template(tmp_path)
    assert (src, where) == (CHATML, "tokenizer_config.json")


def chat(lines: list[str], *flags: str) -> tuple[list[dict], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "hyspec.cli", "chat", "--max-new-tokens", "12", *flags],
                       input="".join(x + "\n" for x in lines), capture_output=True, text=True, env=env, timeout=120,
                       cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    assert "[error" not in p.stdout, p.stdout
    stats = [json.loads(x[len("[stats] "):]) for x in p.stdout.splitlines() if x.startswith("[stats] ")]
    return stats, p.stdout


@pytest.mark.parametrize("flags", [("--draft", "2"), ("--temperature", "0.8", "--seed", "3", "--draft", "3",
                                                      "--sampling-mode", "coupled")])
def test_save_in_one_process_load_in_another(tmp_path, flags):
    f = str(tmp_path / "chat.pt")
    a, out_a = chat(["def add(a, b):", "/stats", f"/save {f}", "    return a", "/stats", "", "/stats"], *flags)
    b, out_b = chat([f"/load {f}", "/stats", "    return a", "/stats", "", "/stats"], *flags)
    assert b[0]["state_digest"] == a[0]["state_digest"] and b[0]["context_tokens"] == a[0]["context_tokens"]
    for x, y in zip(a[1:], b[1:]):
        assert x["turn_tokens"] == y["turn_tokens"] and x["state_digest"] == y["state_digest"]
    assert a[1]["turn_prefilled"] < a[1]["context_tokens"] // 2  # only the new text (and the pending token) ran
    assert "[loaded" in out_b
    if "--temperature" in flags:
        return
    c, _ = chat(["def add(a, b):", "    return a", "/rewind", "/stats", "    return a", "/stats", "/reset", "/stats"],
                *flags)
    assert c[0]["state_digest"] == a[0]["state_digest"] and c[1]["turn_tokens"] == a[1]["turn_tokens"]
    assert c[2]["context_tokens"] == 0 and c[2]["state_digest"] is None


def test_chat_with_a_checkpoint_template_sends_only_the_new_text(zoo, tmp_path):
    """With a tokenizer_config.json chat_template, each turn prefills only the text the
    template adds after what the session holds (plus the pending token)."""
    import io
    import shutil

    from hyspec.chat import Chat
    from hyspec.engine import Engine

    d = tmp_path / "ckpt"
    shutil.copytree(zoo.path("tiny", "qwen3_5"), d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    eng = Engine.load(d, dtype="float64")
    out = io.StringIO()
    c = Chat(eng, eng.session(draft=2, max_new_tokens=6, ignore_eos=True), d, out=out)
    assert c.template_source == "tokenizer_config.json"
    c.user("hello there")
    first = list(c.session.tokens)
    assert first[: len(eng.encode(render_chat([{"role": "user", "content": "hello there"}], d)))] == \
        eng.encode(render_chat([{"role": "user", "content": "hello there"}], d))
    stats = c.user("and again")
    delta = render_chat(c.messages[:-1], d)[len(c.stack[-1][1]):]
    assert delta.startswith("<|im_end|>\n<|im_start|>user\nand again")
    assert c.session.tokens[: len(first)] == first
    assert stats["prompt_tokens"] - stats["cached_tokens"] == len(eng.encode(delta)) + 1  # + the pending token
    c.command("/rewind")
    assert c.session.tokens == first and len(c.messages) == 2


def test_chat_constraint_flags():
    """`hyspec chat --regex ...`: every reply matches; a bad pattern is an error naming the flag."""
    import io
    import re

    pytest.importorskip("llguidance")
    from hyspec.chat import main

    out, err = io.StringIO(), io.StringIO()
    assert main(["--regex", "[a-z ]{3,30}[.]", "--max-new-tokens", "40", "--draft", "2"],
                stdin=io.StringIO("def f():\nclass A:\n"), stdout=out) == 0
    replies = [x.removesuffix("<|endoftext|>") for x in out.getvalue().splitlines()]
    assert len(replies) == 2 and all(re.fullmatch(r"[a-z ]{3,30}[.]", r) for r in replies), replies
    import contextlib

    with contextlib.redirect_stderr(err):
        assert main(["--regex", "[a-z"], stdin=io.StringIO(""), stdout=out) == 2
    assert "--regex" in err.getvalue() and "Traceback" not in err.getvalue()


def test_chat_bad_commands_and_json(tmp_path):
    """A file that is not a torch file, a torch file that is not a session and a non-number
    for /rewind are one-line errors and the chat goes on; --json prints the session's
    figures as one JSON object at the end."""
    import io

    from hyspec.chat import main

    (tmp_path / "text.txt").write_text("hello")
    import torch

    torch.save({"a": 1}, tmp_path / "other.pt")
    out = io.StringIO()
    lines = [f"/load {tmp_path / 'text.txt'}", f"/load {tmp_path / 'other.pt'}", "/rewind abc", "def f():"]
    assert main(["--max-new-tokens", "4", "--json"], stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out) == 0
    text = out.getvalue().splitlines()
    errors = [x for x in text if x.startswith("[error")]
    assert len(errors) == 3 and "Traceback" not in out.getvalue(), text
    assert "not a hyspec session file" in errors[0] and "text.txt" in errors[0] and "\n" not in errors[0]
    assert "not a hyspec session file" in errors[1]
    assert "/rewind takes a number of turns, got 'abc'" in errors[2]
    last = json.loads(text[-1])
    assert last["turns"] == 1 and len(last["turn_tokens"]) == 4
