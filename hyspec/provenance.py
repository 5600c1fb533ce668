"""Where a result came from: the git commit of the code that produced it and whether the
tree had uncommitted changes (every results file under bench/results records this)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_SUFFIXES = (".py", ".sh")  # untracked files that make a tree dirty (code the commit lacks)


def git_state(root: str | Path = ROOT) -> dict:
    """{"commit": sha or None, "dirty": bool or None} of the checkout at `root` (None
    outside a git checkout whose top is `root`, e.g. an installed wheel, even in a venv inside
    some other repository; None without git). HYSPEC_GIT_COMMIT / HYSPEC_GIT_DIRTY
    override both: for a copy of a working tree whose .git is not the one it was copied from
    (the GPU machine gets such a copy); dirty is None (unknown) unless HYSPEC_GIT_DIRTY is
    0 or 1 (a commit named alone was recorded clean, whatever the copy held). An untracked
    file of code (.py, .sh; a new script: the commit lacks it) makes the tree dirty; other
    untracked files (a --out of the documented commands, a results file) do not. "env": the
    HYSPEC_* switches set for the run
    (e.g. HYSPEC_TOPP_KERNEL), when any is."""
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith("HYSPEC_") and k not in ("HYSPEC_GIT_COMMIT", "HYSPEC_GIT_DIRTY")}
    extra = {"env": env} if env else {}
    if os.environ.get("HYSPEC_GIT_COMMIT"):
        return {"commit": os.environ["HYSPEC_GIT_COMMIT"],
                "dirty": {"0": False, "1": True}.get(os.environ.get("HYSPEC_GIT_DIRTY", "").strip()),
                "source": "HYSPEC_GIT_COMMIT", **extra}
    def run(*args):
        try:
            r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        except OSError:  # no git on this machine (a slim image): nothing to record
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    top = run("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(root).resolve():  # an installed copy inside another
        return {"commit": None, "dirty": None, **extra}  # repository (a venv in the user's project): not ours
    commit = run("rev-parse", "HEAD")
    status = run("status", "--porcelain", "--untracked-files=all")
    if status is None:
        return {"commit": commit, "dirty": None, **extra}
    dirty = any(not line.startswith("??") or line[3:].strip('"').endswith(CODE_SUFFIXES)
                for line in status.splitlines() if line.strip())
    return {"commit": commit, "dirty": dirty, **extra}
