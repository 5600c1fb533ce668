"""p_min benchmark: speculative requests with `--p-min` on the batched graph lanes (where
they run since p_min moved onto the device) against the same requests without p_min and
against the engine core (the eager loop they fell back to before), side by side in one run.

    python bench/pmin.py --device cuda --dtype bfloat16 --out bench/results/pmin_h200.json

The model is the embedded default model by default (a trained MTP head: its draft
probabilities are real, so p_min cuts drafts where the drafter is unsure; on random
weights every draft would fall below any useful p_min). Each case runs one request
(`--max-new-tokens` after a `--prompt-tokens` prompt of a held-out Python file) through
Engine.generate, `--repeats` times, and reports the median decode tok/s (the lane's own
clock) and the drafted / accepted counts. p_min = 1e-9 cuts (almost) nothing: its row
against p_min = 0 is the cost of the test itself. Greedy rows must give the plain greedy
tokens whatever p_min is (exactness); sampled rows are seeded (their tokens may differ
from p_min = 0: a cut changes which draws a round makes, not the distribution). The
engine-core row (Engine.graphs_available switched off for it) runs `--core-tokens` tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hyspec.sampling import SamplingParams  # noqa: E402
from hyspec.speculative.loop import SpecOptions  # noqa: E402
from logprobs import add_request_args, git_info, heldout_ids  # noqa: E402
from sessions import add_model_args, engine_of  # noqa: E402

K = 3


def run(eng, prompt, n, draft, params, p_min, repeats):
    rates, out = [], None
    for _ in range(repeats):
        out = eng.generate(prompt, max_new_tokens=n, draft=draft, spec=SpecOptions(k=max(draft, 1), p_min=p_min),
                           params=params, ignore_eos=True, use_store=False)
        rates.append(out.samples[0].stats.get("decode_tok_s") or 0.0)
    s = out.samples[0]
    tel = s.stats.get("spec") or {}
    return {"tokens": s.tokens, "path": s.stats.get("path", "engine-core"), "decode_tok_s": statistics.median(rates),
            "decode_tok_s_all": rates, "rounds": tel.get("rounds"), "drafted": tel.get("drafted"),
            "accepted": tel.get("accepted")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    add_request_args(ap, "pmin_cpu.json")
    ap.add_argument("--p-mins", default="1e-9,0.05,0.2,0.5")
    args = ap.parse_args(argv)

    eng = engine_of(args)
    eng.batch_graphs = args.batch_graphs
    prompt = heldout_ids(eng, args.prompt_tokens)
    n = args.max_new_tokens
    p_mins = [float(x) for x in args.p_mins.split(",")]
    plain = run(eng, prompt, n, 0, None, 0.0, args.repeats)
    print(f"plain greedy [{plain['path']}] {plain['decode_tok_s']:.1f} tok/s", flush=True)
    rows = []
    for name, params in (("greedy", None), ("sampled T=0.8 top-p 0.95", SamplingParams(temperature=0.8, top_p=0.95,
                                                                                      seed=5))):
        for pm in [0.0] + p_mins:
            run(eng, prompt, 8, K, params, pm, 1)  # warm-up: graphs captured, kernels compiled
        base = run(eng, prompt, n, K, params, 0.0, args.repeats)
        for pm in [0.0] + p_mins:
            r = base if pm == 0.0 else run(eng, prompt, n, K, params, pm, args.repeats)
            row = {"case": name, "p_min": pm, "path": r["path"], "decode_tok_s": r["decode_tok_s"],
                   "decode_tok_s_all": r["decode_tok_s_all"], "ratio_to_p_min_0": r["decode_tok_s"] / base["decode_tok_s"],
                   "rounds": r["rounds"], "drafted": r["drafted"], "accepted": r["accepted"],
                   "drafts_per_round": r["drafted"] / r["rounds"], "accepted_per_draft": r["accepted"] / max(1, r["drafted"])}
            if params is None:
                row["same_tokens_as_plain"] = r["tokens"] == plain["tokens"]
            rows.append(row)
            same = f"   same tokens as plain: {row['same_tokens_as_plain']}" if params is None else ""
            print(f"K={K} {name:26s} p_min {pm:<6g} [{r['path']}] {r['decode_tok_s']:8.1f} tok/s "
                  f"(x{row['ratio_to_p_min_0']:.3f} of p_min 0)   drafts/round {row['drafts_per_round']:.2f}   "
                  f"accepted/draft {row['accepted_per_draft']:.3f}{same}", flush=True)
    core = None
    if eng.graphs_available():  # the greedy K=3 request with the largest p_min on the engine core (the old path)
        pm = p_mins[-1]
        eng.graphs_available = lambda: False
        c = run(eng, prompt, args.core_tokens, K, None, pm, 1)
        del eng.graphs_available
        lanes = next(r for r in rows if r["case"] == "greedy" and r["p_min"] == pm)
        core = {"path": c["path"], "p_min": pm, "tokens": args.core_tokens, "decode_tok_s": c["decode_tok_s"],
                "lanes_speedup": lanes["decode_tok_s"] / c["decode_tok_s"],
                "same_tokens_prefix": c["tokens"] == plain["tokens"][: args.core_tokens]}
        print(f"engine core, K={K} greedy, p_min {pm:g}: {c['decode_tok_s']:.1f} tok/s ({args.core_tokens} tokens; "
              f"same tokens: {core['same_tokens_prefix']}); the lanes x{core['lanes_speedup']:.1f}", flush=True)
    res = {**git_info(), "bench": "pmin", "model": args.config or args.model or "default", "device": args.device,
           "dtype": args.dtype, "prompt_tokens": len(prompt), "max_new_tokens": n, "k": K, "repeats": args.repeats,
           "torch": torch.__version__, "plain": {k: plain[k] for k in ("path", "decode_tok_s", "decode_tok_s_all")},
           "cases": rows, "engine_core": core}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
