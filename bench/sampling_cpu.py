"""Micro-benchmark of the device sampler's functions alone (hyspec.gpu.sampling), on any
device: the per-row probabilities (probs_batch) at the bench's sampling settings and one
speculative round's sampling work as the BatchDecoder does it (k drafts, the verify
rows, the accept) for a vocabulary of V tokens, at batch sizes 1 and 16.

    PYTHONPATH=. python bench/sampling_cpu.py [--vocab 151936] [--batch 1,16] [--k 3]

Prints one line per case (median of --reps timed runs, after one warm-up) and, with
--out, writes them as JSON. Greedy lanes' cost is not in it (argmax only)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hyspec.bench.report import write_json


def _time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    from hyspec.gpu import batch_sampling as bs
    from hyspec.gpu import sampling as dsamp
    from hyspec.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--scale", type=float, default=1.0, help="logit std (random rows)")
    ap.add_argument("--all-stages", action="store_true", help="every stage and draw (no regime)")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    ap.add_argument("--fast-uniforms", action="store_true",
                    help="timing only: torch.rand instead of the int64 torch Philox reference for the coupled "
                         "draws' [B, V] uniforms (a Triton kernel on CUDA; on the CPU it dominates coupled rounds)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.fast_uniforms:
        dsamp.u01_rows_ref = lambda seeds, stream, positions, vocab: torch.rand(
            seeds.shape[0], vocab, dtype=torch.float64, device=seeds.device)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    V, k = args.vocab, args.k
    dt = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    cases = {
        "coupled_T0.8_top_p0.95": dict(temperature=0.8, top_p=0.95, mode="coupled"),
        "rejection_T0.8_top_p0.95": dict(temperature=0.8, top_p=0.95),
        "rejection_T0.8": dict(temperature=0.8),
        "rejection_T0.8_top_k50_top_p0.9_min_p0.05": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    }
    out = {"vocab": V, "k": k, "device": str(dev), "threads": args.threads, "dtype": args.dtype,
           "all_stages": args.all_stages, "fast_uniforms": args.fast_uniforms, "runs": {}}
    key = getattr(dsamp, "SampledGraphKey", None)  # older trees: every stage always
    for name, kw in cases.items():
        if args.only and args.only not in name:
            continue
        for B in [int(b) for b in args.batch.split(",")]:
            table = dsamp.SamplingTable(B, dev)
            params = [SamplingParams(seed=b, **kw) for b in range(B)]
            for b in range(B):
                table.set(b, params[b])
            rg = () if key is None or args.all_stages else (key.of(params),)
            logits = (torch.randn(B * (k + 1), V, generator=g) * args.scale).to(dev, dt)
            draft_logits = (torch.randn(B, V, generator=g) * args.scale).to(dev, dt)
            pos = torch.arange(B, device=dev) * 7 + 100
            rows_table = bs.table_rows(table, B, k + 1)

            def probs():
                return bs.blocked(lambda lg, tb: dsamp.probs_batch(lg, tb, None, *rg), B, draft_logits, table)

            def one_round():
                qs, ds = [], []
                for i in range(k):  # the drafter's k rows
                    q, d = bs.draft_draws(draft_logits, table, pos + 1 + i, *rg)
                    qs.append(q)
                    ds.append(d)
                p = bs.blocked(lambda lg, tb: dsamp.probs_batch(lg, tb, None, *rg), B * (k + 1), logits,
                               rows_table).view(B, k + 1, V)
                q = torch.stack(qs, 1)
                drafts = torch.stack(ds, 1)
                n, nxt = bs.blocked(lambda *a: dsamp.speculative_accept(*a, *rg), B, p, q, drafts, table, pos + 1,
                                    torch.full((B,), k, device=dev))
                return n, nxt

            t_probs = _time(probs, args.reps)
            t_round = _time(one_round, max(1, args.reps // 2))
            out["runs"][f"{name}/B{B}"] = {"probs_batch_s": t_probs, "round_sampling_s": t_round}
            print(f"{name:45s} B={B:3d}: probs_batch {t_probs * 1e3:9.2f} ms   one round's sampling (k={k}) "
                  f"{t_round * 1e3:9.2f} ms", flush=True)
    if args.out:
        from hyspec.provenance import git_state

        out["git"] = git_state()
        write_json(args.out, out)  # (whole or not at all)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
