"""Is the block-FP8 matmul bound by the bytes it reads?  The qwen3-next-80b-a3b-fp8 preset's
one-row matmul shapes timed with FP8 weights (with Triton's e4m3 -> bf16 conversion and with
the integer one, HYSPEC_FP8_CVT=0 / 1, outputs checked bitwise equal) and with bf16 weights
of the same shape in the same tile config (the runner's: ``tall_tile(N, K, fp8=True)``,
16-row x tile), and its grouped MoE layer (512 experts, top 10) with FP8 and with bf16
experts.  An FP8 call that takes about as long as the bf16 one, which reads twice the
bytes, is bound by something else than the bytes (latency, the fp8 -> bf16 conversion,
the launch).  Each case is a CUDA graph of back-to-back calls over a ring of weights
larger than the L2 (and, for the MoE, a ring of router logits, so each call routes to
other experts), as cold as in a decode step.  GPU only.

    python bench/fp8_probe.py --out fp8_probe.json
    python bench/fp8_probe.py --eager 3    # a few eager calls per case, e.g. under ncu
    python bench/fp8_probe.py --x-fp16     # also float16 activations: e4m3 -> f16 is one PTX cvt per pair

With ``--x-fp16`` each FP8 case is also timed with float16 activations (x and out float16:
Triton's e4m3 -> f16 conversion, ``cvt.rn.f16x2.e4m3x2`` on sm_89+, and an fp16 MMA), the
form a kernel could take with x converted to fp16 (exact while x is in fp16's normal
range); its output is compared with the bf16-activation call's (x rounded through fp16
first, so both see the same values): max |diff| over max |y|.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from hyspec.bench.report import write_json

SHAPES = [(12352, 2048), (12288, 2048), (9216, 2048), (2048, 4096)]  # the 80B preset's FP8 matmuls
L2_RING_BYTES = 160 * 2 ** 20  # the ring of weights per case: > 3 x the H200's 50 MB L2
# HYSPEC_FP8_CVT per FP8 case: 0 = Triton's e4m3 -> bf16 conversion, 1 = the integer one
CVTS = ("0", "1")


def _fp8(shape, dev, g):
    from hyspec.quant import FP8_DTYPE, Fp8Weight

    *lead, N, K = shape
    w = (torch.randn(*shape, device=dev, generator=g) * 0.1).to(FP8_DTYPE)
    s = torch.rand(*lead, math.ceil(N / 128), math.ceil(K / 128), device=dev, generator=g) * 1e-2 + 1e-3
    return Fp8Weight(w, s, (128, 128))


def _graph_us(calls, reps: int) -> float:
    """us per call: a CUDA graph of every call in `calls` once, replayed."""
    from hyspec.gpu.graphs import graph_ms

    def all_calls():
        for c in calls:
            c()

    return graph_ms(all_calls, reps) * 1e3 / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--eager", type=int, default=0, help="N eager calls per case instead of timing (for ncu)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--x-fp16", action="store_true", help="also time the FP8 cases with float16 activations")
    args = ap.parse_args()
    from hyspec.gpu.runner_triton import tall_tile
    from hyspec.kernels.matmul import skinny_matmul, skinny_matmul_fp8
    from hyspec.kernels.moe.grouped import MoeBuffers, moe_grouped
    from hyspec.provenance import git_state

    if not torch.cuda.is_available():
        sys.exit("fp8_probe: needs a CUDA GPU")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    rows = []

    def run(name, calls, nbytes):
        if args.eager:
            for _ in range(args.eager):
                for c in calls:
                    c()
            torch.cuda.synchronize()
            print(f"{name}: {args.eager} x {len(calls)} eager calls")
            return None
        us = _graph_us(calls, args.reps)
        rows.append(dict(case=name, us=us, bytes=nbytes, TBps=nbytes / us * 1e-6))
        print(f"{name:<34} {us:8.2f} us  {nbytes / 2 ** 20:7.1f} MiB  {nbytes / us * 1e-6:5.2f} TB/s")
        return us

    # (values fp16 holds exactly, so the float16-activation cases see the same x)
    x = torch.randn(1, 8192, device=dev, generator=g).to(torch.float16).to(bf)
    x16 = torch.randn(16, 8192, device=dev, generator=g).to(torch.float16).to(bf)
    xh = x.to(torch.float16)
    ratios, same, close = {}, {}, {}

    def _ref(fn):  # the call with Triton's own e4m3 conversion
        os.environ["HYSPEC_FP8_CVT"], old = "0", os.environ.get("HYSPEC_FP8_CVT", "0")
        try:
            return fn()
        finally:
            os.environ["HYSPEC_FP8_CVT"] = old
    for N, K in SHAPES:
        cfg = tall_tile(N, K, fp8=True)
        ring = max(2, math.ceil(L2_RING_BYTES / (N * K)))
        w8 = [_fp8((N, K), dev, g) for _ in range(ring)]
        out = torch.empty(1, N, device=dev, dtype=bf)
        b8 = N * K + w8[0].scale.numel() * 4
        t8 = None
        for cvt in CVTS:
            os.environ["HYSPEC_FP8_CVT"] = cvt
            t = run(f"fp8  {N}x{K} {ring} weights cvt {cvt}",
                    [lambda w=w: skinny_matmul_fp8(x[:, :K], w, out=out, block_t=16, **cfg) for w in w8], b8)
            t8 = t if t8 is None else t8
            if t and t8:
                ratios[f"{N}x{K} cvt {cvt} / cvt {CVTS[0]}"] = t / t8
            same[f"{N}x{K} cvt {cvt}"] = bool(torch.equal(
                skinny_matmul_fp8(x16[:, :K], w8[0], block_t=16, **cfg), _ref(lambda w=w8[0]: skinny_matmul_fp8(
                    x16[:, :K], w, block_t=16, **cfg))))
        if args.x_fp16:
            outh = torch.empty(1, N, device=dev, dtype=torch.float16)
            th = run(f"fp8  {N}x{K} x fp16",
                     [lambda w=w: skinny_matmul_fp8(xh[:, :K], w, out=outh, block_t=16, **cfg) for w in w8], b8)
            if th and t8:
                ratios[f"{N}x{K} x fp16 / cvt {CVTS[0]}"] = th / t8
                ratios[f"{N}x{K} x fp16 / cvt 1"] = th / rows[-2]["us"]
            ya = skinny_matmul_fp8(x16[:, :K], w8[0], block_t=16, **cfg).float()
            yb = skinny_matmul_fp8(x16[:, :K].to(torch.float16), w8[0], block_t=16, **cfg).float()
            close[f"{N}x{K}"] = float((ya - yb).abs().max() / ya.abs().max())
        del w8
        w16 = [torch.randn(N, K, device=dev, generator=g).to(bf) for _ in range(max(2, ring // 2))]
        t16 = run(f"bf16 {N}x{K} {len(w16)} weights (same tile)",
                  [lambda w=w: skinny_matmul(x[:, :K], w, out=out, block_t=16, **cfg) for w in w16], 2 * N * K)
        del w16
        if t8 and t16:
            ratios[f"{N}x{K}"] = t8 / t16
            print(f"  fp8 / bf16 time {t8 / t16:.2f} (bytes 0.50)")
    # the grouped MoE layer of the 80B preset: 512 experts of intermediate 512, hidden 2048, top 10
    E, H, I, k = 512, 2048, 512, 10
    logits = [torch.randn(1, E, device=dev, generator=g).to(bf) for _ in range(8)]
    buf = MoeBuffers(1, E, k, H, I, dev, bf)
    out = torch.empty(1, H, device=dev, dtype=bf)
    xm = x[:, :H]
    per_call8 = k * (2 * I * H + H * I) + k * (2 * I // 128 * H // 128 + H // 128 * I // 128) * 4
    moe = {}
    for kind in ("fp8", "bf16"):
        if kind == "fp8":
            gu, dn = _fp8((E, 2 * I, H), dev, g), _fp8((E, H, I), dev, g)
        else:
            gu = torch.randn(E, 2 * I, H, device=dev, generator=g).to(bf)
            dn = torch.randn(E, H, I, device=dev, generator=g).to(bf)
        for cvt in (CVTS if kind == "fp8" else ("0",)):
            os.environ["HYSPEC_FP8_CVT"] = cvt
            name = f"{kind} cvt {cvt}" if kind == "fp8" else kind
            moe[name] = run(f"moe {name} t=1 (5 kernels)",
                            [lambda lg=lg, gu=gu, dn=dn: moe_grouped(xm, lg, gu, dn, buf, out, top_k=k, renorm=True)
                             for lg in logits], per_call8 if kind == "fp8" else 2 * k * 3 * I * H)
            if kind == "fp8":
                buf4 = MoeBuffers(4, E, k, H, I, dev, bf)
                a, b = torch.empty(4, H, device=dev, dtype=bf), torch.empty(4, H, device=dev, dtype=bf)
                moe_grouped(x16[:4, :H], logits[0].expand(4, E).contiguous(), gu, dn, buf4, a, top_k=k, renorm=True)
                _ref(lambda gu=gu, dn=dn: moe_grouped(x16[:4, :H], logits[0].expand(4, E).contiguous(), gu, dn, buf4,
                                                       b, top_k=k, renorm=True))
                same[f"moe cvt {cvt}"] = bool(torch.equal(a, b))
        if kind == "fp8" and args.x_fp16:
            bufh = MoeBuffers(1, E, k, H, I, dev, torch.float16)
            outh = torch.empty(1, H, device=dev, dtype=torch.float16)
            lgh = [lg.to(torch.float16) for lg in logits]
            xmh = xm.to(torch.float16)
            moe["fp8 x fp16"] = run("moe fp8 x fp16 t=1 (5 kernels)",
                                    [lambda lg=lg, gu=gu, dn=dn: moe_grouped(xmh, lg, gu, dn, bufh, outh, top_k=k,
                                                                             renorm=True)
                                     for lg in lgh], per_call8)
        del gu, dn
    if moe.get("fp8 x fp16") and moe.get("fp8 cvt 1"):
        ratios["moe t=1 x fp16 / cvt 1"] = moe["fp8 x fp16"] / moe["fp8 cvt 1"]
        print(f"  moe fp8 x fp16 / cvt 1 time {ratios['moe t=1 x fp16 / cvt 1']:.2f}")
    for cvt in CVTS:
        if moe.get(f"fp8 cvt {cvt}") and moe.get("bf16"):
            ratios[f"moe t=1 cvt {cvt}"] = moe[f"fp8 cvt {cvt}"] / moe["bf16"]
            print(f"  moe fp8 cvt {cvt} / bf16 time {ratios[f'moe t=1 cvt {cvt}']:.2f}")
    print("bitwise equal to Triton's conversion:", same)
    if close:
        print("fp16-activation output vs bf16-activation output, max |diff| / max |y|:", close)
    if args.out and not args.eager:
        argv = sys.argv[1:]
        if "--out" in argv:
            i = argv.index("--out")
            argv = argv[:i] + argv[i + 2:]
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, git=git_state(),
                    command=" ".join(["python bench/fp8_probe.py"] + argv))
        write_json(args.out, dict(meta=meta, rows=rows, fp8_over_bf16_time=ratios, bitwise_equal_to_cvt0=same,
                                         x_fp16_rel_diff=close))  # (whole or not at all)


if __name__ == "__main__":
    main()
