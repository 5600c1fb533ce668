"""One variant's figures, and the exactness check.

A *variant* is a FastDecoder build: ``exact`` (row-invariant kernels: a verify row equals
a decode step bitwise) or ``cublas`` (matmuls through cuBLAS: faster, not row-invariant;
old name ``fast``). Words: *plain* = one target forward per token; *forced* drafter = drafts
accepted with fixed per-depth rates (a controlled acceptance), *mtp* = the real MTP head;
*acceptance length* L = tokens emitted per round (accepted drafts + the bonus token);
*ceiling* = the cost model's speed-up L * t_decode / (t_verify(K+1) + K * t_draft)."""

from __future__ import annotations

import torch

from hyspec.bench.report import log
from hyspec.bench.timing import time_fn

VARIANTS = {"exact": True, "cublas": False}  # name -> FastDecoder(exact=...)
VARIANT_ALIASES = {"fast": "cublas"}  # old names


def variant_names(text: str) -> list[str]:
    """'exact,fast' -> ['exact', 'cublas'] (old names resolved); unknown names are an error."""
    names = [VARIANT_ALIASES.get(v, v) for v in text.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown variant(s) {unknown}; choose from "
                         f"{', '.join([*VARIANTS, *VARIANT_ALIASES])}")
    return names


def first_mismatch(tokens: list[int], reference: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)


def bench_variant(model, prompt, args, exact: bool, dev, roofline_ms: float) -> dict:
    """Plain decode tok/s, per-step costs (decode, verify of t rows, draft) and speculative
    tok/s at each K with the forced and the MTP drafter. The decoder is returned under
    "_decoder" (the exactness check reuses the exact one)."""
    from hyspec.gpu import FastDecoder, generate_plain_fast, generate_speculative_fast
    from hyspec.speculative.loop import SpecOptions

    n_new = args.new_tokens
    k_max = max(max(args.ks), args.verify_max - 1, 3)  # 3: the exactness check drafts K=3
    decoder = FastDecoder(model, len(prompt) + max(n_new, args.exact_tokens) + k_max + 4, k_max, exact=exact)
    out: dict = {"backend": decoder.backend, "graphs": decoder.graphs}
    reps = args.reps
    label = "exact" if exact else "cublas"

    generate_plain_fast(model, prompt, max_new_tokens=min(n_new, 16), decoder=decoder)  # compile + capture
    runner = decoder.runner
    moe = getattr(runner, "moe_buf", None) is not None  # the Triton runner counts the experts it reads
    if moe:
        runner.reset_moe_counts()
    plain_run = generate_plain_fast(model, prompt, max_new_tokens=n_new, decoder=decoder)
    plain_counts = runner.moe_experts_read() if moe else {}
    plain = plain_run.tokens
    tok_s = plain_run.stats["decode_tok_s"]
    out["plain"] = {"tok_s": tok_s, "ms_per_token": 1e3 / tok_s, "roofline_frac": roofline_ms / (1e3 / tok_s),
                    "prefill_s": plain_run.stats["prefill_s"], "fla_prefill": decoder.fla_used}
    log(f"[{label}] plain decode {tok_s:.1f} tok/s ({1e3 / tok_s:.3f} ms/token, "
        f"{100 * out['plain']['roofline_frac']:.1f}% of roofline)")

    # per-step costs (graph replays; state after a prefill so every position is valid)
    hidden_pre, hidden_post, logits = decoder.prefill(prompt)
    decoder.start_spec(prompt, hidden_pre, hidden_post, int(torch.argmax(logits[0])))
    verify_rows = list(range(1, args.verify_max + 1))
    decoder.capture_all(verify_ts=verify_rows, decode=True, draft_step=True)
    verify = {t: time_fn(lambda t=t: decoder.verify(t), dev, reps) for t in verify_rows}
    draft = time_fn(decoder.draft_step, dev, reps)
    decoder.start_plain(plain[0])
    step = time_fn(decoder.decode_step, dev, reps)
    out["decode_step_ms"] = step
    out["decode_step_roofline_frac"] = roofline_ms / step
    out["verify_ms"] = verify
    out["verify_rel"] = {t: verify[t] / verify[1] for t in verify_rows}
    out["draft_step_ms"] = draft
    log(f"  step {step:.3f} ms; verify "
        + " ".join(f"t{t}={verify[t]:.3f}({verify[t] / verify[1]:.2f}x)" for t in verify_rows)
        + f"; draft step {draft:.3f} ms")

    out["spec"] = {}
    if moe:
        runner.reset_moe_counts()
    rates = tuple(float(x) for x in args.forced.split(","))
    for drafter in ("forced", "mtp"):
        out["spec"][drafter] = {}
        for K in args.ks:
            opts = SpecOptions(k=K, forced_rates=rates if drafter == "forced" else None)
            generate_speculative_fast(model, prompt, max_new_tokens=min(n_new, 24), opts=opts, reference=plain,
                                      decoder=decoder)  # capture
            spec_run = generate_speculative_fast(model, prompt, max_new_tokens=n_new, opts=opts, reference=plain,
                                                 decoder=decoder)
            profiled = generate_speculative_fast(model, prompt, max_new_tokens=n_new, opts=opts, reference=plain,
                                                 decoder=decoder, profile=True)
            telemetry = spec_run.stats["spec"]
            accept_len = telemetry["acceptance_length"]
            verify_k = verify.get(K + 1)  # a round verifies pending + K drafts
            ceiling = accept_len * step / (verify_k + K * draft) if verify_k else None
            speedup = spec_run.stats["decode_tok_s"] / tok_s
            entry = {"tok_s": spec_run.stats["decode_tok_s"], "speedup": speedup, "acceptance_length": accept_len,
                     "tau": telemetry["tau"], "per_depth_rate": telemetry["per_depth_rate"],
                     "rounds": telemetry["rounds"], "ceiling": ceiling,
                     "ceiling_frac": speedup / ceiling if ceiling else None,
                     "phases_ms_per_round": profiled.stats.get("phases_ms", {}).get("per_round"),
                     "tokens_equal_plain": spec_run.tokens == plain,
                     "first_mismatch": first_mismatch(spec_run.tokens, plain)}
            out["spec"][drafter][K] = entry
            phases = entry["phases_ms_per_round"] or {}
            log(f"  {drafter:6s} K={K}: {entry['tok_s']:.1f} tok/s x{speedup:.2f} (L={accept_len:.2f}, ceiling "
                f"x{ceiling or 0:.2f}, {100 * (entry['ceiling_frac'] or 0):.0f}% of it) phases/round draft "
                f"{phases.get('draft', 0):.3f} verify {phases.get('verify', 0):.3f} commit "
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


def exactness_check(model, args, dev, decoder) -> dict:
    """Greedy speculative (K=3; forced 0.9/0.8/0.7/0.6 and the real MTP) vs plain, bitwise."""
    from hyspec.gpu import generate_plain_fast, generate_speculative_fast
    from hyspec.speculative.loop import SpecOptions

    vocab_size = model.cfg.vocab_size
    report = {"tokens": args.exact_tokens, "prompts": [], "k": 3}
    rates = tuple(float(x) for x in args.forced.split(","))
    for i in range(args.exact_prompts):
        generator = torch.Generator().manual_seed(1000 + i)
        prompt = torch.randint(0, vocab_size, (args.prompt_len,), generator=generator).tolist()
        plain = generate_plain_fast(model, prompt, max_new_tokens=args.exact_tokens, decoder=decoder)
        row = {"prompt_seed": 1000 + i, "plain_tok_s": plain.stats["decode_tok_s"]}
        for drafter in ("forced", "mtp"):
            opts = SpecOptions(k=3, forced_rates=rates if drafter == "forced" else None)
            spec = generate_speculative_fast(model, prompt, max_new_tokens=args.exact_tokens, opts=opts,
                                             reference=plain.tokens, decoder=decoder)
            row[drafter] = {"equal": spec.tokens == plain.tokens,
                            "first_mismatch": first_mismatch(spec.tokens, plain.tokens),
                            "tok_s": spec.stats["decode_tok_s"],
                            "acceptance_length": spec.stats["spec"]["acceptance_length"], "n": len(spec.tokens)}
        row["distinct_tokens_in_plain"] = len(set(plain.tokens))
        report["prompts"].append(row)
        log(f"  exactness prompt {i}: forced equal={row['forced']['equal']} "
            f"(L={row['forced']['acceptance_length']:.2f}) mtp equal={row['mtp']['equal']}; "
            f"{row['distinct_tokens_in_plain']} distinct tokens")
    report["all_equal"] = all(r["forced"]["equal"] and r["mtp"]["equal"] for r in report["prompts"])
    return report
