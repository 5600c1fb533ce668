"""Speculative decoding options, and the single-request entry point. The round itself
(draft with the MTP head, verify in one target forward, accept, commit, refresh, emit)
is written once, for a batch, in hyspec/core/round.py.

Words (see docs/speculative.md): pending = emitted token not yet run through the target;
bonus = the target's own token at the first rejected position (or after a full accept);
every round emits accepted + 1 tokens and leaves the bonus pending for the next verify.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from hyspec.core.request import GREEDY, Request
from hyspec.decode import GenerationResult, run_request
from hyspec.model.hybrid import HybridLM
from hyspec.sampling import ParamError, SamplingParams, as_float, as_int
from hyspec.speculative.rollback import make_rollback
from hyspec.speculative.telemetry import SpecTelemetry

MAX_DRAFT = 16


@dataclass(frozen=True)
class SpecOptions:
    """k: drafts per round (1..16). rollback: checkpoint | rescan | replay. p_min: stop
    drafting when the drafter's probability for its token falls below this. adaptive:
    next round's k = clamp(accepted + 1, adaptive_floor, k). hidden: which target hidden
    seeds the MTP head ("post" final-norm, the Qwen convention, or "pre").
    forced_rates: use the forced-acceptance drafter with these per-depth rates.
    prime_pending: start with the prefill's token pending (False: the first round verifies
    drafts only, the 'no pending' form used when continuing a session)."""

    k: int = 3
    rollback: str = "checkpoint"
    p_min: float = 0.0
    adaptive: bool = False
    adaptive_floor: int = 1
    hidden: str = "post"
    forced_rates: tuple[float, ...] | None = None
    forced_seed: int = 0
    prime_pending: bool = True

    def with_k(self, k: int) -> "SpecOptions":
        """These options for K = k drafts (a request's own draft length): the floor of
        adaptive K is at most k (a batch-wide or file-wide floor above one request's K)."""
        return SpecOptions(**{**self.__dict__, "k": k, "adaptive_floor": min(self.adaptive_floor, k)})

    def __post_init__(self) -> None:
        k = as_int(self.k)
        if k is None or not 1 <= k <= MAX_DRAFT:
            raise ParamError("k", self.k, f"the draft length must be an integer in 1..{MAX_DRAFT} "
                             f"(use --draft 0 for plain decoding)", owner="SpecOptions")
        object.__setattr__(self, "k", k)  # (numpy scalars are kept as Python values)
        make_rollback(self.rollback)
        p_min = as_float(self.p_min)
        if p_min is None or not 0.0 <= p_min < 1.0:
            raise ParamError("p_min", self.p_min, "must be in [0, 1)", owner="SpecOptions")
        object.__setattr__(self, "p_min", p_min)
        floor = as_int(self.adaptive_floor)
        if floor is None or not 1 <= floor <= self.k:
            raise ParamError("adaptive_floor", self.adaptive_floor, f"must be in 1..k={self.k}", owner="SpecOptions")
        object.__setattr__(self, "adaptive_floor", floor)
        if self.hidden not in ("post", "pre"):
            raise ParamError("hidden", self.hidden, "must be 'post' or 'pre'", owner="SpecOptions")
        # numpy scalars are taken and stored as Python values; a string such as "no" is not a bool
        for name in ("adaptive", "prime_pending"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise ParamError(name, v, "must be True or False", owner="SpecOptions")
            object.__setattr__(self, name, bool(v))
        if not isinstance(self.forced_seed, numbers.Integral) or isinstance(self.forced_seed, bool):
            raise ParamError("forced_seed", self.forced_seed, "must be an integer", owner="SpecOptions")
        object.__setattr__(self, "forced_seed", int(self.forced_seed))
        if self.forced_rates is not None:
            rates = self.forced_rates
            if isinstance(rates, (str, bytes)) or not hasattr(rates, "__len__") or not len(rates) or any(
                    isinstance(r, bool) or not isinstance(r, numbers.Real) or not 0.0 <= r <= 1.0 for r in rates):
                raise ParamError("forced_rates", rates, "must be a non-empty sequence of rates in [0, 1] (one per "
                                 "draft depth), e.g. (0.9, 0.8, 0.7)", owner="SpecOptions")
            object.__setattr__(self, "forced_rates", tuple(float(r) for r in rates))


@torch.no_grad()
def generate_speculative(model: HybridLM, prompt: list[int], *, max_new_tokens: int, opts: SpecOptions,
                         params: SamplingParams | None = None, stop_ids=(), reference: list[int] | None = None,
                         telemetry: SpecTelemetry | None = None, on_tokens=None,
                         constraint=None) -> GenerationResult:
    """One speculative request (K = opts.k) through the engine core's round driver;
    on_tokens(ids) is called with the tokens each round commits (the streaming hook).
    `constraint` (hyspec.constraints.Constraint, advanced in place): drafts are drawn from
    the drafter's rows masked by its state after the earlier drafts, verify row j is masked
    by its state after drafts[:j], and after each round it has consumed the emitted tokens."""
    req = Request(prompt_ids=list(prompt), max_new_tokens=max_new_tokens,
                  params=params if params is not None else GREEDY, draft=opts.k, spec=opts, stop_ids=stop_ids,
                  reference=reference, telemetry=telemetry,
                  on_tokens=None if on_tokens is None else (lambda r, toks: on_tokens(toks)), constraint=constraint)
    return run_request(model, req)
