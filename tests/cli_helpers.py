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
    out = []
    for part in r.stdout.split("\n@@hyspec-call@@\n")[1:]:
        text, code = part.rsplit("\n@@hyspec-exit@@ ", 1)
        out.append((int(code), text))
    assert len(out) == len(calls), r.stdout
    return out
