"""Writing a file whole: the bytes go to a temporary file beside it, which then replaces it
(Session.save, `hyspec bench --out`). A failed or interrupted write leaves the older file
whole, never a truncated one."""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_whole(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """write(f) into a binary file beside `path`, then move it over `path`. A symbolic link
    stays a link (the file it points to is replaced); an existing file keeps its mode (not
    the umask's); the temporary name is this call's own (two threads writing one path do not
    share it), and it is gone whatever happens. Errors are raised as they come (the caller
    names its file: an error in making the temporary file names that one)."""
    p = Path(path)
    if p.is_symlink():
        p = p.resolve()
    mode = stat.S_IMODE(p.stat().st_mode) if p.exists() else None
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            if mode is not None:
                os.chmod(tmp, mode)
            write(f)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
