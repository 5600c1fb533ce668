"""Where a result came from: the git commit of the code that produced it and whether the
tree had uncommitted changes (every results file under bench/results records this)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_state(root: str | Path = ROOT) -> dict:
    """{"commit": sha or None, "dirty": bool or None} of the checkout at `root` (None
    outside a git checkout, e.g. an installed wheel)."""
    def run(*args):
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    commit = run("rev-parse", "HEAD")
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}
