"""The `hyspec` command's entry point (pyproject's [project.scripts]). It imports the CLI
(torch and the rest, a second or more) inside its own Ctrl-C handler, so an interrupt while
the command is still starting ends as one line, as it does later (hyspec.cli.dispatch)."""

import sys


def main() -> int:
    try:
        from hyspec.cli.dispatch import main as run
    except KeyboardInterrupt:
        print("\nhyspec: interrupted", file=sys.stderr)
        return 130
    code = run()
    _quiet_exit()
    return code


def _quiet_exit() -> None:
    """The command's work is done: a Ctrl-C while the interpreter shuts down (torch's exit
    handlers take a while) ends the process as a SIGINT does (the shell's status 130), its
    output flushed first; it raised KeyboardInterrupt inside those handlers ("Exception
    ignored in atexit callback" and a traceback under the complete output)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # (a closed pipe: the interpreter's own final flush reports it as before)
            pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
