"""Experiment (issue 14, item 1): does a TMA weight stream make the skinny matmul faster?

The b2 step's matmuls stream at ~3.0 TB/s on the H200 (docs/gpu.md "What is left" 2); the
2048-row ones at 2.5. This script times, per b2 weight shape at one row (bf16), inside a CUDA
graph over enough distinct weight copies that L2 holds none of them:

* ``cur``  hyspec's skinny matmul with its shipped config (the reference point);
* ``tma``  the same tile loop with the weight tile loaded through a host-side TMA descriptor
  (``triton.tools.tensor_descriptor``): the copy engine moves the tile into shared memory and
  the software pipeline keeps ``stages`` tiles in flight without registers;
* ``tmap`` a persistent form of ``tma``: one program per SM walks (column tile, K split) units
  in one flattened loop, so the pipeline does not drain between units.

For each it prints us per call, TB/s of weight bytes and the max |error| against an fp32
torch product, and the device's copy bandwidth as the ceiling. Results JSON: --out.

  python bench/tma_gemv.py --out results.json [--quick]

Timing: hyspec.gpu.graphs.graph_ms (the best of three batches of replays); the copy:
hyspec.bench.timing.copy_bandwidth.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

from hyspec.bench.report import write_json

SHAPES = [(2048, 4096), (2048, 6144), (12288, 2048), (12352, 2048), (9216, 2048), (151936, 2048)]


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def tma_kernel(x_ptr, w_desc, out_ptr, ws_ptr, T, N, K, K_PER_SPLIT, stride_xt, stride_ws_s,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DIRECT: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_t = tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_kb = tl.arange(0, BLOCK_K)
        mask_t = offs_t < T
        k_lo = pid_s * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            xt = tl.load(x_ptr + offs_t[:, None] * stride_xt + (k0 + offs_kb)[None, :], mask=mask_t[:, None],
                         other=0.0)
            wt = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(wt, tl.trans(xt), acc)
        acc = tl.trans(acc)
        mask = mask_t[:, None] & (offs_n < N)[None, :]
        if DIRECT:
            tl.store(out_ptr + offs_t[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + pid_s * stride_ws_s + offs_t[:, None] * N + offs_n[None, :], acc, mask=mask)

    @triton.jit
    def tma_persistent_kernel(x_ptr, w_desc, out_ptr, ws_ptr, T, N, K, K_PER_SPLIT, stride_xt, stride_ws_s,
                              N_TILES, UNITS, STEPS, NUM_PROGS,
                              BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              DIRECT: tl.constexpr):
        pid = tl.program_id(0)
        offs_t = tl.arange(0, BLOCK_T)
        offs_kb = tl.arange(0, BLOCK_K)
        mask_t = offs_t < T
        my_units = (UNITS - pid + NUM_PROGS - 1) // NUM_PROGS
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        for i in range(0, my_units * STEPS):
            u = pid + (i // STEPS) * NUM_PROGS
            kk = i % STEPS
            tile_n = u % N_TILES
            split = u // N_TILES
            k0 = split * K_PER_SPLIT + kk * BLOCK_K
            xt = tl.load(x_ptr + offs_t[:, None] * stride_xt + (k0 + offs_kb)[None, :], mask=mask_t[:, None],
                         other=0.0)
            wt = w_desc.load([tile_n * BLOCK_N, k0])
            acc = tl.dot(wt, tl.trans(xt), acc)
            if kk == STEPS - 1:
                offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
                res = tl.trans(acc)
                mask = mask_t[:, None] & (offs_n < N)[None, :]
                if DIRECT:
                    tl.store(out_ptr + offs_t[:, None] * N + offs_n[None, :], res.to(out_ptr.dtype.element_ty),
                             mask=mask)
                else:
                    tl.store(ws_ptr + split * stride_ws_s + offs_t[:, None] * N + offs_n[None, :], res, mask=mask)
                acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)

    return tma_kernel, tma_persistent_kernel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer configs")
    ap.add_argument("--shapes", default=None, help="N:K,N:K (default: the b2 shapes)")
    ap.add_argument("--bytes", type=float, default=512e6, help="weight bytes per graph (> 2x L2)")
    a = ap.parse_args(argv)
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/tma_gemv.py")
    from triton.tools.tensor_descriptor import TensorDescriptor

    from hyspec.bench.timing import copy_bandwidth
    from hyspec.gpu.graphs import graph_ms
    from hyspec.kernels.matmul import skinny_matmul
    from hyspec.kernels.matmul.kernel import _kernels as hk
    from hyspec.provenance import git_state

    tma_kernel, tmap_kernel = _kernels()
    reduce_kernel = hk()[1]
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    n_sm = props.multi_processor_count
    shapes = SHAPES if not a.shapes else [tuple(int(v) for v in s.split(":")) for s in a.shapes.split(",")]
    report = {"device": props.name, "sms": n_sm, "git": git_state(), "command": "python " + " ".join(sys.argv), "shapes": {}}
    copy_tbs = copy_bandwidth(dev, 1 << 30) / 1e3  # the ceiling: read + write of 1 GiB (GB/s -> TB/s)
    report["copy_TBps"] = copy_tbs
    print(f"{props.name}, {n_sm} SMs; device copy bandwidth {copy_tbs:.2f} TB/s (read + write)")
    torch.manual_seed(0)

    for N, K in shapes:
        wbytes = N * K * 2
        copies = max(2, int(a.bytes // wbytes))
        ws_list = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        ref = (x.float() @ ws_list[0].float().T)
        out = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        ws = torch.empty(16, 16, N, device=dev, dtype=torch.float32)
        rows = []

        def record(name, cfg, fn):
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses is skipped
                print(f"  {N}x{K} {name} {cfg}: skipped ({type(exc).__name__}: {str(exc)[:80]})")
                return
            err = (out.float() - ref).abs().max().item()
            us = graph_ms(lambda: [fn(w) for w in ws_list], 20) * 1e3 / copies  # one call, us
            tbs = wbytes / (us * 1e-6) / 1e12
            rows.append(dict(variant=name, cfg=cfg, us=us, TBps=tbs, max_err=err))

        def cur(w=None):
            skinny_matmul(x, ws_list[0] if w is None else w, out=out, ws=ws)


        from hyspec.kernels.matmul.config import _config_cached
        c = _config_cached(N, K, None, None, None, None, None, None, False)
        record("cur", dict(bn=c.block_n, bk=c.block_k, s=c.split_k, stages=c.num_stages, wt=c.wt), cur)

        bns = (64, 128) if not a.quick else (64,)
        bks = (128, 256) if not a.quick else (128,)
        stages_l = (3, 5) if not a.quick else (4,)
        splits = (1, 2, 4, 8) if N <= 4096 else (1,)
        for bn, bk, st, s in itertools.product(bns, bks, stages_l, splits):
            if bn * bk * 2 * st > 200 * 1024 or K % (bk * s):
                continue
            kps = K // s
            descs = {id(w): TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws_list}
            direct = s == 1
            n_tiles = triton_cdiv(N, bn)

            def reduce():
                reduce_kernel[(triton_cdiv(N, 1024), 1)](ws, out, 1, N, s, ws.stride(0), ws.stride(1), N, 1,
                                                          BLOCK=1024, num_warps=4)

            for warps in (4,):
                def tma(w=None, bn=bn, bk=bk, st=st, s=s, kps=kps, direct=direct, n_tiles=n_tiles, warps=warps):
                    w = ws_list[0] if w is None else w
                    tma_kernel[(n_tiles, s)](x, descs[id(w)], out, ws, 1, N, K, kps, x.stride(0), ws.stride(0),
                                             BLOCK_T=16, BLOCK_N=bn, BLOCK_K=bk, DIRECT=direct,
                                             num_warps=warps, num_stages=st)
                    if not direct:
                        reduce()
                record("tma", dict(bn=bn, bk=bk, s=s, stages=st, warps=warps), tma)
                units = n_tiles * s
                for per_sm in (1, 2):
                    progs = min(units, n_sm * per_sm)

                    def tmap(w=None, bn=bn, bk=bk, st=st, s=s, kps=kps, direct=direct, n_tiles=n_tiles,
                             units=units, progs=progs, warps=warps):
                        w = ws_list[0] if w is None else w
                        tmap_kernel[(progs,)](x, descs[id(w)], out, ws, 1, N, K, kps, x.stride(0), ws.stride(0),
                                              n_tiles, units, kps // bk, progs,
                                              BLOCK_T=16, BLOCK_N=bn, BLOCK_K=bk, DIRECT=direct,
                                              num_warps=warps, num_stages=st)
                        if not direct:
                            reduce()
                    record("tmap", dict(bn=bn, bk=bk, s=s, stages=st, warps=warps, progs=progs), tmap)
        rows.sort(key=lambda r: r["us"])
        base = next(r for r in rows if r["variant"] == "cur")
        best = {v: next((r for r in rows if r["variant"] == v), None) for v in ("tma", "tmap")}
        print(f"{N}x{K} ({wbytes / 1e6:.1f} MB, {copies} copies): cur {base['us']:.2f} us {base['TBps']:.2f} TB/s "
              f"{base['cfg']}")
        for v, r in best.items():
            if r:
                print(f"   best {v}: {r['us']:.2f} us {r['TBps']:.2f} TB/s x{base['us'] / r['us']:.3f} "
                      f"err {r['max_err']:.2e} {r['cfg']}")
        report["shapes"][f"{N}x{K}"] = rows
        ws_list = descs = None
        torch.cuda.empty_cache()
    if a.out:
        write_json(a.out, report)  # (whole or not at all)
    return 0


def triton_cdiv(a, b):
    return -(-a // b)


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"tma_gemv: {time.time() - t0:.0f} s")
    sys.exit(rc)
