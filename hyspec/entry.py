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
    return run()
