"""The top-p cut's launch settings on the GPU: hyspec.kernels.probs.topp's histogram and
cut kernels timed (CUDA-graph replays) with each setting, at b2's vocabulary and a few row
counts, on bf16 logits like a sampled round's (T=0.8, top-p 0.95).  The bins are integer
sums, so every setting must give the default's keep mask bitwise (checked); only the time
may change.  Also the whole probs_batch (softmax, cut, softmax) for scale.  GPU only.

    python bench/topp_bench.py --rows 1,4,16,64 --out bench/results/topp_bench_h200.json
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch


def main() -> None:
    from hyspec.gpu.graphs import graph_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--std", type=float, default=2.0, help="logit standard deviation")
    ap.add_argument("--blocks", default="256,512,1024,2048,4096")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--cut-warps", default="4,8,16")
    ap.add_argument("--copies", default="1x1",
                    help="MREPxREP pairs: copies of the histogram's bins and of its block totals")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/topp_bench.py")
    from hyspec.bench.report import write_json
    from hyspec.gpu import sampling as dsamp
    from hyspec.kernels.probs import topp
    from hyspec.provenance import git_state
    from hyspec.sampling import SamplingParams

    dev = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    V = args.vocab
    default = (dict(topp.HIST_LAUNCH), topp.CUT_WARPS)  # (the settings of calls of more than 16 rows)
    few = dict(topp.HIST_FEW_ROWS)
    topp.HIST_FEW_ROWS.clear()  # each way's settings are the ones timed (the shipped rule is timed too: "rule")
    out = {"git": git_state(), "command": "python bench/topp_bench.py " + " ".join(sys.argv[1:]), "vocab": V,
           "std": args.std, "default": {"hist": default[0], "cut_warps": default[1]}, "rows": {}}
    for B in rows:
        g = torch.Generator(device=dev).manual_seed(B)
        x = (torch.randn(B, V, device=dev, generator=g) * args.std).to(torch.bfloat16)
        table = dsamp.SamplingTable(B, device=dev)
        for i in range(B):
            table.set(i, SamplingParams(temperature=0.8, top_p=0.95, seed=i, mode="coupled"))
        regime = dsamp.SampledGraphKey.of(table.params)
        temp = table.temp_eff
        mass = dsamp.softmax_rows(x, temp, None, mass=True)  # the cut's weights, as probs_batch forms them
        thr = table.topp_threshold.unsqueeze(1)

        def cut():
            return topp.prefix_select_rows(x, 16, None, mass, thr)

        topp.HIST_LAUNCH.update(default[0])
        topp.CUT_WARPS = default[1]
        ref = cut()
        kept = float(ref.sum(1).float().mean()) / V
        whole = graph_ms(lambda: dsamp.probs_batch(x, table, None, regime, kernel=True, with_best=True))
        res = {"kept_fraction": kept, "probs_batch_ms": whole, "ways": []}
        print(f"rows {B}: top-p keeps {100 * kept:.1f} % of the tokens; probs_batch {1e3 * whole:.1f} us", flush=True)
        ways = itertools.product([int(v) for v in args.blocks.split(",")], [int(v) for v in args.warps.split(",")],
                                 [int(v) for v in args.cut_warps.split(",")],
                                 [tuple(int(c) for c in v.split("x")) for v in args.copies.split(",")])
        for blk, w, cw, (mrep, rep) in ways:
            topp.HIST_LAUNCH.update(BLOCK=blk, num_warps=w, MREP=mrep, REP=rep)
            topp.CUT_WARPS = cw
            try:
                same = bool(torch.equal(cut(), ref))
                ms = graph_ms(cut)
            except Exception as e:  # noqa: BLE001 - e.g. a launch over a resource limit
                res["ways"].append({"block": blk, "warps": w, "cut_warps": cw, "mrep": mrep, "rep": rep,
                                    "error": f"{type(e).__name__}: {e}"})
                continue
            res["ways"].append({"block": blk, "warps": w, "cut_warps": cw, "mrep": mrep, "rep": rep, "us": 1e3 * ms,
                                "same_keep": same})
        topp.HIST_LAUNCH.update(default[0])
        topp.CUT_WARPS = default[1]
        topp.HIST_FEW_ROWS.update(few)
        res["rule_us"] = 1e3 * graph_ms(cut)  # the shipped settings (their block by the row count)
        res["rule_same_keep"] = bool(torch.equal(cut(), ref))
        topp.HIST_FEW_ROWS.clear()
        print(f"   shipped rule: {res['rule_us']:.1f} us same keep {res['rule_same_keep']}", flush=True)
        res["ways"].sort(key=lambda r: r.get("us", 1e9))
        for r in res["ways"][:8] + [r for r in res["ways"] if (r["block"], r["warps"], r["cut_warps"], r["mrep"],
                                                               r["rep"]) ==
                                    (default[0]["BLOCK"], default[0]["num_warps"], default[1], default[0]["MREP"],
                                     default[0]["REP"])]:
            print(f"   block {r['block']:5d} warps {r['warps']} cut warps {r['cut_warps']:2d} copies "
                  f"{r['mrep']}x{r['rep']}: "
                  f"{r.get('us', float('nan')):7.1f} us same keep {r.get('same_keep')} {r.get('error', '')}",
                  flush=True)
        out["rows"][B] = res
    write_json(args.out, out)  # (whole or not at all: hyspec.bench.report)


if __name__ == "__main__":
    main()
