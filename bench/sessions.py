"""Sessions benchmark: time to first token of turn N of a conversation, with the kept state
(a live session, and a one-shot request that hits the prefix store) vs a cold re-prefill of
the whole transcript; and how far a store hit's log-probabilities are from the cold ones.

    python bench/sessions.py                                   # default model, CPU
    python bench/sessions.py --model DIR --device cuda --dtype bfloat16 --out bench/results/sessions_h200.json

Each turn sends the next `--user-tokens` tokens of a held-out Python file (the default
model is a code model) and generates `--max-new-tokens` (greedy, `--draft` K). Before the
session's turn N runs, the same prompt (transcript + message) is timed as a one-shot
request twice: cold (use_store=False: prefill everything) and from the store (the
turn-(N-1) boundary state, prefill only [pending] + message). Times are wall clock from the
call to the first token's callback, best of `--repeats`. The log-prob difference is
max |log p_store - log p_cold| over the whole vocabulary, over the first `--lp-tokens`
rows of each turn (while the two greedy continuations agree).
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyspec.engine import Engine  # noqa: E402


def git_info() -> dict:
    from hyspec.provenance import git_state

    st = git_state(ROOT)
    return {"git_commit": st["commit"], "dirty": st["dirty"]}


def heldout_text(min_chars: int) -> str:
    names = set((ROOT / "data" / "heldout_files.txt").read_text().split())
    text = ""
    with lzma.open(ROOT / "data" / "pystdlib_corpus.jsonl.xz", "rt") as f:
        for line in f:
            d = json.loads(line)
            if d["path"] in names:
                text += d["text"]
                if len(text) >= min_chars:
                    break
    return text


def timed(fn, total: bool = False):
    """Wall time from the call to the first streamed token, and the call's result
    (total: also the call's whole wall time, second)."""
    first = []
    t0 = time.perf_counter()

    def cb(*a):
        if not first:
            first.append(time.perf_counter())

    out = fn(cb)
    if total:
        return first[0] - t0, time.perf_counter() - t0, out
    return first[0] - t0, out


def logprob_diff(eng, prompt, k, n) -> tuple[float, bool]:
    V = eng.model.cfg.vocab_size
    hot = eng.generate(prompt, max_new_tokens=n, draft=k, logprobs=V)
    cold = eng.generate(prompt, max_new_tokens=n, draft=k, logprobs=V, use_store=False)
    worst = 0.0
    for (_, a), (_, b), ta, tb in zip(hot.logprobs[0], cold.logprobs[0], hot.tokens, cold.tokens):
        da, db = dict(a), dict(b)
        worst = max(worst, max(abs(da[i] - db[i]) for i in da))
        if ta != tb:
            break
    return worst, hot.tokens == cold.tokens


def add_model_args(ap) -> None:
    """--model / --config / --device / --dtype (also bench/logprobs.py's)."""
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--config", default=None, choices=["qwen3-next-2b-dense", "b2"],
                    help="instead of --model: hyspec bench's in-memory qwen3-next-2b-dense model (old name b2; "
                         "random weights; text is tokenized with the default model's tokenizer, whose ids fit its "
                         "vocabulary)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")


def engine_of(args) -> Engine:
    """The Engine of add_model_args' options."""
    if args.config:
        from hyspec.bench import build_config_model
        from hyspec.loading import parse_dtype
        from hyspec.presets import model_dict

        tok = Engine.load().tokenizer
        return Engine(build_config_model(model_dict(args.config), torch.device(args.device),
                                         parse_dtype(args.dtype, args.device)), tok)
    return Engine.load(args.model, dtype=args.dtype, device=args.device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--draft", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lp-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sessions_cpu.json"))
    ap.add_argument("--core-too", action="store_true",
                    help="where the session turns run on the CUDA-graph lanes (a GPU), also run the same "
                         "conversation through the engine core (Engine.session_graphs = False) and print whole "
                         "turns side by side")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    eng = engine_of(args)
    ids = eng.encode(heldout_text(args.turns * args.user_tokens * 8))
    msgs = [ids[i * args.user_tokens:(i + 1) * args.user_tokens] for i in range(args.turns)]
    k = args.draft
    eng.generate(msgs[0], max_new_tokens=4, draft=k, use_store=False)  # warm up

    s = eng.session(draft=k, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows = []
    for n, m in enumerate(msgs, 1):
        prompt = s.tokens + m
        cold = min(timed(lambda cb: eng.generate(prompt, max_new_tokens=1, draft=k, use_store=False, ignore_eos=True,
                                                 on_tokens=cb))[0] for _ in range(args.repeats))
        store = None
        lp = None
        if n > 1:
            store = min(timed(lambda cb: eng.generate(prompt, max_new_tokens=1, draft=k, ignore_eos=True,
                                                      on_tokens=cb))[0] for _ in range(args.repeats))
            lp = logprob_diff(eng, prompt, k, args.lp_tokens)
        ttft, turn_s, out = timed(lambda cb: s.send(m, on_tokens=cb), total=True)
        sess = [ttft]
        for _ in range(args.repeats - 1):  # the same turn again from the same state (rewind)
            s.rewind()
            sess.append(timed(lambda cb: s.send(m, on_tokens=cb))[0])
        row = {"turn": n, "context_tokens": len(prompt), "new_tokens": len(m),
               "prefilled_tokens": out.stats["prompt_tokens"] - out.stats["cached_tokens"],
               "ttft_session_s": min(sess), "ttft_session_live_slot_s": sess[0],
               "ttft_store_oneshot_s": store, "ttft_cold_s": cold,
               "speedup_session": cold / min(sess),
               "speedup_store": (cold / store) if store else None,
               "max_abs_logprob_diff_store_vs_cold": lp[0] if lp else None,
               "greedy_tokens_equal_store_vs_cold": lp[1] if lp else None,
               "acceptance_length": out.stats["spec"]["acceptance_length"] if k else None,
               "path": out.stats.get("path", "engine-core"), "turn_s": turn_s,
               "turn_tokens": len(out.tokens), "decode_tok_s": out.stats.get("decode_tok_s"),
               "tokens": out.tokens}
        rows.append(row)
        print(f"turn {n:2d}: context {row['context_tokens']:5d}  prefilled {row['prefilled_tokens']:3d}  "
              f"ttft session {row['ttft_session_s'] * 1e3:7.1f} ms  store one-shot "
              f"{(store or float('nan')) * 1e3:7.1f} ms  cold {cold * 1e3:7.1f} ms  "
              f"x{row['speedup_session']:.1f}  lp diff {row['max_abs_logprob_diff_store_vs_cold']}", flush=True)
    core = None
    if args.core_too:  # the same conversation, whole turns, through the engine core
        eng.session_graphs = False
        c = eng.session(draft=k, max_new_tokens=args.max_new_tokens, ignore_eos=True, use_store=False)
        for r, m in zip(rows, msgs):
            _, turn_s, out = timed(lambda cb: c.send(m, on_tokens=cb), total=True)
            r.update({"turn_s_core": turn_s, "decode_tok_s_core": out.stats.get("decode_tok_s"),
                      "tokens_equal_core": out.tokens == r["tokens"], "turn_speedup_vs_core": turn_s / r["turn_s"]})
            print(f"turn {r['turn']:2d}: whole turn ({r['turn_tokens']} tokens) session {r['turn_s'] * 1e3:8.1f} ms "
                  f"[{r['path']}]  engine core {turn_s * 1e3:8.1f} ms  x{r['turn_speedup_vs_core']:.1f}  "
                  f"same tokens: {r['tokens_equal_core']}", flush=True)
        eng.session_graphs = True
        core = {"turn_speedup_vs_core_median": statistics.median(r["turn_speedup_vs_core"] for r in rows),
                "decode_tok_s_session_median": statistics.median(r["decode_tok_s"] or 0.0 for r in rows),
                "decode_tok_s_core_median": statistics.median(r["decode_tok_s_core"] or 0.0 for r in rows),
                "tokens_equal_core": sum(r["tokens_equal_core"] for r in rows)}
    later = [r["ttft_session_s"] for r in rows[1:]]
    summary = {
        "turn10_speedup_session": rows[-1]["speedup_session"], "turn10_speedup_store": rows[-1]["speedup_store"],
        "ttft_session_turns2plus_median_s": statistics.median(later) if later else None,
        "ttft_session_turns2plus_max_over_min": (max(later) / min(later)) if later else None,
        "max_abs_logprob_diff_store_vs_cold": max((r["max_abs_logprob_diff_store_vs_cold"] or 0.0) for r in rows),
        "store": eng.store.stats(),
        "session_path": rows[-1]["path"],
        "turn_s_median": statistics.median(r["turn_s"] for r in rows),
    }
    if core is not None:
        summary["vs_engine_core"] = core
    res = {**git_info(), "bench": "sessions", "model": args.config or args.model or "default", "device": args.device,
           "dtype": args.dtype, "threads": args.threads, "draft": k, "user_tokens": args.user_tokens,
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "torch": torch.__version__,
           "turns": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
