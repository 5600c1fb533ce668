"""Block-FP8 matmuls with dynamically quantized activations (``act_quant``: x rounded to e4m3
per row and 128-wide group, an e4m3 x e4m3 MMA) against the bf16-activation form that
converts every weight to bf16 (the runner's until now), on the qwen3-next-80b-a3b-fp8
preset's matmul shapes.  Each case is a CUDA graph of back-to-back calls over a ring of
weights larger than the L2 (as cold as in a decode step), at 1 and 4 rows.  Per shape it
also checks the quantized form against its torch reference
(``skinny_matmul_fp8_ref(act_quant=True)``, max abs error over the output's max) and that a
row has the same bits at every row-tile height (16, 32, 64 rows).  GPU only.

    python bench/fp8_act_probe.py --out fp8_act_probe.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fp8_probe import L2_RING_BYTES, SHAPES, _fp8, _graph_us  # noqa: E402

# act_quant configs tried per shape (the weight is always the MMA's left operand)
VARIANTS = [dict(block_n=64), dict(block_n=64, num_stages=5), dict(block_n=128), dict(block_n=64, num_warps=8),
            dict(block_n=128, num_warps=8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hyspec.gpu.runner_triton import tall_tile
    from hyspec.kernels.matmul import skinny_matmul_fp8, skinny_matmul_fp8_ref
    from hyspec.kernels.matmul.fp8 import fp8_config
    from hyspec.provenance import git_state

    if not torch.cuda.is_available():
        sys.exit("fp8_act_probe: needs a CUDA GPU")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    rows_t = [int(r) for r in args.rows.split(",")]
    xs = torch.randn(64, 8192, device=dev, generator=g).to(bf)
    results = []
    for N, K in SHAPES:
        base = tall_tile(N, K, fp8=True)
        ring = max(2, math.ceil(L2_RING_BYTES / (N * K)))
        w8 = [_fp8((N, K), dev, g) for _ in range(ring)]
        nbytes = N * K + w8[0].scale.numel() * 4
        cases = [("bf16 act (runner)", dict(base), False)]
        for v in VARIANTS:
            o = dict(split_k=base["split_k"], block_k=128, **v)
            cases.append((f"act_quant {v}", o, True))
        for name, cfg, aq in cases:
            try:
                c = fp8_config(N, K, w8[0].block, False, aq, **cfg)
                row = dict(shape=[N, K], case=name, aq=aq, config=dict(block_n=c.block_n, split_k=c.split_k,
                                                                       num_warps=c.num_warps, num_stages=c.num_stages,
                                                                       wt=c.wt))
                for T in rows_t:
                    out = torch.empty(T, N, device=dev, dtype=bf)
                    x = xs[:T, :K]
                    us = _graph_us([lambda w=w: skinny_matmul_fp8(x, w, out=out, block_t=16, act_quant=aq, **cfg)
                                    for w in w8], args.reps)
                    row[f"us_t{T}"] = us
                    row[f"TBps_t{T}"] = nbytes / us * 1e-6
                y = skinny_matmul_fp8(xs[:16, :K], w8[0], block_t=16, act_quant=aq, **cfg)
                r = skinny_matmul_fp8_ref(xs[:16, :K], w8[0], act_quant=aq)
                row["rel_err_vs_ref"] = ((y.float() - r.float()).abs().max() / r.float().abs().max()).item()
                same = True
                for bt in (32, 64):
                    yb = skinny_matmul_fp8(xs[:, :K], w8[0], block_t=bt, act_quant=aq, **cfg)
                    same = same and bool(torch.equal(yb[:16], y))
                row["same_bits_heights_16_32_64"] = same
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
                row = dict(shape=[N, K], case=name, aq=aq, error=f"{type(e).__name__}: {str(e)[:300]}")
            results.append(row)
            ts = "  ".join(f"t{T} {row.get(f'us_t{T}', float('nan')):6.2f} us {row.get(f'TBps_t{T}', 0):4.2f} TB/s"
                           for T in rows_t)
            print(f"{N}x{K} {name:<48} {ts}  err {row.get('rel_err_vs_ref', float('nan')):.2e} "
                  f"heights-same {row.get('same_bits_heights_16_32_64')} {row.get('error', '')}")
        del w8
    # the grouped MoE layer of the 80B preset (512 experts of intermediate 512, hidden 2048, top
    # 10, the shared expert fused as expert 512): 8 router-logit sets, so each call routes to
    # other experts (cold weights)
    from hyspec.kernels.moe.grouped import MoeBuffers, moe_grouped

    E, H, I, k = 512, 2048, 512, 10
    logits = [torch.randn(4, E + 1, device=dev, generator=g).to(bf) for _ in range(8)]
    gu, dn = _fp8((E, 2 * I, H), dev, g), _fp8((E, H, I), dev, g)
    sh = (gu[0], dn[0])
    per_row = (k + 1) * (2 * I * H + H * I)
    first = {}
    for aq in (False, True):
        row = dict(shape=["moe", E, H, I, k], case=f"moe act_quant={aq}", aq=aq)
        for T in rows_t:
            buf = MoeBuffers(T, E + 1, k + 1, H, I, dev, bf)
            out = torch.empty(T, H, device=dev, dtype=bf)
            us = _graph_us([lambda lg=lg, buf=buf, out=out, T=T: moe_grouped(
                xs[:T, :H], lg[:T], gu, dn, buf, out, top_k=k, renorm=True, shared_experts=sh, act_quant=aq)
                for lg in logits], args.reps)
            row[f"us_t{T}"] = us
        buf4, buf1 = MoeBuffers(4, E + 1, k + 1, H, I, dev, bf), MoeBuffers(1, E + 1, k + 1, H, I, dev, bf)
        o4, o1 = torch.empty(4, H, device=dev, dtype=bf), torch.empty(1, H, device=dev, dtype=bf)
        moe_grouped(xs[:4, :H], logits[0][:4], gu, dn, buf4, o4, top_k=k, renorm=True, shared_experts=sh, act_quant=aq)
        moe_grouped(xs[2:3, :H], logits[0][2:3], gu, dn, buf1, o1, top_k=k, renorm=True, shared_experts=sh,
                    act_quant=aq)
        row["row_bits_same_1_vs_4"] = bool(torch.equal(o1[0], o4[2]))
        if aq:
            r4 = first["o4"].float()
            row["rel_diff_vs_bf16_act"] = ((o4.float() - r4).abs().max() / r4.abs().max()).item()
        else:
            first["o4"] = o4.clone()
        results.append(row)
        print(f"moe act_quant={aq}: " + "  ".join(f"t{T} {row[f'us_t{T}']:6.2f} us" for T in rows_t)
              + f"  row bits 1 vs 4 same {row['row_bits_same_1_vs_4']} {row.get('rel_diff_vs_bf16_act', '')}"
              + f"  ({per_row / 2 ** 20:.0f} MiB of experts per row)")
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, git=git_state(),
                    command="python bench/fp8_act_probe.py " + " ".join(a for a in sys.argv[1:]))
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
