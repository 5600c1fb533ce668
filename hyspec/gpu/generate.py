"""Greedy plain and speculative generation on the FastDecoder (the GPU fast path).

Same contract and result type as hyspec.decode.generate_plain /
hyspec.speculative.loop.generate_speculative for greedy decoding; sampled requests stay on the
reference loop.  The host touches the device once per speculative round (one copy of
n, bonus and the drafts), and while far from the end the next round is already queued
before that copy is read, so the GPU does not wait for the host.
"""
from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

from hyspec.config import no_mtp_error
from hyspec.decode import GenerationResult, check_prompt, check_stop, emit
from hyspec.rng import u01_tensor
from hyspec.speculative.drafter import FORCED_STREAM
from hyspec.speculative.loop import SpecOptions
from hyspec.speculative.telemetry import SpecTelemetry

from hyspec.gpu.decoder import FastDecoder

_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def get_decoder(model, max_len: int, k_max: int, *, exact: bool = True, **kw) -> FastDecoder:
    """A FastDecoder for model, reused across calls while it is big enough (graphs and
    packed weights are built once)."""
    per_model = _CACHE.setdefault(model, {})
    key = (exact, tuple(sorted(kw.items())))
    dec = per_model.get(key)
    if dec is None or dec.max_len < max_len or dec.k_max < k_max:
        if dec is not None:  # grow: keep k_max / max_len at least as big as before
            max_len, k_max = max(max_len, dec.max_len), max(k_max, dec.k_max)
            per_model.pop(key)
            del dec
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        dec = FastDecoder(model, max_len, k_max, exact=exact, **kw)
        per_model[key] = dec
    return dec


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _prefill_first(dec: FastDecoder, prompt: list[int], stops, on_tokens):
    """Start the clock, prefill, take the greedy first token and emit it:
    (t0, pre, post, first, out [first], reason: "eos" when first is a stop id else "length")."""
    _sync(dec.dev)
    t0 = time.perf_counter()
    pre, post, logits = dec.prefill(prompt)
    first = int(torch.argmax(logits[0]))
    if on_tokens is not None:
        on_tokens([first])
    return t0, pre, post, first, [first], "eos" if first in stops else "length"


def forced_table(reference: list[int], rates, seed: int, capacity: int, k_max: int, vocab: int) -> torch.Tensor:
    """[capacity, k_max] tokens the forced drafter proposes at (position, depth): exactly
    hyspec.core.round.forced_token, vectorised."""
    K = max(k_max, 1)
    pos = torch.arange(capacity, dtype=torch.long)[:, None]
    depth = torch.arange(K, dtype=torch.long)[None, :]
    ref = torch.tensor(list(reference) + [0] * max(0, capacity - len(reference)), dtype=torch.long)[:capacity]
    rate = torch.tensor([rates[min(d, len(rates) - 1)] for d in range(K)], dtype=torch.float64)[None, :]
    u = u01_tensor(seed, FORCED_STREAM, pos * 64 + depth)
    r = ref[:, None].expand(capacity, K)
    tok = torch.where(u < rate, r, (r + 1) % vocab)
    tok[pos[:, 0] >= len(reference)] = 0
    return tok


@torch.no_grad()
def generate_plain_fast(model, prompt: list[int], *, max_new_tokens: int, stop_ids=(), exact: bool = True,
                        decoder: FastDecoder | None = None, check_every: int = 32,
                        on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Greedy decoding on the fast path: prefill, then one captured decode step per token
    with the next token fed back on the device; the host looks every `check_every`
    steps (only when there are stop ids)."""
    check_prompt(prompt, model.cfg.vocab_size)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    stops = check_stop(stop_ids, model.cfg.vocab_size)
    P = len(prompt)
    dec = decoder or get_decoder(model, P + max_new_tokens + 1, 1, exact=exact)
    if dec.max_len < P + max_new_tokens + 1:
        raise ValueError(f"decoder max_len {dec.max_len} < {P + max_new_tokens + 1} needed")
    if max_new_tokens == 0:
        return GenerationResult([], "length", {"prompt_tokens": P, "generated_tokens": 0})
    t0, _, _, first, out, reason = _prefill_first(dec, prompt, stops, on_tokens)
    steps = 0 if reason == "eos" else max_new_tokens - 1
    dec.start_plain(first)
    dec.decode_step_capture_only()
    t1 = time.perf_counter()  # graph capture is set-up, not decoding
    chunk = check_every if stops or on_tokens is not None else max(steps, 1)
    done = 0
    while done < steps:
        n = min(chunk, steps - done)
        for _ in range(n):
            dec.decode_step()
        new = dec.out_buf[1 + done : 1 + done + n].tolist()  # the one sync
        done += n
        n0 = len(out)
        for tok in new:
            out.append(tok)
            if tok in stops:
                reason = "eos"
                break
        if on_tokens is not None:
            on_tokens(out[n0:])
        if reason == "eos":
            break
    t2 = time.perf_counter()
    return GenerationResult(out, reason, {
        "prompt_tokens": P, "generated_tokens": len(out), "prefill_s": t1 - t0, "decode_s": t2 - t1,
        "decode_tok_s": (len(out) - 1) / (t2 - t1) if len(out) > 1 and t2 > t1 else None,
        "target_forwards": max(len(out) - 1, 0), "path": f"fast-{dec.backend}", "exact": dec.exact,
        "graphs": dec.step_graphs.active,
    })


@torch.no_grad()
def generate_speculative_fast(model, prompt: list[int], *, max_new_tokens: int, opts: SpecOptions, stop_ids=(),
                              reference: list[int] | None = None, exact: bool = True,
                              decoder: FastDecoder | None = None, telemetry: SpecTelemetry | None = None,
                              profile: bool = False, trace: list | None = None,
                              on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Greedy speculative decoding on the fast path (MTP drafter, or the forced-acceptance
    drafter when opts.forced_rates is set). Output equals generate_plain_fast's bitwise
    in exact mode. opts.rollback is ignored (the runner's own commit: the Triton runner
    replays the accepted rows, the torch runner keeps per-row states); p_min > 0 and
    prime_pending=False are not supported here (use the reference loop). trace (a list)
    receives (k, accepted, drafts) per round; profile adds per-phase times (CUDA events on a
    GPU, the wall clock on the CPU)."""
    check_prompt(prompt, model.cfg.vocab_size)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if opts.p_min > 0.0:
        raise ValueError("the fast path drafts a fixed k per round: p_min > 0 needs the reference loop")
    if not opts.prime_pending:
        raise ValueError("the fast path always starts with the prefill's token pending (prime_pending=True)")
    stops = check_stop(stop_ids, model.cfg.vocab_size)
    if not model.has_mtp:
        raise no_mtp_error()
    forced = opts.forced_rates is not None
    if forced and reference is None:
        raise ValueError("the forced-acceptance drafter needs a reference continuation")
    P = len(prompt)
    K = opts.k
    dec = decoder or get_decoder(model, P + max_new_tokens + K + 2, K, exact=exact)
    if dec.k_max < K or dec.max_len < P + max_new_tokens + K + 2:
        raise ValueError(f"decoder (max_len {dec.max_len}, k_max {dec.k_max}) too small for this request")
    tel = telemetry if telemetry is not None else SpecTelemetry()
    dev = dec.dev
    cuda = dev.type == "cuda"
    if forced:
        dec.set_forced(forced_table(list(prompt) + list(reference), list(opts.forced_rates), opts.forced_seed,
                                    dec.capacity, dec.k_max, model.cfg.vocab_size))
    if max_new_tokens == 0:
        return GenerationResult([], "length", {"prompt_tokens": P, "generated_tokens": 0})
    t0, pre, post, pending, out, reason = _prefill_first(dec, prompt, stops, on_tokens)
    dec.start_spec(prompt, pre, post, pending, opts.hidden)
    _sync(dev)
    t_prefill = time.perf_counter() - t0
    # capture what this run needs before the clock starts (no-op when already captured)
    ks = sorted({min(K, r) for r in range(0, K + 1)})
    dec.capture_all(ks=ks, forced=(forced,))
    _sync(dev)
    t1 = time.perf_counter()

    slots = 2
    if cuda:
        result_host = [torch.empty(2 + dec.k_max, dtype=torch.long, pin_memory=True) for _ in range(slots)]
        events = [torch.cuda.Event() for _ in range(slots)]
    phase_ev = []  # (e0, e1, e2, e3) per round when profiling
    mtp_forwards = 0
    k_next = K

    def mark(ev: list) -> None:  # a phase boundary: a CUDA event, or the wall clock (CPU calls are synchronous)
        if cuda:
            ev.append(torch.cuda.Event(enable_timing=True))
            ev[-1].record()
        else:
            ev.append(time.perf_counter())

    def launch(k: int, slot: int) -> None:
        t = k + 1
        ev: list = []
        if profile:
            mark(ev)
        dec.draft(k, forced)
        if profile:
            mark(ev)
        dec.verify(t)
        if profile:
            mark(ev)
        dec.commit(t)
        if profile:
            mark(ev)
            phase_ev.append(ev)
        if cuda:
            result_host[slot].copy_(dec.result, non_blocking=True)
            events[slot].record()

    def read_result(slot: int) -> list[int]:
        if cuda:
            events[slot].synchronize()
            return result_host[slot].tolist()
        return dec.result.tolist()

    inflight = None  # (k, slot)
    slot = 0
    rounds = 0
    while reason != "eos" and len(out) < max_new_tokens:
        if inflight is None:
            remaining = max_new_tokens - len(out)
            k = min(k_next, remaining - 1)
            launch(k, slot)
            inflight = (k, slot)
            slot = (slot + 1) % slots
        k, s = inflight
        nxt = None
        if cuda and not opts.adaptive and (max_new_tokens - len(out)) - (k + 1) >= K + 1:
            launch(K, slot)  # the next round's k is K whatever this round emits
            nxt = (K, slot)
            slot = (slot + 1) % slots
        row = read_result(s)  # (accepted n, bonus, d1..dk)
        rounds += 1
        n, bonus = row[0], row[1]
        drafts = row[2 : 2 + k]
        tel.record_round(k, n)
        if trace is not None:
            trace.append((k, n, list(drafts)))
        if k > 0:
            mtp_forwards += k
        n0 = len(out)
        if emit(out, drafts[:n] + [bonus], stops, max_new_tokens):
            reason = "eos"
        if on_tokens is not None:
            on_tokens(out[n0:])
        if opts.adaptive:
            k_next = max(opts.adaptive_floor, min(n + 1, K))
        inflight = nxt
    _sync(dev)
    t2 = time.perf_counter()
    stats = {
        "prompt_tokens": P, "generated_tokens": len(out[:max_new_tokens]), "prefill_s": t_prefill,
        "decode_s": t2 - t1,
        "decode_tok_s": (len(out) - 1) / (t2 - t1) if len(out) > 1 and t2 > t1 else None,
        "target_forwards": tel.rounds, "mtp_forwards": mtp_forwards, "k": K, "rollback": "checkpoint",
        "spec": tel.to_dict(), "path": f"fast-{dec.backend}", "exact": dec.exact,
        "graphs": dec.step_graphs.active,
    }
    if phase_ev:
        tot = [0.0, 0.0, 0.0]
        for ev in phase_ev:
            for i in range(3):
                tot[i] += ev[i].elapsed_time(ev[i + 1]) if cuda else (ev[i + 1] - ev[i]) * 1e3
        nr = len(phase_ev)
        stats["phases_ms"] = {"draft": tot[0], "verify": tot[1], "commit": tot[2],
                              "per_round": {"draft": tot[0] / nr, "verify": tot[1] / nr, "commit": tot[2] / nr},
                              "rounds_launched": nr}
    return GenerationResult(out[:max_new_tokens], reason, stats)
