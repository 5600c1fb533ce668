"""Evaluate the embedded default model on the held-out split of its corpus.

    python bench/default_model_eval.py --out bench/results/default_model_eval.json [--device cpu]

1. Held-out perplexity and teacher-forced MTP acceptance per depth (the replay tool,
   K = 4, so the implied acceptance length for every K' = 1..4 comes from one pass).
2. Real generation from held-out prompts: plain greedy vs --draft 3 side by side in the
   same run (output equality checked), acceptance length and tok/s of both.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyspec.engine import Engine  # noqa: E402
from hyspec.provenance import git_state  # noqa: E402
from hyspec.speculative.replay import replay_acceptance  # noqa: E402
from hyspec.speculative.telemetry import SpecTelemetry  # noqa: E402
from hyspec.train.corpus import load_corpus  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench/results/default_model_eval.json"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--stride", type=int, default=4, help="replay drafts at every stride-th position")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft", type=int, default=3)
    ap.add_argument("--parts", default="replay,generate", help="which parts to run (replay, generate)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="replay each file's first N tokens (default: the model's context, max_position_embeddings, "
                         "as `hyspec replay --max-tokens` cuts a longer file; 0: whole files, past the context)")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    git = git_state()  # the code that runs, recorded before it runs
    if a.device == "cpu":
        torch.set_num_threads(1)

    eng = Engine.load(dtype=a.dtype, device=a.device)
    heldout = load_corpus(ROOT / "data/pystdlib_corpus.jsonl.xz")["heldout"]
    eos = eng.eos_ids[0]

    replay = gen = None
    if "replay" in parts:
        replay = run_replay(eng, heldout, eos, a)
    if "generate" in parts:
        gen = run_generate(eng, heldout, a)
    res = {
        "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "git": git,
        "machine": f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__} "
                   f"threads {torch.get_num_threads()}", "device": a.device, "dtype": a.dtype,
        "replay": replay, "generate": gen,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


def run_replay(eng, heldout, eos, a) -> dict:
    """Replay over every held-out file (each file its own text, EOS-terminated), cut to its
    first max_tokens tokens (the model's context: positions past it are not the model's)."""
    t0 = time.perf_counter()
    cap = eng.model.cfg.max_position_embeddings if a.max_tokens is None else a.max_tokens
    tot_nll = tot_tok = 0.0
    tel_pos = 0
    acc_through = [0] * a.k  # positions whose drafts 1..d+1 all equal the real text
    acc_target = [0] * a.k  # ... all equal the target's own greedy predictions
    per_file = []
    for path, text in heldout:
        whole = eng.encode(text) + [eos]
        ids = whole[:cap] if cap else whole
        r = replay_acceptance(eng.model, ids, k=a.k, stride=a.stride)
        tot_nll += r["nll_sum"]
        tot_tok += r["nll_tokens"]
        tel_pos += r["positions"]
        for d in range(a.k):
            acc_through[d] += r["accepted_at"][d]
            acc_target[d] += r["vs_target"]["accepted_at"][d]
        per_file.append({"path": path, "tokens": len(ids), "file_tokens": len(whole), "ppl": r["perplexity"],
                         "positions": r["positions"]})
    through = [x / tel_pos for x in acc_through]
    through_t = [x / tel_pos for x in acc_target]
    replay = {
        "files": len(heldout), "max_tokens": cap or None,
        "files_cut": sum(f["file_tokens"] > f["tokens"] for f in per_file), "scored_tokens": int(tot_tok), "nll_per_token": tot_nll / tot_tok,
        "perplexity": float(torch.tensor(tot_nll / tot_tok).exp()), "draft_positions": tel_pos,
        "accept_through_depth": through,
        "conditional_rate_at": [through[0]] + [through[d] / through[d - 1] if through[d - 1] else 0.0
                                               for d in range(1, a.k)],
        "acceptance_length_by_k": {str(kk): 1 + sum(through[:kk]) for kk in range(1, a.k + 1)},
        "vs_target_accept_through_depth": through_t,
        "vs_target_acceptance_length_by_k": {str(kk): 1 + sum(through_t[:kk]) for kk in range(1, a.k + 1)},
        "seconds": time.perf_counter() - t0, "per_file": per_file,
    }
    print(f"replay: {tot_tok:.0f} held-out tokens, ppl {replay['perplexity']:.3f}; "
          f"acceptance length by K vs text {replay['acceptance_length_by_k']}, vs target's greedy "
          f"{replay['vs_target_acceptance_length_by_k']}")
    return replay


def run_generate(eng, heldout, a) -> dict:
    """Generation from held-out prompts: plain vs speculative, same run."""
    gens = []
    tel = SpecTelemetry()
    t_plain = t_spec = 0.0
    n_plain = n_spec = 0
    all_equal = True
    for path, text in heldout[: a.prompts]:
        prompt = eng.encode(text)[: a.prompt_tokens]
        p = eng.generate(prompt, max_new_tokens=a.new_tokens, draft=0, ignore_eos=True)
        s = eng.generate(prompt, max_new_tokens=a.new_tokens, draft=a.draft, ignore_eos=True)
        eq = p.tokens == s.tokens
        all_equal &= eq
        tel.merge(SpecTelemetry.from_dict(s.stats["spec"]))
        t_plain += p.stats["decode_s"]
        t_spec += s.stats["decode_s"]
        n_plain += len(p.tokens)
        n_spec += len(s.tokens)
        gens.append({"path": path, "equal": eq, "acceptance_length": s.stats["spec"]["acceptance_length"]})
    gen = {
        "prompts": len(gens), "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens, "k": a.draft,
        "outputs_equal": all_equal, "spec": tel.to_dict(),
        "plain_tok_s": n_plain / t_plain, "spec_tok_s": n_spec / t_spec, "speedup": (n_spec / t_spec) / (n_plain / t_plain),
        "per_prompt": gens,
    }
    print(f"generate: {len(gens)} held-out prompts, outputs equal: {all_equal}; K={a.draft} acceptance length "
          f"{tel.acceptance_length:.3f}; {a.device} plain {gen['plain_tok_s']:.1f} tok/s, "
          f"speculative {gen['spec_tok_s']:.1f} tok/s ({gen['speedup']:.2f}x)")
    return gen


if __name__ == "__main__":
    sys.exit(main())
