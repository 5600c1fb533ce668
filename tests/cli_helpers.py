"""Running `hyspec ARGS` for several argument lists in one fresh process (the CLI tests'
one-by-one references): `python -m hyspec.cli ARGS` is sys.exit(main(ARGS)) of
hyspec.cli.dispatch, and each call of main loads its own Engine (its own prefix store), so
each call runs alone; only the Python start (the imports, seconds per process on a busy
machine) is shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# argv[1]: a JSON list of argument lists. Each call's stdout follows a marker line, then
# comes its exit code.
_EACH = """
import json, sys
from hyspec.cli.dispatch import main
for args in json.loads(sys.argv[1]):
    print("\\n@@hyspec-call@@", flush=True)
    code = main(args)
    sys.stdout.flush()
    print("\\n@@hyspec-exit@@", 0 if code is None else code, flush=True)
"""


def cli_each(calls: list[list[str]], env: dict | None = None, timeout: float = 300) -> list[tuple[int, str]]:
    """[(exit code, stdout)] of `hyspec ARGS` for each ARGS in calls, one after the other."""
    r = subprocess.run([sys.executable, "-c", _EACH, json.dumps(calls)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr
    return parse_each(r.stdout, len(calls))


def parse_each(stdout: str, n: int) -> list[tuple[int, str]]:
    """[(exit code, stdout)] per call from the output of the _EACH script (n calls)."""
    out = []
    for part in stdout.split("\n@@hyspec-call@@\n")[1:]:
        text, code = part.rsplit("\n@@hyspec-exit@@ ", 1)
        out.append((int(code), text))
    assert len(out) == n, stdout
    return out


# argv[1]: a JSON list of argument lists; each call runs with its own stdout and stderr
# captured, an escaping exception printed as the interpreter would (a traceback, exit 1)
_MANY = """
import contextlib, io, json, sys, traceback
from hyspec.cli.dispatch import main
results = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) or e.code is None else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append([0 if code is None else code, out.getvalue(), err.getvalue()])
sys.stdout.write("@@hyspec-results@@" + json.dumps(results))
"""


def cli_many(calls: list[list[str]], env: dict | None = None, timeout: float = 300,
             cwd: Path | str | None = None) -> list[tuple[int, str, str]]:
    """[(exit code, stdout, stderr)] of `hyspec ARGS` for each ARGS in calls, one after the
    other in one fresh process (one Python start for all of them): each call's output is
    captured on its own, and an exception escaping `main` shows as a traceback with exit
    code 1, as it would reach a user."""
    r = subprocess.run([sys.executable, "-c", _MANY, json.dumps(calls)], cwd=cwd or ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout,
                       check=False)
    assert r.returncode == 0 and "@@hyspec-results@@" in r.stdout, r.stderr[-3000:]
    return [tuple(x) for x in json.loads(r.stdout.split("@@hyspec-results@@", 1)[1])]
