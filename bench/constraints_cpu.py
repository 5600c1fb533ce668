"""Constrained vs unconstrained decoding speed on the CPU (default model, JSON schema).

    python3 bench/constraints_cpu.py [--out bench/results/constraints_cpu.json] [--reps 3]

For K = 0 (plain) and K = 3 (speculative), greedy and sampled (T = 1), runs the same
prompts with and without a JSON-schema constraint and reports decode tok/s (generated
tokens / decode seconds, prefill excluded, summed over prompts; median of --reps), the
acceptance length, and the share of decode time spent in the constraint (allowed() +
commit(): llguidance mask computation, bit unpacking, consume/rollback).
Unconstrained runs ignore EOS so they decode the same token budget as long outputs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hyspec import constraints as C  # noqa: E402
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


def git_meta() -> dict:
    def run(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}


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


def run_arm(eng: Engine, draft: int, params: SamplingParams, constrained: bool, reps: int) -> dict:
    c = eng.constraint("json_schema", SCHEMA) if constrained else None
    rates, tokens, acc, share, valid = [], 0, [], [], 0
    for _ in range(reps):
        n_tok, dec, c_s, rounds, accepted = 0, 0.0, 0.0, 0, 0
        for i, prompt in enumerate(PROMPTS):
            p = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
            with Timer() as tm:
                out = eng.generate(prompt, max_new_tokens=MAX_NEW, params=p, draft=draft, constraint=c,
                                   ignore_eos=not constrained)
            st = out.stats
            n_tok += st["generated_tokens"]
            dec += st["decode_s"]
            c_s += tm.s
            if draft:
                rounds += st["spec"]["rounds"]
                accepted += st["spec"]["accepted"]
            if constrained and out.samples[0].stop_reason == "eos":
                try:
                    json.loads(eng.decode(out.tokens[:-1]))
                    valid += 1
                except ValueError:
                    pass
        rates.append(n_tok / dec)
        tokens = n_tok
        share.append(c_s / dec)
        if draft:
            acc.append(1 + accepted / rounds)
    res = {"draft": draft, "temperature": params.temperature, "constrained": constrained,
           "tokens_per_rep": tokens, "decode_tok_s": statistics.median(rates), "decode_tok_s_all": rates}
    if draft:
        res["acceptance_length"] = statistics.median(acc)
    if constrained:
        res["constraint_time_share"] = statistics.median(share)
        res["complete_json_outputs"] = f"{valid}/{len(PROMPTS) * reps}"
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench/results/constraints_cpu.json"))
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    meta = git_meta()  # the code that runs: recorded before it runs
    torch.set_num_threads(1)
    eng = Engine.load()
    import llguidance

    t0 = time.time()
    eng.generate(PROMPTS[0], max_new_tokens=8, draft=3, constraint=eng.constraint("json_schema", SCHEMA))  # warm-up
    rows = []
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)):
        for draft in (0, 3):
            for constrained in (False, True):
                r = run_arm(eng, draft, params, constrained, args.reps)
                rows.append(r)
                extra = (f" accept_len {r['acceptance_length']:.2f}" if draft else "") + \
                        (f" constraint share {r['constraint_time_share']:.1%} json {r['complete_json_outputs']}"
                         if constrained else "")
                print(f"T={params.temperature} K={draft} {'constrained  ' if constrained else 'unconstrained'} "
                      f"{r['decode_tok_s']:7.1f} tok/s ({r['tokens_per_rep']} tokens/rep){extra}", flush=True)
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
