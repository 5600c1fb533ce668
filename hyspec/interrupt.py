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
    previous handler is back on exit. Only where Ctrl-C has Python's own handler (raise
    KeyboardInterrupt): off the main thread (where Python delivers no signals), with SIGINT
    ignored (a background job: Ctrl-C is not for it), handled outside Python or by another
    handler of this process (a pipeline driver's, which defers the interrupt past an
    exchange with its stages: hyspec.parallel), it does nothing and a Ctrl-C acts as before."""
    flag.setdefault(key, False)
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
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
