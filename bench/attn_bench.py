"""The bf16 fast path's attention (``attn_decode_grouped``: the split partial kernel + the
combine) at b2's shapes, compiled and launched several ways (the keys of
``hyspec.kernels.attention.grouped.LAUNCH``; ``chunked``: grouped.CHUNKED, a row's
partials as chunks of its keys by level, 0 the interleaved 16 splits; ``combine_tile``:
attention.kernel.COMBINE_TILE, the combine's partials as one tile or in a loop): microseconds per call as CUDA-graph
replays (no launch gaps), the K/V bytes it reads and their bandwidth, whether the output is
bitwise that of the first way with the same ``chunked`` and ``combine_tile`` (a launch
option may not change a value; those two do), and its largest difference from the fp32 torch reference.
GPU only.

Cases: lanes x context x rows per lane (1: a decode step; 4: a K=3 verify), each lane
at its own position (the context +- up to 64, from a seeded generator).

    python bench/attn_bench.py --lanes 1,16,64 --ctx 640 --rows 1,4 \\
        --ways "split16:chunked=0;levels:chunked=1" --out attn.json
"""
from __future__ import annotations

import argparse
import sys

import torch

from hyspec.bench.report import write_json
from hyspec.presets import QWEN3_NEXT_2B_DENSE as _B2

# "split16" is the library's default form (16 interleaved partials per row); "levels" the
# chunked option (grouped.CHUNKED: HYSPEC_ATTN_CHUNKED=1)
DEFAULT_WAYS = ("split16:chunked=0;levels:chunked=1;levels_p512:chunked=1,programs_target=512;"
                "levels_p2048:chunked=1,programs_target=2048;levels_s2:chunked=1,num_stages=2")


def parse_ways(text: str) -> list[tuple[str, dict]]:
    ways = []
    for item in filter(None, (w.strip() for w in text.split(";"))):
        name, _, kv = item.partition(":")
        opts = {}
        for pair in filter(None, kv.split(",")):
            k, _, v = pair.partition("=")
            opts[k.strip()] = int(v) if v.strip() not in ("", "None") else None
        ways.append((name.strip(), opts))
    return ways


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lanes", default="1,16,64")
    ap.add_argument("--ctx", default="640", help="comma-separated context lengths (keys before the rows)")
    ap.add_argument("--rows", default="1,4", help="rows per lane: 1 decode, 4 a K=3 verify")
    ap.add_argument("--long", default="32768", help="contexts run at one lane only ('' none)")
    ap.add_argument("--ways", default=DEFAULT_WAYS)
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/attn_bench.py")
    from hyspec.bench.timing import time_fn
    from hyspec.kernels.attention import grouped
    from hyspec.kernels.attention import kernel as akernel
    from hyspec.kernels.attention.reference import attn_decode_ref
    from hyspec.provenance import git_state

    dev = torch.device("cuda")
    Hq, Hkv, D = _B2["num_attention_heads"], _B2["num_key_value_heads"], _B2["head_dim"]
    lanes_l = [int(x) for x in args.lanes.split(",")]
    ctxs = [int(x) for x in args.ctx.split(",")]
    rows_l = [int(x) for x in args.rows.split(",")]
    cases = [(b, c, t) for b in lanes_l for c in ctxs for t in rows_l]
    cases += [(1, int(c), t) for c in filter(None, args.long.split(",")) for t in rows_l]
    ways = parse_ways(args.ways)
    saved = dict(grouped.LAUNCH)
    saved_chunk = grouped.CHUNKED
    saved_tile = akernel.COMBINE_TILE
    out = {"git": git_state(), "command": "python bench/attn_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": torch.cuda.get_device_name(), "shapes": {"Hq": Hq, "Hkv": Hkv, "D": D},
           "ways": {n: o for n, o in ways}, "cases": []}
    print(f"# {out['git']}  {out['device']}  Hq {Hq} Hkv {Hkv} D {D}")
    g = torch.Generator().manual_seed(0)
    for lanes, ctx, t in cases:
        L = ctx + 64 + t + 32
        kc0 = torch.randn(lanes, Hkv, L, D, generator=g).to(dev, torch.bfloat16)
        vc0 = torch.randn(lanes, Hkv, L, D, generator=g).to(dev, torch.bfloat16)
        pos = (ctx + torch.randint(-64, 65, (lanes,), generator=g)).clamp(min=0).to(dev)
        T = lanes * t
        q = torch.randn(T, Hq, D, generator=g).to(dev, torch.bfloat16)
        proj = torch.randn(T, Hq * 2 * D + 2 * Hkv * D, generator=g).to(dev, torch.bfloat16)
        outs = {}
        ws = torch.empty(T * Hq * max(32, grouped.GROUPED_SPLITS, -(-L // grouped.BLOCK_N)) * (D + 2), device=dev,
                         dtype=torch.float32)
        refs = []
        for b in range(lanes):
            rows_b = slice(b * t, (b + 1) * t)
            gate = proj[rows_b, : Hq * 2 * D].reshape(t, Hq, 2 * D)[:, :, D:].float()
            refs.append(attn_decode_ref(q[rows_b].float(), kc0[b].float(), vc0[b].float(), int(pos[b]), gate))
        ref = torch.cat(refs)
        kv_bytes = int(sum(2 * Hkv * (int(p) + t) * D * 2 for p in pos.tolist()))
        row = {"lanes": lanes, "ctx": ctx, "rows": t, "kv_bytes": kv_bytes, "ways": {}}
        for name, opts in ways:
            grouped.LAUNCH.clear()
            grouped.LAUNCH.update(saved)
            opts = dict(opts)
            grouped.CHUNKED = bool(opts.pop("chunked", saved_chunk))
            akernel.COMBINE_TILE = bool(opts.pop("combine_tile", saved_tile))
            form = (grouped.CHUNKED, akernel.COMBINE_TILE)  # the numerics (a launch option keeps them)
            grouped.LAUNCH.update(opts)
            o = torch.empty(T, Hq * D, device=dev, dtype=torch.bfloat16)

            def call():
                grouped.attn_decode_grouped(q, kc0[0], vc0[0], pos, 0, proj, o, rows=T, ws=ws, lanes=lanes,
                                            kv_lane_stride=Hkv * L * D)

            try:
                call()
                torch.cuda.synchronize()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    call()
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(args.calls):
                        call()
                us = time_fn(graph.replay, dev, 10, warmup=2) * 1e3 / args.calls
            except Exception as e:  # noqa: BLE001 - a way that does not compile is reported, not fatal
                row["ways"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(f"B={lanes:>3} ctx {ctx:>6} rows {t}: {name:>18s} failed: {e}")
                continue
            first = next((n for n, (f, _) in outs.items() if f == form), name)
            outs[name] = (form, o.clone())
            same = bool(torch.equal(o, outs[first][1]))
            err = float((o.float() - ref).abs().max())
            row["ways"][name] = {"us": us, "kv_tb_s": kv_bytes / (us * 1e-6) / 1e12, "chunked": grouped.CHUNKED, "combine_tile": akernel.COMBINE_TILE,
                                 "same_bits_as": first, "same_bits": same, "max_abs_err_vs_fp32_ref": err}
            print(f"B={lanes:>3} ctx {ctx:>6} rows {t}: {name:>18s} {us:8.2f} us  {kv_bytes / (us * 1e-6) / 1e12:5.2f} TB/s"
                  f"  same bits as {first}: {same}  max |err| vs fp32 ref {err:.2e}")
        out["cases"].append(row)
    grouped.LAUNCH.clear()
    grouped.LAUNCH.update(saved)
    grouped.CHUNKED = saved_chunk
    akernel.COMBINE_TILE = saved_tile
    if args.out:
        write_json(args.out, out)  # (whole or not at all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
