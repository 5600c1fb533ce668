"""The block-FP8 skinny matmul's tiles on the qwen3-next-80b-a3b-fp8 preset's shapes: more
bytes in flight per program (more pipeline stages, ``k_unroll`` quant-block steps per loop
iteration, wider column tiles) against the runner's tall config. Each case is a CUDA graph
of back-to-back calls over a ring of weights larger than the L2 (as cold as in a decode
step) at 1 and 4 rows; every case's output is compared bit for bit with the runner's
config (the same K split, so a row must keep its bits). GPU only.

    python bench/fp8_tile_probe.py --out fp8_tile_probe.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fp8_probe import L2_RING_BYTES, _fp8, _graph_us  # noqa: E402

SHAPES = [(12288, 2048), (9216, 2048), (2048, 4096)]  # the 80B preset's block-FP8 matmuls
VARIANTS = [dict(num_stages=3), dict(num_stages=6), dict(num_stages=8),
            dict(k_unroll=2, num_stages=3), dict(k_unroll=2, num_stages=4), dict(k_unroll=2, num_stages=5),
            dict(k_unroll=4, num_stages=2), dict(k_unroll=4, num_stages=3),
            dict(block_n=64, num_stages=4), dict(block_n=64, k_unroll=2, num_stages=3),
            dict(block_n=64, k_unroll=2, num_stages=4), dict(num_warps=2, num_stages=5),
            dict(num_warps=2, k_unroll=2, num_stages=4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hyspec.gpu.runner_triton import tall_tile
    from hyspec.kernels.matmul import skinny_matmul_fp8
    from hyspec.provenance import git_state

    if not torch.cuda.is_available():
        sys.exit("fp8_tile_probe: needs a CUDA GPU")
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
        want = skinny_matmul_fp8(xs[:16, :K], w8[0], block_t=16, **base)
        for v in [{}] + VARIANTS:
            cfg = dict(base, **v)
            row = dict(shape=[N, K], change=v, config=cfg)
            try:
                for T in rows_t:
                    out = torch.empty(T, N, device=dev, dtype=bf)
                    x = xs[:T, :K]
                    row[f"us_t{T}"] = _graph_us([lambda w=w: skinny_matmul_fp8(x, w, out=out, block_t=16, **cfg)
                                                 for w in w8], args.reps)
                    row[f"TBps_t{T}"] = nbytes / row[f"us_t{T}"] * 1e-6
                row["same_bits_as_runner_config"] = bool(torch.equal(
                    skinny_matmul_fp8(xs[:16, :K], w8[0], block_t=16, **cfg), want))
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is a result too
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            results.append(row)
            ts = "  ".join(f"t{T} {row.get(f'us_t{T}', float('nan')):6.2f} us {row.get(f'TBps_t{T}', 0):4.2f} TB/s"
                           for T in rows_t)
            print(f"{N}x{K} {str(v or 'runner config ' + str(base)):<60} {ts}  same bits "
                  f"{row.get('same_bits_as_runner_config')} {row.get('error', '')}")
        del w8
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, git=git_state(),
                    command="python bench/fp8_tile_probe.py " + " ".join(sys.argv[1:]))
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
