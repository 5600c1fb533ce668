"""Sampling: penalties, filters, and lossless speculative sampling.
(One module on purpose: the scalar reference every other sampler — the engine core, the
device sampler in hyspec/gpu/sampling.py — is tested against.)

Conventions
-----------
* ``V`` is the vocabulary size; probability rows are float64 tensors ``[V]`` or
  ``[N, V]``.
* The *same* transformation (:func:`row_probs` = penalties + :func:`filter_probs`) is
  applied to target rows (p) and drafter rows (q).  With a reduced draft vocabulary
  the caller scatters q into the full vocabulary before calling anything here.
* All randomness comes from :mod:`hyspec.rng`: a uniform is ``u01(seed, stream,
  counter)``.  The counter is the **absolute position of the token being decided**
  (for example ``len(prompt) + tokens emitted so far``); see
  :func:`speculative_sample` for the exact scheme.
* Ties are broken towards the lowest token id everywhere (argmax, top-k, top-p), so
  results never depend on sort stability or device.

Words: *p* = the target's distribution for a position, *q* = the drafter's; a draft is
*accepted* when the target keeps it (rejection test ``u * q[d] < p[d]``, or in coupled
mode the same Gumbel-max choice); at the first rejection the *residual* token is drawn
from normalize(max(0, p - q)); after a full accept the *bonus* token is drawn from the
target's row after the last draft. Each round emits accepted drafts + one token.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hyspec.config import finite_number
from hyspec.rng import Stream, gumbel_noise, u01

__all__ = [
    "SamplingParams",
    "ParamError",
    "apply_penalties",
    "check_logit_bias",
    "filter_probs",
    "fixed_mass",
    "top_p_threshold",
    "row_probs",
    "greedy_token",
    "sample_index",
    "draft_token",
    "plain_token",
    "accept_or_resample",
    "speculative_sample",
    "coupled_token",
    "coupled_speculative",
]

Mode = Literal["rejection", "coupled"]
_MODES = ("rejection", "coupled")
SEED_MAX = (1 << 64) - 1


class ParamError(ValueError):
    """A bad argument or option value. `field` is the argument's name in the Python API
    (``temperature``, ``max_new_tokens``...); the command line maps it onto the flag the
    user typed (``--temperature``). str() keeps the Python-facing form."""

    def __init__(self, field: str, value: object, why: str, owner: str | None = None) -> None:
        self.field, self.value, self.why, self.owner = field, value, why, owner
        name = f"{owner}.{field}" if owner else field
        shown = repr(value)
        if len(shown) > 80:  # (a 400-digit number, a long list)
            shown = shown[:60] + f"... ({len(shown)} characters)"
        self.shown = shown
        super().__init__(f"{name}={shown}: {why}")


class NonFiniteLogits(ValueError):
    """A sequence's logits row holds NaN or +inf: the model's activations overflowed (a
    damaged checkpoint, or a dtype too narrow for it). That sequence ends in error; the
    others of its batch go on (Engine.generate_batch, a prompts file, the server)."""

    def __init__(self, what: str = "logits contain NaN or +inf") -> None:
        super().__init__(f"{what} (the model's activations overflowed: a damaged checkpoint, or a dtype "
                         "too narrow for it, e.g. float16)")


def as_int(value) -> int | None:
    """`value` as a Python int when it is an integer -- int, a numpy integer, a 0-d integer
    tensor (anything with __index__) -- else None. True / False are not integers here."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")) or getattr(value, "ndim", 0) != 0:
        return None  # (a one-element tensor or array is not a number either)
    try:
        return operator.index(value)
    except TypeError:
        return None


def int_in(value, lo: int, hi: int | None = None) -> int | None:
    """`value` as a Python int when it is an integer (as_int) in lo..hi (hi None: no bound),
    else None: the caller raises its own message."""
    n = as_int(value)
    return n if n is not None and n >= lo and (hi is None or n <= hi) else None


def as_float(value) -> float | None:
    """`value` as a Python float when it is a real number (int, float, numpy scalar), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # (10**400: not a finite number, refused by the caller as such)
        return math.inf


def as_bool(value) -> bool | None:
    """`value` as a Python bool when it is True / False (or a numpy bool), else None: a
    string such as "no" or a number is not taken by its truthiness."""
    import numpy as np

    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    return None


# --------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------


# Bounds that keep every penalised or tempered logit finite (float32 logits, float64 x / t):
# a smaller temperature or a larger penalty says nothing more, it only overflows.
TEMPERATURE_MIN = 1e-5
PENALTY_MAX = 1e4


@dataclass(frozen=True)
class SamplingParams:
    """Sampling configuration: transformers' order (penalties, temperature, top-k, top-p,
    min-p: docs/sampling.md; vLLM's v0 too, its v1 applies min-p first), with llama.cpp's
    penalty window.

    temperature: 0 means greedy.  top_k: 0 = off.  top_p: 1.0 = off.  min_p: 0 = off.
    repetition_penalty: 1.0 = off.  frequency_penalty / presence_penalty: 0 = off.
    penalty_last_n: penalty window over the history; 0 = penalties off, -1 = whole
    history.  seed: key of the counter-based RNG.  mode: "rejection" (speculative
    sampling with accept/residual) or "coupled" (Gumbel-max with position-keyed
    noise; speculative output equals plain output token for token).
    logit_bias: {token id: bias} added to the target's logits before everything else
    (OpenAI's logit_bias: each bias in [-100, 100]; -100 all but bans a token, +100 all
    but forces it); kept as a sorted tuple of (id, bias) pairs; greedy decoding takes
    the argmax of the biased logits.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int = 0
    mode: Mode = "rejection"
    logit_bias: Any = ()

    def __post_init__(self) -> None:
        def bad(name: str, value: object, why: str) -> ValueError:
            return ParamError(name, value, why, owner="SamplingParams")

        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias, bad))

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            v = getattr(self, name)
            f = as_float(v)
            if f is None or not finite_number(f):
                raise bad(name, v, "must be a finite number")
            if type(v) is not int:  # numpy scalars are kept as Python floats (ints stay as given)
                object.__setattr__(self, name, f)
        for name in ("top_k", "penalty_last_n", "seed"):
            v = getattr(self, name)
            i = as_int(v)
            if i is None:
                raise bad(name, v, "must be an int")
            object.__setattr__(self, name, i)
        if not 0 <= self.seed <= SEED_MAX:
            raise bad("seed", self.seed, "must be in 0..2**64-1 (18446744073709551615)")
        if self.temperature < 0 or 0 < self.temperature < TEMPERATURE_MIN:
            raise bad("temperature", self.temperature, f"must be 0 (greedy) or >= {TEMPERATURE_MIN:g}")
        if self.top_k < 0:
            raise bad("top_k", self.top_k, "must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1] (1 = off)")
        if not 0.0 <= self.min_p < 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1) (0 = off)")
        if not 1 / PENALTY_MAX <= self.repetition_penalty <= PENALTY_MAX:
            raise bad("repetition_penalty", self.repetition_penalty,
                      f"must be in [{1 / PENALTY_MAX:g}, {PENALTY_MAX:g}] (1 = off)")
        for name in ("frequency_penalty", "presence_penalty"):
            if abs(getattr(self, name)) > PENALTY_MAX:
                raise bad(name, getattr(self, name), f"must be in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}] (0 = off)")
        if self.penalty_last_n < -1:
            raise bad("penalty_last_n", self.penalty_last_n, "must be >= -1")
        if self.mode not in _MODES:
            raise bad("mode", self.mode, f"must be one of {_MODES}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether apply_penalties changes a row (a logit bias or a penalty): greedy then
        takes the argmax of its result, not of the raw row."""
        return bool(self.logit_bias) or self.has_penalties


LOGIT_BIAS_MAX = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


def _bias_pairs(value, bad) -> tuple:
    """SamplingParams.logit_bias as sorted ((id, bias), ...): from a mapping or pairs."""
    if value is None:
        return ()
    try:
        items = list(value.items()) if hasattr(value, "items") else [tuple(x) for x in value]
    except TypeError:
        raise bad("logit_bias", value, "must map token ids to biases ({id: bias})") from None
    out = {}
    for pair in items:
        if len(pair) != 2:
            raise bad("logit_bias", value, "must map token ids to biases ({id: bias})")
        key = pair[0]
        if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():
            key = int(key)  # (JSON's object keys: OpenAI's logit_bias is {"id": bias})
        tid, b = as_int(key), as_float(pair[1])
        if tid is None or tid < 0:
            raise bad("logit_bias", pair[0], "token ids must be ints >= 0")
        if b is None or not finite_number(b) or abs(b) > LOGIT_BIAS_MAX:
            raise bad("logit_bias", pair[1], f"biases must be numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")
        if tid in out:
            raise bad("logit_bias", tid, "a token id given twice")
        out[tid] = float(b)
    return tuple(sorted(out.items()))


def check_logit_bias(params, vocab_size: int) -> None:
    """A ValueError naming logit_bias ids outside the vocabulary (the scheduler's check)."""
    bad = [t for t, _ in getattr(params, "logit_bias", ()) if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias: token id(s) {bad[:5]} out of range for vocabulary size {vocab_size}")


# --------------------------------------------------------------------------------------
# Penalties and filters
# --------------------------------------------------------------------------------------


def _window(history: Sequence[int] | torch.Tensor, last_n: int) -> list[int]:
    if isinstance(history, torch.Tensor):
        history = history.reshape(-1).tolist()
    hist = list(history)
    # max(0, ...): a history shorter than the window is the whole window (a bare
    # len - last_n would go negative and slice from the end instead)
    return hist if last_n < 0 else hist[max(0, len(hist) - last_n) :]


def apply_penalties(
    logits: torch.Tensor, history: Sequence[int] | torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """The logit bias, then repetition / frequency / presence penalties over the last
    ``penalty_last_n`` tokens.

    logits: [V]; history: prior token ids (oldest first).  First logit[t] += bias for
    each (t, bias) of ``params.logit_bias`` (ids outside [0, V) are ignored; the
    scheduler refuses them). Then for each distinct token t in the window (ids outside
    [0, V) are ignored), with c = its count in the window::

        logit[t] = logit[t] / r if logit[t] > 0 else logit[t] * r    (repetition r)
        logit[t] -= frequency_penalty * c + presence_penalty

    Returns a new tensor (float32 or wider); the input is never modified.
    """
    if logits.dim() != 1:
        raise ValueError(f"logits must be [V], got shape {tuple(logits.shape)}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = logits.to(dtype=dtype, copy=True)  # [V]
    V = out.shape[0]
    bias = [(t, b) for t, b in params.logit_bias if t < V]
    if bias:
        ids = torch.tensor([t for t, _ in bias], dtype=torch.int64, device=out.device)
        out[ids] += torch.tensor([b for _, b in bias], dtype=dtype, device=out.device)
    if not params.has_penalties:
        return out
    window = [t for t in _window(history, params.penalty_last_n) if 0 <= t < V]
    if not window:
        return out
    ids = torch.tensor(window, dtype=torch.int64, device=out.device)
    counts = torch.bincount(ids, minlength=V).to(dtype)  # [V]
    present = counts > 0  # [V]
    r = params.repetition_penalty
    if r != 1.0:
        out = torch.where(present, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty != 0.0:
        out = out - params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        out = out - params.presence_penalty * present.to(dtype)
    return out


def _masked_softmax(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """softmax over kept entries of each row. x, keep: [N, V]; every row keeps >= 1."""
    return torch.softmax(torch.where(keep, x, torch.full_like(x, -math.inf)), dim=-1)


MASS_BITS = 62
MASS_ONE = 1 << MASS_BITS  # the fixed-point unit of top-p masses: probability 1


def fixed_mass(probs: torch.Tensor) -> torch.Tensor:
    """Probabilities as int64 multiples of 2**-62, rounded down (exact: a power-of-two
    scale and a truncation). Sums of them are exact in any order, so the top-p nucleus
    does not depend on how a sort or a device adds the masses up."""
    return (probs * float(MASS_ONE)).to(torch.int64)


def top_p_threshold(top_p: float) -> int:
    """top_p in the fixed-point unit of :func:`fixed_mass` (rounded down)."""
    return int(top_p * MASS_ONE)


def filter_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Filtered sampling distribution(s): temperature -> top-k -> top-p -> min-p.

    logits: [V] or [N, V] (``-inf`` marks forbidden tokens).  Returns float64 probs of
    the same shape; each row sums to 1.

    Tokens are ranked by decreasing logit, ties towards the lowest id (the ranking of the
    logits before temperature, which temperature does not change; ranking the divided
    values instead could only add ties where a division rounds two logits together).
    With ``x = logits / temperature`` in float64:

    * greedy (temperature 0): one-hot at the argmax (lowest id on ties).
    * top-k: the k best-ranked tokens.
    * top-p: with ``m = fixed_mass(softmax(x over the top-k tokens))`` (exact integers), a
      token is kept when the mass of the tokens ranked before it is below
      ``top_p_threshold(top_p)``: the smallest prefix of the ranking whose mass reaches
      top_p; the top token is always kept.
    * min-p: keep tokens with ``p >= min_p * p_max``, i.e. ``x - max(x) >= log(min_p)``.

    The result is ``softmax(x)`` over the kept tokens, computed in token order. Every
    decision is an exact comparison (integer masses, a rounded subtraction against
    ``math.log(min_p)``), so the batched device sampler (hyspec.gpu.sampling) finds the same
    kept set without sorting, and the same floating-point softmax gives the same bits.
    """
    x = logits.to(torch.float64)
    squeeze = x.dim() == 1
    if squeeze:
        x = x.unsqueeze(0)  # [N, V]
    if x.dim() != 2:
        raise ValueError(f"logits must be [V] or [N, V], got shape {tuple(logits.shape)}")
    if bool(torch.isnan(x).any()) or bool((x == math.inf).any()):
        raise NonFiniteLogits()
    if not bool(torch.isfinite(x).any(dim=-1).all()):
        raise ValueError("a logits row has no finite entry (every token forbidden)")
    N, V = x.shape

    if params.greedy:
        idx = x.argmax(dim=-1, keepdim=True)  # [N, 1]; first maximum = lowest id
        out = torch.zeros_like(x).scatter_(-1, idx, 1.0)
        return out[0] if squeeze else out

    xt = x / params.temperature  # [N, V]
    keep = torch.isfinite(xt)  # [N, V]
    use_k = 0 < params.top_k < V
    if use_k or params.top_p < 1.0:
        # descending stable sort of the logits: equal logits keep ascending id order
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices  # [N, V] token at each rank
        ranks = torch.arange(V, device=x.device).expand(N, V)
        rank = torch.empty_like(order).scatter_(-1, order, ranks)  # [N, V] rank of each token
    if use_k:
        keep &= rank < params.top_k
    if params.top_p < 1.0:
        mass = fixed_mass(_masked_softmax(xt, keep))  # [N, V] int64, token order
        ranked = mass.gather(-1, order)  # [N, V] in rank order
        before = (ranked.cumsum(-1) - ranked).gather(-1, rank)  # [N, V] mass ranked ahead, exact
        keep &= (before < top_p_threshold(params.top_p)) | (rank == 0)
    if params.min_p > 0.0:
        keep &= (xt - xt.amax(dim=-1, keepdim=True)) >= math.log(params.min_p)  # the top token: 0 >= log < 0

    out = _masked_softmax(xt, keep)  # [N, V], token order
    return out[0] if squeeze else out


def row_probs(
    logits: torch.Tensor, history: Sequence[int] | torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """Penalties then filters for one row: logits [V] -> float64 probs [V]."""
    return filter_probs(apply_penalties(logits, history, params), params)


def top_ids(x: torch.Tensor, n: int) -> torch.Tensor:
    """The ids [..., n] of the n largest values of each row of x [..., V], by value
    descending and, among equal values, by ascending id: the tie rule of greedy_token (the
    lowest id wins) and of top-k (a stable sort), so a greedy token comes first among the
    tokens tied with it and the n ids are those top_k = n keeps. (torch.topk leaves the
    order of ties open: on the CPU it lists the highest id first.) No host sync: one topk
    over int64 keys, the value's bits in order-preserving form above the reversed id
    (values exact in float32: bf16, fp16, fp32 logits; a float64 row takes a stable sort)."""
    n = min(int(n), x.shape[-1])
    if x.dtype == torch.float64:
        return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :n]
    bits = (x.float() + 0.0).view(torch.int32)  # (+ 0.0: -0.0 is +0.0, one key; a copy, changed in place)
    bits ^= (bits >> 31) & 0x7FFFFFFF  # negative floats: their order reversed back (arithmetic shift)
    V = x.shape[-1]
    tie = (V - 1) - torch.arange(V, device=x.device)  # the lower id, the larger key
    key = bits.to(torch.int64).mul_(1 << 32).add_(tie)  # (in place: a [rows, V] logits pack is large)
    return torch.topk(key, n, dim=-1).indices


def greedy_token(logits: torch.Tensor) -> int:
    """argmax of a [V] row; the lowest id wins ties. A row with NaN or +inf is an error
    (NonFiniteLogits), as for the sampled choice: argmax would pick the first NaN's id."""
    if logits.dim() != 1:
        raise ValueError(f"logits must be [V], got shape {tuple(logits.shape)}")
    i = torch.argmax(logits)  # torch returns the first maximal index (a NaN's, a +inf's if any)
    idx, top = torch.stack([i.to(torch.float64), logits[i].to(torch.float64)]).tolist()  # (one read: on CUDA,
    if not top < math.inf:  # one sync)
        raise NonFiniteLogits()
    return int(idx)


# --------------------------------------------------------------------------------------
# Inverse-CDF sampling
# --------------------------------------------------------------------------------------


def sample_index(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one token from probs [V] with the uniform ``u`` in (0, 1)."""
    if probs.dim() != 1:
        raise ValueError(f"probs must be [V], got shape {tuple(probs.shape)}")
    p = probs.to(torch.float64)
    cdf = torch.cumsum(p, dim=0)  # [V]
    total = float(cdf[-1])
    if not total > 0.0 or float(p.min()) < 0.0:
        raise ValueError("probabilities must be non-negative with positive total mass")
    target = torch.tensor([u * total], dtype=torch.float64, device=p.device)  # [1]
    idx = int(torch.searchsorted(cdf, target, right=True))
    if idx >= p.shape[0]:
        idx = int(torch.nonzero(p > 0)[-1])  # last token with positive probability
    return idx


def draft_token(q: torch.Tensor, seed: int, position: int) -> int:
    """Drafter's sampled token at absolute ``position``: u = u01(seed, DRAFT, position)."""
    return sample_index(q, u01(seed, Stream.DRAFT, position))


def plain_token(probs: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Plain (non-speculative) decoding of the token at absolute ``position``.

    greedy -> argmax; mode "rejection" -> inverse CDF with u01(seed, PLAIN, position);
    mode "coupled" -> :func:`coupled_token`.
    """
    if params.greedy:
        return greedy_token(probs)
    if params.mode == "coupled":
        return coupled_token(probs, params.seed, position)
    return sample_index(probs, u01(params.seed, Stream.PLAIN, position))


# --------------------------------------------------------------------------------------
# Speculative sampling (rejection mode)
# --------------------------------------------------------------------------------------


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, draft: int, u_accept: float, u_resid: float
) -> tuple[bool, int | None]:
    """One accept/reject step for a draft token drawn from q.

    p, q: [V] target and draft distributions.  Accept iff ``u_accept * q[d] < p[d]``
    (so q[d] == 0 < p[d] accepts and p[d] == 0 rejects).  On rejection return a token
    drawn with ``u_resid`` from normalize(max(0, p - q)), or from p when that residual
    has no mass (p == q).  Returns (True, None) or (False, token).
    """
    p_draft = float(p[draft])
    q_draft = float(q[draft])
    if u_accept * q_draft < p_draft:
        return True, None
    residual = torch.clamp(p.to(torch.float64) - q.to(torch.float64), min=0.0)  # [V]
    if not float(residual.sum()) > 0.0:
        residual = p
    return False, sample_index(residual, u_resid)


def speculative_sample(
    p_rows: torch.Tensor,
    q_rows: torch.Tensor,
    drafts: Sequence[int] | torch.Tensor,
    seed: int,
    position: int,
) -> tuple[int, int]:
    """Lossless speculative sampling over one round of k drafts.

    p_rows: [k+1, V] target distributions; row j is for the token at absolute position
    ``position + j`` (verify row j, given the j drafts before it).
    q_rows: [k, V] draft distributions the drafts were drawn from.
    drafts: k token ids; draft j is the candidate for position ``position + j``.

    Returns (n_accepted, next_token): drafts[:n_accepted] are emitted, then next_token
    (the residual draw at the first rejection, or the bonus after a full accept).

    Counter scheme (all draws keyed by the absolute position t of the token decided):

    * the draft for t was drawn with ``u01(seed, Stream.DRAFT, t)`` (:func:`draft_token`)
    * its acceptance uses ``u01(seed, Stream.ACCEPT, t)``
    * a residual token at t uses ``u01(seed, Stream.RESIDUAL, t)``
    * the bonus after a full accept, at t = position + k, uses ``u01(seed, Stream.BONUS, t)``

    A round ends at the first position whose outcome is not an accepted draft, so every
    position's uniforms are consumed by exactly one decision in the emitted output;
    draws made for positions past that point only fed discarded work and are drawn
    afresh (same counter, new context) in the next round.  The same seed therefore gives
    the same output whenever the rounds see the same p and q.
    """
    draft_ids = drafts.tolist() if isinstance(drafts, torch.Tensor) else [int(t) for t in drafts]
    k = len(draft_ids)
    if p_rows.dim() != 2 or p_rows.shape[0] != k + 1:
        raise ValueError(f"p_rows must be [k+1={k + 1}, V], got {tuple(p_rows.shape)}")
    if k and (q_rows.dim() != 2 or q_rows.shape[0] != k):
        raise ValueError(f"q_rows must be [k={k}, V], got {tuple(q_rows.shape)}")
    for j in range(k):
        decided = position + j  # absolute position of the token this step decides
        accepted, residual_token = accept_or_resample(
            p_rows[j],
            q_rows[j],
            draft_ids[j],
            u01(seed, Stream.ACCEPT, decided),
            u01(seed, Stream.RESIDUAL, decided),
        )
        if not accepted:
            assert residual_token is not None
            return j, residual_token
    return k, sample_index(p_rows[k], u01(seed, Stream.BONUS, position + k))


# --------------------------------------------------------------------------------------
# Coupled (Gumbel-max) sampling
# --------------------------------------------------------------------------------------


def coupled_token(probs: torch.Tensor, seed: int, position: int) -> int:
    """Gumbel-max sample: argmax over {p > 0} of log p + gumbel_noise(seed, COUPLED, position).

    probs: [V].  The noise depends only on (seed, position, token id), so the drafter and
    the target at the same position see the same noise, and plain and speculative
    decoding pick the same token from the same distribution.
    """
    if probs.dim() != 1:
        raise ValueError(f"probs must be [V], got shape {tuple(probs.shape)}")
    p = probs.to(torch.float64)
    g = gumbel_noise(seed, Stream.COUPLED, position, p.shape[0], device=p.device)  # [V]
    score = torch.where(p > 0, torch.log(p) + g, torch.full_like(p, -math.inf))
    return int(torch.argmax(score))


def coupled_speculative(
    p_rows: torch.Tensor,
    drafts: Sequence[int] | torch.Tensor,
    seed: int,
    position: int,
) -> tuple[int, int]:
    """Speculative verification in coupled mode.

    The drafter proposes ``coupled_token(q_j, seed, position + j)``; draft j is accepted
    iff the target's own coupled choice ``coupled_token(p_rows[j], seed, position + j)``
    equals it.  The first mismatch (or row k after a full accept) gives next_token.  The
    output equals plain coupled decoding token for token.  p_rows: [k+1, V].
    """
    draft_ids = drafts.tolist() if isinstance(drafts, torch.Tensor) else [int(t) for t in drafts]
    k = len(draft_ids)
    if p_rows.dim() != 2 or p_rows.shape[0] != k + 1:
        raise ValueError(f"p_rows must be [k+1={k + 1}, V], got {tuple(p_rows.shape)}")
    for j in range(k):
        target_token = coupled_token(p_rows[j], seed, position + j)
        if target_token != draft_ids[j]:
            return j, target_token
    return k, coupled_token(p_rows[k], seed, position + k)
