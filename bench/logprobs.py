"""Logprobs benchmark: what asking for each token's log-probability (and a top-N list)
costs a request on the batched graph lanes, measured side by side in one run, and what the
same request cost on the engine core (where logprobs requests ran before they moved to the
lanes).

    python bench/logprobs.py --config b2 --device cuda --dtype bfloat16 \
        --out bench/results/logprobs_h200.json

Each case runs one request (`--max-new-tokens` after a `--prompt-tokens` prompt of a
held-out Python file) through Engine.generate, `--repeats` times, and reports the median
decode tok/s (tokens after the first per second, the lane's own clock) without logprobs,
with logprobs=1 and with logprobs=`--top`; the tokens must be the same with and without
(asking changes nothing). Speculative cases use the forced-acceptance drafter (0.9 / 0.8 /
0.7 / 0.6, K=3, proposing from the plain greedy continuation), as `hyspec bench` does on
random weights. The engine-core row (Engine.graphs_available switched off for it) runs
`--core-tokens` tokens: it is the eager loop.

Target printed: logprobs=`--top` keeps >= 0.8 of the lanes' tok/s without logprobs (the
device computes the asking lanes' log-probabilities behind each round; the host reads them
with the round's tokens).
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

from hyspec.engine import Engine  # noqa: E402
from sessions import add_model_args, engine_of, heldout_text  # noqa: E402
from hyspec.sampling import SamplingParams  # noqa: E402
from hyspec.speculative.loop import SpecOptions  # noqa: E402

FORCED = (0.9, 0.8, 0.7, 0.6)
TARGET = 0.8


def git_info() -> dict:
    from hyspec.provenance import git_state

    st = git_state(ROOT)
    return {"git_commit": st["commit"], "dirty": st["dirty"]}


def heldout_ids(eng: Engine, n: int) -> list[int]:
    return eng.encode(heldout_text(n * 8))[:n]


def run(eng, prompt, n, draft, params, logprobs, reference, repeats):
    spec = SpecOptions(forced_rates=FORCED) if draft else None
    outs, rates = [], []
    for _ in range(repeats):
        out = eng.generate(prompt, max_new_tokens=n, draft=draft, spec=spec, params=params, logprobs=logprobs,
                           reference=reference if draft else None, ignore_eos=True, use_store=False)
        s = out.samples[0]
        outs.append(out)
        rates.append(s.stats.get("decode_tok_s") or 0.0)
    s = outs[-1].samples[0]
    return {"tokens": s.tokens, "path": s.stats.get("path", "engine-core"), "decode_tok_s": statistics.median(rates),
            "decode_tok_s_all": rates, "logprobs": outs[-1].logprobs[0] if logprobs is not None else None,
            "acceptance_length": s.stats["spec"]["acceptance_length"] if draft else None}


def add_request_args(ap, out_name: str) -> None:
    """The request and run options of the one-request lane benches (this one, bench/pmin.py)."""
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--core-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / out_name))
    ap.add_argument("--batch-graphs", action="store_true",
                    help="run the lanes on a CPU too (the Triton interpreter, TRITON_INTERPRET=1: slow; to try the "
                         "script on a tiny --model)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    add_request_args(ap, "logprobs_cpu.json")
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args(argv)

    eng = engine_of(args)
    eng.batch_graphs = args.batch_graphs
    prompt = heldout_ids(eng, args.prompt_tokens)
    n = args.max_new_tokens
    # the forced drafter's reference: the plain greedy continuation (on the lanes where they run)
    reference = eng.generate(prompt, max_new_tokens=n + 8, ignore_eos=True, use_store=False).samples[0].tokens
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    cases = [("plain greedy", 0, None), ("K=3 forced greedy", 3, None), ("K=3 forced sampled T=0.8 top-p 0.95", 3,
                                                                          sampled)]
    rows = []
    for name, draft, params in cases:
        run(eng, prompt, 8, draft, params, args.top, reference, 1)  # warm-up: graphs captured, kernels compiled
        base = run(eng, prompt, n, draft, params, None, reference, args.repeats)
        row = {"case": name, "draft": draft, "sampled": params is not None, "path": base["path"],
               "tok_s_no_logprobs": base["decode_tok_s"], "acceptance_length": base["acceptance_length"]}
        for lp in (1, args.top):
            r = run(eng, prompt, n, draft, params, lp, reference, args.repeats)
            row[f"tok_s_logprobs_{lp}"] = r["decode_tok_s"]
            row[f"ratio_logprobs_{lp}"] = r["decode_tok_s"] / base["decode_tok_s"]
            row[f"same_tokens_logprobs_{lp}"] = r["tokens"] == base["tokens"]
            row[f"path_logprobs_{lp}"] = r["path"]
        row["met"] = row[f"ratio_logprobs_{args.top}"] >= TARGET and row[f"same_tokens_logprobs_{args.top}"]
        rows.append(row)
        print(f"{name:38s} [{row[f'path_logprobs_{args.top}']}] no logprobs {row['tok_s_no_logprobs']:8.1f} tok/s   "
              f"logprobs=1 {row['tok_s_logprobs_1']:8.1f} (x{row['ratio_logprobs_1']:.3f})   "
              f"logprobs={args.top} {row[f'tok_s_logprobs_{args.top}']:8.1f} (x{row[f'ratio_logprobs_{args.top}']:.3f},"
              f" target >= x{TARGET}: {'met' if row['met'] else 'MISSED'})   same tokens: "
              f"{row['same_tokens_logprobs_1'] and row[f'same_tokens_logprobs_{args.top}']}", flush=True)
    core = None
    if eng.graphs_available():  # the same greedy K=3 request with logprobs on the engine core (the old path)
        eng.graphs_available = lambda: False
        c = run(eng, prompt, args.core_tokens, 3, None, args.top, reference, 1)
        del eng.graphs_available
        lanes = next(r for r in rows if r["case"] == "K=3 forced greedy")
        core = {"path": c["path"], "tokens": args.core_tokens, "decode_tok_s": c["decode_tok_s"],
                "lanes_speedup": lanes[f"tok_s_logprobs_{args.top}"] / c["decode_tok_s"],
                "same_tokens_prefix": c["tokens"] == lanes_tokens_prefix(eng, prompt, args, reference)}
        print(f"engine core, K=3 forced greedy, logprobs={args.top}: {c['decode_tok_s']:.1f} tok/s "
              f"({args.core_tokens} tokens); the lanes x{core['lanes_speedup']:.1f}", flush=True)
    res = {**git_info(), "bench": "logprobs", "model": args.config or args.model or "default", "device": args.device,
           "dtype": args.dtype, "prompt_tokens": len(prompt), "max_new_tokens": n, "top": args.top,
           "repeats": args.repeats, "forced_rates": list(FORCED), "target_ratio": TARGET, "torch": torch.__version__,
           "cases": rows, "engine_core": core}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


def lanes_tokens_prefix(eng, prompt, args, reference) -> list[int]:
    return run(eng, prompt, args.core_tokens, 3, None, None, reference, 1)["tokens"]


if __name__ == "__main__":
    sys.exit(main())
