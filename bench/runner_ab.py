"""Two settings of the batched runner side by side: two BatchDecoders on the same model and
prompts, A and B, that differ only in TritonRunner attributes set before their first step
(``--a name=value`` / ``--b name=value``, e.g. ``norm_w_first=0``, ``fast_argmax=0``),
CUDA-graph replays of a decode step and a K=3 round at each batch size, timed alternately
(best of ``--trials``, each the median of three batches of replays), then every lane's state (GDN conv and SSM state, KV cache,
positions) and the last logits compared bitwise between the two (the settings compared
here must change no number).  GPU only.

    python bench/runner_ab.py --config b2 --sizes 1,4,16,64 --a norm_w_first=0 --b norm_w_first=1

(bench/results/prefetch_h200.json ran as bench/prefetch_bench.py at 1a0aeb4: A without
an L2 prefetch of the output projections, B with it on every call of at most 256 rows;
gnorm_fold_h200.json as this script at 00b3c59 with ``--a gnorm_fold=0 --b gnorm_fold=1``;
both were measured slower and removed; gdn_persist_ab_h200.json with ``--a gdn_persist=0
--b gdn_persist=1`` at f02965f and gdn_maxnreg_ab_h200.json with ``--b-gdn-maxnreg 96`` at
b9fca3e, both removed since: docs/gpu.md "What is left", item 10; moe_split_ab_<preset>_h200.json
with ``--a moe_split=1 --b moe_split=2 --numbers-may-differ`` at 7548d12, the MoE gate|up
gemm's K split, which changes the sums' order, hence the flag; slower, removed.)  ``--b-pdl``: A's step graphs
are captured without programmatic dependent launch, B's with it (the runner attribute ``pdl``,
``hyspec.kernels.pdl``); B keeps the runner's default ``pdl_skip`` / ``pdl_late`` (since
``hyspec.kernels.pdl.step_default``'s rule: dense models put the skinny matmuls under PDL with
their dependents launched after the K loop, MoE and block-FP8 models leave them out), so PDL on
every kernel, each triggering at its start as before the rule, is ``--b-pdl --b pdl_skip= --b
pdl_late=0`` (pdl_ab_h200.json and pdl_ab_<preset>_h200.json ran as that);
pdlskip_ab_<preset>_h200.json ran ``--a pdl=False --b pdl=True --b pdl_skip=matmul``, the 35B's
``--a pdl=True`` (PDL on every kernel then); mmlate_ab_<preset>_h200.json ran ``--b pdl_skip=
--b pdl_late=1`` against the matmuls-left-out default of that time, and mmpf512 / mmpf2048 the
same with an L2 prefetch of each matmul program's first 512 / 2048 weight columns before its
wait (``git show 1b28a4a``; slower, removed).
``--bits-only STEPS`` skips the timing: every arm makes the same STEPS decode steps and STEPS
K-rounds per size, then the states are compared; ``--also`` adds arms compared with A that
way (``--a`` and ``--b`` the same and an ``--also`` of A's settings: does a run reproduce
itself?), e.g.

    python bench/runner_ab.py --config qwen3.5-35b-a3b --sizes 1,4 --bits-only 20 --also '' --also moe_defer=0
"""
from __future__ import annotations

import argparse
import ast
import sys

import torch

from hyspec.bench.report import write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="b2")
    ap.add_argument("--sizes", default="1,4,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30, help="graph replays per timing")
    ap.add_argument("--trials", type=int, default=3, help="alternating timings per case (best kept)")
    ap.add_argument("--a", action="append", default=[], metavar="NAME=VALUE", help="a runner attribute of A")
    ap.add_argument("--b", action="append", default=[], metavar="NAME=VALUE", help="a runner attribute of B")
    ap.add_argument("--b-pdl", action="store_true",
                    help="A's step graphs captured without programmatic dependent launch, B's with it (the "
                         "runner attribute pdl: --a pdl=False --b pdl=True; B keeps the runner's default pdl_skip "
                         "and pdl_late unless --b says otherwise; hyspec.kernels.pdl.step_default)")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                    help="one more arm (its attributes, comma-separated; empty: the defaults), run the same "
                         "calls untimed and compared bitwise with A (e.g. A again: does the run reproduce itself?)")
    ap.add_argument("--bits-only", type=int, default=0, metavar="STEPS",
                    help="no timing: STEPS decode steps and STEPS K-rounds at each size on every arm, then the "
                         "bitwise comparison")
    ap.add_argument("--numbers-may-differ", action="store_true",
                    help="the arms compute in another order (as moe_split did at 7548d12): report the bitwise "
                         "comparison, do not fail on it")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/runner_ab.py")
    from hyspec.bench.timing import time_fn
    from hyspec.gpu.batch_bench import preset_model, random_lanes
    from hyspec.provenance import git_state

    model = preset_model(args.config)
    sizes = [int(s) for s in args.sizes.split(",")]
    S = max(sizes)
    if args.bits_only < 0:
        raise SystemExit("runner_ab: --bits-only takes a number of steps >= 0")
    # positions a lane may advance: per size, a decode call 1 and a round call up to k + 1,
    # timed: trials x (1 warm-up + 3 x reps) calls of each (hyspec.bench.timing.time_fn)
    calls = args.bits_only if args.bits_only else args.trials * (3 * args.reps + 1)
    steps = len(sizes) * calls * (args.k + 2)

    def settings(pairs: list[str]) -> dict:
        out = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep:
                raise SystemExit(f"runner_ab: want NAME=VALUE, got {pair!r}")
            try:
                out[name] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                out[name] = value
        return out

    if args.also and not args.bits_only:
        raise SystemExit("runner_ab: --also arms run only with --bits-only (they are not timed)")
    sets = {"A": settings(args.a), "B": settings(args.b)}
    if args.b_pdl:
        sets["A"].setdefault("pdl", False)
        sets["B"].setdefault("pdl", True)
    for i, arm in enumerate(args.also):
        sets[f"C{i + 1}"] = settings([p for p in arm.split(",") if p])

    def decoder(attrs: dict):
        def setup(d):
            for name, value in attrs.items():
                if not hasattr(d.runner, name):
                    raise SystemExit(f"runner_ab: TritonRunner has no attribute {name!r}")
                now = getattr(d.runner, name)  # (None stays None: e.g. pdl=None, the process-wide PDL)
                setattr(d.runner, name, type(now)(value)
                        if isinstance(now, (bool, int, float)) and value is not None else value)

        return random_lanes(model, S, args.prompt_len, args.prompt_len + steps + 64, args.k, setup=setup)

    decs = {name: decoder(attrs) for name, attrs in sets.items()}
    out = {"git": git_state(), "command": "python bench/runner_ab.py " + " ".join(sys.argv[1:]),
           "config": args.config, "k": args.k, "device": torch.cuda.get_device_name(), "settings": sets,
           "b_pdl": args.b_pdl,
           "cases": {}}
    print("  ".join(f"{name}: {attrs}" for name, attrs in sets.items()), flush=True)

    def timed(fn) -> float:  # ms per call: the median of three batches of back-to-back calls
        return time_fn(fn, torch.device("cuda"), args.reps, warmup=1)

    for nb in (sizes if args.bits_only else []):  # the same calls on every arm, in the same order
        for _ in range(args.bits_only):
            for d in decs.values():
                d.decode(nb)
        for _ in range(args.bits_only):
            for d in decs.values():
                d.round(nb, args.k)
    for nb in ([] if args.bits_only else sizes):
        for case in ("decode", f"round_k{args.k}"):
            best = {}
            for _ in range(args.trials):
                for name in ("A", "B"):
                    d = decs[name]
                    fn = (lambda d=d: d.decode(nb)) if case == "decode" else (lambda d=d: d.round(nb, args.k))
                    best[name] = min(best.get(name, float("inf")), timed(fn))
            row = {"a_ms": best["A"], "b_ms": best["B"], "b_over_a": best["B"] / best["A"]}
            out["cases"][f"{case}_B{nb}"] = row
            print(f"{case:9s} B={nb:3d}: A {best['A']:.4f} ms  B {best['B']:.4f} ms  "
                  f"B/A {row['b_over_a']:.4f}", flush=True)

    def compare(a, b) -> dict:
        return {"ssm": torch.equal(a.ssm, b.ssm), "conv": torch.equal(a.conv, b.conv),
                "kv": all(torch.equal(x, y) for x, y in zip(a.kv_k + a.kv_v, b.kv_k + b.kv_v)),
                "pos": torch.equal(a.pos, b.pos),
                "logits": torch.equal(a.runner.bufs.logits, b.runner.bufs.logits)}

    for name, d in decs.items():  # no lane ran past its cache
        if int(d.pos.max()) >= d.max_len:
            raise SystemExit(f"runner_ab: arm {name} ran to position {int(d.pos.max())} of max_len {d.max_len}")
    same = compare(decs["A"], decs["B"])
    out["bitwise_equal"] = same
    print("bitwise equal (A vs B):", same, flush=True)
    ok = all(same.values())
    for name in sets:
        if name.startswith("C"):
            out[f"bitwise_equal_{name}"] = c = compare(decs["A"], decs[name])
            print(f"bitwise equal (A vs {name}):", c, flush=True)
            ok = ok and all(c.values())
    if args.out:
        write_json(args.out, out)  # (whole or not at all)
    if not ok and not args.numbers_may_differ:
        sys.exit(1)


if __name__ == "__main__":
    main()
