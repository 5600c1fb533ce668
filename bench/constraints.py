"""Constrained vs unconstrained decoding speed (default model, JSON schema): the engine
core on the CPU, the CUDA-graph path (BatchDecoder, masks applied on the device) on a GPU.

    python3 bench/constraints.py [--path core|graphs] [--reps 3] [--out FILE]

--path core (the default on a CPU; results bench/results/constraints_cpu.json): for K = 0
(plain) and K = 3 (speculative), greedy and sampled (T = 1), runs the same prompts with
and without a JSON-schema constraint through the engine core and reports decode tok/s
(generated tokens / decode seconds, prefill excluded, summed over prompts; median and best
of --reps, the eight arms interleaved within each rep), the acceptance length, and the
share of decode time spent in the constraint (allowed() + commit(): llguidance mask
computation, bit unpacking, consume/rollback). Unconstrained runs ignore EOS so they
decode the full token budget; constrained runs stop at the end of the JSON (or the budget).

--path graphs (the default on CUDA; results bench/results/constraints_h200.json): the same
schema and prompts on the BatchDecoder's rounds (hyspec.gpu.batch_loop.run_batch), greedy,
K = 0 and K = 3, constrained and not, at batch sizes --batch (B = 1: the prompts one after
another), for the default model (its MTP drafter) and for qwen3-next-2b-dense ("b2",
random weights, constrained with the default model's tokenizer) with the forced-acceptance
drafter at the b2 profile (--forced; each speculative run proposes from the plain run's own
output, constrained or not). Round tok/s (prefill excluded), median of --reps after one
untimed warm-up rep (graph captures); speculative == plain is checked on every run. The
issue-13 targets, on b2 at B = 1: the constraint costs <= 15 % of speculative throughput
(1 - constrained K=3 / unconstrained K=3) and speculation keeps >= 1.7x over constrained
plain decoding (constrained K=3 / constrained K=0). On a CPU, --path graphs is a small
smoke run through the Triton interpreter: a tiny random model in b2's place, one prompt,
8 tokens, one rep (the default model there takes ~8 s per round).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the graph path on a CPU runs Triton's interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


def core_main(args, argv) -> int:
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
                 "command": "python3 bench/constraints.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
                 "llguidance": llguidance.__version__, "python": platform.python_version(),
                 "model": "hyspec/default_model (float32)", "prompts": PROMPTS, "max_new_tokens": MAX_NEW,
                 "reps": args.reps, "schema": SCHEMA},
        "rows": rows,
        "wall_s": time.time() - t0,
    }
    out = args.out or str(REPO / "bench/results/constraints_cpu.json")
    Path(out).write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


# ---------------------------------------------------------------------------------------
# --path graphs: the BatchDecoder
# ---------------------------------------------------------------------------------------
B2_FORCED = (0.9, 0.8, 0.7)  # the b2 bench's forced profile (hyspec bench --forced 0.9,0.8,0.7,0.6) at K = 3
# issue 13, on b2 at B = 1: (name, value key, bound, "max" | "min")
TARGETS = [("constraint_cost_K3", 0.15, "max"), ("spec_vs_constrained_plain", 1.7, "min")]


def _graph_run(dec, prompts, B, k, c, refs, forced, max_new, eos):
    from hyspec.gpu.batch_loop import LaneRequest, run_batch

    reqs = [LaneRequest(prompt=p, max_new_tokens=max_new, k=k, stop_ids=frozenset(eos) if c is not None else frozenset(),
                        reference=None if refs is None else refs[i], constraint=None if c is None else c.clone())
            for i, p in enumerate(prompts)]
    st = run_batch(dec, reqs, max_batch=B, forced_rates=forced if (k > 0 and forced) else None)
    return reqs, st


def graph_model(name, model, c, prompts, *, batches, k, forced, max_new, reps, warmup, eos, decode_text, log) -> dict:
    """The four arms (K 0 / k x constrained or not) on one model at each batch size."""
    from hyspec.gpu.batch import BatchDecoder

    slots = max(batches)
    max_len = max(len(p) for p in prompts) + max_new + k + 8
    t0 = time.perf_counter()
    dec = BatchDecoder(model, max_len, k, slots)
    setup_s = time.perf_counter() - t0
    arms = [("plain", 0, False), ("plain", 0, True), ("spec", k, False), ("spec", k, True)]
    out = {"model": name, "slots": slots, "max_len": max_len, "k": k, "forced": list(forced) if forced else None,
           "graphs": dec.step_graphs.active, "setup_s": setup_s, "batches": {}}
    for B in batches:
        runs = {i: [] for i in range(len(arms))}
        last = {}
        for rep in range(warmup + reps):  # the arms interleaved; the warm-up reps capture the graphs
            plain_out = {}
            for i, (kind, kk, constrained) in enumerate(arms):
                cc = c if constrained else None
                refs = plain_out.get(constrained) if (kk > 0 and forced) else None
                reqs, st = _graph_run(dec, prompts, B, kk, cc, refs, forced, max_new, eos)
                if kk == 0:
                    plain_out[constrained] = [r.tokens for r in reqs]
                if rep >= warmup:
                    runs[i].append(st)
                last[i] = reqs
        row = {}
        for i, (kind, kk, constrained) in enumerate(arms):
            key = f"{'constrained' if constrained else 'unconstrained'}_K{kk}"
            rates = [st["round_tok_s"] for st in runs[i]]
            reqs = last[i]
            r = {"tok_s": statistics.median(rates), "tok_s_all": rates, "tokens": sum(len(q.tokens) for q in reqs),
                 "constraint_share": statistics.median(st["constraint_s"] / st["rounds_s"] for st in runs[i])
                 if constrained else None}
            if kk > 0:
                rounds = sum(q.telemetry.rounds for q in reqs)
                r["acceptance_length"] = 1 + sum(q.telemetry.accepted for q in reqs) / max(1, rounds)
                plain = last[arms.index(("plain", 0, constrained))]
                r["equals_plain"] = all(a.tokens == b.tokens for a, b in zip(reqs, plain))
            if constrained:
                done = [q for q in reqs if q.reason == "eos"]
                ok = 0
                for q in done:
                    try:
                        json.loads(decode_text(q.tokens[:-1]))
                        ok += 1
                    except ValueError:
                        pass
                r["complete_json_outputs"] = f"{ok}/{len(reqs)}"
            row[key] = r
            extra = (f" accept_len {r['acceptance_length']:.2f} spec==plain {r['equals_plain']}" if kk else "") + \
                    (f" constraint share {r['constraint_share']:.1%} JSON {r['complete_json_outputs']}"
                     if constrained else "")
            log(f"{name} B={B} K={kk} {'constrained  ' if constrained else 'unconstrained'} {r['tok_s']:9.1f} tok/s "
                f"({r['tokens']} tokens){extra}")
        row["constraint_cost_K3"] = 1 - row[f"constrained_K{k}"]["tok_s"] / row[f"unconstrained_K{k}"]["tok_s"]
        row["constraint_cost_K0"] = 1 - row["constrained_K0"]["tok_s"] / row["unconstrained_K0"]["tok_s"]
        row["spec_vs_constrained_plain"] = row[f"constrained_K{k}"]["tok_s"] / row["constrained_K0"]["tok_s"]
        row["spec_vs_plain_unconstrained"] = row[f"unconstrained_K{k}"]["tok_s"] / row["unconstrained_K0"]["tok_s"]
        log(f"{name} B={B}: constraint cost K={k} {row['constraint_cost_K3']:.1%}, K=0 {row['constraint_cost_K0']:.1%}; "
            f"speculation x{row['spec_vs_constrained_plain']:.2f} constrained, x{row['spec_vs_plain_unconstrained']:.2f} "
            f"unconstrained")
        out["batches"][B] = row
    return out


def targets(row: dict) -> dict:
    """{name: {value, target, met}} (the shape bench/tables.py renders)."""
    res = {}
    for name, bound, kind in TARGETS:
        v = row[name]
        res[name] = {"value": round(v, 4), "target": bound, "met": v <= bound if kind == "max" else v >= bound}
    return res


def graphs_main(args, argv) -> int:
    from hyspec.bench.models import B2, build_config_model
    from hyspec.engine import DEFAULT_MODEL_DIR
    from hyspec.tokenizer import Tokenizer

    meta = git_state()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    import llguidance

    tok = Tokenizer(DEFAULT_MODEL_DIR)
    tok_json = DEFAULT_MODEL_DIR / "tokenizer.json"
    k = 3
    forced = tuple(float(x) for x in args.forced.split(","))[:k]
    if cuda:
        prompts = [tok.encode(p) for p in PROMPTS]
        batches = [int(b) for b in args.batch.split(",")]
        max_new, reps, warmup = args.max_new, args.reps, 1
        eng = Engine.load(dtype=args.dtype, device="cuda")
        models = [("default", eng.model, C.Constraint.json_schema(eng, SCHEMA), None),
                  ("b2", lambda: build_config_model(B2, dev, getattr(torch, args.dtype)), None, forced)]
    else:  # a smoke run through the interpreter: a tiny random model with the default tokenizer's vocabulary
        from hyspec.tiny import tiny_config

        prompts = [tok.encode(PROMPTS[2])]
        batches, max_new, reps, warmup = [1], 8, 1, 0
        tiny = tiny_config("qwen3_next", vocab_size=4096, hidden=32, layers=4)
        models = [("tiny (in b2's place)", lambda: build_config_model(tiny, dev, torch.float32), None, forced)]
    t0 = time.time()
    results = []
    for name, model, c, fr in models:
        if not isinstance(model, torch.nn.Module):  # a builder (a module is callable too)
            model = model()
        if c is None:  # the default model's tokenizer over this model's (padded) vocabulary; EOS = its EOS id 0
            c = C.Constraint.json_schema(tok_json, SCHEMA, vocab_size=model.cfg.vocab_size, eos_ids=(0,))
        eos = tuple(c.eos_ids)
        results.append(graph_model(name, model, c, prompts, batches=batches, k=k, forced=fr, max_new=max_new,
                                   reps=reps, warmup=warmup, eos=eos, decode_text=tok.decode, log=print))
        del model
        if cuda:
            torch.cuda.empty_cache()
    b2 = results[-1]["batches"][min(batches)]
    tg = targets(b2)
    print(f"targets ({results[-1]['model']}, B={min(batches)}, forced {list(forced)}):")
    for name, bound, kind in TARGETS:
        t = tg[name]
        print(f"  {name}: {t['value']} ({'<=' if kind == 'max' else '>='} {bound}) {'met' if t['met'] else 'MISSED'}")
    result = {
        "meta": {**meta, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                 "command": "python3 bench/constraints.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter: a smoke run)",
                 "torch": torch.__version__, "llguidance": llguidance.__version__,
                 "python": platform.python_version(), "dtype": args.dtype if cuda else "float32",
                 "prompts": PROMPTS if cuda else PROMPTS[2:3], "max_new_tokens": max_new, "reps": reps,
                 "warmup_reps": warmup, "schema": SCHEMA, "path": "batch-graphs"},
        "models": results,
        "targets": tg,
        "wall_s": time.time() - t0,
    }
    out = args.out or str(REPO / ("bench/results/constraints_h200.json" if cuda else "/tmp/constraints_graphs_cpu.json"))
    Path(out).write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", choices=("core", "graphs"), default=None,
                    help="core: the engine core (the CPU default); graphs: the BatchDecoder (the CUDA default)")
    ap.add_argument("--out", default=None, help="results JSON (default: bench/results/constraints_cpu.json for "
                                                "core, constraints_h200.json for graphs on CUDA)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", default="1,4", help="graphs: batch sizes (the prompts run max B at a time)")
    ap.add_argument("--max-new", type=int, default=MAX_NEW, help="graphs: new tokens per prompt")
    ap.add_argument("--forced", default=",".join(map(str, B2_FORCED)), help="graphs: b2's forced profile by depth")
    ap.add_argument("--dtype", default="bfloat16", help="graphs on CUDA: the models' dtype")
    args = ap.parse_args(argv)
    path = args.path or ("graphs" if torch.cuda.is_available() else "core")
    return graphs_main(args, argv) if path == "graphs" else core_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
