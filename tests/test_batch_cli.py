"""`hyspec generate --prompts-file`: one JSON result per line, in input order, each equal
to what `hyspec generate --json` gives for that line alone (each line's own call of the
CLI's main, with its own Engine); bad lines are named."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import cli_each

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "hyspec.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


LINES = [
    {"prompt": "def fibonacci(n):", "max_new_tokens": 20, "draft": 3},
    {"prompt": "import os\n", "max_new_tokens": 12, "temperature": 0.8, "seed": 3},
    {"prompt_ids": [5, 6, 7], "max_new_tokens": 7, "draft": 2, "temperature": 1.0, "seed": 9, "top_p": 0.9},
    {"prompt": "class Stack:", "max_new_tokens": 15},
]


def test_prompts_file_equals_one_by_one(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    out = tmp_path / "out.jsonl"
    r = cli("generate", "--prompts-file", str(f), "--max-batch", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(LINES)))
    calls = []
    for x in LINES:
        args = ["generate", "--json", "--max-new-tokens", str(x["max_new_tokens"]), "--draft", str(x.get("draft", 0))]
        args += ["--prompt", x["prompt"]] if "prompt" in x else ["--prompt-ids", ",".join(map(str, x["prompt_ids"]))]
        for key in ("temperature", "seed", "top_p"):
            if key in x:
                args += ["--" + key.replace("_", "-"), str(x[key])]
        calls.append(args)
    for row, (code, stdout) in zip(rows, cli_each(calls)):
        assert code == 0
        ref = json.loads(stdout)
        assert row["tokens"] == ref["tokens"] and row["text"] == ref["text"]
        assert row["stop_reason"] == ref["stop_reason"]
        assert set(row["stats"]) >= {"prompt_tokens", "generated_tokens"}


@pytest.mark.parametrize("line,msg", [
    ("not json", "not valid JSON"),
    ('{"promt": "x"}', "unknown field"),
    ('{"prompt": "x", "prompt_ids": [1]}', "exactly one"),
    ('{"prompt": "x", "temperature": -1}', "temperature"),
    ('{"prompt": "x", "draft": "3"}', "draft must be an integer"),
    ('{"prompt": "x", "logprobs": -1}', "logprobs must be null or an integer >= 0"),
])
def test_bad_lines_are_named(tmp_path, line, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    r = cli("generate", "--prompts-file", str(f))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert ":2:" in r.stderr and re.search(msg, r.stderr), r.stderr


def test_bad_chat_lines_fail_before_the_model_loads(tmp_path):
    """A chat line's messages and tools are checked with the other fields, before the model
    loads (a missing --model directory is not what the user hears about first)."""
    from cli_helpers import cli_many

    calls = []
    for i, line in enumerate(('{"messages": [{"content": "hi"}]}',
                              '{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes"}')):
        f = tmp_path / f"bad{i}.jsonl"
        f.write_text('{"prompt": "ok"}\n' + line + "\n")
        calls.append(["generate", "--prompts-file", str(f), "--model", str(tmp_path / "no_such_model")])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for (code, _, err), msg in zip(cli_many(calls, env=env), ("string role", "tool_choice")):
        assert code == 2 and "Traceback" not in err, err
        assert ":2:" in err and re.search(msg, err) and "no_such_model" not in err, err


def test_prompts_file_from_a_pipe():
    """--prompts-file /dev/stdin reads a pipe (the missing-file check leaves non-regular files alone)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "hyspec.cli", "generate", "--prompts-file", "/dev/stdin"],
                       input='{"prompt": "def f(x):", "max_new_tokens": 2}\n', capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 2
