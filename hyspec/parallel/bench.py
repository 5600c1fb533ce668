"""`hyspec bench --pp N`: pipeline stages against one process, and the bubble with and
without two-session lanes.

For each mode the same batch of requests runs to the end: one process (no pipeline),
--pp N with one batch, --pp N with --lanes 2. Reported per mode: generated tokens per
second, and per stage the *bubble* = the share of the measured wall time the stage spent
with nothing to do (blocked waiting for the other stage; for the driver: every lane
waiting). Tokens are checked equal across the modes. On the CPU with gloo the numbers only
show the mechanism (tiny layers, Python overhead, processes share cores); the GPU command
is in docs/multi-gpu.md.

Ranks: started here with torch.multiprocessing on 127.0.0.1 (hyspec/parallel/local.py),
so this command is not for torchrun.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path


def _requests(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n)]


def main(argv=None) -> int:
    from hyspec.cli import HelpFormatter

    ap = argparse.ArgumentParser(prog="hyspec bench --pp", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (processes)")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a random tiny checkpoint)")
    ap.add_argument("--arch", default="qwen3_5", choices=["qwen3_next", "qwen3_5", "qwen3_5_moe"],
                    help="family of the random checkpoint (without --model)")
    ap.add_argument("--layers", type=int, default=8, help="layers of the random checkpoint")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the random checkpoint")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, rank r on cuda:r)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=8, help="requests (all decode together; lanes split them)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--draft", type=int, default=2, help="drafts per round K (0 = plain decoding)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args([a for a in (argv if argv is not None else sys.argv[1:])])

    import torch

    from hyspec.config import ModelConfig
    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.parallel.local import run_job, run_jobs
    from hyspec.parallel.pipeline import stage_ranges
    from hyspec.provenance import git_state

    git = git_state()  # the code that runs, recorded before it runs
    torch.set_num_threads(args.threads)
    tmp = None
    path = args.model
    if path is None:
        from hyspec.tiny import make_tiny

        tmp = tempfile.TemporaryDirectory()
        path = make_tiny(args.arch, Path(tmp.name) / "ckpt", seed=args.seed, layers=args.layers, hidden=args.hidden)
    cfg = ModelConfig.from_dir(path)
    prompts = _requests(args.batch, args.prompt_len, cfg.vocab_size, args.seed)
    job = {"prompts": prompts, "max_new_tokens": args.new_tokens, "draft": args.draft, "max_batch": args.batch,
           "ignore_eos": True}
    warm = ("generate_batch", {**job, "prompts": prompts[:1], "max_new_tokens": 4})
    ranges = stage_ranges(cfg, args.pp)
    print(f"pipeline bench: {path} ({cfg.num_hidden_layers} layers), stages "
          f"{[f'{r.start}..{r.stop - 1}' for r in ranges]}, batch {args.batch}, K={args.draft}, "
          f"{args.new_tokens} new tokens, device {args.device}", file=sys.stderr)

    rows = []
    eng = Engine(load_model(path, dtype=args.dtype, device=args.device))
    run_job(eng, warm)
    t0 = time.perf_counter()
    base = run_job(eng, ("generate_batch", job))
    wall = time.perf_counter() - t0
    n_tok = sum(len(t) for t in base)
    rows.append({"mode": "1 process", "wall_s": wall, "tok_s": n_tok / wall, "bubble": None, "same_tokens": True})
    for lanes in (1, 2):
        jobs = [warm, ("mark", {}), ("generate_batch", {**job, "lanes": lanes})]
        res, st = run_jobs(path, jobs, world=args.pp, dtype=args.dtype, device=args.device, threads=args.threads,
                           with_stats=True)
        d = st["driver"]
        bub = [w["wait_s"] / w["wall_s"] for w in st["workers"]] + [d["wait_s"] / d["wall_s"]]
        rows.append({"mode": f"--pp {args.pp}" + (f" --lanes {lanes}" if lanes > 1 else ""), "wall_s": d["wall_s"],
                     "tok_s": n_tok / d["wall_s"], "bubble": bub, "same_tokens": res[2] == base, "stats": st})
    print(f"{'mode':<20} {'tok/s':>8} {'wall s':>8}  bubble per stage (idle share)  tokens == 1 process")
    for r in rows:
        b = "-" if r["bubble"] is None else "  ".join(f"s{i}: {x:5.1%}" for i, x in enumerate(r["bubble"]))
        print(f"{r['mode']:<20} {r['tok_s']:8.1f} {r['wall_s']:8.2f}  {b:<28}  {r['same_tokens']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"git": git, "args": vars(args), "stages": [[r.start, r.stop] for r in ranges],
                                              "rows": rows}, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return 0 if all(r["same_tokens"] for r in rows) else 1
