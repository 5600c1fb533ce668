"""One variant's figures, and the exactness check.

A *variant* is a decoder build: ``exact`` (row-invariant kernels: a verify row equals
a decode step bitwise) or ``cublas`` (matmuls through cuBLAS: faster, not row-invariant;
old name ``fast``). On a GPU the decoder is the BatchDecoder with one lane (the decoder
every GPU request runs on); on the CPU the engine core's reference backend (the model's
modules), timed per phase. Words: *plain* = one target forward per token; *forced* drafter
= drafts accepted with fixed per-depth rates (a controlled acceptance), *mtp* = the real
MTP head; *acceptance length* L = tokens emitted per round (accepted drafts + the bonus
token); *ceiling* = the cost model's speed-up L * t_decode / (t_verify(K+1) + K * t_draft),
t_draft = one drafter step (on a GPU the draft graph of K = 1: the fill rows' MTP forward
and the head)."""

from __future__ import annotations

import time

import torch

from hyspec.bench.report import log
from hyspec.bench.timing import time_fn

VARIANTS = {"exact": True, "cublas": False}  # name -> the decoder's exact=
VARIANT_ALIASES = {"fast": "cublas"}  # old names


def variant_names(text: str) -> list[str]:
    """'exact,fast' -> ['exact', 'cublas'] (old names resolved); unknown names are an error."""
    names = [VARIANT_ALIASES.get(v, v) for v in text.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown variant(s) {unknown}; choose from "
                         f"{', '.join([*VARIANTS, *VARIANT_ALIASES])}")
    if len(set(names)) < len(names):  # (the second run's figures replaced the first's)
        raise ValueError(f"--variants: each variant once, got {text!r}")
    return names


def first_mismatch(tokens: list[int], reference: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)


class LaneDecoder:
    """GPU: one sequence at a time on a BatchDecoder with one lane (CUDA graphs)."""

    kind = "BatchDecoder, one lane"

    def __init__(self, model, max_len: int, k_max: int, exact: bool) -> None:
        from hyspec.gpu.batch import BatchDecoder

        self.dec = BatchDecoder(model, max_len, k_max, 1, exact=exact)
        self.runner = self.dec.runner

    def run(self, prompt, n: int, k: int = 0, forced_rates=None, reference=None, params=None):
        from hyspec.gpu.batch_loop import decode_one

        return decode_one(self.dec, prompt, n, k=k, forced_rates=forced_rates, reference=reference, params=params)

    @staticmethod
    def replays(reps: int, warmup: int = 2) -> int:
        """Calls time_fn makes: rounds and decode steps advance the lane that many times."""
        return warmup + 3 * reps

    def step_costs(self, prompt, verify_rows, ks, dev, reps: int) -> dict:
        """Graph replays after a prefill: the decode step, a verify of t rows, the draft
        graph of k drafts (fill + k chained steps), a whole round of K with the MTP drafter,
        ms each. Rounds and decode steps advance the lane: each K starts again from the
        prompt (the decoder's max_len leaves room for replays(reps) rounds of K + 1 rows)."""
        dec = self.dec
        dec.prefill_start(0, prompt, dec.k_max)
        ks_all = sorted({t - 1 for t in verify_rows} | set(ks) | {1})
        dec.capture([1], ks_all, decode=True)
        start = dec.step_graphs.snapshot()  # the lane just after the prompt

        def from_start(fn):
            dec.step_graphs.restore(start)
            return time_fn(fn, dev, reps)

        out = {"verify": {t: from_start(lambda t=t: dec.verify(1, t)) for t in verify_rows},
               "draft_graph": {k: from_start(lambda k=k: dec.draft(1, k)) for k in sorted(set(ks) | {1})},
               "round": {k: from_start(lambda k=k: dec.round(1, k)) for k in ks}}
        out["draft"] = out["draft_graph"][1]
        dec.step_graphs.restore(start)
        dec.k_lane[0].fill_(0)  # plain steps
        out["decode"] = time_fn(lambda: dec.decode(1), dev, reps)
        return out

    def phases(self, costs: dict, K: int, round_ms: float) -> dict:
        """Per-round phase times of a K-draft round of a run: the draft and verify graphs'
        replay times, commit = the run's time per round minus both (the commit graph plus
        whatever the host added); "round_graph": the MTP round's graph replayed alone."""
        d, v = costs["draft_graph"][K], costs["verify"].get(K + 1)
        return {"draft": d, "verify": v, "commit": round_ms - d - (v or 0.0), "round": round_ms,
                "round_graph": costs["round"][K]}


class TimedBackend:
    """The engine core's reference backend with wall-clock totals per phase (CPU bench)."""

    def __init__(self, model) -> None:
        from hyspec.core.backend import ReferenceBackend

        self.inner = ReferenceBackend(model)
        self.draft_s = self.verify_s = 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _timed(self, total: str, fn, *args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            setattr(self, total, getattr(self, total) + time.perf_counter() - t0)

    def mtp(self, items):
        return self._timed("draft_s", self.inner.mtp, items)

    def draft_logits(self, h):
        return self._timed("draft_s", self.inner.draft_logits, h)

    def verify(self, items, **kw):
        return self._timed("verify_s", self.inner.verify, items, **kw)


class ReferenceDecoder:
    """CPU: one sequence at a time through the engine core (reference backend), its
    drafter and verify time totalled per phase; commit = the rest of the decode time."""

    kind = "engine core, reference backend"
    runner = None

    def __init__(self, model) -> None:
        self.model = model
        self.last_phases = None

    def run(self, prompt, n: int, k: int = 0, forced_rates=None, reference=None, params=None):
        from hyspec.core.request import GREEDY, Request
        from hyspec.core.scheduler import Scheduler
        from hyspec.decode import run_request
        from hyspec.speculative.loop import SpecOptions

        backend = TimedBackend(self.model)
        spec = SpecOptions(k=k, forced_rates=forced_rates) if k > 0 else None
        req = Request(prompt_ids=list(prompt), max_new_tokens=n, params=params or GREEDY, draft=k, spec=spec,
                      reference=reference)
        res = run_request(self.model, req, Scheduler(self.model, max_batch=1, backend=backend))
        rounds = res.stats.get("target_forwards") or 1
        dec_s = res.stats.get("decode_s") or 0.0
        draft, verify = backend.draft_s * 1e3 / rounds, backend.verify_s * 1e3 / rounds
        self.last_phases = {"draft": draft, "verify": verify, "commit": max(dec_s * 1e3 / rounds - draft - verify, 0.0)}
        return res

    def step_costs(self, prompt, verify_rows, ks, dev, reps: int) -> dict:
        """The target forward of t rows after the prompt (model modules, exact mode), ms;
        the decode step is t = 1; the draft step comes from the K = 1 runs (phases)."""
        from hyspec.model.ops import StepCtx

        m = self.model
        cache = m.new_cache(len(prompt) + max(verify_rows) + 8)
        m.forward_states(torch.tensor(prompt, device=dev), cache, StepCtx(start=0, chunked=True))
        ids = torch.tensor(prompt[: max(verify_rows)] * max(verify_rows), device=dev)

        def forward(t):  # (the same position every call: the linear states drift, the cost does not)
            cache.pos = len(prompt)
            _, post = m.forward_states(ids[:t], cache, StepCtx(start=len(prompt), exact=True))
            m.logits(post)

        with torch.no_grad():
            verify = {t: time_fn(lambda t=t: forward(t), dev, reps) for t in verify_rows}
        return {"verify": verify, "decode": verify[1], "draft": None}

    def phases(self, costs: dict, K: int, round_ms: float) -> dict:
        return dict(self.last_phases)


def bench_variant(model, prompt, args, exact: bool, dev, roofline_ms: float) -> dict:
    """Plain decode tok/s, per-step costs (decode, verify of t rows, draft) and speculative
    tok/s at each K with the forced and the MTP drafter. The decoder is returned under
    "_decoder" (the exactness check reuses the exact one)."""
    n_new = args.new_tokens
    k_max = max(max(args.ks), args.verify_max - 1, 3)  # 3: the exactness check drafts K=3
    cuda = dev.type == "cuda"
    if cuda:  # room for the longest run and for the timed rounds of the largest K
        room = max(n_new, args.exact_tokens, LaneDecoder.replays(args.reps) * (max(args.ks) + 1))
        decoder = LaneDecoder(model, len(prompt) + room + k_max + 4, k_max, exact)
    else:
        if not exact:
            raise ValueError("the cublas variant needs a GPU (the CPU bench runs the reference backend)")
        decoder = ReferenceDecoder(model)
    out: dict = {"backend": "triton" if cuda else "reference", "decoder": decoder.kind, "graphs": cuda}
    reps = args.reps
    label = "exact" if exact else "cublas"

    decoder.run(prompt, min(n_new, 16))  # compile + capture
    runner = decoder.runner
    moe = getattr(runner, "moe_buf", None) is not None  # the Triton runner counts the experts it reads
    if moe:
        runner.reset_moe_counts()
    plain_run = decoder.run(prompt, n_new)
    plain_counts = runner.moe_experts_read() if moe else {}
    plain = plain_run.tokens
    tok_s = plain_run.stats["decode_tok_s"]
    out["plain"] = {"tok_s": tok_s, "ms_per_token": 1e3 / tok_s, "roofline_frac": roofline_ms / (1e3 / tok_s),
                    "prefill_s": plain_run.stats["prefill_s"],
                    "fla_prefill": bool(getattr(getattr(decoder, "dec", None), "use_fla", False))}
    log(f"[{label}] plain decode {tok_s:.1f} tok/s ({1e3 / tok_s:.3f} ms/token, "
        f"{100 * out['plain']['roofline_frac']:.1f}% of roofline)")

    verify_rows = list(range(1, args.verify_max + 1))
    costs = decoder.step_costs(prompt, verify_rows, args.ks, dev, reps)
    step, verify = costs["decode"], costs["verify"]
    out["decode_step_ms"] = step
    out["decode_step_roofline_frac"] = roofline_ms / step
    out["verify_ms"] = verify
    out["verify_rel"] = {t: verify[t] / verify[1] for t in verify_rows}
    if "draft_graph" in costs:
        out["draft_graph_ms"] = costs["draft_graph"]
        out["round_ms"] = costs["round"]

    out["spec"] = {}
    if moe:
        runner.reset_moe_counts()
    rates = tuple(float(x) for x in args.forced.split(","))
    for drafter in ("forced", "mtp"):
        out["spec"][drafter] = {}
        for K in args.ks:
            forced = rates if drafter == "forced" else None
            decoder.run(prompt, min(n_new, 24), k=K, forced_rates=forced, reference=plain)  # capture
            spec_run = decoder.run(prompt, n_new, k=K, forced_rates=forced, reference=plain)
            telemetry = spec_run.stats["spec"]
            speedup = spec_run.stats["decode_tok_s"] / tok_s
            # the rounds' own time where the decoder keeps it (the GPU lane's runner; its
            # decode_s also holds host time outside the rounds, 0.38 of 0.92 s in the 80B
            # preset's forced run at 7f9b934, which the commit phase used to absorb)
            runner_st = spec_run.stats.get("runner") or {}
            if runner_st.get("rounds_s") and runner_st.get("rounds"):
                round_ms = 1e3 * runner_st["rounds_s"] / runner_st["rounds"]
            else:
                round_ms = 1e3 * spec_run.stats["decode_s"] / max(telemetry["rounds"], 1)
            out["spec"][drafter][K] = {
                "tok_s": spec_run.stats["decode_tok_s"], "speedup": speedup,
                "acceptance_length": telemetry["acceptance_length"], "tau": telemetry["tau"],
                "per_depth_rate": telemetry["per_depth_rate"], "rounds": telemetry["rounds"],
                "phases_ms_per_round": decoder.phases(costs, K, round_ms),
                "tokens_equal_plain": spec_run.tokens == plain, "first_mismatch": first_mismatch(spec_run.tokens, plain)}
    draft = costs["draft"]
    if draft is None:  # CPU: the drafter's time per round of the smallest K's MTP run, per draft
        k0 = min(args.ks)
        draft = out["spec"]["mtp"][k0]["phases_ms_per_round"]["draft"] / k0
    out["draft_step_ms"] = draft
    log(f"  step {step:.3f} ms; verify "
        + " ".join(f"t{t}={verify[t]:.3f}({verify[t] / verify[1]:.2f}x)" for t in verify_rows)
        + f"; draft step {draft:.3f} ms")
    for drafter in ("forced", "mtp"):
        for K in args.ks:
            entry = out["spec"][drafter][K]
            verify_k = verify.get(K + 1)  # a round verifies pending + K drafts
            ceiling = entry["acceptance_length"] * step / (verify_k + K * draft) if verify_k else None
            entry["ceiling"] = ceiling
            entry["ceiling_frac"] = entry["speedup"] / ceiling if ceiling else None
            phases = entry["phases_ms_per_round"] or {}
            where = (f"ceiling x{ceiling:.2f}, {100 * entry['ceiling_frac']:.0f}% of it" if ceiling else
                     f"no ceiling: --verify-max {max(verify_rows)} < K+1 = {K + 1} rows")
            log(f"  {drafter:6s} K={K}: {entry['tok_s']:.1f} tok/s x{entry['speedup']:.2f} "
                f"(L={entry['acceptance_length']:.2f}, {where}) phases/round draft "
                f"{phases.get('draft', 0):.3f} verify {phases.get('verify') or 0:.3f} commit "
                f"{phases.get('commit', 0):.3f} ms; equal plain: {entry['tokens_equal_plain']}")
    if moe:
        out["moe"] = moe_figures(runner, plain_counts, runner.moe_experts_read(), roofline_ms, verify, step)
    out["_decoder"] = decoder
    return out


def moe_figures(runner, plain_counts: dict, spec_counts: dict, roofline_ms: float, verify_ms: dict,
                step_ms: float) -> dict:
    """Routed experts the run read, counted on the device by the grouped MoE path (per MoE
    layer call, by the call's row count t): t = 1 from the plain run, t = K + 1 from the
    speculative runs' verifies. Bytes per step = everything shared + the counted experts
    (hyspec.gpu.runner_triton.weight_bytes_per_step), the roofline at the bench's bandwidth
    (the decode roofline's), next to the uniform-routing expectation and the worst case."""
    from hyspec.presets import expected_distinct_experts

    cfg = runner.cfg
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    per_ms = runner.weight_bytes_per_step() / roofline_ms  # bytes per ms at the measured bandwidth
    counts = dict(spec_counts)
    counts.update({t: c for t, c in plain_counts.items() if t == 1})
    rows = {}
    for t in sorted(counts):
        d = counts[t]["experts_per_layer"]
        nbytes = runner.weight_bytes_per_step(experts=d)
        ms = verify_ms.get(t, step_ms if t == 1 else None)
        rows[t] = {"experts_per_layer": d, "calls": counts[t]["calls"],
                   "expected_uniform": expected_distinct_experts(E, k, t), "worst": min(E, t * k),
                   "bytes_per_step": nbytes, "roofline_ms": nbytes / per_ms,
                   "measured_ms": ms, "roofline_frac": (nbytes / per_ms) / ms if ms else None,
                   "source": "plain decode" if t == 1 else "speculative verifies"}
        r = rows[t]
        log(f"  MoE t={t}: {d:.2f} distinct experts/layer read (counted over {r['calls']} layer calls; "
            f"uniform routing {r['expected_uniform']:.2f}, worst {r['worst']}) -> {nbytes / 1e9:.3f} GB per "
            f"forward, roofline {r['roofline_ms']:.3f} ms"
            + (f"; measured {ms:.3f} ms ({100 * r['roofline_frac']:.0f}% of it)" if ms else ""))
    draft = runner.moe_experts_read(drafter=True)
    return {"experts": E, "top_k": k, "by_rows": rows,
            "one_expert_per_layer_bytes": runner.weight_bytes_per_step(experts=1) - runner.weight_bytes_per_step(experts=0),
            "shared_bytes": runner.weight_bytes_per_step(experts=0),
            "drafter_by_rows": {t: c["experts_per_layer"] for t, c in draft.items()}}


# the sampled half of the exactness check: coupled mode (Gumbel-max with position-keyed
# noise), whose speculative output must equal its plain output token for token
COUPLED = dict(temperature=0.8, top_p=0.95, mode="coupled")


def exactness_check(model, args, dev, decoder) -> dict:
    """Speculative (K=3; forced 0.9/0.8/0.7/0.6 and the real MTP) vs plain, bitwise, on the
    exact variant's decoder: greedy, and (args.exact_coupled) coupled sampling at T=0.8,
    top-p 0.95 with a seed per prompt."""
    from hyspec.sampling import SamplingParams

    vocab_size = model.cfg.vocab_size
    report = {"tokens": args.exact_tokens, "prompts": [], "k": 3, "decoder": decoder.kind}
    if getattr(args, "exact_coupled", False):
        report["coupled"] = dict(COUPLED)
    rates = tuple(float(x) for x in args.forced.split(","))

    def against(prompt, plain, params=None) -> dict:
        row = {}
        for drafter in ("forced", "mtp"):
            spec = decoder.run(prompt, args.exact_tokens, k=3, forced_rates=rates if drafter == "forced" else None,
                               reference=plain.tokens, params=params)
            row[drafter] = {"equal": spec.tokens == plain.tokens,
                            "first_mismatch": first_mismatch(spec.tokens, plain.tokens),
                            "tok_s": spec.stats["decode_tok_s"],
                            "acceptance_length": spec.stats["spec"]["acceptance_length"], "n": len(spec.tokens)}
        return row

    for i in range(args.exact_prompts):
        generator = torch.Generator().manual_seed(1000 + i)
        prompt = torch.randint(0, vocab_size, (args.prompt_len,), generator=generator).tolist()
        plain = decoder.run(prompt, args.exact_tokens)
        row = {"prompt_seed": 1000 + i, "plain_tok_s": plain.stats["decode_tok_s"], **against(prompt, plain)}
        row["distinct_tokens_in_plain"] = len(set(plain.tokens))
        msg = (f"  exactness prompt {i}: forced equal={row['forced']['equal']} "
               f"(L={row['forced']['acceptance_length']:.2f}) mtp equal={row['mtp']['equal']}; "
               f"{row['distinct_tokens_in_plain']} distinct tokens")
        if "coupled" in report:
            params = SamplingParams(seed=2000 + i, **COUPLED)
            plain_c = decoder.run(prompt, args.exact_tokens, params=params)
            row["coupled"] = {"seed": 2000 + i, "plain_tok_s": plain_c.stats["decode_tok_s"],
                              "distinct_tokens_in_plain": len(set(plain_c.tokens)),
                              **against(prompt, plain_c, params)}
            c = row["coupled"]
            msg += (f"; coupled (seed {2000 + i}): forced equal={c['forced']['equal']} "
                    f"(L={c['forced']['acceptance_length']:.2f}) mtp equal={c['mtp']['equal']}")
        report["prompts"].append(row)
        log(msg)
    report["all_equal"] = all(r["forced"]["equal"] and r["mtp"]["equal"] for r in report["prompts"])
    if "coupled" in report:
        report["coupled_all_equal"] = all(r["coupled"]["forced"]["equal"] and r["coupled"]["mtp"]["equal"]
                                          for r in report["prompts"])
    return report
