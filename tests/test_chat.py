"""`hyspec chat` and chat templates: HF-style rendering, the plain fallback, and a session
saved by one process and loaded by another (bitwise the same state, the same reply)."""

from __future__ import annotations

import contextlib
import json
import os
import re
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


def test_a_template_with_a_generation_block_renders_as_transformers_does(tmp_path):
    """{% generation %}...{% endgeneration %} (around the assistant's text, for training masks;
    transformers registers the tag for every template) was refused: "the chat template does not
    parse: Encountered unknown tag 'generation'"."""
    src = CHATML.replace("+ message['content'] + '<|im_end|>' + '\n' }}",
                         "}}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}")
    assert "{% generation %}" in src
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": src, "eos_token": "<|im_end|>"}))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(msgs, tmp_path) == want
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": src, "eos_token": "<|im_end|>",
                                                                "tokenizer_class": "PreTrainedTokenizerFast"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == want


QWEN3_LOOP = ("{%- if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
              "{%- endif %}{%- for m in messages %}"
              "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
              "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}<|im_end|>\n{%- endif %}"
              "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_a_developer_message_reaches_a_template_that_knows_only_system(tmp_path):
    """OpenAI's "developer" role (its newer name for "system"): Qwen's templates test
    role == "system" and rendered no such message at all (dropped in silence)."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3_LOOP}))
    dev = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    sys_ = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert "Be brief." in render_chat(dev, tmp_path)
    assert render_chat(dev, tmp_path) == render_chat(sys_, tmp_path)
    # a template that names the role itself gets it as it is
    own = "{% for m in messages %}{% if m.role == 'developer' %}D:{{ m.content }}|{% else %}{{ m.content }}|" \
          "{% endif %}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": own}))
    assert render_chat(dev, tmp_path) == "D:Be brief.|hi|"


def test_template_sources(tmp_path):
    assert load_template(tmp_path)[1] == "plain"
    assert load_template(tmp_path)[0] == PLAIN_TEMPLATE
    assert render_chat([{"role": "user", "content": "def f():\n"}, {"role": "assistant", "content": "  pass"}],
                       tmp_path) == "def f():\n  pass"
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    assert load_template(tmp_path)[1] == "chat_template.jinja"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]}))
    src, where, _ = load_template(tmp_path)
    assert (src, where) == (CHATML, "tokenizer_config.json")


def test_chat_template_jinja_wins_over_the_config_template_as_in_transformers(tmp_path):
    """A checkpoint with both a tokenizer_config.json chat_template and a chat_template.jinja
    (the file transformers saves, and the one it loads first): hyspec rendered the config's
    (older) template, transformers' apply_chat_template (and vLLM) the .jinja file."""
    msgs = [{"role": "user", "content": "hi"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "OLD {{ messages[0].content }}",
                                                                "eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text("NEW {{ messages[0].content }} {{ eos_token }}")
    src, where, special = load_template(tmp_path)
    assert where == "chat_template.jinja" and special["eos_token"] == "<|im_end|>"
    assert render_chat(msgs, tmp_path) == "NEW hi <|im_end|>"
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.apply_chat_template(msgs, tokenize=False) == render_chat(msgs, tmp_path)


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



def _chatml_engine(zoo, tmp_path):
    """A copy of the tiny qwen3_5 checkpoint with the ChatML template and <|im_end|> as its
    eos token, and its float64 Engine: (checkpoint dir, engine)."""
    import shutil

    from hyspec.engine import Engine

    d = tmp_path / "ckpt"
    shutil.copytree(zoo.path("tiny", "qwen3_5"), d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return d, Engine.load(d, dtype="float64")

def test_chat_with_a_checkpoint_template_sends_only_the_new_text(zoo, tmp_path):
    """With a tokenizer_config.json chat_template, each turn prefills only the text the
    template adds after what the session holds (plus the pending token)."""
    import io

    from hyspec.chat import Chat

    d, eng = _chatml_engine(zoo, tmp_path)
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


def test_a_system_message_opens_the_conversation_and_each_after_reset(zoo, tmp_path, monkeypatch, capsys):
    """`hyspec chat --system TEXT`: the first turn's prompt is the template's rendering of the
    system message and the user's (the transcript == a session sent that text), /reset and
    /rewind to the start keep it; with the plain template its text opens the transcript and
    the line starts on a new line; a template that refuses or drops a system message is a
    one-line error naming the flag, before any turn."""
    import io
    import shutil

    from hyspec.chat import Chat, main
    from hyspec.cli import common

    d, eng = _chatml_engine(zoo, tmp_path)
    sys_msg = [{"role": "system", "content": "Be terse."}]
    text = render_chat(sys_msg + [{"role": "user", "content": "hello"}], d)
    want = eng.encode(text) + eng.session(max_new_tokens=4, ignore_eos=True).send(text).tokens
    c = Chat(eng, eng.session(max_new_tokens=4, ignore_eos=True), d, out=io.StringIO())
    c.set_system("Be terse.")
    c.user("hello")
    assert c.session.tokens == want
    assert c.messages[:2] == sys_msg + [{"role": "user", "content": "hello"}]
    first = list(c.session.tokens)
    c.command("/reset")
    assert c.messages == sys_msg and not c.session.tokens
    c.user("hello")
    assert c.session.tokens == first
    c.user("more")
    c.command("/rewind 2")
    assert c.messages == sys_msg and not c.session.tokens
    c.user("hello")
    assert c.session.tokens == first
    with pytest.raises(ValueError, match="has begun"):
        c.set_system("late")

    # the plain template (the embedded code model): the text opens the transcript, the line after it
    monkeypatch.setattr(common, "load_engine", lambda args: eng_plain)
    from hyspec.engine import Engine

    eng_plain = Engine.load()
    out = io.StringIO()
    assert main(["--system", "# helpers", "--max-new-tokens", "3", "--ignore-eos"],
                stdin=io.StringIO("def f(x):\n/stats\n"), stdout=out) == 0
    s = stats_lines(out.getvalue())[0]
    prompt = eng_plain.encode("# helpers\ndef f(x):")
    assert s["context_tokens"] == len(prompt) + 3
    capsys.readouterr()

    # a template without a system role: refused up front, naming the flag
    d2 = tmp_path / "nosys"
    shutil.copytree(d, d2)
    for tpl, why in (("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                      "{% endif %}{{ m['content'] }}{% endfor %}", "refuses a system message: no system role"),
                     ("{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}"
                      "{% endfor %}", "leaves a system message out")):
        (d2 / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl, "eos_token": "<|im_end|>"}))
        e2 = Engine.load(d2, dtype="float64")
        monkeypatch.setattr(common, "load_engine", lambda args: e2)
        assert main(["--model", str(d2), "--system", "x"], stdin=io.StringIO("hi\n"), stdout=io.StringIO()) == 2
        err = capsys.readouterr().err
        assert err.startswith("hyspec chat: error: --system: the chat template") and why in err, err
        assert "Traceback" not in err


def test_the_checkpoints_recommended_sampling_where_no_flag_is_given(zoo, tmp_path, monkeypatch, capsys):
    """A checkpoint whose generation_config.json recommends sampling (do_sample true,
    temperature, top_k: Qwen3.5's files do, and warn against greedy decoding): `hyspec chat`
    samples with it where no flag says otherwise and says so on stderr (the replies == the
    same flags given by hand); a flag wins (--temperature 0: greedy, == the checkpoint without
    the file). Engine.load reads it (Engine.sampling_defaults), and a bad value there is an
    error before the weights load."""
    import io
    import shutil

    from hyspec.chat import main
    from hyspec.cli import common
    from hyspec.config import ConfigError
    from hyspec.engine import Engine
    from hyspec.sampling import SamplingParams

    d = tmp_path / "ckpt"
    shutil.copytree(zoo.path("tiny", "qwen3_5"), d)
    plain = Engine.load(d, dtype="float64")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "do_sample": True, "temperature": 0.9,
                                                          "top_k": 7}))
    rec = Engine.load(d, dtype="float64")
    assert rec.sampling_defaults == {"temperature": 0.9, "top_k": 7} and plain.sampling_defaults == {}
    assert Engine(rec.model, rec.tokenizer, str(d)).sampling_defaults == rec.sampling_defaults  # (a pipeline's)
    assert rec.recommended_params(seed=3, top_k=2) == SamplingParams(temperature=0.9, top_k=2, seed=3)
    assert plain.recommended_params() == SamplingParams()

    def chat(eng, *flags):
        monkeypatch.setattr(common, "load_engine", lambda args: eng)
        out = io.StringIO()
        assert main(["--max-new-tokens", "12", "--ignore-eos", *flags], stdin=io.StringIO("abc\n/stats\n"),
                    stdout=out) == 0
        return stats_lines(out.getvalue())[0]["turn_tokens"], capsys.readouterr().err

    got, err = chat(rec)
    assert "generation_config.json sampling: --temperature 0.9, --top-k 7" in err
    assert got == chat(plain, "--temperature", "0.9", "--top-k", "7")[0]
    assert got != chat(plain)[0]  # (it samples: not the greedy reply)
    got, err = chat(rec, "--temperature", "0")
    assert got == chat(plain)[0] and "--temperature 0.9" not in err and "--top-k 7" in err
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 3}))
    with pytest.raises(ConfigError, match=r"generation_config\.json: .*top_p"):
        Engine.load(d, dtype="float64")


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
    """A file that is not a torch file, a torch file that is not a session, a non-number
    for /rewind and an argument to /reset or /quit are one-line errors and the chat goes on; --json prints the session's
    figures as one JSON object at the end."""
    import io

    from hyspec.chat import main

    (tmp_path / "text.txt").write_text("hello")
    import torch

    torch.save({"a": 1}, tmp_path / "other.pt")
    out = io.StringIO()
    lines = [f"/load {tmp_path / 'text.txt'}", f"/load {tmp_path / 'other.pt'}", "/rewind abc", "def f():",
             "/reset all", f"/load {tmp_path / 'none.pt'}", f"/load {tmp_path}",  # (were "[Errno 2] ...")
             "/quit now"]  # (an argument to /reset or /quit was ignored: they ran)
    assert main(["--max-new-tokens", "4", "--json"], stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out) == 0
    text = out.getvalue().splitlines()
    errors = [x for x in text if x.startswith("[error")]
    assert len(errors) == 7 and "Traceback" not in out.getvalue(), text
    assert "/reset takes no argument" in errors[3] and "/quit takes no argument" in errors[6]
    assert errors[4] == f"[error: no session file {tmp_path / 'none.pt'}]"
    assert errors[5] == f"[error: {tmp_path} is a directory, not a session file]"
    assert "not a hyspec session file" in errors[0] and "text.txt" in errors[0] and "\n" not in errors[0]
    assert "not a hyspec session file" in errors[1]
    assert "/rewind takes a number of turns, got 'abc'" in errors[2]
    last = json.loads(text[-1])
    assert last["turns"] == 1 and len(last["turn_tokens"]) == 4


def test_chat_flag_errors_are_one_line(capsys):
    """--stop-ids that are not ids (a traceback once) and --forced-rates (taken and ignored
    once: the forced drafter needs a reference continuation; not a chat flag now) are
    one-line errors, before the model loads."""
    from hyspec.chat import main

    with pytest.raises(SystemExit) as e:
        main(["--stop-ids", "abc"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--stop-ids" in err and "Traceback" not in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        main(["--forced-rates", "0.9", "--draft", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--forced-rates" in err and len(err.splitlines()) == 1


# -- the terminal chat's display and commands, in process over the embedded default model ------------------
@pytest.fixture(scope="module")
def default_engine():
    from hyspec.engine import Engine

    return Engine.load()


@pytest.fixture
def run_chat(default_engine, monkeypatch):
    """`hyspec chat` (hyspec.chat.main) over the module's engine: lines in, stdout's text out."""
    import io

    from hyspec.chat import main
    from hyspec.cli import common

    monkeypatch.setattr(common, "load_engine", lambda args: default_engine)

    def run(lines, *flags, stdin=None, stdout=None):
        out = stdout if stdout is not None else io.StringIO()
        stdin = stdin if stdin is not None else io.StringIO("".join(x + "\n" for x in lines))
        assert main(["--max-new-tokens", "8", *flags], stdin=stdin, stdout=out) == 0
        return out.getvalue()

    return run


class Lines:
    """Standard input as a list of lines; the item KeyboardInterrupt is a Ctrl-C while reading."""

    def __init__(self, items):
        self.items = list(items)

    def readline(self):
        x = self.items.pop(0) if self.items else ""
        if x is KeyboardInterrupt:
            raise KeyboardInterrupt
        return x


def stats_lines(text: str) -> list[dict]:
    return [json.loads(x[len("[stats] "):]) for x in text.splitlines() if x.startswith("[stats] ")]


@contextlib.contextmanager
def verify_failing_at(engine, call: int):
    """Inside the block, the engine's session rounds fail at the `call`-th verify (1-based,
    counted from the block's start): that verify raises RuntimeError("boom") before its
    forward, the others run as usual; the real verify is back after the block. A block that
    ends without reaching that verify fails (the fault was not injected)."""
    backend = engine.session_scheduler().backend
    orig, had, calls = backend.verify, "verify" in vars(backend), []

    def verify(*a, **kw):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("boom")
        return orig(*a, **kw)

    backend.verify = verify
    try:
        yield
    finally:
        if had:
            backend.verify = orig
        else:
            del backend.verify
    assert len(calls) >= call, f"verify ran {len(calls)} times: the fault at call {call} was never injected"


def test_a_cut_reply_goes_on_on_its_own_line(run_chat):
    """A reply cut by --max-new-tokens and continued by empty lines reads as the one uncut
    reply (no line break at the cuts); output between them ends the line first."""
    whole = run_chat(["def f(x):"], "--max-new-tokens", "24")
    assert run_chat(["def f(x):", "", ""]) == whole
    assert run_chat(["def f(x):", "", ""], "--draft", "2") == whole
    between = run_chat(["def f(x):", "/stats", ""])
    assert "\n[stats] " in between and not between.startswith("[stats]")


def terminal(data: str, cols: int = 80) -> list[str]:
    """The rows a terminal shows for `data` (text, line breaks, wrapping, ESC[nF, ESC[nG, ESC[J)."""
    import re

    rows, r, c, i = [[]], 0, 0, 0
    while i < len(data):
        m = re.match(r"\x1b\[(\d*)([FGJ])", data[i:])
        if m:
            if m.group(2) == "F":
                r, c = max(0, r - int(m.group(1) or 1)), 0
            elif m.group(2) == "G":
                c = min(cols, int(m.group(1) or 1)) - 1
            else:
                del rows[r][c:], rows[r + 1:]
            i += m.end()
            continue
        ch, i = data[i], i + 1
        if ch == "\n":
            r, c = r + 1, 0
        else:
            if c == cols:
                r, c = r + 1, 0
            while len(rows) <= r:
                rows.append([])
            rows[r] += [" "] * (c + 1 - len(rows[r]))
            rows[r][c], c = ch, c + 1
        while len(rows) <= r:
            rows.append([])
    return ["".join(x) for x in rows]


def test_a_cut_reply_goes_on_on_its_line_on_a_terminal(default_engine, monkeypatch):
    """On a terminal the prompt comes after a cut reply; the empty line typed there draws
    the reply's last line again in the prompt's place: the screen shows the uncut reply."""
    import io

    from hyspec.chat import Chat
    from hyspec.engine import default_model_dir

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("TERM", "xterm")
    eng = default_engine
    whole = eng.decode(eng.session(max_new_tokens=24).send("def f(x):").tokens)
    assert whole.startswith("\n")  # (the line's break: not drawn again after the typed line's)
    tty = Tty()
    c = Chat(eng, eng.session(max_new_tokens=8), default_model_dir(), out=tty)
    for typed in ("def f(x):", "", ""):
        c.prompt()
        tty.write(typed + "\n")  # the terminal's echo
        c.user(typed)
    c.prompt()
    assert terminal(tty.getvalue()) == ["> def f(x):"] + whole[1:].split("\n") + ["> "]
    assert tty.getvalue().count("\x1b[") == 4  # (two redraws: up, clear)
    tty.write("/stats\n")
    c.command("/stats")  # a command's output ends the reply's line: the next piece starts a line of its own
    tty.write("\n")
    c.user("")
    assert tty.getvalue().count("\x1b[") == 4 and "\n[stats] " in tty.getvalue()


def test_a_dumb_terminal_gets_no_escape_sequences(default_engine, monkeypatch):
    """TERM=dumb: a terminal that cannot move the cursor; a cut reply continued there is written
    on as on a pipe, no ESC[ sequences (the redraw's would show as text)."""
    import io

    from hyspec.chat import Chat
    from hyspec.engine import default_model_dir

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("TERM", "dumb")
    eng = default_engine
    tty = Tty()
    c = Chat(eng, eng.session(max_new_tokens=8), default_model_dir(), out=tty)
    for typed in ("import", "", ""):
        c.prompt()
        tty.write(typed + "\n")  # the terminal's echo
        c.user(typed, typed=typed)
    c.end_line()
    assert "\x1b" not in tty.getvalue() and c.session.num_turns == 3, repr(tty.getvalue())
    c.close()


def test_a_reply_that_goes_on_on_the_typed_line_is_drawn_after_it(default_engine, monkeypatch):
    """Plain template on a terminal: a reply that continues the typed line itself ("import" ->
    " warnings...") is drawn after it on its row (it was drawn on the row below, where the
    Enter left the cursor: the screen showed a line break the transcript does not have); a
    reply that opens with a line break is drawn below as before; piped input has no echo."""
    import io

    from hyspec.chat import Chat
    from hyspec.engine import default_model_dir

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("TERM", "xterm")
    eng = default_engine
    # (the second one wraps past the 80 columns; the third, with the prompt, fills its row exactly:
    # the reply starts on the row below, where the Enter left the cursor)
    for typed in ("import", "x" * 70 + " import", "x" * 71 + " import"):
        reply = eng.decode(eng.session(max_new_tokens=6).send(typed).tokens)
        assert not reply.startswith("\n")
        tty = Tty()
        c = Chat(eng, eng.session(max_new_tokens=6), default_model_dir(), out=tty)
        c.prompt()
        tty.write(typed + "\n")  # the terminal's echo
        c.user(typed, typed=typed)
        c.end_line()
        want = [row[i:i + 80] for row in ("> " + typed + reply).split("\n") for i in range(0, max(1, len(row)), 80)]
        assert terminal(tty.getvalue()) == want + [""], (terminal(tty.getvalue()), want)
    piped = Tty()
    c = Chat(eng, eng.session(max_new_tokens=6), default_model_dir(), out=piped)
    c.user("import")  # (no echo: nothing to go back over)
    assert "\x1b[" not in piped.getvalue()


def test_a_crlf_line_is_the_same_message(run_chat):
    """A line typed or piped with a CRLF end is the message without its "\r" (it was sent)."""
    crlf, lf = (stats_lines(run_chat([line, "/stats"])) for line in ("def f(x):\r", "def f(x):"))
    assert crlf[0]["turn_tokens"] == lf[0]["turn_tokens"] and crlf[0]["context_tokens"] == lf[0]["context_tokens"]


def test_a_plain_chat_shows_the_stop_token_and_help_and_refuses_arguments(default_engine):
    """Plain template: the screen is the transcript, the token that ended the reply (a
    --stop-ids one) included; /help prints the commands; /stats, /help and /exit take no
    argument (one that was given was ignored)."""
    import io

    from hyspec.chat import HELP, Chat
    from hyspec.engine import default_model_dir

    eng = default_engine
    free = eng.generate("def f(x):", max_new_tokens=4, ignore_eos=True).tokens
    stop = free[1]
    assert stop not in free[:1] and not eng.decode(free[1:2]).startswith("\n")
    out = io.StringIO()
    c = Chat(eng, eng.session(max_new_tokens=4, ignore_eos=True, stop_ids=[stop]), default_model_dir(), out=out)
    c.user("def f(x):")
    c.end_line()
    assert out.getvalue() == eng.decode(free[:2]).removeprefix("\n") + "\n"
    assert c.messages[-1]["content"] == eng.decode(free[:2])
    c.command("/help")
    assert out.getvalue().endswith(HELP + "\n")
    for line in ("/stats x", "/help me", "/exit now"):
        with pytest.raises(ValueError, match="takes no argument"):
            c.command(line)
    c.close()


def test_rewind_of_several_turns_restores_the_record_before_them(default_engine):
    """/rewind N (N > 1) goes back to the chat's record before the N-th last turn, and a
    later /rewind to the one before that (the records of the undone turns all go)."""
    import io

    from hyspec.chat import Chat
    from hyspec.engine import default_model_dir

    eng = default_engine
    c = Chat(eng, eng.session(max_new_tokens=3), default_model_dir(), out=io.StringIO())
    for line in ("def f(x):", "    y = x", "    return y"):
        c.user(line)
    first = (list(c.stack[1][0]), c.stack[1][1])
    c.command("/rewind 2")
    assert len(c.stack) == 1 and (c.messages, c.rendered) == first and c.rendered == eng.decode(c.session.tokens)
    c.command("/rewind")
    assert c.stack == [] and c.messages == [] and c.rendered == "" and c.session.tokens == []
    c.close()


def test_a_continuation_stops_at_a_line_break_that_opens_it(run_chat, default_engine):
    """--stop "\n" (plain template): the opening line break of a reply is no match, but a
    cut reply's continuation that opens with a line break ends there (the reply's first
    whole line ended)."""
    first = default_engine.generate("x = 1", max_new_tokens=13, ignore_eos=True).tokens
    assert default_engine.decode(first[12:13]).startswith("\n") and "\n" not in default_engine.decode(first[1:12])
    st = stats_lines(run_chat(["x = 1", "/stats", "", "/stats"], "--max-new-tokens", "12", "--stop", "\n"))
    assert st[0]["turn_tokens"] == first[:12] and st[1]["turn_tokens"] == first[12:13]


def test_a_double_slash_line_is_a_message_starting_with_a_slash(run_chat, default_engine):
    """"//usr/bin/env python" sends "/usr/bin/env python" (a line starting with one "/" is a
    command: it was refused as an unknown one)."""
    out = run_chat(["//usr/bin/env python", "/stats"], "--draft", "0")
    assert "unknown command" not in out
    want = default_engine.generate("/usr/bin/env python", max_new_tokens=8)
    assert stats_lines(out)[0]["turn_tokens"] == want.tokens
    s = default_engine.session(max_new_tokens=8)
    s.send("/usr/bin/env python")
    assert stats_lines(out)[0]["state_digest"] == s.state().digest()  # (the message's own tokens: one "/")
    s.close()


def test_chat_stop_ends_a_reply_at_the_stop_string(run_chat, default_engine):
    """--stop TEXT: a reply ends with the token that completes TEXT (the one-shot run with
    stop= gives the same tokens), and the chat goes on from there."""
    full = default_engine.generate("def f(x):", max_new_tokens=8, draft=3, ignore_eos=True)
    stop = full.text[len(full.text) // 2:][:2]
    want = default_engine.generate("def f(x):", max_new_tokens=8, draft=3, ignore_eos=True, stop=stop)
    assert want.samples[0].stop_reason == "stop" and len(want.tokens) < len(full.tokens)
    st = stats_lines(run_chat(["def f(x):", "/stats", "y = 1", "/stats"], "--draft", "3", "--ignore-eos", "--stop",
                              stop, "--stop", "never here"))
    assert st[0]["turn_tokens"] == want.tokens and st[1]["turns"] == 2


def test_a_reply_ended_by_a_stop_string_goes_on_on_its_line(run_chat, default_engine):
    """Plain template: an empty line after a reply ended by a --stop string continues it on
    the same line (the transcript shows no line break there)."""
    full = default_engine.generate("def f(x):", max_new_tokens=16, ignore_eos=True)
    stop = full.text[len(full.text) // 3:][:2]
    out = run_chat(["def f(x):", ""], "--ignore-eos", "--stop", stop)
    first = default_engine.generate("def f(x):", max_new_tokens=8, ignore_eos=True, stop=stop)
    assert first.samples[0].stop_reason == "stop"
    # (the chat shows the stop string, .text leaves it out; the reply's opening line break is not drawn)
    reply = default_engine.decode(first.tokens).removeprefix("\n")
    rest = out[len(reply):]
    assert out.startswith(reply) and rest.strip() and not rest.startswith("\n")


def test_a_newline_stop_ends_a_reply_at_its_first_whole_line(run_chat, default_engine):
    """Plain template: a line is sent without its newline, so the reply opens with the line
    break; --stop "\n" must not match that break (the reply was its first token alone) but
    the one that ends the reply's first whole line."""
    st = stats_lines(run_chat(["def f(x):", "/stats"], "--max-new-tokens", "40", "--stop", "\n"))
    text = default_engine.decode(st[0]["turn_tokens"])
    assert text.startswith("\n") and text[1:].split("\n")[0].strip()  # (was "\n        ": one token)
    assert "\n" in text[1:] and len(st[0]["turn_tokens"]) < 40  # ended by the first whole line's break


def test_stats_after_rewind_count_only_the_turns_left(run_chat):
    """/stats after /rewind: the conversation's acceptance without the undone turn, and the
    figures of the turn that is now the last (were: the undone turn counted, nulls)."""
    s = stats_lines(run_chat(["def f(x):", "/stats", "    return x", "/stats", "/rewind", "/stats", "/rewind",
                              "/stats"], "--draft", "2"))
    assert s[0]["overall_acceptance"] != s[1]["overall_acceptance"]
    assert s[2]["overall_acceptance"] == s[0]["overall_acceptance"]
    assert s[2]["turn_tokens"] == s[0]["turn_tokens"] and s[2]["turn_acceptance"] == s[0]["turn_acceptance"]
    assert s[2]["turns"] == 1 and s[2]["state_digest"] == s[0]["state_digest"]
    assert s[3]["turns"] == 0 and s[3]["overall_acceptance"] is None and s[3]["turn_tokens"] is None


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(run_chat):
    """A Ctrl-C that stops a reply at once (a KeyboardInterrupt raised inside it: a second
    press, or where no handler of ours runs) drops that turn (the conversation is as before
    it) and the chat goes on; Ctrl-C at the prompt is a note, not the end (was: the whole chat
    ended)."""
    import io

    class Interrupting(io.StringIO):
        def __init__(self, at):
            super().__init__()
            self.n, self.at = 0, at

        def write(self, s):
            self.n += 1
            if self.n == self.at:
                raise KeyboardInterrupt
            return super().write(s)

    want = stats_lines(run_chat(["    return x", "/stats"]))[0]
    try:
        text = run_chat([], stdin=Lines(["def f(x):\n", KeyboardInterrupt, "/stats\n", "    return x\n", "/stats\n"]),
                        stdout=Interrupting(3))
    except KeyboardInterrupt:  # (not let through: pytest would stop the whole run)
        pytest.fail("Ctrl-C ended the chat")
    assert "[interrupted: the reply is dropped" in text and "[Ctrl-C: /quit or Ctrl-D leaves]" in text
    s = stats_lines(text)
    assert s[0]["turns"] == 0 and s[0]["context_tokens"] == 0
    assert s[1]["turns"] == 1 and s[1]["turn_tokens"] == want["turn_tokens"]


@pytest.mark.parametrize("draft", ["0", "2"])
def test_a_first_ctrl_c_keeps_the_reply_so_far_and_a_second_drops_it(run_chat, draft):
    """A real SIGINT during a reply (sent from the stream's write, as a terminal's Ctrl-C
    arrives mid-reply): one press stops the reply after its round and keeps it, a cut reply
    (the chat says so; the conversation's state == a chat whose reply --max-new-tokens cut at
    the same length; an empty line continues it); two presses stop at once and undo the turn
    (was: any Ctrl-C undid the turn, the text on screen forgotten). Our SIGINT handler is
    gone afterwards."""
    import io
    import os
    import signal

    class PressingCtrlC(io.StringIO):
        def __init__(self, presses):
            super().__init__()
            self.presses, self.n = presses, 0

        def write(self, s):
            self.n += 1
            if self.n == 2:  # the reply's second round on screen
                for _ in range(self.presses):
                    os.kill(os.getpid(), signal.SIGINT)
            return super().write(s)

    before = signal.getsignal(signal.SIGINT)
    assert before not in (signal.SIG_IGN, None)  # (tests/conftest.py restores a background run's)
    flags = ("--max-new-tokens", "24", "--draft", draft, "--ignore-eos")
    whole = stats_lines(run_chat(["def f(x):", "/stats"], *flags))[0]
    text = run_chat([], *flags, stdin=io.StringIO("def f(x):\n/stats\n\n/stats\n"), stdout=PressingCtrlC(1))
    assert "[stopped: the reply so far is kept" in text and "[interrupted" not in text
    s = stats_lines(text)
    m = len(s[0]["turn_tokens"])  # (the turn's token ids)
    assert s[0]["turns"] == 1 and 1 <= m < len(whole["turn_tokens"]) == 24
    assert s[0]["turn_tokens"] == whole["turn_tokens"][:m]
    cut = stats_lines(run_chat(["def f(x):", "/stats"], "--max-new-tokens", str(m), "--draft", draft, "--ignore-eos"))[0]
    assert s[0]["state_digest"] == cut["state_digest"] and s[0]["context_tokens"] == cut["context_tokens"]
    assert s[1]["context_tokens"] == s[0]["context_tokens"] + 24  # the empty line went on from it
    assert signal.getsignal(signal.SIGINT) is before
    text = run_chat([], *flags, stdin=io.StringIO("def f(x):\n/stats\n"), stdout=PressingCtrlC(2))
    assert "[interrupted: the reply is dropped" in text and "[stopped" not in text
    assert stats_lines(text)[0]["turns"] == 0 and stats_lines(text)[0]["context_tokens"] == 0
    assert signal.getsignal(signal.SIGINT) is before


def test_paste_sends_the_lines_up_to_end_as_one_message(run_chat, default_engine):
    """/paste: the lines after it, up to one that is only /end, are one message (empty lines
    and "/" lines in it as typed, none run as a command): the conversation == one turn of
    that text sent by the API (the plain template: after a line break, as a typed line); the
    end of input ends a paste too (it is sent); a Ctrl-C in it drops it; nothing pasted is a
    note; /paste with an argument is an error."""
    import io

    from hyspec.chat import Chat

    block = ["def f(x):", "", "    /stats", "    return [x,"]
    text = run_chat(["/paste", *block, "/end", "/stats"])
    s = stats_lines(text)
    assert len(s) == 1 and s[0]["turns"] == 1  # (the "/stats" inside the paste was text, not a command)
    c = Chat(default_engine, default_engine.session(max_new_tokens=8), out=io.StringIO())
    c.user("\n".join(block))
    assert s[0]["state_digest"] == c.stats()["state_digest"]
    assert s[0]["context_tokens"] == len(c.session.tokens)
    c.close()
    at_eof = run_chat([], stdin=io.StringIO("/paste\n" + "\n".join(block) + "\n"))
    assert at_eof.startswith(text[:text.index("[stats]")].rstrip("\n"))

    text = run_chat([], stdin=Lines(["/paste\n", "def f(x):\n", KeyboardInterrupt, "/stats\n", "/paste\n", "/end\n",
                                     "/paste x\n", "/stats\n"]))
    assert "[Ctrl-C: the pasted lines are dropped]" in text and "[nothing pasted]" in text
    assert "[error: /paste takes no argument" in text
    assert [x["turns"] for x in stats_lines(text)] == [0, 0]


def test_verbose_prints_each_replys_figures_on_stderr(run_chat, capsys):
    """`hyspec chat --verbose`: after each reply, its figures on stderr as `hyspec generate`
    prints them (the tokens of that turn; the speculative line with --draft); stdout's text is
    the same as without the flag."""
    capsys.readouterr()
    quiet = run_chat(["def f(x):", "", "/stats"], "--draft", "2")
    capsys.readouterr()
    loud = run_chat(["def f(x):", "", "/stats"], "--draft", "2", "--verbose")
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("[8 tokens, prefill ")]
    assert len(lines) == 2 and all(" ms, decode " in x and x.endswith(" tok/s]") for x in lines), err
    assert err.count("spec: rounds=") == 2
    strip = [x for x in loud.splitlines() if not x.startswith("[stats]")]
    assert strip == [x for x in quiet.splitlines() if not x.startswith("[stats]")]


def test_verbose_figures_start_a_line_when_stderr_shares_the_output(run_chat, tmp_path, monkeypatch):
    """With stderr into the same file as stdout (2>&1) the figures follow the reply on a line
    of their own (they were glued to the reply's open last line)."""
    with open(tmp_path / "both.txt", "w+", encoding="utf-8") as f:
        import io

        from hyspec.chat import main

        monkeypatch.setattr(sys, "stderr", f)  # (run_chat's engine: its fixture set load_engine)
        assert main(["--max-new-tokens", "8", "--draft", "2", "--verbose"], stdin=io.StringIO("def f(x):\n\n"),
                    stdout=f) == 0
        f.flush()
        f.seek(0)
        text = f.read()
    assert text.count("\n[8 tokens, prefill ") == 2, text
    assert not re.search(r"[^\n]\[8 tokens, prefill ", text), text


def test_rewind_into_a_loaded_session_without_a_chat_record(run_chat, default_engine, tmp_path):
    """/load of a session saved by the API (no chat record), then /rewind: the session's turns
    are rewound (was: an IndexError traceback ending the chat)."""
    s = default_engine.session(max_new_tokens=8)
    s.send("def f(x):\n")
    s.send("    return 1\n")
    f = tmp_path / "api.pt"
    s.save(f)
    text = run_chat([f"/load {f}", "/rewind", "/stats", "/rewind", "/stats", "def g():"])
    assert "[error" not in text, text
    st = stats_lines(text)
    assert [x["turns"] for x in st] == [1, 0]


def test_save_and_load_expand_the_home_directory(run_chat, tmp_path, monkeypatch):
    """/save ~/FILE and /load ~/FILE are in the home directory (was: a "~" directory looked for)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    text = run_chat(["def f(x):", "/save ~/chat.pt", "/load ~/chat.pt"])
    assert "[error" not in text and (tmp_path / "chat.pt").is_file(), text


def test_a_turn_failing_mid_reply_keeps_the_chat_in_step(default_engine):
    """A round failing mid-reply keeps the rounds before it (a turn of the session): the chat
    records that turn too, so /rewind undoes it (was: the chat's record one turn behind)."""
    import io

    from hyspec.chat import Chat
    from hyspec.engine import default_model_dir

    eng = default_engine
    c = Chat(eng, eng.session(max_new_tokens=8), default_model_dir(), out=io.StringIO())
    c.user("def f(x):")
    with verify_failing_at(eng, 3), pytest.raises(RuntimeError, match="boom"):
        c.user("    return x")
    assert c.session.num_turns == len(c.stack) == 2
    assert c.rendered == eng.decode(c.session.tokens) and c.cut
    c.command("/rewind")
    assert c.session.num_turns == len(c.stack) == 1 and c.rendered == eng.decode(c.session.tokens)


def test_empty_line_with_a_chat_template_continues_the_cut_reply(zoo, tmp_path):
    """With a checkpoint's chat template, an empty line after a cut reply continues it (was:
    an empty user message, which closed the reply); with nothing to continue it is a note."""
    import io

    from hyspec.chat import Chat

    d, eng = _chatml_engine(zoo, tmp_path)
    prompt = render_chat([{"role": "user", "content": "hello"}], d)
    whole = eng.session(max_new_tokens=12, ignore_eos=True).send(prompt).tokens
    out = io.StringIO()
    c = Chat(eng, eng.session(max_new_tokens=6, ignore_eos=True), d, out=out)
    assert c.user("") == {} and "[nothing to continue" in out.getvalue() and not c.session.tokens
    c.user("hello")
    c.user("")
    assert c.session.tokens == eng.encode(prompt) + whole
    assert c.messages == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": eng.decode(whole)}]
    assert out.getvalue().endswith("\n" + eng.decode(whole))  # one reply, no break at the cut
    c.command("/rewind")
    assert c.cut and c.messages[-1]["content"] == eng.decode(whole[:6])
    # a reply stopped by cancel (a first Ctrl-C) is kept as a cut one: an empty line goes on
    out = io.StringIO()
    c = Chat(eng, eng.session(max_new_tokens=8, ignore_eos=True), d, out=out)
    asked = []  # (asked after each round: one token each without drafts)
    c.user("hello", cancel=lambda: asked.append(1) or len(asked) == 4)
    assert c.cut and "[stopped: the reply so far is kept" in out.getvalue()
    assert len(c.session.tokens) == len(eng.encode(prompt)) + 4
    assert c.messages[-1]["content"] == eng.decode(c.session.tokens[len(eng.encode(prompt)):])
    c.user("")
    assert c.session.tokens == eng.encode(prompt) + whole  # (4 + 8 tokens: the uncut reply's 12)


def test_chat_template_kwargs_reach_the_template(zoo, tmp_path, capsys):
    """`hyspec chat --chat-template-kwargs '{"enable_thinking": false}'`: the variable is
    rendered into every turn's prompt (the Qwen templates' switch); bad JSON is a one-line
    error naming the flag."""
    import io
    import shutil

    from hyspec.chat import main

    d = tmp_path / "ckpt"
    shutil.copytree(zoo.path("tiny", "qwen3_5"), d)
    template = CHATML + "{% if enable_thinking is defined and not enable_thinking %}NO THINKING{% endif %}"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    script = io.StringIO("hello\n/stats\n")
    stats = []
    for flags in ([], ["--chat-template-kwargs", '{"enable_thinking": false}']):
        out = io.StringIO()
        script.seek(0)
        assert main(["--model", str(d), "--dtype", "float64", "--max-new-tokens", "2", "--ignore-eos", *flags],
                    stdin=script, stdout=out) == 0
        stats += [json.loads(x[len("[stats] "):]) for x in out.getvalue().splitlines() if x.startswith("[stats] ")]
    from hyspec.engine import Engine

    eng = Engine.load(d, dtype="float64")
    extra = len(eng.encode("NO THINKING"))
    assert stats[1]["turn_prefilled"] - stats[0]["turn_prefilled"] == extra > 0
    for bad, words in (("{nope", "not valid JSON"), ("[1]", "JSON object"),
                       ('{"messages": []}', "other than ['messages']"),
                       ('{"add_generation_prompt": false}', "other than ['add_generation_prompt']")):
        assert main(["--model", str(d), "--chat-template-kwargs", bad], stdin=io.StringIO("")) == 2
        err = capsys.readouterr().err
        assert "--chat-template-kwargs" in err and words in err and "Traceback" not in err


def test_an_interrupted_restart_keeps_the_conversation(zoo, tmp_path):
    """A turn whose template re-renders the past differently starts from the whole text on a
    new session, kept apart until it succeeds: Ctrl-C (or an error) in it leaves the old
    conversation whole (was: the session reset first, so a Ctrl-C emptied it)."""
    import io

    from hyspec.chat import Chat

    d, eng = _chatml_engine(zoo, tmp_path)
    c = Chat(eng, eng.session(draft=2, max_new_tokens=4, ignore_eos=True), d, out=io.StringIO())
    c.user("hello there")
    c.rendered += "x"  # the next render no longer extends what the session holds: a restart
    held, turns, messages = list(c.session.tokens), c.session.num_turns, list(c.messages)

    def interrupt(final=False):
        if not final:
            raise KeyboardInterrupt

    c._show = interrupt  # the first streamed tokens: Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        c.user("and again")
    assert c.session.tokens == held and c.session.num_turns == turns and c.messages == messages
    del c._show
    stats = c.user("and again")  # the restart itself: one turn on the new session, from the whole text
    assert c.session.num_turns == 1 and stats["prompt_tokens"] == len(eng.encode(render_chat(c.messages[:-1], d)))
    # /rewind undoes the restarted turn: back to the session before it, kept aside without a
    # slot (was: the new one-turn session rewound to nothing, the whole conversation wiped)
    c.command("/rewind")
    assert c.session.tokens == held and c.session.num_turns == turns and c.messages == messages
    c.user("and again")  # (the record still ends in the test's "x": a restart again)
    assert c.stats()["turns"] == 2  # (was the current session's: 1)
    pool = eng.session_scheduler().pool
    for i in range(4):  # each restart parks a session: its slot is let go of (they piled up in the free list)
        c.rendered += "x"
        c.user(f"turn {i}")
    assert pool.stats()["slots_in_use"] == 1 and pool.stats()["slots_free"] <= 1, pool.stats()
    c.command("/rewind 4")
    with pytest.raises(ValueError, match=r"cannot rewind 3 turn\(s\): the conversation has 2"):
        c.command("/rewind 3")
    assert c.session.num_turns == 1 and len(c.previous) == 1  # (a refused rewind changes nothing)
    c.command("/rewind 2")
    assert c.session.tokens == [] and c.messages == [] and not c.previous
    c.user("hello there")  # the parked session resumes as it was
    assert c.session.tokens == held
    c.close()


def test_reset_forgets_restarts_and_load_keeps_a_cut_reply_going(zoo, tmp_path):
    """/reset after a restarted turn leaves nothing to /rewind into (the sessions kept aside
    for it are closed); a template chat saved after a cut reply and loaded again continues
    that reply on an empty line, as before the save."""
    import io

    from hyspec.chat import Chat

    d, eng = _chatml_engine(zoo, tmp_path)
    c = Chat(eng, eng.session(max_new_tokens=4, ignore_eos=True), d, out=io.StringIO())
    c.user("hello there")
    assert c.cut
    f = tmp_path / "chat.pt"
    c.command(f"/save {f}")
    c.rendered += "x"  # the next render no longer extends what the session holds: a restart
    c.user("and again")
    assert len(c.previous) == 1
    c.command("/reset")
    assert not c.previous
    with pytest.raises(ValueError, match=r"cannot rewind 1 turn\(s\): the conversation has 0"):
        c.command("/rewind")
    c.command(f"/load {f}")
    held = len(c.session.tokens)
    assert c.cut and c.user("") and len(c.session.tokens) > held and len(c.messages) == 2
    c.close()


def test_overall_acceptance_counts_the_turns_before_a_restart(default_engine):
    """/stats after a restarted turn: the conversation's acceptance merges the telemetry of the
    session kept aside for /rewind with the new session's (docs/sessions.md: "/stats counts its
    turns")."""
    import io

    from hyspec.chat import Chat
    from hyspec.engine import default_model_dir

    eng = default_engine
    c = Chat(eng, eng.session(draft=2, max_new_tokens=8), default_model_dir(), out=io.StringIO())
    c.user("def f(x):")
    c.user("    return x")
    c.rendered += "x"  # the next render no longer extends what the session holds: a restart
    c.user("def g(y):")
    assert len(c.previous) == 1
    old, new = c.previous[0][0].telemetry, c.session.telemetry
    merged = new.copy().merge(old)
    assert (merged.acceptance_length, merged.acceptance_rate) != (new.acceptance_length, new.acceptance_rate)
    st = c.stats()
    assert st["turns"] == 3 and st["overall_acceptance"] == {"acceptance_length": merged.acceptance_length,
                                                             "acceptance_rate": merged.acceptance_rate}
    c.close()


def test_a_redrawn_line_counts_terminal_columns():
    """The rows a cut reply's last line took are counted in terminal columns: a CJK
    character takes two, a combining accent none (was: one per character)."""
    from hyspec.chat import display_width

    assert display_width("def f(x):") == 9
    assert display_width("你好") == 4 and display_width("ｆｕｌｌ") == 8
    assert display_width("e\u0301") == 1 and display_width("a\u200bb") == 2


def test_a_template_chat_shows_the_reply_without_its_stop_token(zoo, tmp_path):
    """With a chat template the screen shows the reply without the stop token that ended it
    (was: its text, e.g. <|endoftext|>, printed at the end of every reply); the session
    still holds it (pending: the next turn's template text follows it)."""
    import io

    from hyspec.chat import Chat

    d, eng = _chatml_engine(zoo, tmp_path)
    free = Chat(eng, eng.session(max_new_tokens=6, ignore_eos=True), d, out=io.StringIO())
    free.user("hello there")
    reply = free.session.tokens[-6:]
    stop = reply[3]
    assert stop not in reply[:3]
    out = io.StringIO()
    c = Chat(eng, eng.session(max_new_tokens=6, ignore_eos=True, stop_ids=[stop]), d, out=out)
    c.user("hello there")
    assert c.session.tokens[-4:] == reply[:4]
    assert out.getvalue() == eng.decode(reply[:3]) + "\n" and c.messages[-1]["content"] == eng.decode(reply[:3])


def _chat_engine_with_a_24_token_context(tmp_path, monkeypatch):
    """A tiny checkpoint whose context is 24 tokens, the engine `hyspec chat` loads."""
    from hyspec.cli import common
    from hyspec.engine import Engine
    from hyspec.tiny import make_tiny

    ckpt = make_tiny("qwen3_5", tmp_path / "tiny", vocab_size=320, hidden=32, layers=2, seed=1, std=0.1)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["max_position_embeddings"] = 24
    (ckpt / "config.json").write_text(json.dumps(cfg))
    eng = Engine.load(ckpt)
    monkeypatch.setattr(common, "load_engine", lambda args: eng)
    return eng


def test_a_reply_is_capped_to_the_context_left(tmp_path, monkeypatch):
    """--max-new-tokens beyond the model's context: each reply is capped to the room left (as
    generate caps it) and says the context cut it; with no room a turn is refused, the chat
    goes on (every turn failed, and the limit cannot be lowered inside the chat)."""
    import io

    from hyspec.chat import main

    eng = _chat_engine_with_a_24_token_context(tmp_path, monkeypatch)
    out = io.StringIO()
    lines = "ab\n/stats\n\nab\n/rewind\n/stats\n"
    assert main(["--max-new-tokens", "500", "--ignore-eos", "--draft", "2"], stdin=io.StringIO(lines),
                stdout=out) == 0
    text = out.getvalue()
    stats = stats_lines(text)
    first = len(eng.encode("ab"))
    assert len(stats[0]["turn_tokens"]) == 24 - first and stats[1]["turns"] == 0
    assert text.count("[the reply reached the model's context of 24 tokens") == 1
    assert text.count("[the conversation fills the model's context of 24 tokens") == 2
    # a message too long for the room a short conversation leaves: said so, not "fills" (it said
    # the conversation filled the context at 5 of 24 tokens)
    out = io.StringIO()
    long = next(t for t in (" ".join(["ab"] * k) for k in range(1, 24)) if len(eng.encode(t)) >= 24 - first - 2)
    n_long = len(eng.encode(long))
    assert n_long < 23
    assert main(["--max-new-tokens", "2", "--ignore-eos"], stdin=io.StringIO(f"ab\n{long}\n"), stdout=out) == 0
    assert "fills" not in out.getvalue()
    assert re.search(rf"\[the message is \d+ tokens: the conversation holds {first + 2} of the model's "
                     r"context of 24 tokens, which leaves \d+ for a message", out.getvalue())


def test_the_room_left_for_a_message_is_counted_exactly(tmp_path, monkeypatch):
    """A conversation one token short of the context fills it (no message and reply fit); the
    room a shorter one leaves for a message is the context less the conversation less one
    token for the reply."""
    import io

    from hyspec.chat import main

    eng = _chat_engine_with_a_24_token_context(tmp_path, monkeypatch)
    first = len(eng.encode("ab"))
    out = io.StringIO()
    assert main(["--max-new-tokens", str(23 - first), "--ignore-eos"], stdin=io.StringIO("ab\n/stats\nab\n"),
                stdout=out) == 0
    assert stats_lines(out.getvalue())[0]["context_tokens"] == 23
    assert "[the conversation fills the model's context of 24 tokens: /rewind or /reset]" in out.getvalue()
    out = io.StringIO()
    long = next(t for t in (" ".join(["ab"] * k) for k in range(1, 24)) if len(eng.encode("\n" + t)) >= 24 - first - 2)
    assert main(["--max-new-tokens", "2", "--ignore-eos"], stdin=io.StringIO(f"ab\n{long}\n"), stdout=out) == 0
    assert (f"the conversation holds {first + 2} of the model's context of 24 tokens, which leaves "
            f"{24 - first - 3} for a message") in out.getvalue(), out.getvalue()


def test_a_terminal_that_cannot_encode_the_reply_keeps_the_chat(capsys):
    """With an ASCII terminal (PYTHONIOENCODING=ascii) a reply holding a character it cannot
    show ended the chat mid-reply ("'ascii' codec can't encode ...", exit 2; through main() a
    chained traceback), and a typed byte it cannot decode did too. Now the reply shows "?"
    there and the chat goes on; the undecodable line is refused in one line."""
    import io

    from hyspec.chat import main

    stdin = io.TextIOWrapper(io.BytesIO(b"# \xe4\xb8\xad\nx = 1\n/stats\n"), encoding="ascii")
    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding="ascii", write_through=True)
    # (seeded: this reply holds U+FFFD, a byte token the model drew alone)
    assert main(["--temperature", "1.5", "--seed", "12", "--max-new-tokens", "60"], stdin=stdin, stdout=stdout) == 0
    text = raw.getvalue().decode("ascii")
    assert "[error: prompt='# \\udce4\\udcb8\\udcad': is not valid text: character 2 is a lone surrogate" in text
    assert "?" in text and "[stats] " in text


@pytest.mark.skipif(sys.platform == "win32", reason="a pseudo-terminal (POSIX)")
def test_on_a_terminal_lines_are_edited_with_the_arrow_keys(tmp_path):
    """On a real terminal the chat read lines with stdin.readline(): the arrow keys' escape
    sequences went to the model as text ("x = 1\\x1b[D\\x1b[D2"), and the reply drawn on the
    typed line's row overwrote their echo. Lines are now read with the line editor (readline),
    so Left Left then 2 edits the line, and Up recalls it."""
    pytest.importorskip("readline")
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    from hyspec.engine import Engine
    from hyspec.session import Session

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "hyspec", "chat", "--max-new-tokens", "3"], stdin=follower,
                            stdout=follower, stderr=follower, cwd=tmp_path, close_fds=True)
    os.close(follower)
    seen = b""

    def until_prompts(n, timeout=120.0):  # the screen so far, once it shows n prompts
        nonlocal seen
        end = time.monotonic() + timeout
        while seen.count(b"> ") < n and time.monotonic() < end:
            if select.select([leader], [], [], 0.2)[0]:
                try:
                    seen += os.read(leader, 4096)
                except OSError:  # (the child closed the terminal)
                    break
        assert seen.count(b"> ") >= n, seen

    try:
        until_prompts(1)
        os.write(leader, b"x = 1\x1b[D\x1b[D2\r")  # Left Left 2: "x =2 1"
        until_prompts(2)
        os.write(leader, b"\x1b[A\r")  # Up: the same line again
        until_prompts(3)
        os.write(leader, f"/save {tmp_path / 's.pt'}\r".encode())
        until_prompts(4)
        os.write(leader, b"\x04")  # Ctrl-D leaves
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    eng = Engine.load()
    text = eng.decode(Session.load(eng, tmp_path / "s.pt").tokens)
    assert text.startswith("x =2 1") and text.count("x =2 1") == 2 and "\x1b" not in text, text


def test_a_line_after_a_loaded_session_without_a_chat_record_starts_a_new_line(default_engine, tmp_path):
    """/load of a session saved by the Python API (no chat record), or /rewind into its turns:
    the next typed line was glued onto the transcript's last line ("return self.tk.print(1)"),
    since the chat decided the line break from its own (empty) record. It now goes after a
    line break, as in a chat that made those turns itself."""
    import io

    from hyspec.chat import Chat

    eng = default_engine
    s = eng.session(max_new_tokens=6, ignore_eos=True)
    s.send("def f(x):")
    s.send("    y = 1")
    assert not eng.decode(s.tokens).endswith("\n")
    f = tmp_path / "api.pt"
    s.save(f)
    for commands in ([f"/load {f}"], [f"/load {f}", "/rewind 1"]):
        c = Chat(eng, eng.session(max_new_tokens=6, ignore_eos=True), out=io.StringIO())
        for cmd in commands:
            c.command(cmd)
        held = list(c.session.tokens)
        assert not eng.decode(held).endswith("\n")
        c.user("print(1)")
        assert c.session.tokens[len(held):len(held) + len(eng.encode("\nprint(1)"))] == eng.encode("\nprint(1)")
        c.close()
    s.close()


def test_a_first_message_longer_than_the_context_says_so(tmp_path, monkeypatch):
    """A first message longer than the whole context was refused with "the conversation fills
    the model's context: /rewind or /reset" (the conversation was empty: neither helps)."""
    import io

    from hyspec.chat import main

    eng = _chat_engine_with_a_24_token_context(tmp_path, monkeypatch)
    out = io.StringIO()
    long = "ab " * 30
    assert main(["--max-new-tokens", "4"], stdin=io.StringIO(long + "\n/stats\n"), stdout=out) == 0
    text = out.getvalue()
    assert f"[the message is {len(eng.encode(long))} tokens: the model's context is 24 tokens" in text, text
    assert "/rewind or /reset" not in text and stats_lines(text)[0]["turns"] == 0
    # ... and after a turn, a message longer than the context alone says so too (it said "the
    # conversation fills the context: /rewind or /reset", which cannot make room for it)
    out = io.StringIO()
    assert main(["--max-new-tokens", "4"], stdin=io.StringIO("ab\n" + long + "\n/stats\n"), stdout=out) == 0
    text = out.getvalue()
    assert "[the message is " in text and "tokens: the model's context is 24 tokens" in text, text
    assert "/rewind or /reset" not in text and stats_lines(text)[0]["turns"] == 1


def test_a_terminal_reporting_no_columns_counts_eighty(monkeypatch):
    """A pty with no window size reports 0 columns: the redraw of a continued line went up one
    row per character and cleared the output above it."""
    import io

    from hyspec import chat as chat_mod

    c = chat_mod.Chat.__new__(chat_mod.Chat)
    c.out = io.StringIO()
    monkeypatch.setattr(c.out, "fileno", lambda: 1, raising=False)
    monkeypatch.setattr(chat_mod.os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    assert c._columns() == 80
    monkeypatch.setattr(chat_mod.os, "get_terminal_size", lambda fd: os.terminal_size((100, 30)))
    assert c._columns() == 100


def test_a_continued_reply_completes_a_character_cut_in_its_bytes(default_engine):
    """A reply cut inside a character's bytes, then continued (an empty line): the chat's record
    (the messages /save writes, the rendered text a restart re-encodes) kept the U+FFFD of
    both parts' decodings, where the session's tokens hold the character."""
    import io

    pytest.importorskip("llguidance")
    from hyspec.chat import Chat
    from hyspec.engine import default_model_dir

    eng = default_engine
    c = eng.constraint("regex", "ab😀cd中文ef é gh")
    for plain in (True, False):
        out = io.StringIO()
        chat = Chat(eng, eng.session(draft=0, max_new_tokens=3, constraint=c, use_store=False), default_model_dir(),
                    out=out)
        if not plain:  # the record of a templated chat (its messages' content) alike
            chat.plain = False
        chat.user("s = '")
        assert chat.rendered.endswith("\ufffd") and chat.cut
        chat.user("")
        chat.user("")
        want = eng.decode(chat.session.tokens)
        assert "😀" in want and chat.rendered == want, (chat.rendered, want)
        assert chat.messages[-1]["content"].startswith("ab😀cd"), chat.messages
        if plain:  # the screen too: the character's bytes wait for the rest (no U+FFFD drawn)
            chat.end_line()
            assert out.getvalue().startswith("ab😀cd") and "\ufffd" not in out.getvalue(), out.getvalue()
        chat.close()


def test_chat_help_shows_the_defaults(capsys):
    """`hyspec chat --help` showed no defaults (its own 128-token replies, where generate's are
    64, among them), unlike every other command's help."""
    from hyspec.chat import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "reply length limit per turn (default: 128)" in " ".join(capsys.readouterr().out.split())


# a template that shows an assistant turn's reasoning the way the Qwen templates do (in our words)
REASONING_TPL = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
                 "{% if m.role == 'assistant' and m.reasoning_content is string %}"
                 "{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}"
                 "{{ m.content + '<|im_end|>\\n' }}{% endfor %}")


def test_a_reasoning_field_reaches_the_template_as_reasoning_content_as_in_transformers():
    """An assistant message sent back with its thinking under `reasoning` (vLLM's newer name,
    OpenRouter's) or `thinking`: transformers' apply_chat_template gives the template it as
    `reasoning_content` too (what the Qwen templates read); hyspec dropped it from the prompt."""
    from hyspec.chat_template import ChatTemplate, normalize_messages

    tpl = ChatTemplate(REASONING_TPL)
    want = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>r1</think>a<|im_end|>\n"
    for field in ("reasoning_content", "reasoning", "thinking"):
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", field: "r1"}]
        assert tpl.render(normalize_messages(msgs), add_generation_prompt=False) == want, field
    # reasoning_content wins over the other names; a null one does not count
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r1", "reasoning": "x", "thinking": "y"}]
    assert tpl.render(normalize_messages(msgs), add_generation_prompt=False) == want
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": None, "reasoning": "r1"}]
    assert tpl.render(normalize_messages(msgs), add_generation_prompt=False) == want
    pytest.importorskip("transformers")
    from transformers.utils import chat_template_utils as hf

    if not hasattr(hf, "_alias_reasoning_fields"):
        pytest.skip("this transformers does not alias reasoning fields")
    for field in ("reasoning", "thinking"):
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", field: "r1"}]
        assert hf.render_jinja_template([msgs], chat_template=REASONING_TPL)[0][0] == want


def test_chat_without_a_tokenizer_says_chat_needs_one(default_engine, tmp_path, capsys):
    """A checkpoint without tokenizer.json: Engine.chat (and a --prompts-file "messages" line)
    said "pass token ids instead of text", which a chat cannot do (a message's content is text
    only). Now it says that chat needs the tokenizer, and what to do instead."""
    from hyspec.cli.dispatch import main
    from hyspec.engine import Engine

    eng = Engine(default_engine.model, None)
    msgs = [{"role": "user", "content": "hi"}]
    for call in (lambda: eng.chat(msgs, max_new_tokens=2), lambda: eng.prepare_chat(msgs)):
        with pytest.raises(ValueError, match=r"chat needs the checkpoint's tokenizer\.json.*token ids to generate"):
            call()
    assert eng.chat_prompt(msgs)  # (rendering the text needs no tokenizer)
    d = tmp_path / "no_tok"
    d.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        (d / f).symlink_to(Path(default_engine.model_dir) / f)
    lines = tmp_path / "reqs.jsonl"
    lines.write_text(json.dumps({"messages": msgs, "max_new_tokens": 2}) + "\n")
    assert main(["generate", "--model", str(d), "--prompts-file", str(lines)]) == 2
    err = capsys.readouterr().err
    assert "reqs.jsonl:1: chat needs the checkpoint's tokenizer.json" in err and "Traceback" not in err


def test_rendering_details_match_transformers(tmp_path):
    """What transformers' apply_chat_template does and a template's output depends on: block
    tags take their line's indent and newline away (lstrip_blocks, trim_blocks); tojson keeps
    non-ASCII text and key order; a message's own `thinking` wins over the alias; an empty
    config template is no template; a template list without "default" gives its first;
    `messages` is no extra variable."""
    from hyspec.chat_template import render_template

    src = ("{% for m in messages %}\n  {% if m.role == 'user' %}\nU: {{ m.content }}\n  {% endif %}\n{% endfor %}"
           "{{ tools | tojson }}|{{ tools | tojson(indent=1) }}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
    want = 'U: hi\n[{"b": "é", "a": 1}]|[\n {\n  "b": "é",\n  "a": 1\n }\n]'  # (transformers' output)
    assert render_template(src, msgs, True, None, tools=[{"b": "é", "a": 1}]) == want
    both = [{"role": "assistant", "content": "a", "reasoning_content": "r", "thinking": "t"}]
    assert render_template("{{ messages[0].thinking }} {{ messages[0].reasoning_content }}", both) == "t r"
    with pytest.raises(TemplateError, match="messages"):
        render_template("x", msgs, True, None, messages=[])
    for none in ("", []):  # no template: the plain one
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": none}))
        assert load_template(tmp_path)[:2] == (PLAIN_TEMPLATE, "plain")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]}))
    assert load_template(tmp_path)[:2] == ("T", "tokenizer_config.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        "junk", {"name": "default", "template": "D"}]}))
    try:  # an entry that is no {name, template} object: skipped or a TemplateError, never a traceback
        assert load_template(tmp_path)[:2] == ("D", "tokenizer_config.json")
    except TemplateError:
        pass
    # the loopcontrols extension (transformers enables it): {% continue %} and {% break %}
    loop = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}|"
            "{% if m.role == 'assistant' %}{% break %}{% endif %}{% endfor %}")
    three = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    assert render_template(loop, three) == "u|a|"


def test_normalize_messages_checks_and_leaves_the_callers_messages_alone():
    from hyspec.chat_template import normalize_messages

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = [{"role": "system", "content": None}, {"role": "user", "content": parts}]
    got = normalize_messages(msgs)
    assert [m["content"] for m in got] == ["", "ab"]
    assert msgs == [{"role": "system", "content": None}, {"role": "user", "content": parts}]  # not changed
    legacy = [{"role": "function", "name": "f", "content": "42"}]  # OpenAI's older tool-result role
    assert normalize_messages(legacy)[0]["role"] == "function"
    for bad, words in [("hi", "must be a list"), ({"role": "user", "content": "x"}, "must be a list"),
                       (5, "must be a list"), ([], "must not be empty"), ([{"content": "x"}], r"messages\[0\]"),
                       ([{"role": "user", "content": "x"}, {"role": "bot", "content": "x"}], r"messages\[1\]\.role"),
                       ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string"),
                       ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "needs a string"),
                       ([{"role": "user", "content": ["x"]}], "of type 'str'")]:
        with pytest.raises(ValueError, match=words):
            normalize_messages(bad)


def test_template_properties_and_generation_suffix():
    from hyspec.chat_template import ChatTemplate

    role_only = ChatTemplate("{% for m in messages %}{% if m.role == 'tool' %}T{% endif %}<think>{% endfor %}")
    assert not role_only.reads_tools and not role_only.thinks and not role_only.plain
    assert ChatTemplate("{{ tools }}</think>").reads_tools and ChatTemplate("</think>").thinks
    assert ChatTemplate(PLAIN_TEMPLATE, where="plain").plain
    msgs = [{"role": "user", "content": "q"}]
    tpl = ChatTemplate("{{ messages | length }}{% if add_generation_prompt %}A:{% endif %}")
    assert tpl.generation_suffix(tpl.render(msgs), msgs, add_generation_prompt=True) == "A:"
    # rendered differently without the generation prompt: the whole prompt
    odd = ChatTemplate("{% if add_generation_prompt %}G{% endif %}{{ messages | length }}")
    assert odd.generation_suffix(odd.render(msgs), msgs) == "G1"


def test_template_globals_special_tokens_and_bad_files(tmp_path):
    """strftime_now and raise_exception (its message as the template gives it); special tokens
    that are unset or not text are no variables (a template's {{ bos_token }} renders nothing,
    not "None"); a tokenizer_config.json that is no JSON object, and a --chat-template file
    that is not UTF-8, are one-line errors."""
    from datetime import datetime

    from hyspec.chat_template import ChatTemplate, read_template_file

    before = datetime.now().year
    assert ChatTemplate("{{ strftime_now('%Y') }}").render([]) in {str(before), str(datetime.now().year)}
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{{ raise_exception('no system role') }}").render([])
    assert str(e.value) == "no system role"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "[{{ bos_token }}|{{ pad_token }}|{{ eos_token }}]", "pad_token": 0, "eos_token": "</s>"}))
    assert ChatTemplate.for_model(tmp_path).render([]) == "[||</s>]"
    assert render_chat([], tmp_path) == "[||</s>]"
    (tmp_path / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(TemplateError, match="top level must be a JSON object"):
        load_template(tmp_path)
    latin = tmp_path / "latin.jinja"
    latin.write_bytes("{{ 'café' }}".encode("latin-1"))
    with pytest.raises(ValueError, match="--chat-template .*latin.jinja"):
        read_template_file(latin, "--chat-template")


def test_exit_leaves_and_command_errors_say_what_is_wrong(run_chat, default_engine):
    """/exit leaves as /quit does (the lines after it are not run); an unknown command is
    named in its note; /rewind 0 or a non-ASCII digit, /save and /load without a file are
    one-line errors naming the command."""
    import io

    from hyspec.chat import Chat
    from hyspec.engine import default_model_dir

    for leave in ("/exit", "/quit"):
        text = run_chat([leave, "def f(x):", "/stats"])
        assert stats_lines(text) == [] and "[error" not in text and "unknown command" not in text, text
    out = io.StringIO()
    c = Chat(default_engine, default_engine.session(max_new_tokens=3), default_model_dir(), out=out)
    assert c.command("/exit") is False and c.command("/quit") is False
    assert c.command("/frobnicate now") is True
    assert out.getvalue().startswith("[unknown command /frobnicate; ")
    c.user("def f(x):")
    for line, words in (("/rewind 0", "/rewind needs a number of turns >= 1, got 0"),
                        ("/rewind \u00b2", "/rewind takes a number of turns, got '\u00b2'"),
                        ("/save", "/save needs a file name"), ("/save   ", "/save needs a file name"),
                        ("/load", "/load needs a file name")):
        with pytest.raises(ValueError, match=re.escape(words)):
            c.command(line)
    assert c.session.num_turns == 1 and len(c.stack) == 1  # (nothing changed)
    c.close()


def test_a_turn_failing_with_a_runtime_error_is_one_line_and_the_chat_goes_on(run_chat, default_engine):
    """A RuntimeError in a turn (a failing round) is an "[error: ...]" line, not a traceback
    ending the chat; the next message runs, and /stats shows its figures (time to first token
    among them)."""
    with verify_failing_at(default_engine, 1):
        text = run_chat(["def f(x):", "def f(x):", "/stats"])
    assert "[error: boom]" in text and "Traceback" not in text, text
    st = stats_lines(text)
    # (the failed turn keeps what ran before the failing round, the prefill's token: a turn of its own)
    assert st[0]["turns"] == 2 and len(st[0]["turn_tokens"]) == 8
    assert isinstance(st[0]["turn_ttft_s"], float) and st[0]["turn_ttft_s"] > 0


def test_load_of_a_chat_record_saved_without_the_cut_flags(run_chat, default_engine, tmp_path):
    """A session file whose chat record keeps (messages, rendered) pairs before each turn (as
    /save wrote them before the cut flag) loads, and /rewind goes back through them."""
    s = default_engine.session(max_new_tokens=4)
    first = s.send("def f(x):").tokens
    r1 = default_engine.decode(s.tokens)
    s.send("\n    return 1")
    m1 = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": default_engine.decode(first)}]
    f = tmp_path / "old.pt"
    s.save(f, extra={"messages": m1 + [{"role": "user", "content": "\n    return 1"}], "rendered":
                     default_engine.decode(s.tokens), "stack": [[[], ""], [m1, r1]]})
    s.close()
    text = run_chat([f"/load {f}", "/rewind", "/stats", "/rewind", "/stats"])
    assert "[error" not in text, text
    assert [x["turns"] for x in stats_lines(text)] == [1, 0]


def test_retry_sends_the_last_message_again_with_a_new_seed(run_chat, default_engine):
    """/retry [SEED]: the last message's turns (its reply and the reply's continued part) are
    undone and the message is sent again, as recorded, with SEED or a random seed it shows:
    the conversation then equals a new one sent that message with --seed SEED (the plain
    template's line break not doubled; with drafts). Errors leave the conversation as it was:
    a greedy chat, a bad seed, no message yet."""
    flags = ("--temperature", "0.8", "--draft", "3")
    fresh = {seed: stats_lines(run_chat(["def add(a, b):", "/stats"], *flags, "--seed", str(seed)))[0]
             for seed in (5, 9)}
    assert fresh[5]["turn_tokens"] != fresh[9]["turn_tokens"]  # (the seeds draw other replies)
    out = run_chat(["/retry", "def add(a, b):", "", "/stats", "/retry 5", "/stats", "/retry x", "/retry 5", "/stats",
                    "/retry", "/stats"], *flags, "--seed", "9")
    s = stats_lines(out)
    assert "[error: /retry: there is no message to send again]" in out
    assert s[0]["turns"] == 2 and s[0]["context_tokens"] > fresh[9]["context_tokens"]  # (a continued reply)
    for got in s[1:3]:
        assert got["turns"] == 1 and got["turn_tokens"] == fresh[5]["turn_tokens"]
        assert got["state_digest"] == fresh[5]["state_digest"]
    assert "[error: /retry takes a seed, an integer in 0..18446744073709551615, got 'x']" in out
    assert out.count("[retry: the last message again, seed 5]") == 2
    seed = int(re.findall(r"\[retry: the last message again, seed (\d+)\]", out)[-1])
    again = stats_lines(run_chat(["def add(a, b):", "/stats"], *flags, "--seed", str(seed)))[0]
    assert s[3]["turn_tokens"] == again["turn_tokens"] and s[3]["state_digest"] == again["state_digest"]
    greedy = run_chat(["def add(a, b):", "/stats", "/retry", "/stats"], "--draft", "3")
    g = stats_lines(greedy)
    assert "[error: /retry draws another reply by sampling: this chat is greedy" in greedy and g[0] == g[1]
    # a later line: sent again as recorded, after the line break the plain template put before it
    import io

    from hyspec.chat import Chat
    from hyspec.sampling import SamplingParams

    def two_lines(last_seed=None):
        session = default_engine.session(draft=3, max_new_tokens=6, ignore_eos=True,
                                         params=SamplingParams(temperature=0.8, seed=9))
        c = Chat(default_engine, session, out=io.StringIO())
        c.user("def add(a, b):")
        c.user("    return a", params=None if last_seed is None else SamplingParams(temperature=0.8, seed=last_seed))
        return c

    want, c = two_lines(5), two_lines()
    assert c.messages[-2]["content"] == "\n    return a"  # (the first reply did not end its line)
    c.retry("5")
    assert c.session.tokens == want.session.tokens and c.messages == want.messages


def test_retry_with_a_chat_template_redoes_only_the_last_message(zoo, tmp_path):
    """With a chat template and a system message, /retry undoes the last message's turn alone:
    the conversation then equals one whose last message was sent with the retry's seed, the
    earlier turn and the system message kept."""
    import io

    from hyspec.chat import Chat
    from hyspec.sampling import SamplingParams

    d, eng = _chatml_engine(zoo, tmp_path)

    def conversation(seed):
        c = Chat(eng, eng.session(max_new_tokens=6, ignore_eos=True, params=SamplingParams(temperature=0.9, seed=seed)),
                 d, out=io.StringIO())
        c.set_system("be brief")
        c.user("hello")
        return c

    want = conversation(2)
    want.user("again", params=SamplingParams(temperature=0.9, seed=7))
    c = conversation(2)
    c.user("again")
    c.user("")  # (the reply continued: both parts go)
    assert c.session.num_turns == 3
    c.retry("7")
    assert c.session.tokens == want.session.tokens and c.messages == want.messages
    assert c.session.num_turns == 2 and c.messages[0] == {"role": "system", "content": "be brief"}
    c.command("/rewind")
    assert c.messages == want.messages[:3]  # (the first reply stays)
