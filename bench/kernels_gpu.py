#!/usr/bin/env python
"""Decode/verify kernel benchmark on the GPU for the "b2" shapes (hidden 2048).

Times, under CUDA graphs, in bf16:
  gemm : every mat-vec shape of a b2 decode step, torch F.linear (cuBLAS) vs
         hyspec skinny_matmul, t = 1, 2, 4, 8 rows; weights rotated over enough copies
         that they stream from HBM (as in a real step), plus correctness and bitwise
         row-invariance checks (and whether cuBLAS happens to be row-invariant);
  step : all 127 mat-vecs of one b2 decode step in one graph (the facts.md number:
         cuBLAS 1.43 ms t=1, 2.47 ms t=4; plain Triton 1.23 / 1.26 ms);
  sweep: (opt-in, --sweep) tile / split-K / stages grid per gemm shape, best config.

Usage (on the H200, repo root):
    python bench/kernels_gpu.py --out bench/results/kernels_gpu.json
    python bench/kernels_gpu.py --out /tmp/sweep.json --sections sweep --sweep-t 1,4
    python bench/kernels_gpu.py --cpu-smoke --out /tmp/smoke.json   # code-path check, no GPU

No network needed.  Every section runs in a try/except: failures land in the JSON
under "errors" and the remaining sections still run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

# --cpu-smoke needs the Triton interpreter, which must be switched on before triton loads
if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hyspec.kernels.matmul import skinny_config, skinny_matmul  # noqa: E402
from hyspec.provenance import git_state

# b2: hidden 2048, 24 layers = 18 Gated DeltaNet + 6 gated attention, vocab 151936.
# (name, N out, K in, count per decode step); gate/up fused.  Sum of counts = 127.
B2_SHAPES = [
    ("attn.q_proj", 16 * 256 * 2, 2048, 6),
    ("attn.k_proj", 2 * 256, 2048, 6),
    ("attn.v_proj", 2 * 256, 2048, 6),
    ("attn.o_proj", 2048, 16 * 256, 6),
    ("gdn.in_proj_qkvz", 16 * (2 * 128 + 2 * 2 * 128), 2048, 18),
    ("gdn.in_proj_ba", 16 * 2 * 2, 2048, 18),
    ("gdn.out_proj", 2048, 32 * 128, 18),
    ("mlp.gate_up", 2 * 6144, 2048, 24),
    ("mlp.down", 2048, 6144, 24),
    ("lm_head", 151936, 2048, 1),
]
# one decode step in layer order: 3 GDN layers then 1 attention layer, 6 times
GDN_LAYER = ["gdn.in_proj_qkvz", "gdn.in_proj_ba", "gdn.out_proj", "mlp.gate_up", "mlp.down"]
ATTN_LAYER = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_up", "mlp.down"]
STEP_ORDER = (GDN_LAYER * 3 + ATTN_LAYER) * 6 + ["lm_head"]

ROTATE_BYTES = 256 << 20  # rotate weights over >= this many bytes (H200 L2: 50 MB)
MAX_COPIES = 1024


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------- timing
class Timer:
    """CUDA: capture fn in a CUDA graph, replay `reps` times, median/min ms per replay.
    CPU smoke: wall clock of fn, once."""

    def __init__(self, cuda: bool, reps: int):
        self.cuda, self.reps = cuda, reps

    def __call__(self, fn) -> dict:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
            return {"median_ms": ms, "min_ms": ms}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # compile + allocator warm-up outside capture
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.reps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del graph
        return {"median_ms": statistics.median(times), "min_ms": min(times)}


def n_copies(bytes_each: int, smoke: bool) -> int:
    if smoke:
        return 2
    return max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / max(1, bytes_each))))


# ----------------------------------------------------------------------------- gemm
def weight_copies(N: int, K: int, dtype, dev, smoke: bool, seed: int):
    """(bytes of one weight, number of copies, the copies [N, K], x [16, K]): enough copies
    of a random weight that timing them in turn streams from HBM, not L2."""
    bytes_w = N * K * torch.finfo(dtype).bits // 8
    copies = n_copies(bytes_w, smoke)
    gen = torch.Generator(device=dev).manual_seed(seed)
    ws = [(torch.randn(N, K, device=dev, generator=gen) * K ** -0.5).to(dtype) for _ in range(copies)]
    return bytes_w, copies, ws, torch.randn(16, K, device=dev, generator=gen).to(dtype)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_row_invariance(fn, x16: torch.Tensor, ts) -> bool:
    """fn(x[:t]) must equal rows of fn(x16) bitwise for every t, and each row alone."""
    full = fn(x16)
    ok = True
    for t in ts:
        ok &= torch.equal(fn(x16[:t]), full[:t])
    for r in range(x16.shape[0]):
        ok &= torch.equal(fn(x16[r : r + 1])[0], full[r])
    return bool(ok)


def bench_gemm(args, dev, dtype, timer, shapes, results):
    rows = []
    for name, N, K, count in shapes:
        cfg = skinny_config(N, K)
        bytes_w, copies, ws, x16 = weight_copies(N, K, dtype, dev, args.cpu_smoke, seed=0)
        # correctness + invariance on copy 0
        ref = x16.float() @ ws[0].float().t()
        y_sk = skinny_matmul(x16, ws[0])
        y_th = F.linear(x16, ws[0])
        inv_ts = [1, 2, 3, 4, 5, 8, 16] if not args.cpu_smoke else [1, 3]
        inv_sk = check_row_invariance(lambda x: skinny_matmul(x, ws[0]), x16, inv_ts)
        inv_th = check_row_invariance(lambda x: F.linear(x, ws[0]), x16, inv_ts)
        row = {
            "name": name, "N": N, "K": K, "count": count, "copies": copies,
            "config": vars(cfg) if hasattr(cfg, "__dict__") else cfg.__repr__(),
            "rel_err_skinny": rel_err(y_sk, ref), "rel_err_torch": rel_err(y_th, ref),
            "row_invariant_skinny": inv_sk, "row_invariant_torch": inv_th, "t": {},
        }
        for t in args.ts:
            x = x16[:t].contiguous()
            r_th = timer(lambda: [F.linear(x, w) for w in ws])
            r_sk = timer(lambda: [skinny_matmul(x, w) for w in ws])
            us_th = r_th["median_ms"] * 1e3 / copies
            us_sk = r_sk["median_ms"] * 1e3 / copies
            row["t"][t] = {
                "torch_us": us_th, "skinny_us": us_sk,
                "torch_GBps": bytes_w / (us_th * 1e3), "skinny_GBps": bytes_w / (us_sk * 1e3),
                "speedup": us_th / us_sk,
            }
        rows.append(row)
        tcols = "  ".join(
            f"t={t}: {row['t'][t]['torch_us']:7.1f}/{row['t'][t]['skinny_us']:7.1f}us "
            f"({row['t'][t]['skinny_GBps']:5.0f} GB/s)" for t in args.ts
        )
        log(f"{name:18s} N={N:6d} K={K:5d} BN={cfg.block_n:3d} BK={cfg.block_k:3d} S={cfg.split_k:2d} "
            f"inv={'Y' if inv_sk else 'N'}/cuBLAS {'Y' if inv_th else 'N'} "
            f"err={row['rel_err_skinny']:.1e}  torch/skinny {tcols}")
        ws = None  # free the copies (not del: the timed lambdas above name it)
    results["gemm"] = rows


def bench_step(args, dev, dtype, timer, shapes, results):
    """The 127 mat-vecs of one b2 decode step, one graph, distinct weights."""
    by_name = {s[0]: s for s in shapes}
    gen = torch.Generator(device=dev).manual_seed(1)
    weights = []
    total_bytes = 0
    for name in STEP_ORDER:
        _, N, K, _ = by_name[name]
        weights.append((torch.randn(N, K, device=dev, generator=gen) * K ** -0.5).to(dtype))
        total_bytes += N * K * torch.finfo(dtype).bits // 8
    xs = {K: torch.randn(16, K, device=dev, generator=gen).to(dtype) for K in {w.shape[1] for w in weights}}
    out = {"n_matvecs": len(weights), "weight_GB": total_bytes / 1e9, "t": {}}
    for t in args.ts:
        xt = {K: x[:t].contiguous() for K, x in xs.items()}
        r_th = timer(lambda: [F.linear(xt[w.shape[1]], w) for w in weights])
        r_sk = timer(lambda: [skinny_matmul(xt[w.shape[1]], w) for w in weights])
        out["t"][t] = {
            "torch_ms": r_th["median_ms"], "skinny_ms": r_sk["median_ms"],
            "torch_TBps": total_bytes / (r_th["median_ms"] * 1e9),
            "skinny_TBps": total_bytes / (r_sk["median_ms"] * 1e9),
        }
        log(f"step t={t}: {len(weights)} mat-vecs, {total_bytes / 1e9:.2f} GB: torch {r_th['median_ms']:.3f} ms "
            f"({out['t'][t]['torch_TBps']:.2f} TB/s)  skinny {r_sk['median_ms']:.3f} ms "
            f"({out['t'][t]['skinny_TBps']:.2f} TB/s)")
    weights = None  # free them (not del: the timed lambdas above name it)
    results["step"] = out


def bench_sweep(args, dev, dtype, timer, shapes, results):
    """Grid over BN, BK, split-K, stages, warps per distinct (N, K); reports the best."""
    seen = set()
    rows = []
    filt = [f for f in args.sweep_shapes.split(",") if f]
    for name, N, K, _ in shapes:
        if (N, K) in seen or (filt and not any(f in name for f in filt)):
            continue
        seen.add((N, K))
        default = skinny_config(N, K)
        bytes_w, copies, ws, x16 = weight_copies(N, K, dtype, dev, args.cpu_smoke, seed=2)
        ref = x16.float() @ ws[0].float().t()
        splits = sorted({1, max(1, default.split_k // 2), default.split_k, default.split_k * 2, default.split_k * 4})
        cands = []
        for bn in args.sweep_bn:
            for bk in args.sweep_bk:
                for s in splits:
                    cfg = skinny_config(N, K, split_k=s, block_n=bn, block_k=bk)
                    if cfg.split_k != s:  # would be a duplicate of a smaller split
                        continue
                    for st in args.sweep_stages:
                        for nw in args.sweep_warps:
                            cands.append(dict(block_n=bn, block_k=bk, split_k=s, num_stages=st, num_warps=nw))
        log(f"sweep {name} N={N} K={K}: {len(cands)} configs x t={args.sweep_t}")
        for kw in cands:
            entry = {"name": name, "N": N, "K": K, **kw, "t": {}}
            try:
                y = skinny_matmul(x16, ws[0], **kw)
                entry["rel_err"] = rel_err(y, ref)
                for t in args.sweep_t:
                    x = x16[:t].contiguous()
                    r = timer(lambda: [skinny_matmul(x, w, **kw) for w in ws])
                    entry["t"][t] = r["median_ms"] * 1e3 / copies
            except Exception as e:  # e.g. out of shared memory for big tiles
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(entry)
        ok = [e for e in rows if e["N"] == N and e["K"] == K and "error" not in e and e["t"]]
        t0 = args.sweep_t[0]
        if ok:
            best = min(ok, key=lambda e: e["t"][t0])
            dflt = [e for e in ok if (e["block_n"], e["block_k"], e["split_k"], e["num_stages"], e["num_warps"])
                    == (default.block_n, default.block_k, default.split_k, default.num_stages, default.num_warps)]
            d_us = dflt[0]["t"][t0] if dflt else float("nan")
            log(f"  best t={t0}: BN={best['block_n']} BK={best['block_k']} S={best['split_k']} "
                f"stages={best['num_stages']} warps={best['num_warps']} {best['t'][t0]:.1f} us "
                f"({bytes_w / (best['t'][t0] * 1e3):.0f} GB/s); default {d_us:.1f} us")
        ws = None  # free the copies (not del: the timed lambdas above name it)
    results["sweep"] = rows


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--sections", default="gemm,step",
                    help="comma list of gemm,step,sweep (default: all but sweep)")
    ap.add_argument("--sweep", action="store_true", help="also run the config sweep")
    ap.add_argument("--ts", default="1,2,4,8", help="row counts for gemm/step")
    ap.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    ap.add_argument("--sweep-t", default="1", help="row counts timed in the sweep")
    ap.add_argument("--sweep-bn", default="32,64,128")
    ap.add_argument("--sweep-bk", default="64,128,256")
    ap.add_argument("--sweep-stages", default="3,4")
    ap.add_argument("--sweep-warps", default="4")
    ap.add_argument("--sweep-shapes", default="", help="comma list of shape-name substrings to sweep (default all)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every code path on CPU with the Triton interpreter, tiny shapes, fp32")
    args = ap.parse_args(argv)
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    args.ts, args.sweep_t = ints(args.ts), ints(args.sweep_t)
    args.sweep_bn, args.sweep_bk = ints(args.sweep_bn), ints(args.sweep_bk)
    args.sweep_stages, args.sweep_warps = ints(args.sweep_stages), ints(args.sweep_warps)
    sections = [s for s in args.sections.split(",") if s]
    if args.sweep and "sweep" not in sections:
        sections.append("sweep")

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        sys.exit("kernels_gpu.py: no CUDA device (use --cpu-smoke to exercise the code paths on CPU)")
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's tl.dot cannot do bf16
    shapes = B2_SHAPES
    if args.cpu_smoke:  # shrink every dim by 8 (split-K still happens), tiny vocab
        shapes = [(n, max(16, N // 8), max(16, K // 8), c) for n, N, K, c in B2_SHAPES[:-1]]
        shapes.append(("lm_head", 300, 64, 1))
        args.ts, args.reps = args.ts[:2], 1
        args.sweep_t, args.sweep_bn, args.sweep_bk, args.sweep_stages = [1], [32], [64], [3]
    timer = Timer(cuda, args.reps)

    try:
        import triton
        triton_version = triton.__version__
    except Exception as e:
        triton_version = f"unavailable: {e}"
    results = {
        "meta": {
            "device": torch.cuda.get_device_name(0) if cuda else "cpu (triton interpreter)",
            "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "dtype": str(dtype), "reps": args.reps, "sections": sections,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "git": git_state(),
        },
        "errors": {},
    }
    log(f"# {results['meta']}")
    fns = {
        "gemm": lambda: bench_gemm(args, dev, dtype, timer, shapes, results),
        "step": lambda: bench_step(args, dev, dtype, timer, shapes, results),
        "sweep": lambda: bench_sweep(args, dev, dtype, timer, shapes, results),
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for sec in sections:
        if sec not in fns:
            results["errors"][sec] = "unknown section"
            continue
        log(f"\n## {sec}")
        t0 = time.perf_counter()
        try:
            fns[sec]()
        except Exception as e:
            results["errors"][sec] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
            log(f"!! section {sec} failed: {type(e).__name__}: {e}")
        finally:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        log(f"## {sec} done in {time.perf_counter() - t0:.1f} s")
        out_path.write_text(json.dumps(results, indent=1, default=str))  # partial results survive
    log(f"\nwrote {out_path}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
