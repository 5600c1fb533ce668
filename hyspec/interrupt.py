"""A Ctrl-C that asks, then insists: for commands whose work can stop cleanly at a boundary
(a training step, a decoding round), the first Ctrl-C only asks for the stop and the work
ends at its next boundary, keeping what it did; a second one raises KeyboardInterrupt at
once, as Ctrl-C does everywhere else."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


@contextmanager
def stop_on_ctrl_c(flag: dict, key: str = "sigint"):
    """While inside: a first Ctrl-C (SIGINT) sets flag[key] = True (the caller looks at it at
    its boundaries); a second one, once flag[key] is True, raises KeyboardInterrupt. The
    previous handler is back on exit. Off the main thread (where Python delivers no
    signals), with SIGINT ignored (a background job: Ctrl-C is not for it) or handled outside
    Python, it does nothing: a Ctrl-C then acts as the previous handler says."""
    flag.setdefault(key, False)
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        yield flag
        return

    def on_sigint(signum, frame):
        if flag[key]:
            raise KeyboardInterrupt
        flag[key] = True

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, old)
