"""Single-request entry points over the engine core, and the result type they return.

generate_plain (K = 0) and hyspec.speculative.loop.generate_speculative (K >= 1) are one request
run through hyspec.core's scheduler and round driver; there is no separate loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from hyspec.core.request import GREEDY, Request
from hyspec.core.round import choose_token  # noqa: F401  (re-exported: the plain token rule)
from hyspec.core.scheduler import Scheduler, check_prompt, check_stop  # noqa: F401
from hyspec.sampling import SamplingParams


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (prompt excluded)
    stop_reason: str  # "eos" | "length" | "constraint"
    stats: dict = field(default_factory=dict)


def run_request(model, req: Request, scheduler: Scheduler | None = None) -> GenerationResult:
    """Run one request to the end and return its result (errors are raised)."""
    sched = scheduler if scheduler is not None else Scheduler(model, max_batch=1)
    sched.submit(req)
    while not req.done:
        sched.step()
    exc = getattr(req, "exception", None)
    if exc is not None:
        raise exc
    return GenerationResult(list(req.tokens), req.stop_reason, req.stats)


def generate_plain(model, prompt: list[int], *, max_new_tokens: int, params: SamplingParams | None = None,
                   stop_ids=(), max_len: int | None = None, on_tokens=None, constraint=None) -> GenerationResult:
    """Prefill the prompt, then one target forward per token (a K = 0 request); on_tokens(ids)
    is called with each round's emitted tokens (the streaming hook). `constraint`
    (hyspec.constraints.Constraint, advanced in place) masks every row. `max_len` is not
    used (kept for older callers: the request's length is prompt + max_new_tokens)."""
    req = Request(prompt_ids=list(prompt), max_new_tokens=max_new_tokens,
                  params=params if params is not None else GREEDY, draft=0, stop_ids=stop_ids,
                  on_tokens=None if on_tokens is None else (lambda r, toks: on_tokens(toks)), constraint=constraint)
    return run_request(model, req)
