"""Plain (non-speculative) decoding and the token-choice rule shared with the speculative loop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx
from hyspec.sampling import SamplingParams, greedy_token, plain_token, row_probs

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (prompt excluded)
    stop_reason: str  # "eos" | "length" | "constraint" (the constraint allowed no token)
    stats: dict = field(default_factory=dict)


def target_probs(logits: torch.Tensor, history: list[int], params: SamplingParams) -> torch.Tensor:
    """The distribution plain sampling draws from at a row: penalties over `history`
    (all tokens before the position), then temperature / top-k / top-p / min-p."""
    return row_probs(logits, history, params)


def choose_token(logits: torch.Tensor, history: list[int], params: SamplingParams, position: int) -> int:
    """The token plain decoding emits at absolute `position` given the row's logits [V]."""
    if params.greedy:
        if params.has_penalties:
            from hyspec.sampling import apply_penalties

            return greedy_token(apply_penalties(logits, history, params))
        return greedy_token(logits)
    return plain_token(target_probs(logits, history, params), params, position)


def constrained(logits: torch.Tensor, constraint, prefix=()) -> torch.Tensor | None:
    """`logits` [V] with the tokens `constraint` disallows after its committed tokens +
    `prefix` set to -inf; None when it allows none. No constraint: the logits unchanged."""
    if constraint is None:
        return logits
    allow = constraint.allowed(prefix)
    if not bool(allow.any()):
        return None
    return logits.masked_fill(~allow.to(logits.device), float("-inf"))


def emit(out: list[int], tokens: list[int], stops: set[int], max_new_tokens: int) -> bool:
    """Append a round's tokens to `out`, stopping at a stop id or the token limit.
    Returns True when a stop id was emitted."""
    for tok in tokens:
        out.append(tok)
        if tok in stops:
            return True
        if len(out) >= max_new_tokens:
            return False
    return False


def check_prompt(prompt: list[int], vocab: int) -> None:
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"prompt token id(s) {bad[:5]} out of range for vocabulary size {vocab}")


def check_stop(stop_ids, vocab: int) -> set[int]:
    s = set(int(t) for t in stop_ids)
    bad = [t for t in s if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop id(s) {sorted(bad)[:5]} out of range for vocabulary size {vocab}")
    return s


@torch.no_grad()
def generate_plain(model: HybridLM, prompt: list[int], *, max_new_tokens: int, params: SamplingParams | None = None,
                   stop_ids=(), max_len: int | None = None, constraint=None) -> GenerationResult:
    """Prefill the prompt, then one target forward per token. `constraint`
    (hyspec.constraints.Constraint, advanced in place): every row is masked by it."""
    params = params if params is not None else GREEDY
    check_prompt(prompt, model.cfg.vocab_size)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    stops = check_stop(stop_ids, model.cfg.vocab_size)
    P = len(prompt)
    cache = model.new_cache(max_len or P + max_new_tokens + 1)
    t0 = time.perf_counter()
    ids = torch.tensor(prompt, device=model.device)
    h = model.forward_hidden(ids, cache, StepCtx(start=0, chunked=True))
    logits = model.logits(h[-1:])[0]
    t1 = time.perf_counter()
    out: list[int] = []
    reason = "length"
    while len(out) < max_new_tokens:
        logits = constrained(logits, constraint)
        if logits is None:
            reason = "constraint"
            break
        tok = choose_token(logits, prompt + out, params, P + len(out))
        out.append(tok)
        if constraint is not None:
            constraint.commit([tok])
        if tok in stops:
            reason = "eos"
            break
        if len(out) == max_new_tokens:
            break
        ctx = StepCtx(start=cache.pos, exact=True)
        h = model.forward_hidden(torch.tensor([tok], device=model.device), cache, ctx)
        logits = model.logits(h, ctx)[0]
    t2 = time.perf_counter()
    return GenerationResult(out, reason, {
        "prompt_tokens": P, "generated_tokens": len(out), "prefill_s": t1 - t0, "decode_s": t2 - t1,
        "decode_tok_s": (len(out) - 1) / (t2 - t1) if len(out) > 1 and t2 > t1 else None,
        "target_forwards": max(len(out) - 1, 0),
    })
