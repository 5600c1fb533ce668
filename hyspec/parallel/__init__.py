"""Multi-process (multi-GPU) inference: pipeline stages over torch.distributed
(NCCL on GPUs, gloo on CPU). See docs/multi-gpu.md and hyspec/parallel/pipeline.py.

    hyspec generate --pp 2 ...            # hyspec starts its 2 ranks itself (127.0.0.1, a free port)
    torchrun --nproc-per-node 2 -m hyspec.cli generate --pp 2 ...   # ranks launched by the user
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import subprocess
import sys
import time

# set in a rank process while the CLI runs there: {"world", "rank", "device", "link"}
ACTIVE: dict | None = None


def pp_from_argv(argv: list[str]) -> int:
    """The --pp value of a command line (1 without it); ValueError naming the flag when it
    is not an integer >= 1."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--pp", default="1")
    args, _ = ap.parse_known_args(argv)
    try:
        stages = int(args.pp)
    except ValueError:
        raise ValueError(f"--pp must be an integer >= 1, got {args.pp!r}") from None
    if stages < 1:
        raise ValueError(f"--pp must be >= 1, got {stages}")
    return stages


def check_launch(argv: list[str], stages: int) -> None:
    """What a `--pp N` launch can check before it starts N processes: the device (as one
    process would: cpu, or cuda with N GPUs, rank r on cuda:r) and that the model has at
    least N layers (config.json only)."""
    from hyspec.config import ModelConfig
    from hyspec.engine import check_device, default_model_dir
    from hyspec.loading import resolve_model_dir
    from hyspec.parallel.pipeline import env_number

    for name in ("HYSPEC_PP_TIMEOUT", "HYSPEC_PP_JOIN_TIMEOUT"):  # (each rank said it, then the launcher)
        env_number(name, 1.0)
    margs = _model_args(argv)
    dev = check_device(margs.device)
    if dev.type == "cuda" and dev.index is None:
        import torch

        if torch.cuda.device_count() < stages:
            raise ValueError(f"--pp {stages} --device cuda puts rank r on cuda:r: this machine has "
                             f"{torch.cuda.device_count()} GPU(s)")
    cfg = ModelConfig.from_dir(resolve_model_dir(margs.model) if margs.model else default_model_dir())
    if stages > cfg.num_hidden_layers:
        raise ValueError(f"--pp {stages}: the model has {cfg.num_hidden_layers} layers; each stage needs at least one")


def graceful_ctrl_c(argv: list[str]) -> bool:
    """Whether a Ctrl-C of this `--pp` command is passed to its driver rank, which ends the
    command as one process does (what it printed so far kept): `generate` with one lane.
    `serve` (uvicorn takes SIGINT itself and would count the launcher's copy as a second,
    forced one) and `--lanes N` (the lanes' exchanges run in threads the signal does not
    reach) stop every rank at once, as before."""
    if not argv or argv[0] != "generate":
        return False
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--lanes", default="1")
    args, _ = ap.parse_known_args(argv)
    return str(args.lanes).strip() in ("", "1")


def _model_args(argv: list[str]):
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--model", default=None, type=os.path.expanduser)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ssm-dtype", default=None)
    args, _ = ap.parse_known_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_launcher() -> None:
    """In a rank that launch() started: on Linux, have the kernel SIGTERM it when the
    launcher dies (a SIGKILL of the launcher, which it cannot pass on, left the ranks
    running and holding their GPUs); if the launcher is already gone, end now."""
    launcher = os.environ.get("HYSPEC_LAUNCHER_PID")
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # it died before the prctl took hold
        raise SystemExit(1)


class RankDied(RuntimeError):
    """A pipeline rank ended mid-run (killed, or exited on its own): the message names it;
    exit_code is what a shell would report for it."""

    def __init__(self, rank: int, world: int, code: int) -> None:
        import signal

        how = f"exited with code {code}"
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:  # (a signal number without a name)
                how = f"was killed by signal {-code}"
        super().__init__(f"pipeline rank {rank} of {world} {how}; the other ranks were stopped")
        self.exit_code = 128 - code if code < 0 else (code or 1)


_DEFERRED = {"depth": 0, "pending": False}  # the driver's Ctrl-C inside an exchange with the stages


@contextlib.contextmanager
def sigint_deferred():
    """A Ctrl-C that reaches the pipeline driver inside this block (a message sent to the
    stages, their reply not yet read) is raised at the block's end: raised halfway, the
    driver's stop message would meet a worker blocked sending that reply, and neither would
    move (the launcher then killed them, and everything printed so far was lost)."""
    if not threading_main():  # (a signal reaches the main thread only: another thread's block defers nothing)
        yield
        return
    _DEFERRED["depth"] += 1
    try:
        yield
    finally:
        _DEFERRED["depth"] -= 1
    if _DEFERRED["depth"] == 0 and _DEFERRED["pending"]:
        _DEFERRED["pending"] = False
        raise KeyboardInterrupt


def _driver_sigint(*_):
    """The driver rank's SIGINT handler: the first Ctrl-C ends the command (at once, or at the
    end of an exchange with the stages); later copies (a terminal's and the launcher's) are
    ignored."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _DEFERRED["depth"]:
        _DEFERRED["pending"] = True
        return
    raise KeyboardInterrupt


def launch(argv: list[str], world: int) -> int:
    """Start `world` ranks of `python -m hyspec.cli ARGV` on this machine (what torchrun
    would do) and wait for them; if one fails, the others are stopped. Returns rank 0's
    exit code (or the first failure's)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world)}
    import signal

    stopped_by: list[int] = []  # SIGTERM: the ranks are stopped and the exit is a SIGTERM's (143), not Ctrl-C's

    def _term(*_):
        stopped_by.append(signal.SIGTERM)
        raise KeyboardInterrupt

    if threading_main():
        signal.signal(signal.SIGTERM, _term)  # stop the ranks too
    env["HYSPEC_LAUNCHER_PID"] = str(os.getpid())  # a rank ends itself when this process dies
    def _no_sigint():  # (in each rank, before Python starts: a Ctrl-C while it boots is not a traceback;
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver takes SIGINT once it can end cleanly, run_cli)

    procs = [subprocess.Popen([sys.executable, "-m", "hyspec.cli", *argv], preexec_fn=_no_sigint,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
    first = None  # (rank, exit code) of the first rank that failed
    try:
        while True:
            rcs = [p.poll() for p in procs]
            bad = [rc for rc in rcs if rc not in (None, 0)]
            if bad:
                first = next((r, rc) for r, rc in enumerate(rcs) if rc not in (None, 0))
            if bad or all(rc is not None for rc in rcs):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        if not stopped_by and graceful_ctrl_c(argv) and procs[-1].poll() is None:
            # Ctrl-C: the driver rank ends the command as one process would (its "interrupted" line,
            # the lines finished so far) and hands rank 0 what it printed; the other ranks ignore
            # SIGINT (run_cli). A second Ctrl-C, or 15 s without an end, stops every rank now.
            try:
                deadline, resend = time.monotonic() + 15, 0.0
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    if time.monotonic() >= resend and procs[-1].poll() is None:  # (again until it takes it:
                        procs[-1].send_signal(signal.SIGINT)  # a driver still starting ignores SIGINT)
                        resend = time.monotonic() + 0.5
                    time.sleep(0.05)
            except KeyboardInterrupt:
                pass
            if all(p.poll() is not None for p in procs) and procs[0].returncode is not None \
                    and procs[0].returncode >= 0:
                return procs[0].returncode  # (rank 0 printed the driver's output, its "interrupted" included)
        bad = [143 if stopped_by else 130]
        if not stopped_by:
            print("hyspec: interrupted", file=sys.stderr)  # (as one process says it)
    if bad:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # (a stopped process keeps its SIGTERM pending)
                p.kill()
                p.wait()
        if first is not None and (first[1] < 0 or first[0] != 0):  # rank 0 prints its own (the driver's) errors
            print(f"hyspec: error: {RankDied(first[0], world, first[1])}", file=sys.stderr)
        rc = procs[0].returncode if procs[0].returncode not in (None, 0, -15) else bad[0]
        return 128 - rc if rc < 0 else rc  # (a signal as a shell reports it, not 256 - n)
    return procs[0].returncode


def run_cli(argv: list[str], world: int, main) -> int:
    """Run one rank of a `--pp world` command: the last rank runs the command (`main`) as
    the pipeline driver, its stdout/stderr captured and handed to rank 0 at the end; the
    other ranks serve their stages; rank 0 prints."""
    global ACTIVE
    if world < 1:
        raise ValueError(f"--pp must be >= 1, got {world}")
    if "RANK" not in os.environ:
        return launch(argv, world)
    _die_with_launcher()
    import torch
    import torch.distributed as dist

    from hyspec.parallel.pipeline import Link, Worker, init, load_stage

    margs = _model_args(argv)
    rank, dev = init(world, margs.device)
    link = Link(rank, world, dev)
    try:
        # launch()'s ranks start with SIGINT ignored; the driver takes it from its command's start
        # (the launcher passes a Ctrl-C on), the workers serve their stages until the driver stops them
        ours = os.environ.get("HYSPEC_LAUNCHER_PID") is not None and threading_main() and graceful_ctrl_c(argv)
        if rank == world - 1:
            ACTIVE = {"world": world, "rank": rank, "device": dev, "link": link}
            out, err = io.StringIO(), io.StringIO()
            rc, alone = 1, world == 1  # alone: this rank's exit code is the command's
            # `serve` runs the HTTP server on this (driver) rank and logs live; other commands'
            # output is handed to rank 0, which prints it
            live = bool(argv) and argv[0] == "serve"
            try:
                with contextlib.nullcontext() if live else contextlib.redirect_stdout(out), \
                        contextlib.nullcontext() if live else contextlib.redirect_stderr(err):
                    try:
                        if ours:
                            import signal

                            signal.signal(signal.SIGINT, _driver_sigint)
                        rc = main(argv)
                    except SystemExit as e:  # argparse: --help, usage errors
                        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
                        if not isinstance(e.code, (int, type(None))):
                            print(e.code, file=sys.stderr)
                    except RuntimeError as e:  # a stage's rank went away mid-command (the link broke)
                        rc = 1
                        first = str(e).splitlines()[0] if str(e) else type(e).__name__
                        if first.startswith("[") and ("gloo" in first or "nccl" in first.lower()):
                            first = "the connection to another rank was lost"  # (not gloo's source line and quip)
                        print(f"hyspec: error: the pipeline broke: {first}", file=sys.stderr)
            finally:
                if ours:  # (a Ctrl-C now would cut the stop messages short: the workers would wait on)
                    import signal

                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                driver = ACTIVE.get("driver")
                result = (out.getvalue(), err.getvalue(), rc)
                try:
                    if driver is not None:
                        driver.stop(result)
                    else:  # the command ended before it loaded the model (e.g. a bad flag)
                        for r in range(world - 1):
                            link.send_obj({"stop": True, "result": result if r == 0 else None}, r)
                except RuntimeError:  # rank 0 is gone: this rank prints what it would have printed
                    sys.stdout.write(out.getvalue())
                    sys.stderr.write(err.getvalue())
                    rc, alone = rc or 1, True
                ACTIVE = None
            return rc if alone else 0
        from hyspec.engine import default_model_dir

        path = margs.model if margs.model is not None else default_model_dir()
        model, load_error = None, None
        try:
            model = load_stage(path, world, rank, dtype=margs.dtype, device=dev, ssm_dtype=margs.ssm_dtype)
            if dev.type == "cpu" and sum(p.numel() for p in model.parameters()) < 50_000_000:
                torch.set_num_threads(1)
        except Exception as e:  # (its own layers: the driver loads only its own) reported to the driver,
            load_error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"  # which names it
        try:
            result = _drain(link, load_error) if model is None else Worker(model, link).run()
        except Exception as e:  # another rank went away (the link broke): one line, not a traceback
            print(f"hyspec: pipeline rank {rank}: stopped, the link to another rank broke ({type(e).__name__})",
                  file=sys.stderr)
            return 1
        if rank == 0 and result is not None:
            out, err, rc = result
            sys.stdout.write(out)
            sys.stdout.flush()
            sys.stderr.write(err)
            sys.stderr.flush()
            return rc
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _drain(link, load_error: str):
    """A worker that could not load its stage: answer the driver's status question with
    why, and fail every forward until the driver stops."""
    while True:
        msg = link.recv_obj(link.world - 1)
        if msg.get("stop"):
            return msg.get("result")
        if msg.get("status"):
            link.send_obj({"load_error": load_error}, link.world - 1)
            continue
        if link.rank > 0:
            try:
                link.recv_x(link.rank - 1, (1, 1), None, None)
            except RuntimeError:
                pass
        link.send_x(None, link.rank + 1, f"rank {link.rank} could not load its stage: {load_error}")


def check_stages(link, ranges) -> None:
    """The driver asks every other rank whether its stage loaded; ValueError naming the
    first that did not, and why (so a command fails at start-up with the reason, not at its
    first forward with a traceback, and a server does not start half-loaded)."""
    with sigint_deferred():  # (a Ctrl-C halfway would leave a worker blocked on its answer)
        for r in range(link.world - 1):
            link.send_obj({"status": True}, r)
        answers = [link.recv_obj(r) for r in range(link.world - 1)]
    for r, answer in enumerate(answers):
        if answer.get("load_error"):
            raise ValueError(f"pipeline stage {r} (layers {ranges[r].start}..{ranges[r].stop - 1}, rank {r}) could "
                             f"not load: {answer['load_error']}")


def active_engine(path, *, dtype: str, device: str, ssm_dtype: str | None = None):
    """In a pipeline driver: the Engine over this rank's (last) stage with PipelineBackend."""
    from hyspec.engine import Engine, default_model_dir
    from hyspec.loading import resolve_model_dir
    from hyspec.parallel.pipeline import PipelineBackend, load_stage
    from hyspec.tokenizer import Tokenizer

    a = ACTIVE
    path = resolve_model_dir(path) if path is not None else default_model_dir()
    model = load_stage(path, a["world"], a["rank"], dtype=dtype, device=a["device"], ssm_dtype=ssm_dtype)
    from hyspec.parallel.pipeline import stage_ranges

    ranges = stage_ranges(model.cfg, a["world"], model.dtype)
    check_stages(a["link"], ranges)
    print(f"[pipeline: {a['world']} stages, layers " + " | ".join(f"{r.start}..{r.stop - 1}" for r in ranges)
          + f", {a['link'].comm_dev.type} {'nccl' if a['link'].comm_dev.type == 'cuda' else 'gloo'}]",
          file=sys.stderr)
    backend = PipelineBackend(model, a["link"])
    a["driver"] = backend.driver
    tok = Tokenizer(path) if (path / "tokenizer.json").is_file() else None
    eng = Engine(model, tok, str(path))
    eng.backend = backend
    return eng
