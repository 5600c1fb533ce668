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
    assert [row["line"] for row in rows] == list(range(1, len(LINES) + 1))  # the file's line numbers
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
    # (a plain ValueError and a RecursionError of json.loads: unnamed, or a traceback)
    pytest.param('{"prompt": "x", "seed": ' + "9" * 5000 + "}", "not valid JSON here .*4300", id="bignum"),
    pytest.param('{"prompt": "x", "stop": ' + "[" * 100000 + "]" * 100000 + "}",
                 r"not valid JSON here \(nested too deeply\)", id="deep"),
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


def test_file_wide_flags_and_damaged_input(tmp_path):
    """--adaptive-floor reaches the file's lines (it was dropped: other drafts than the one
    prompt run); --forced-rates is refused (it was ignored); a non-UTF-8 line, an integer too
    large for a float (a traceback), a bad flag value (blamed on line 1) and options checked
    after the model loaded (--max-batch 0, --stop-ids out of range: --out was emptied first)
    are one-line errors naming the line or the flag, and an existing --out keeps its bytes."""
    from cli_helpers import cli_many

    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "def add(a, b):", "max_new_tokens": 24}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "a", "max_new_tokens": 2}\n{"prompt": "\xff\xfe"}\n')
    big = tmp_path / "big.jsonl"
    big.write_text('{"prompt": "a", "temperature": 1' + "0" * 400 + "}\n")
    keep = tmp_path / "keep.jsonl"
    keep.write_text("precious\n")
    mix = tmp_path / "mix.jsonl"  # lines drafting less than the file-wide floor: the floor is each line's K at most
    mix.write_bytes(b'{"prompt": "def f(x):", "max_new_tokens": 4, "draft": 4}\r{"prompt": "def g(x):", '
                    b'"max_new_tokens": 4, "draft": 2}\r')  # (and lone-CR line ends)
    adaptive = ["--draft", "3", "--adaptive", "--adaptive-floor", "3"]
    calls = [["generate", "--prompts-file", str(one), *adaptive],
             ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--json", *adaptive],
             ["generate", "--prompts-file", str(one), "--draft", "3", "--forced-rates", "0,0,0"],
             ["generate", "--prompts-file", str(bad)],
             ["generate", "--prompts-file", str(big)],
             ["generate", "--prompts-file", str(one), "--out", str(keep), "--max-batch", "0"],
             ["generate", "--prompts-file", str(one), "--out", str(keep), "--stop-ids", "99999"],
             ["generate", "--prompts-file", str(one), "--temperature", "-1"],
             ["generate", "--prompts-file", str(mix), "--adaptive", "--adaptive-floor", "3", "--out",
              str(tmp_path / "mix_out.jsonl")],
             ["generate", "--prompts-file", "/dev/null", "--pp", "2"],
             ["generate", "--prompts-file", str(one), "--max-new-tokens", "-1"],  # (was blamed on one.jsonl:1)
             ["generate", "--prompts-file", str(keep), "--out", str(keep)],  # (it emptied the prompts)
             ["generate", "--prompt", "a", "--stop-ids", "99999"]]  # (one prompt: the flag was not named)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = cli_many(calls, env=env)
    assert res[0][0] == res[1][0] == 0, res[0][2] + res[1][2]
    file_spec, one_spec = (json.loads(r[1].splitlines()[0])["stats"]["spec"] for r in res[:2])
    assert file_spec["drafted_at"] == one_spec["drafted_at"] and file_spec["accepted_at"] == one_spec["accepted_at"]
    tail = res[-3:]
    res = res[:-3]
    assert res[-2][0] == 0, res[-2][2]
    assert [json.loads(x)["line"] for x in (tmp_path / "mix_out.jsonl").read_text().splitlines()] == [1, 2]
    errs = [err for code, _, err in res[2:-2]] + [res[-1][2]]
    assert all(code == 2 for code, _, _ in res[2:-2] + res[-1:]) and not any("Traceback" in e for e in errs), errs
    assert [code for code, _, _ in tail] == [2, 2, 2], tail
    assert "--max-new-tokens must be >= 0" in tail[0][2] and "one.jsonl" not in tail[0][2]
    assert "is the --prompts-file" in tail[1][2] and keep.read_text() == "precious\n"
    assert "--stop-ids: stop id(s) [99999] out of range" in tail[2][2]
    assert "--forced-rates" in errs[0]
    assert "bad.jsonl:2: not UTF-8" in errs[1]
    assert "big.jsonl:1:" in errs[2] and "finite" in errs[2] and len(errs[2]) < 300
    assert "--max-batch" in errs[3] and "--stop-ids" in errs[4] and keep.read_text() == "precious\n"
    assert "--temperature" in errs[5] and "one.jsonl" not in errs[5]
    assert "regular file" in errs[6]  # (--pp's ranks each read it: a pipe would be read by the launcher)


def test_prompts_file_from_a_pipe():
    """--prompts-file /dev/stdin reads a pipe (the missing-file check leaves non-regular files alone)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "hyspec.cli", "generate", "--prompts-file", "/dev/stdin"],
                       input='{"prompt": "def f(x):", "max_new_tokens": 2}\n', capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 2
    r = subprocess.run([sys.executable, "-m", "hyspec.cli", "generate", "--prompts-file", "-"],
                       input='{"prompt": "def f(x):", "max_new_tokens": 2}\n', capture_output=True, text=True,
                       env=env, timeout=300)  # "-": standard input, as for most tools
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 2


def test_ctrl_c_writes_the_finished_lines_only(tmp_path, monkeypatch, capsys):
    """Ctrl-C mid-batch: the lines finished so far are written (one after a line still running
    too, with its line number), the cut-off ones are not (they were written as "error" rows,
    "KeyboardInterrupt: ", so the file looked complete with two failures); exit 130."""
    from hyspec.cli.dispatch import main
    from hyspec.core.scheduler import Scheduler

    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": [5, 6, 7], "max_new_tokens": n}) + "\n" for n in (2, 60, 2, 60)))
    out = tmp_path / "out.jsonl"
    step, calls = Scheduler.step, [0]

    def interrupted_step(self):
        calls[0] += 1
        if calls[0] == 12:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Scheduler, "step", interrupted_step)
    assert main(["generate", "--prompts-file", str(f), "--max-batch", "2", "--ignore-eos", "--out", str(out)]) == 130
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 3] and all(len(r["tokens"]) == 2 and "error" not in r for r in rows)
    assert "interrupted" in capsys.readouterr().err
    # ... and before any line finished: --out holds none (not an earlier run's rows)
    calls[0] = 11  # (the next step is the 12th: it raises)
    assert main(["generate", "--prompts-file", str(f), "--max-batch", "2", "--ignore-eos", "--out", str(out)]) == 130
    assert out.read_text() == ""


def test_a_closed_standard_output_is_one_line(monkeypatch, capsys, tmp_path):
    """`hyspec generate ... >&-` decoded everything, then died in a traceback at its first
    write ('NoneType' object has no attribute 'write'); `hyspec score` printed nothing, exit 0."""
    from hyspec.cli.dispatch import main

    monkeypatch.setattr(sys, "stdout", None)
    for argv in (["generate", "--prompt", "a"], ["score", "--text", "ab cd"]):
        assert main(argv) == 2
        assert "standard output is closed" in capsys.readouterr().err
    # commands whose results go to files still run
    f, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    f.write_text('{"prompt_ids": [5, 6], "max_new_tokens": 2}\n')
    assert main(["generate", "--prompts-file", str(f), "--out", str(out)]) == 0 and len(out.read_text().splitlines()) == 1
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "config.json").is_file()


def test_out_is_the_file_standard_input_reads(tmp_path):
    """`--prompts-file - --out p.jsonl < p.jsonl` emptied the prompts (exit 0, results only)."""
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt_ids": [5, 6], "max_new_tokens": 2}\n')
    with open(p) as stdin:
        r = subprocess.run([sys.executable, "-m", "hyspec.cli", "generate", "--prompts-file", "-", "--out", str(p)],
                           stdin=stdin, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "is the --prompts-file" in r.stderr, r.stderr
    assert p.read_text() == '{"prompt_ids": [5, 6], "max_new_tokens": 2}\n'


def test_lines_the_checkpoint_cannot_run_are_named_and_leave_out_alone(tmp_path, capsys):
    """A line drafting on a checkpoint without an MTP head was "prompt 0: ..." (0-based, or
    another line's number), one with stop strings on a checkpoint without a tokenizer named no
    line at all, and both emptied an existing --out file; an --adaptive-floor above every
    line's K was refused although a line drafting fewer takes its K as the floor."""
    from hyspec.cli import main

    nomtp, notok = tmp_path / "nomtp", tmp_path / "notok"
    assert main(["make-tiny", "--arch", "qwen3_next", "--out", str(nomtp), "--no-mtp"]) == 0
    assert main(["make-tiny", "--arch", "qwen3_5", "--out", str(notok), "--vocab-size", "256"]) == 0
    f, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    for model, lines, flags, msg in (  # (a flag's value: the flag named; a line's own: its line)
            (nomtp, '\n\n{"prompt": "a"}\n', ["--draft", "3"],
             "error: this checkpoint has no MTP head (no mtp.* weights): --draft 3 cannot run; use --draft 0"),
            (nomtp, '{"prompt": "a"}\n{"prompt": "b", "draft": 2}\n', [],
             f'error: {f}:2: this checkpoint has no MTP head (no mtp.* weights), so it cannot speculate: the line\'s '
             '"draft": 2'),
            (notok, '{"prompt_ids": [1, 2]}\n\n{"prompt_ids": [1, 2], "stop": ["x"]}\n', [],
             f"error: {f}:3: the line's \"stop\": stop strings need the checkpoint's tokenizer.json"),
            (notok, '{"prompt_ids": [1, 2]}\n', ["--stop", "x"],
             "error: --stop: stop strings need the checkpoint's tokenizer.json"),
            (notok, '{"prompt_ids": [1, 2], "stop": ["x"]}\n', ["--stop", "y"],  # (its own: the flag's is unused)
             f"error: {f}:1: the line's \"stop\": stop strings need the checkpoint's tokenizer.json")):
        f.write_text(lines)
        capsys.readouterr()
        assert main(["generate", "--model", str(model), "--prompts-file", str(f), "--out", str(out), *flags]) == 2
        assert msg in capsys.readouterr().err
        assert out.read_text() == "earlier results\n"
    f.write_text('{"prompt_ids": [1, 2], "draft": 2, "max_new_tokens": 3}\n')
    assert main(["generate", "--model", str(notok), "--prompts-file", str(f), "--out", str(out), "--adaptive",
                 "--adaptive-floor", "3"]) == 0
    assert len(out.read_text().splitlines()) == 1


def test_a_prompts_file_may_open_with_a_byte_order_mark(tmp_path):
    """A UTF-8 BOM before the first line (Notepad on Windows writes one) was "not valid JSON
    (Unexpected UTF-8 BOM)"; a BOM-like U+FEFF later in the file is still what it is."""
    from hyspec.cli.dispatch import build_parser
    from hyspec.cli.generate import read_prompts_file

    f = tmp_path / "bom.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "x = ", "max_new_tokens": 3}\n{"prompt": "y"}\n')
    args = build_parser().parse_args(["generate", "--prompts-file", str(f)])
    reqs = read_prompts_file(str(f), args)
    assert len(reqs) == 2
    f.write_bytes(b'{"prompt": "x = "}\n\xef\xbb\xbf{"prompt": "y"}\n')
    with pytest.raises(ValueError, match="bom.jsonl:2: not valid JSON"):
        read_prompts_file(str(f), args)


def _screen(text: str) -> list[str]:
    """The lines a terminal shows for `text` (a carriage return goes back to the line's start)."""
    lines = []
    for raw in text.split("\n"):
        buf, col = [], 0
        for ch in raw:
            if ch == "\r":
                col = 0
                continue
            buf[col:col + 1] = [ch]
            col += 1
        lines.append("".join(buf).rstrip())
    return lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal")
def test_results_on_a_terminal_are_not_glued_to_the_progress_bar(tmp_path):
    """Results on standard output in a terminal that also shows the progress bar (stderr): a
    result line was written after the bar's text ("generate:   0%|...| 0/3 [...]{"index": 0,
    ..."); the bar is cleared for each line now, and drawn again under it."""
    import fcntl
    import pty
    import struct
    import termios

    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": [5, 6], "max_new_tokens": 2}) + "\n" for _ in range(3)))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "hyspec.cli", "generate", "--prompts-file", str(f), "--max-batch",
                          "1"], stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.close(follower)
    data = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # (the other end closed: EIO)
            break
        if not chunk:
            break
        data += chunk
    os.close(leader)
    assert p.wait(timeout=300) == 0, data.decode(errors="replace")
    shown = _screen(data.decode())
    assert "generate:" in data.decode()  # (the bar was drawn: a terminal)
    rows = [line for line in shown if '"index"' in line]
    assert len(rows) == 3 and all(line.startswith('{"index": ') for line in rows), shown


def test_ctrl_c_mid_round_writes_no_row_for_the_lines_it_cut_off(tmp_path, monkeypatch):
    """Ctrl-C inside a round ends the round's sequences with a KeyboardInterrupt "error" (the
    scheduler stays clean): those lines are not results, so no row is written for them (nor
    counted as lines that failed); the lines finished before are."""
    from hyspec.cli.dispatch import main
    from hyspec.core import scheduler

    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": [5, 6, 7], "max_new_tokens": n}) + "\n" for n in (2, 60, 60)))
    out = tmp_path / "out.jsonl"
    run_round, calls = scheduler.run_round, [0]

    def interrupted_round(*a, **k):
        calls[0] += 1
        if calls[0] == 8:
            raise KeyboardInterrupt
        return run_round(*a, **k)

    monkeypatch.setattr(scheduler, "run_round", interrupted_round)
    assert main(["generate", "--prompts-file", str(f), "--max-batch", "3", "--ignore-eos", "--out", str(out)]) == 130
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1] and "error" not in rows[0] and len(rows[0]["tokens"]) == 2


def test_the_flags_are_each_lines_defaults_and_a_lines_own_fields_win(tmp_path):
    """read_prompts_file directly (no model): --max-new-tokens, --draft, --logprobs, --stop and
    the sampling flags are the value of every line that does not set its own (the help: "a line
    may set its own"), and a line's own wins; the documented edges hold on a line (draft 0..16,
    max_new_tokens 0, logprobs 0) and a boolean is not a token id."""
    from hyspec.cli.dispatch import build_parser
    from hyspec.cli.generate import _file_options, _options, read_prompts_file
    from hyspec.speculative.loop import MAX_DRAFT

    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n'
                 f'{{"prompt_ids": [5], "max_new_tokens": 0, "draft": {MAX_DRAFT}, "logprobs": 0, "stop": ["z"], '
                 '"temperature": 0.5, "seed": 2}\n')
    args = build_parser().parse_args(["generate", "--prompts-file", str(f), "--max-new-tokens", "7", "--draft", "2",
                                      "--logprobs", "3", "--stop", "END", "--temperature", "0.9", "--seed", "11"])
    flag, own = read_prompts_file(str(f), args)
    assert (flag["max_new_tokens"], flag["draft"], flag["logprobs"], flag["stop"], flag["own"]) == (7, 2, 3, ["END"],
                                                                                                  set())
    assert (flag["params"].temperature, flag["params"].seed) == (0.9, 11)
    assert (own["max_new_tokens"], own["draft"], own["logprobs"], own["stop"], own["own"]) == \
        (0, MAX_DRAFT, 0, ["z"], {"draft", "stop"})
    assert (own["params"].temperature, own["params"].seed, own["prompt"]) == (0.5, 2, [5])
    for line, msg in (('{"prompt_ids": [true, 2]}', '"prompt_ids" must be a non-empty list of integer'),
                      ('{"prompt_ids": []}', '"prompt_ids" must be a non-empty list of integer'),
                      ('{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}',
                       '"chat_template_kwargs" must be an object or null'),
                      ('{"prompt": "x", "max_new_tokens": -1}', "max_new_tokens must be an integer >= 0"),
                      ('{"prompt": "x", "draft": -1}', "draft must be an integer >= 0"),
                      ('{"prompt": "x", "logprobs": -1}', "logprobs must be null or an integer >= 0"),
                      ('   ', "no requests in the file")):
        f.write_text(line + "\n")
        with pytest.raises(ValueError, match=re.escape(msg)):
            read_prompts_file(str(f), args)
    # one --prompt: --draft takes 0..16 too (16 ran as K = 16, not refused)
    _, spec = _options(build_parser().parse_args(["generate", "--prompt", "x", "--draft", str(MAX_DRAFT)]))
    assert spec.k == MAX_DRAFT
    with pytest.raises(ValueError, match=f"--draft must be in 0..{MAX_DRAFT}"):
        _options(build_parser().parse_args(["generate", "--prompt", "x", "--draft", str(MAX_DRAFT + 1)]))
    # --adaptive-floor above every line's K is that K (as a line drafting less than the floor), not an error
    f.write_text('{"prompt": "a", "draft": 2}\n')
    _, spec = _file_options(build_parser().parse_args(["generate", "--prompts-file", str(f), "--adaptive",
                                                       "--adaptive-floor", "3"]))
    assert (spec.k, spec.adaptive_floor) == (2, 2)
