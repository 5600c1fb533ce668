"""Warps per program of the float64 sampling kernels on the GPU: the softmax
(hyspec.kernels.probs.softmax_rows, mass and final forms), the Gumbel-max
(hyspec.kernels.rng.gumbel_argmax) and the inverse CDF (inverse_cdf_rows), each timed as
CUDA-graph replays with each setting at b2's vocabulary, on bf16 logits like a sampled
round's (T=0.8, top-p 0.95), then a whole coupled sampling site (probs_batch + the
Gumbel-max draw) with the shipped settings and with each kernel's fastest.

What may change with the setting: the time; the Gumbel-max tokens may not (integer Philox,
logs and a max: no float sum; checked equal to the shipped setting's); the softmax's
in-chunk float64 sums add in an order that depends on the warps, so its rows may differ
from the shipped setting's by a few ulps (printed: the largest relative difference and the
fraction of the int64 top-p masses that changed). The shipped setting is one constant
for every call (row invariance), so a change is a change for all sites at once.  GPU only.

    python bench/sampling_warps.py --rows 16,64 --out bench/results/sampling_warps_h200.json
"""
from __future__ import annotations

import argparse
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--std", type=float, default=2.0, help="logit standard deviation")
    ap.add_argument("--warps", default="1,2,4,8,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hyspec.bench.report import write_json
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/sampling_warps.py")
    from hyspec.gpu import sampling as dsamp
    from hyspec.gpu.graphs import graph_ms
    from hyspec.kernels.probs import kernel as pk
    from hyspec.kernels.rng import kernel as rk
    from hyspec.provenance import git_state
    from hyspec.sampling import SamplingParams

    dev = torch.device("cuda")
    warps = [int(w) for w in args.warps.split(",")]
    shipped = {"softmax": pk.SOFTMAX_WARPS, "gumbel": rk.GUMBEL_WARPS, "cdf": pk.CDF_WARPS}
    out = {"git": git_state(), "command": "python bench/sampling_warps.py " + " ".join(sys.argv[1:]),
           "vocab": args.vocab, "std": args.std, "shipped": shipped, "rows": {}}

    def setting(softmax=None, gumbel=None, cdf=None):
        pk.SOFTMAX_WARPS = shipped["softmax"] if softmax is None else softmax
        rk.GUMBEL_WARPS = shipped["gumbel"] if gumbel is None else gumbel
        pk.CDF_WARPS = shipped["cdf"] if cdf is None else cdf

    for B in [int(r) for r in args.rows.split(",")]:
        g = torch.Generator(device=dev).manual_seed(B)
        x = (torch.randn(B, args.vocab, device=dev, generator=g) * args.std).to(torch.bfloat16)
        table = dsamp.SamplingTable(B, device=dev)
        for i in range(B):
            table.set(i, SamplingParams(temperature=0.8, top_p=0.95, seed=i, mode="coupled"))
        regime = dsamp.SampledGraphKey.of(table.params)
        temp = table.temp_eff
        pos = torch.arange(B, device=dev, dtype=torch.int64) + 100
        u = torch.rand(B, device=dev, generator=g, dtype=torch.float64)
        setting()
        p_ref = dsamp.probs_batch(x, table, None, regime, kernel=True)  # [B, V] the site's final rows
        keep = p_ref > 0
        kinds = {
            "softmax_mass": lambda: pk.softmax_rows(x, temp, None, mass=True, with_best=True),
            "softmax_final": lambda: pk.softmax_rows(x, temp, keep),
            "gumbel": lambda: rk.gumbel_argmax(p_ref, table.seed, 3, pos),
            "cdf": lambda: pk.inverse_cdf_rows(p_ref, u),
        }
        knob = {"softmax_mass": "softmax", "softmax_final": "softmax", "gumbel": "gumbel", "cdf": "cdf"}
        refs = {k: f() for k, f in kinds.items()}
        res = {"kernels": {}}
        best = {}
        print(f"rows {B} (shipped warps {shipped}):", flush=True)
        for name, fn in kinds.items():
            rows = []
            for w in warps:
                setting(**{knob[name]: w})
                try:
                    got = fn()
                    ms = graph_ms(fn)
                except Exception as e:  # noqa: BLE001 - e.g. a launch over a resource limit
                    rows.append({"warps": w, "error": f"{type(e).__name__}: {e}"})
                    continue
                row = {"warps": w, "us": 1e3 * ms}
                ref = refs[name]
                if name == "softmax_mass":
                    row["masses_changed"] = float((got[0] != ref[0]).double().mean())
                    row["best_same"] = bool(torch.equal(got[1], ref[1]))
                elif name == "softmax_final":
                    rel = ((got - ref).abs() / ref.abs().clamp(min=1e-300)).max()
                    row["max_rel_diff"] = float(rel)
                else:
                    row["same_tokens"] = bool(torch.equal(got, ref))
                rows.append(row)
            setting()
            res["kernels"][name] = rows
            timed = [r for r in rows if "us" in r]
            if timed:
                best[name] = min(timed, key=lambda r: r["us"])["warps"]
            for r in rows:
                extra = {k: v for k, v in r.items() if k not in ("warps", "us")}
                print(f"   {name:14s} warps {r['warps']:2d}: {r.get('us', float('nan')):8.1f} us {extra}", flush=True)

        def site():  # a coupled site: the three softmax launches' kernels, the cut, the draw
            p, b = dsamp.probs_batch(x, table, None, regime, kernel=True, with_best=True)
            return dsamp.coupled_rows(p, table.seed, pos, kernel=True)

        setting()
        res["site_shipped_us"] = 1e3 * graph_ms(site)
        fastest = {"softmax": best.get("softmax_final"), "gumbel": best.get("gumbel"), "cdf": best.get("cdf")}
        setting(**fastest)
        res["site_fastest_us"] = 1e3 * graph_ms(site)
        res["fastest"] = fastest
        setting()
        print(f"   coupled site (probs_batch + Gumbel-max): shipped {res['site_shipped_us']:.1f} us, "
              f"fastest warps {fastest}: {res['site_fastest_us']:.1f} us", flush=True)
        out["rows"][B] = res
    write_json(args.out, out)


if __name__ == "__main__":
    main()
