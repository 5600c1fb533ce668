"""The README's shell examples run: every command of a ```sh block that needs no GPU, no
network and no long run is executed through this tree's CLI (`hyspec` = `python -m
hyspec.cli` with PYTHONPATH = the worktree root; all of them in one process, each with
its own output and exit code) and must exit 0, so the README cannot drift from the code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from cli_helpers import cli_many

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# not run here: installs, the test suite itself, GPU runs, the large bench, training,
# placeholders for the user's own files
SKIP = ("pip install", "pytest", "--device cuda", "--config b2", "--config qwen3-next-2b-dense", "hyspec train",
        "/path/to/", "hyspec serve", "hyspec chat", "curl ")  # servers and interactive programs: tests/test_server.py, test_chat.py


def readme_commands() -> list[str]:
    cmds = []
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S):
        cur = ""
        for line in block.splitlines():
            if line.rstrip().endswith("\\"):
                cur += line.rstrip()[:-1] + " "
                continue
            cur += line
            if cur.strip() and not cur.lstrip().startswith("#"):
                cmds.append(cur.strip())
            cur = ""
    return cmds


def runnable() -> list[str]:
    out = []
    for cmd in readme_commands():
        # the set-up line installs, then generates: keep the generate part
        parts = [p.strip() for p in cmd.split("&&")]
        parts = [p for p in parts if not any(s in p for s in SKIP)]
        if parts and all(p.startswith("hyspec ") for p in parts):
            out.extend(parts)
    return out


def test_readme_has_runnable_examples() -> None:
    cmds = runnable()
    assert any(c.startswith("hyspec generate") for c in cmds)
    assert any(c.startswith("hyspec score") for c in cmds)
    assert any(c.startswith("hyspec replay") for c in cmds)
    assert any(c.startswith("hyspec bench") for c in cmds)


def run_sh(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    script = f'hyspec() {{ "{sys.executable}" -m hyspec.cli "$@"; }}\n{cmd}\n'
    return subprocess.run(["sh", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_readme_score_example_scores_real_newlines(tmp_path) -> None:
    cmd = next(c for c in runnable() if c.startswith("hyspec score"))
    r = run_sh(cmd + " --json", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    from hyspec.engine import Engine

    scored = Engine.load().decode(json.loads(r.stdout)["tokens"])
    assert "\n" in scored and "\\" not in scored, repr(scored)  # a newline, not a backslash and an n


def shell_argvs(cmds: list[str], cwd: Path) -> list[list[str]]:
    """Each command's `hyspec` arguments as the shell expands them (quotes, $(...)):
    `sh` runs the commands with `hyspec` a function that prints its arguments."""
    script = "hyspec() { for a in \"$@\"; do printf '%s\\0' \"$a\"; done; printf '@@end@@\\0'; }\n" + "\n".join(cmds)
    r = subprocess.run(["sh", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=60, check=True)
    argvs, cur = [], []
    for arg in r.stdout.split("\0")[:-1]:
        if arg == "@@end@@":
            argvs.append(cur)
            cur = []
        else:
            cur.append(arg)
    assert len(argvs) == len(cmds), (cmds, r.stdout)
    return argvs


def test_readme_examples_run(tmp_path) -> None:
    """Every runnable example, one after the other in one Python process (its argv as the
    shell expands it; its own stdout, stderr and exit code: cli_helpers.cli_many)."""
    # files the examples name, written where they run
    (tmp_path / "some_file.py").write_text((ROOT / "hyspec" / "tokenizer.py").read_text())
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "def add(a, b):", "max_new_tokens": 8, "draft": 3}\n'
                                            '{"prompt": "import os", "max_new_tokens": 8, "temperature": 0.8}\n')
    # (their /tmp/ folders here: a checkpoint another run left in /tmp/tiny is not this run's)
    cmds = [c.replace("/tmp/", f"{tmp_path}/") for c in runnable()]
    argvs = shell_argvs(cmds, tmp_path)
    assert argvs[cmds.index(next(c for c in cmds if "$(printf" in c))][2] == "def add(a, b):\n    return a + b"  # $(...) expanded
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for cmd, (code, stdout, stderr) in zip(cmds, cli_many(argvs, env=env, cwd=tmp_path, timeout=600)):
        assert code == 0, (cmd, stdout[-2000:], stderr[-3000:])
        assert "Traceback" not in stderr, (cmd, stderr)
        if cmd.startswith("hyspec generate --prompts-file") and "--out" in cmd:  # one JSON object per request
            out = tmp_path / cmd.split("--out", 1)[1].split()[0]
            assert all(json.loads(line)["tokens"] for line in out.read_text().splitlines()), cmd
        elif cmd.startswith("hyspec generate") and "--json" not in cmd:
            assert stdout.strip(), cmd
            lines = [ln for ln in stdout.splitlines() if ln.strip()]
            # worth looking at: not one line repeated to the token limit
            assert len(set(lines)) >= len(lines) // 2, (cmd, stdout)
