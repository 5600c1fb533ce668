"""The `hyspec` entry point: the top-level parser and the dispatch to each subcommand.

generate / score / replay / make-tiny are parsed here (each module adds its subparser);
bench, train, serve and chat own their whole argument list and are handed argv as is."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from hyspec.parallel import RankDied

from hyspec.cli import generate, make_tiny, replay, score
from hyspec.sampling import ParamError

SUBCOMMANDS = {"generate": generate, "score": score, "replay": replay, "make-tiny": make_tiny}


def build_parser() -> argparse.ArgumentParser:
    import hyspec.cli

    from hyspec.cli.common import OneLineParser

    parser = OneLineParser(prog="hyspec", description=hyspec.cli.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hyspec {hyspec.__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    sub.add_parser("bench", help="speed benchmark (see `hyspec bench --help`)", add_help=False)
    sub.add_parser("train", help="train the small default model (see `hyspec train --help`)", add_help=False)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server (see `hyspec serve --help`)", add_help=False)
    sub.add_parser("chat", help="interactive chat with a kept session state (see `hyspec chat --help`)",
                   add_help=False)
    parser.commands = sub.choices  # name -> its subparser (parse reports a command's unknown flags there)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The top-level parser's namespace; a flag the command does not know is that command's
    error ("hyspec score: error: unrecognized arguments ...", as its other flag errors are)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


# Python argument / option names -> the flags a user types
FLAG_NAMES = {"mode": "--sampling-mode", "k": "--draft", "prompt": "--prompt / --prompt-ids"}


def flag_name(name: str) -> str:
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


# a missing optional module -> what installs it (pyproject.toml's extras)
EXTRA_OF = {"fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "prometheus_client": "serve",
            "pydantic": "serve", "llguidance": "constraints", "triton": "gpu", "fla": "gpu"}


def error_message(e: Exception) -> str:
    if isinstance(e, ParamError):
        return f"argument {flag_name(e.field)}: {e.why} (got {e.shown})"
    if isinstance(e, ModuleNotFoundError) and e.name and "pip install" not in str(e):
        top = e.name.split(".")[0]
        if top in EXTRA_OF:  # (the bare "No module named 'fastapi'" said nothing of what to install)
            return f"{e} (pip install 'hyspec[{EXTRA_OF[top]}]', or from a checkout: pip install -e '.[{EXTRA_OF[top]}]')"
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.strerror}: {e.filename}"
    return str(e)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"hyspec: warning: {message}\n"


def _delegated(cmd: str):
    """The main(argv) of a subcommand that parses its own arguments (None for the others)."""
    if cmd == "bench":
        from hyspec.bench import main
    elif cmd == "train":
        from hyspec.train.train import main
    elif cmd == "serve":
        from hyspec.server import main
    elif cmd == "chat":
        from hyspec.chat import main
    else:
        return None
    return main


def _check_before_launch(cmd: str, argv: list[str]) -> None:
    """The options of a `--pp N` command that need no model, checked in this process before
    it starts N ranks (a ValueError or the parser's exit, as the ranks would give)."""
    from hyspec import parallel

    if cmd == "serve":
        from hyspec import server

        args = server.build_parser().parse_args(argv[1:])
        server.check(args)
        server.check_port(args.host, args.port)  # (the driver rank binds it: said before N ranks start)
    elif cmd in SUBCOMMANDS and hasattr(SUBCOMMANDS[cmd], "check"):
        SUBCOMMANDS[cmd].check(parse(argv))
    parallel.check_launch(argv, parallel.pp_from_argv(argv))  # device, stages <= layers


def out_of_memory(e: BaseException) -> bool:
    """A failed allocation: MemoryError, torch's OutOfMemoryError (CUDA), or the CPU
    allocator's RuntimeError."""
    text = str(e)
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower()))


def main(argv: list[str] | None = None) -> int:
    """Entry point. User errors (bad values, missing files) end in one `hyspec CMD:
    error: ...` line and exit code 2, never a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else None
    old_format = warnings.formatwarning
    warnings.formatwarning = _format_warning
    try:
        if sys.stdout is None and cmd is not None:  # (`>&-`: a write would fail, after the work)
            to_file = any(a == "--out" or a.startswith("--out=") for a in argv)
            if cmd in ("score", "replay", "chat") or (cmd in ("generate", "bench") and not to_file):
                raise ValueError("standard output is closed: this command writes its results there (redirect it "
                                 "to a file instead)")
            sys.stdout = open(os.devnull, "w")  # (its results go to files: a stray line is dropped, not fatal)
        if cmd not in (None, "--version") and not {"-h", "--help"} & set(argv):  # a bad HYSPEC_* knob, before
            # any model loads (hyspec.envknobs; a help text is shown whatever the environment holds)
            from hyspec.envknobs import check as check_env

            check_env()
        if cmd in ("generate", "bench", "serve") and "--pp" in " ".join(argv):
            from hyspec import parallel

            stages = parallel.pp_from_argv(argv)
            if stages > 1 and parallel.ACTIVE is None and cmd != "bench":  # the pipeline bench starts its own ranks
                if "RANK" not in os.environ:  # before this process starts the ranks
                    _check_before_launch(cmd, argv)
                return parallel.run_cli(argv, stages, main)
        delegated = _delegated(cmd)
        if delegated is not None:
            return delegated(argv[1:])
        args = parse(argv)
        return SUBCOMMANDS[args.cmd].run(args)
    except BrokenPipeError:  # the reader went away (`| head`): not an error of the user's input
        try:  # stop the interpreter's final flush of stdout from failing again at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except (ValueError, OSError, ImportError) as e:
        print(f"hyspec {cmd}: error: {error_message(e)}", file=sys.stderr)
        return 2
    except RankDied as e:  # a pipeline rank the bench started died: named, its signal's exit code
        print(f"hyspec {cmd}: error: {e}", file=sys.stderr)
        return e.exit_code
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise  # a bug: its traceback is what a report needs
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"hyspec {cmd}: error: out of memory ({first})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nhyspec: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = old_format
