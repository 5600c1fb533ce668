"""`hyspec serve`: an OpenAI-compatible HTTP server (docs/server.md).

This package module stays import-light (no FastAPI) so `hyspec --help` does not pay for it;
the app lives in hyspec.server.app and all engine interaction in hyspec.server.worker."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# the prefix store's default budgets (None on the command line: not given, which --pp must know)
STORE_BYTES, STORE_HOST_BYTES = 1 << 30, 4 << 30


def build_parser() -> argparse.ArgumentParser:
    from hyspec.config import DTYPE_NAMES, SSM_CHOICES
    from hyspec.speculative.loop import MAX_DRAFT

    from hyspec.cli.common import HelpFormatter, OneLineParser

    class Help(HelpFormatter):  # the defaults shown, but no "(default: None)" after a help that explains it
        def _get_help_string(self, action):
            return action.help if action.default is None else super()._get_help_string(action)

    p = OneLineParser(prog="hyspec serve", description="OpenAI-compatible server (docs/server.md)", formatter_class=Help)
    p.add_argument("--model", default=None, type=os.path.expanduser, help="checkpoint directory, or a Hugging Face model id (org/name[@revision]: from the local cache, else downloaded) (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--draft", type=int, default=None,
                   help=f"default drafts per round K for requests that do not set `draft` (0..{MAX_DRAFT}; "
                        "default 3 when the model has an MTP head, else 0)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    p.add_argument("--max-queue", type=int, default=256, help="sequences waiting for a batch slot; beyond: 429")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: hyspec-default for the embedded model, else the directory name, or the Hugging Face id as given)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    p.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="auto: a request's sampling fields left out take the checkpoint's generation_config.json "
                        "recommendation (as vLLM); none: OpenAI's defaults (temperature 1, top_p 1)")
    p.add_argument("--no-prefix-store", action="store_true",
                   help="do not keep finished requests' end states in the prefix store nor resume prompts from it")
    p.add_argument("--no-warm-up", action="store_true",
                   help="on a GPU, do not run the batched graphs once before the first request (the first "
                        "requests then pay for imports, compilation and the first graph captures)")
    p.add_argument("--prefix-store-bytes", type=int, default=None,
                   help="prefix store budget on the model's device (least recently used states beyond it move "
                        f"to host memory; default {STORE_BYTES >> 30} GiB)")
    p.add_argument("--prefix-store-host-bytes", type=int, default=None,
                   help="prefix store budget in host memory (least recently used states beyond it are dropped; "
                        f"default {STORE_HOST_BYTES >> 30} GiB)")
    p.add_argument("--dtype", default="auto", choices=("auto",) + DTYPE_NAMES,
                   help="weight and activation dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--ssm-dtype", default=None, choices=SSM_CHOICES,
                   help="storage dtype of the Gated DeltaNet state (default: the checkpoint's mamba_ssm_dtype, "
                        "else float32; bfloat16 halves a sequence's state bytes, output changes slightly)")
    p.add_argument("--chat-template", default=None, type=os.path.expanduser, metavar="FILE",
                   help="a Jinja chat template file to use instead of the checkpoint's")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "qwen3", "none"],
                   help="qwen3: a reply's <think> part is returned as reasoning_content; none: all is content; "
                        "auto (default): qwen3 when the chat template writes </think>")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGINT / SIGTERM the running requests are stopped (each answered 503, a stream with "
                        "its error event); connections still open after this many seconds are closed")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the level of the server's log (one line per finished request at info) and uvicorn's")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (processes / GPUs); the HTTP server runs on the last rank (docs/multi-gpu.md)")
    p.add_argument("--optimistic", action="store_true",
                   help="with --pp: fork the next round's verify on the first stages before the current one "
                        "resolves (hyspec/parallel/fork.py; output unchanged)")
    return p


def check(args) -> None:
    """The checks of the options that need no model (make_app runs them first; `--pp N`
    runs them before it starts its ranks, so a bad option fails at once)."""
    from hyspec.speculative.loop import MAX_DRAFT

    if args.draft is not None and not 0 <= args.draft <= MAX_DRAFT:
        raise ValueError(f"--draft must be in 0..{MAX_DRAFT}, got {args.draft}")
    given = [f for f, v in (("--prefix-store-bytes", args.prefix_store_bytes),
                            ("--prefix-store-host-bytes", args.prefix_store_host_bytes)) if v is not None]
    if any(v is not None and v < 0 for v in (args.prefix_store_bytes, args.prefix_store_host_bytes)):
        raise ValueError("--prefix-store-bytes and --prefix-store-host-bytes must be >= 0")
    if given and getattr(args, "pp", 1) >= 2:  # (it was dropped in silence: /health said prefix_store null)
        raise ValueError(f"{given[0]} does not go with --pp: a pipeline keeps no prefix store")
    if given and args.no_prefix_store:
        raise ValueError(f"{given[0]} does not go with --no-prefix-store")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not args.shutdown_timeout >= 0:  # (NaN too)
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.max_body_bytes < 1:  # (0 removed the limit in silence, a negative one refused every POST)
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.chat_template is not None:
        from hyspec.chat_template import read_template_file

        read_template_file(args.chat_template, "--chat-template")


def check_port(host: str, port: int) -> None:
    """ValueError when the server's address is taken (or its host unknown), said before the
    model loads. Each address the host resolves to is bound as asyncio binds it for uvicorn
    (SO_REUSEADDR; IPv6 sockets IPv6-only; "" is every interface); "in use", "not an address of
    this machine" and "permission denied" are reported, any other bind failure is left to uvicorn."""
    import errno
    import socket

    if not isinstance(port, int) or not 0 <= port <= 65535:  # (a bad one: check(); 0, any free port, is bound too:
        return  # its host can be unknown or not this machine's all the same)
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0,
                                   socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: not an address this machine can listen on ({e.strerror})") from None
    for family, kind, proto, _, addr in dict.fromkeys(infos):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(f"cannot listen on {host}:{port}: the address is in use (--host / --port)") \
                        from None
                if e.errno == errno.EADDRNOTAVAIL:  # (it resolves, but to no interface of this machine: uvicorn
                    raise ValueError(f"cannot listen on {host}:{port}: {addr[0]} is not an address of this "  # said
                                     "machine (--host; 0.0.0.0 listens on every interface)") from None  # so after the load
                if e.errno == errno.EACCES:
                    raise ValueError(f"cannot listen on {host}:{port}: permission denied (ports below 1024 need "
                                     "privileges; --port)") from None


def make_app(args):
    """Load the engine and build the FastAPI app for parsed `hyspec serve` arguments."""
    from pathlib import Path

    import torch

    from hyspec.config import no_mtp_error
    from hyspec.engine import Engine
    from hyspec.server.app import ServerConfig, create_app

    from hyspec import parallel

    check(args)
    if parallel.ACTIVE is not None:  # --pp: this process is the pipeline driver (the last stage)
        eng = parallel.active_engine(args.model, dtype=args.dtype, device=args.device,
                                     ssm_dtype=getattr(args, "ssm_dtype", None))
        eng.optimistic = eng.backend.driver.optimistic = bool(args.optimistic)
    else:
        if args.optimistic:
            raise ValueError("--optimistic forks pipeline stages: it needs --pp N with N >= 2")
        eng = Engine.load(args.model, dtype=args.dtype, device=args.device, ssm_dtype=getattr(args, "ssm_dtype", None))
    if args.chat_template is not None:
        eng.use_chat_template(Path(args.chat_template))
    if eng.model.device.type == "cpu" and sum(p.numel() for p in eng.model.parameters()) < 50_000_000:
        torch.set_num_threads(1)
    draft = args.draft if args.draft is not None else (3 if eng.model.has_mtp else 0)  # (in range: check)
    if draft and not eng.model.has_mtp:
        raise no_mtp_error()
    if parallel.ACTIVE is not None:  # the pipeline keeps no prefix store: /health and /metrics say so
        args.no_prefix_store = True
    if not args.no_prefix_store:
        from hyspec.prefix_store import PrefixStore

        eng.store = PrefixStore(
            budget_bytes=STORE_BYTES if args.prefix_store_bytes is None else args.prefix_store_bytes,
            host_budget_bytes=STORE_HOST_BYTES if args.prefix_store_host_bytes is None else args.prefix_store_host_bytes)
    if args.served_model_name:
        name = args.served_model_name
    elif args.model is None:
        name = "hyspec-default"
    else:  # a Hugging Face id: the id (as clients name it), else the directory's name
        from hyspec.loading import is_hub_id

        hub = is_hub_id(args.model) and not Path(args.model).expanduser().exists()
        name = args.model.partition("@")[0] if hub else Path(args.model).expanduser().resolve().name
    if args.generation_config == "none":
        eng.sampling_defaults = {}
    rec = eng.sampling_defaults
    if rec:  # (as vLLM: a request's sampling fields left out take the checkpoint's recommendation)
        print("hyspec serve: requests that leave them out get the checkpoint's generation_config.json sampling: "
              + ", ".join(f"{k} {v:g}" for k, v in rec.items()), file=sys.stderr)
    cfg = ServerConfig(served_model_name=name, draft=draft, max_batch=args.max_batch, max_queue=args.max_queue,
                       api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                       prefix_store=not args.no_prefix_store, warm_up=False if args.no_warm_up else None,
                       reasoning_parser=args.reasoning_parser)
    return create_app(eng, cfg)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        check(args)
        check_port(args.host, args.port)  # before the model loads (minutes for a large one)
        app = make_app(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"hyspec serve: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from hyspec.server.thread import uvicorn_server

    server = uvicorn_server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, timeout_graceful_shutdown=args.shutdown_timeout))
    server.run()
    return 0 if server.started else 3  # (as uvicorn.run: a bind that failed after the model loaded)
