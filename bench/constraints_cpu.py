"""Constrained vs unconstrained decoding speed on the CPU (default model, JSON schema).

    python3 bench/constraints_cpu.py [--out bench/results/constraints_cpu.json] [--reps 3]

For K = 0 (plain) and K = 3 (speculative), greedy and sampled (T = 1), runs the same
prompts with and without a JSON-schema constraint and reports decode tok/s (generated
tokens / decode seconds, prefill excluded, summed over prompts; median and best of --reps,
the eight arms interleaved within each rep), the acceptance length, and the share of
decode time spent in the constraint (allowed() + commit(): llguidance mask computation,
bit unpacking, consume/rollback). Unconstrained runs ignore EOS so they decode the full
token budget; constrained runs stop at the end of the JSON (or the budget).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hyspec import constraints as C  # noqa: E402
from hyspec.provenance import git_state  # noqa: E402
from hyspec.engine import Engine  # noqa: E402
from hyspec.sampling import SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "module": {"type": "string", "maxLength": 24},
        "functions": {"type": "array", "minItems": 2, "maxItems": 6, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24},
                           "args": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                           "returns": {"enum": ["int", "str", "list", "dict", "None", "bool"]}},
            "required": ["name", "args", "returns"], "additionalProperties": False}},
        "lines": {"type": "integer", "minimum": 0},
    },
    "required": ["module", "functions", "lines"],
    "additionalProperties": False,
}
PROMPTS = ["# module summary as JSON\nsummary = ", "def describe(mod):\n    return ", "config = ",
           "import json\n\ndata = json.loads('"]
MAX_NEW = 128


class Timer:
    """Wraps Constraint.allowed / commit to time them."""

    def __init__(self) -> None:
        self.s = 0.0
        self.calls = 0
        self._orig = (C.Constraint.allowed, C.Constraint.commit)

    def __enter__(self):
        timer = self
        allowed, commit = self._orig

        def t_allowed(c, prefix=()):
            t0 = time.perf_counter()
            try:
                return allowed(c, prefix)
            finally:
                timer.s += time.perf_counter() - t0
                timer.calls += 1

        def t_commit(c, tokens):
            t0 = time.perf_counter()
            try:
                return commit(c, tokens)
            finally:
                timer.s += time.perf_counter() - t0

        C.Constraint.allowed, C.Constraint.commit = t_allowed, t_commit
        return self

    def __exit__(self, *exc):
        C.Constraint.allowed, C.Constraint.commit = self._orig


def run_once(eng: Engine, draft: int, params: SamplingParams, c) -> dict:
    """All prompts once: generated tokens, decode seconds, constraint seconds, rounds, accepted, complete JSON."""
    r = {"tokens": 0, "decode_s": 0.0, "constraint_s": 0.0, "rounds": 0, "accepted": 0, "json": 0}
    for i, prompt in enumerate(PROMPTS):
        p = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
        with Timer() as tm:
            out = eng.generate(prompt, max_new_tokens=MAX_NEW, params=p, draft=draft, constraint=c,
                               ignore_eos=c is None)
        st = out.stats
        r["tokens"] += st["generated_tokens"]
        r["decode_s"] += st["decode_s"]
        r["constraint_s"] += tm.s
        if draft:
            r["rounds"] += st["spec"]["rounds"]
            r["accepted"] += st["spec"]["accepted"]
        if c is not None and out.samples[0].stop_reason == "eos":
            try:
                json.loads(eng.decode(out.tokens[:-1]))
                r["json"] += 1
            except ValueError:
                pass
    return r


def summarize(draft: int, params: SamplingParams, constrained: bool, runs: list[dict]) -> dict:
    rates = [r["tokens"] / r["decode_s"] for r in runs]
    res = {"draft": draft, "temperature": params.temperature, "constrained": constrained,
           "tokens_per_rep": runs[0]["tokens"], "decode_tok_s": statistics.median(rates),
           "decode_tok_s_best": max(rates), "decode_tok_s_all": rates}
    if draft:
        res["acceptance_length"] = 1 + runs[0]["accepted"] / runs[0]["rounds"]
    if constrained:
        res["constraint_time_share"] = statistics.median(r["constraint_s"] / r["decode_s"] for r in runs)
        res["complete_json_outputs"] = f"{runs[0]['json']}/{len(PROMPTS)}"
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench/results/constraints_cpu.json"))
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    meta = git_state()  # the code that runs: recorded before it runs
    torch.set_num_threads(1)
    eng = Engine.load()
    import llguidance

    t0 = time.time()
    eng.generate(PROMPTS[0], max_new_tokens=8, draft=3, constraint=eng.constraint("json_schema", SCHEMA))  # warm-up
    arms = [(params, draft, constrained) for params in (SamplingParams(temperature=0.0),
                                                         SamplingParams(temperature=1.0, seed=1))
            for draft in (0, 3) for constrained in (False, True)]
    runs: dict[int, list[dict]] = {i: [] for i in range(len(arms))}
    c = eng.constraint("json_schema", SCHEMA)
    for rep in range(args.reps):  # arms interleaved, so machine-load drift hits all of them alike
        for i, (params, draft, constrained) in enumerate(arms):
            runs[i].append(run_once(eng, draft, params, c if constrained else None))
        print(f"rep {rep + 1}/{args.reps} done", flush=True)
    rows = []
    for i, (params, draft, constrained) in enumerate(arms):
        r = summarize(draft, params, constrained, runs[i])
        rows.append(r)
        extra = (f" accept_len {r['acceptance_length']:.2f}" if draft else "") + \
                (f" constraint share {r['constraint_time_share']:.1%} complete JSON {r['complete_json_outputs']}"
                 if constrained else "")
        print(f"T={params.temperature} K={draft} {'constrained  ' if constrained else 'unconstrained'} "
              f"{r['decode_tok_s']:7.1f} tok/s median, {r['decode_tok_s_best']:7.1f} best "
              f"({r['tokens_per_rep']} tokens/rep){extra}", flush=True)
    result = {
        "meta": {**meta, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                 "command": "python3 bench/constraints_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
                 "llguidance": llguidance.__version__, "python": platform.python_version(),
                 "model": "hyspec/default_model (float32)", "prompts": PROMPTS, "max_new_tokens": MAX_NEW,
                 "reps": args.reps, "schema": SCHEMA},
        "rows": rows,
        "wall_s": time.time() - t0,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
