"""`hyspec bench --pp N`: pipeline stages against one process, and the bubble with and
without two-session lanes (or, with --optimistic, with and without the optimistic fork).

For each mode the same batch of requests runs to the end: one process (no pipeline),
--pp N with one batch, --pp N with --lanes 2. Reported per mode: generated tokens per
second, and per stage the *bubble* = the share of the measured wall time the stage spent
with nothing to do (blocked waiting for the other stage; for the driver: every lane
waiting). Tokens are checked equal across the modes. On the CPU with gloo the numbers only
show the mechanism (tiny layers, Python overhead, processes share cores); the GPU command
is in docs/multi-gpu.md.

With --optimistic: --batch single requests run one after the other (a fork is worth
most with one sequence: the guess must hold for the whole batch), each mode on the same
prompts: one process, --pp N, --pp N --optimistic; once per drafter setting
(--forced-rates, repeatable; "mtp" = the checkpoint's MTP head). Reported besides tok/s
and the bubble: forks, hits, wasted rows, and the workers' seconds of fork work (all /
thrown away). Every results file records the git commit and dirty flag.

Ranks: started here with torch.multiprocessing on 127.0.0.1 (hyspec/parallel/local.py),
so this command is not for torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--model", default=None, type=os.path.expanduser,
                    help="checkpoint directory (default: a random tiny checkpoint)")
    ap.add_argument("--arch", default="qwen3_5", choices=["qwen3_next", "qwen3_5", "qwen3_5_moe"],
                    help="family of the random checkpoint (without --model)")
    ap.add_argument("--layers", type=int, default=8, help="layers of the random checkpoint")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the random checkpoint")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, rank r on cuda:r)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=8, help="requests (all decode together; lanes split them)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--draft", type=int, default=2, help="drafts per round K (0 = plain decoding)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, type=os.path.expanduser, help="write the results as JSON here")
    ap.add_argument("--optimistic", action="store_true",
                    help="compare --pp N with and without the optimistic fork instead of lanes (single requests)")
    ap.add_argument("--forced-rates", action="append", default=None,
                    help="with --optimistic: a drafter setting to run, repeatable: comma-separated forced-acceptance "
                         "rates by depth, or 'mtp' (default: mtp)")
    args = ap.parse_args([a for a in (argv if argv is not None else sys.argv[1:])])
    if args.pp < 2:  # (one stage would wait forever for a previous one)
        raise ValueError(f"--pp must be >= 2 for the pipeline bench (it compares N stages with one process), "
                         f"got {args.pp}")
    from hyspec.cli.common import check_out_file, parse_rates
    from hyspec.engine import check_device

    if args.threads < 1:  # (torch.set_num_threads' traceback)
        raise ValueError(f"--threads: must be >= 1, got {args.threads}")
    # (--optimistic --batch 0 was an IndexError traceback; the others were blamed on flags the
    # bench does not have: "max_batch", "--max-new-tokens", "the prompt is empty")
    for flag, value, least in (("--batch", args.batch, 1), ("--new-tokens", args.new_tokens, 0),
                               ("--prompt-len", args.prompt_len, 1)):
        if value < least:
            raise ValueError(f"{flag}: must be >= {least}, got {value}")
    if args.forced_rates and not args.optimistic:
        raise ValueError("--forced-rates picks the drafters of the --optimistic comparison: add --optimistic "
                         "(the lanes comparison runs the checkpoint's MTP head)")
    for setting in args.forced_rates or ():
        if setting != "mtp":
            try:
                parse_rates(setting)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"--forced-rates: {e} or 'mtp'") from None

    check_device(args.device)  # (CUDA asked for where there is none: one error line, not a rank's traceback)
    check_out_file(args.out)

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
    if path is not None:
        from hyspec.loading import resolve_model_dir

        path = resolve_model_dir(path)
    else:
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

    if args.optimistic:
        try:
            return _fork_bench(args, path, cfg, prompts, ranges, git)
        finally:
            if tmp is not None:
                tmp.cleanup()
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


def _fork_bench(args, path, cfg, prompts, ranges, git: dict) -> int:
    """--optimistic: one process vs --pp N vs --pp N --optimistic, single requests in turn,
    per drafter setting."""
    import platform

    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.parallel.local import run_job, run_jobs
    from hyspec.speculative.loop import SpecOptions

    settings = args.forced_rates or ["mtp"]
    eng = Engine(load_model(path, dtype=args.dtype, device=args.device))
    # the reference continuations (the forced drafter's, and the tokens every mode must give)
    refs = [run_job(eng, ("generate", {"prompt": p, "max_new_tokens": args.new_tokens + args.draft + 1,
                                       "ignore_eos": True}))[0] for p in prompts]
    n_tok = len(prompts) * args.new_tokens
    rows = []
    for setting in settings:
        spec = None if setting == "mtp" or args.draft == 0 else \
            SpecOptions(forced_rates=tuple(float(x) for x in setting.split(",")))
        gen = [("generate", {"prompt": p, "max_new_tokens": args.new_tokens, "draft": args.draft, "spec": spec,
                             "reference": r, "ignore_eos": True}) for p, r in zip(prompts, refs)]
        warm = ("generate", {**gen[0][1], "max_new_tokens": 4})
        run_job(eng, warm)
        t0 = time.perf_counter()
        base = [run_job(eng, j) for j in gen]
        wall = time.perf_counter() - t0
        rows.append({"drafter": setting, "mode": "1 process", "wall_s": wall, "tok_s": n_tok / wall,
                     "bubble": None, "same_tokens": True})
        for opt in (False, True):
            jobs = [warm, ("mark", {})] + [(k, {**kw, "optimistic": opt}) for k, kw in gen] + [("fork_stats", {})]
            res, st = run_jobs(path, jobs, world=args.pp, dtype=args.dtype, device=args.device,
                               threads=args.threads, with_stats=True)
            d = st["driver"]
            bub = [w["wait_s"] / w["wall_s"] for w in st["workers"]] + [d["wait_s"] / d["wall_s"]]
            fw = [w["fork"] for w in st["workers"]]
            row = {"drafter": setting, "mode": f"--pp {args.pp}" + (" --optimistic" if opt else ""),
                   "wall_s": d["wall_s"], "tok_s": n_tok / d["wall_s"], "bubble": bub,
                   # idle or thrown-away share of each worker's time (the fork's wasted work counts as bubble)
                   "bubble_or_wasted": [(w["wait_s"] + f["wasted_s"]) / w["wall_s"] for w, f in
                                        zip(st["workers"], fw)],
                   "same_tokens": res[2:2 + len(gen)] == base, "stats": st}
            if opt:
                row["fork"] = res[-1]
                row["worker_fork"] = fw
            rows.append(row)
    print(f"{'drafter':<18} {'mode':<22} {'tok/s':>7} {'wall s':>7}  {'bubble per stage':<22} "
          f"{'fork: hits/forks  wasted rows  worker fork s (wasted)':<52} same")
    for r in rows:
        b = "-" if r["bubble"] is None else " ".join(f"s{i} {x:4.0%}" for i, x in enumerate(r["bubble"]))
        f = ""
        if "fork" in r:
            t, w = r["fork"], r["worker_fork"][0]
            f = (f"{t['hits']}/{t['forks']} ({t['hit_rate']:.0%})  {t['wasted_rows']}/{t['forked_rows']}  "
                 f"{w['fork_s']:.2f} ({w['wasted_s']:.2f})")
        print(f"{r['drafter']:<18} {r['mode']:<22} {r['tok_s']:7.1f} {r['wall_s']:7.2f}  {b:<22} {f:<52} "
              f"{r['same_tokens']}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "args": vars(args), "stages": [[r.start, r.stop] for r in ranges], "rows": rows, "git": git,
            "machine": {"cpu_count": __import__("os").cpu_count(), "platform": platform.platform()}}, indent=1))
    return 0 if all(r["same_tokens"] for r in rows) else 1
