#!/usr/bin/env python
"""Plot hyspec bench JSON: speculative tok/s vs K, and verify cost vs t (relative to t=1).

    python bench/plot_results.py bench/results/b2_h200.json bench/results/b2_h200_baselines.json \
        --out bench/results/b2_h200.png
    python bench/plot_results.py bench/results/default_model_h200.json \
        bench/results/default_model_h200_baselines.json --out bench/results/default_model_h200.png
Each JSON's variants are drawn (the first file given wins for a variant); labels carry the
file's stem so two runs can be compared; the roofline and the title come from the first file.
"""
import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    seen = set()
    first = None
    for path in args.json:
        r = json.loads(Path(path).read_text())
        first = first or r
        tag = Path(path).stem
        for name, v in r.get("variants", {}).items():
            if (name, "plain") in seen:
                continue  # the first file given wins for a variant
            seen.add((name, "plain"))
            ls = "-" if name == "exact" else "--"
            for kind, mk in (("forced", "o"), ("mtp", "s")):
                ks = sorted(v["spec"][kind], key=int)
                a1.plot([int(k) for k in ks], [v["spec"][kind][k]["tok_s"] for k in ks], ls, marker=mk,
                        label=f"{name} {kind} ({tag})")
            a1.axhline(v["plain"]["tok_s"], ls=ls, color="gray", lw=1)
            a1.text(1, v["plain"]["tok_s"] * 1.01, f"plain {name} {v['plain']['tok_s']:.0f}", fontsize=8)
            ts = sorted(v["verify_rel"], key=int)
            a2.plot([int(t) for t in ts], [v["verify_rel"][t] for t in ts], ls, marker="o",
                    label=f"{name} ({tag}, t1={v['verify_ms'][ts[0]]:.2f} ms)")
    r, meta = first, first["meta"]
    top = max(max(line.get_ydata()) for line in a1.get_lines())
    if r["roofline_tok_s"] <= 2 * top:  # a launch-bound model's roofline would flatten the curves
        a1.axhline(r["roofline_tok_s"], color="k", lw=0.8, ls=":")
        a1.text(1, r["roofline_tok_s"] * 0.97, f"roofline {r['roofline_tok_s']:.0f}", fontsize=8, va="top")
    xlabel = "K (drafts per round)" + ("" if r["roofline_tok_s"] <= 2 * top
                                       else f"; roofline {r['roofline_tok_s']:.0f} tok/s, off the chart")
    a1.set_xlabel(xlabel)
    a1.set_ylabel("tok/s")
    a1.set_title(f"speculative decode, {meta.get('config')}, {meta.get('device')} (forced 0.9/0.8/0.7/0.6 vs MTP)")
    a1.legend(fontsize=7)
    a1.set_xticks([1, 2, 3, 4])
    a2.axhline(1.10, color="r", lw=0.8, ls=":")
    a2.set_xlabel("t (verify rows)")
    a2.set_ylabel("verify cost / decode-step cost")
    a2.set_title("verify cost vs t")
    a2.legend(fontsize=7)
    fig.suptitle(f"{meta['device']}  {meta['dtype']}  prompt {meta['prompt_len']}  new {meta['new_tokens']}  "
                 f"{meta['date_utc']} UTC", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
