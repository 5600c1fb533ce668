"""Batched sampling on the device: static shapes, no host synchronisation.

The reference sampler (:mod:`hyspec.sampling`) decides one row at a time and reads
values back to the host (``float(p[d])``, ``int(argmax)``, Python loops over drafts).
This module makes the same decisions for a batch of ``B`` lanes at once, with every
per-lane choice (greedy or sampled, rejection or coupled, top-k, penalties, seed, how
many drafts) held in device tensors of fixed shape.  Nothing here calls ``.item()``,
``.tolist()``, ``bool(tensor)`` or ``nonzero``, builds a tensor whose shape depends on
data, or branches in Python on a tensor value, so a CUDA-graph decoder can capture a
call once and replay it for any mix of parameters (the table's values change, the
graph does not).

Run on the CPU in float64, every function returns exactly what the scalar reference
returns lane by lane (probabilities bitwise, tokens identical); tests/test_gpu_sampling.py
checks it.  The Philox draws are integer arithmetic and bit-identical on every device;
floating-point reductions (softmax, cumsum, log) may round differently on a GPU, so a
GPU run matches the CPU reference only up to those last-bit differences.

Glossary (one speculative round of a lane, drafts ``d_0..d_{k-1}`` at positions
``pos..pos+k-1``)

* **accepted** tokens: the longest prefix of drafts the target agrees with, ``n`` of
  ``k``.  Rejection mode: draft ``j`` is accepted iff ``u_accept * q_j[d_j] < p_j[d_j]``
  (``u_accept = u01(seed, ACCEPT, pos + j)``); coupled mode: iff the target's own
  Gumbel-max choice at row ``j`` equals ``d_j``; greedy lanes: iff ``argmax p_j == d_j``.
* **recovered** (residual) token: at the first rejected position ``n < k`` (rejection
  mode) a token drawn with ``u01(seed, RESIDUAL, pos + n)`` from
  ``normalize(max(0, p_n - q_n))``, or from ``p_n`` when that residual has no mass.
  Coupled and greedy lanes emit the target's own choice at row ``n`` instead.
* **bonus** token: after all ``k`` drafts are accepted, a token drawn from ``p_k`` with
  ``u01(seed, BONUS, pos + k)`` (coupled: Gumbel-max at ``pos + k``; greedy: argmax).

``next_token`` of :func:`speculative_accept` is the recovered token when ``n < k`` and
the bonus token when ``n == k``; the round emits ``d_0..d_{n-1}`` then ``next_token``.

Layout

* :class:`SamplingTable`: the lanes' :class:`~hyspec.sampling.SamplingParams` as
  tensors ``[B]``; :class:`SampledGraphKey`: which stages and draws a batch needs (its
  graphs leave the others out).
* :func:`probs_batch` (= ``row_probs``; penalties from per-lane token counts; top-k and
  top-p without a sort: :func:`prefix_select`, exact integer radix passes over the
  logits' ranking key :func:`order_key`), :func:`plain_tokens`, :func:`draft_tokens`,
  :func:`speculative_accept`; coupled draws through one fused kernel on CUDA
  (:func:`hyspec.kernels.rng.gumbel_argmax`); on CUDA (``kernel`` arguments) the
  softmaxes and the inverse CDF are the row kernels of :mod:`hyspec.kernels.probs`
  (a row's result depends on that row alone, for any number of rows).
* the penalty window (per-lane token counts kept on the device) and the counts of a
  round's rows: :mod:`hyspec.gpu.penalties` (the BatchDecoder carries one per lane).

Preconditions the reference checks and this module cannot (checking would need a host
sync): logits have no NaN or ``+inf`` and every row has a finite entry; probability rows
are non-negative with positive mass (a row without mass yields token 0 where the
reference raises); positions are in ``[0, 2**31)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyspec.envknobs import switch
from hyspec.kernels.common import triton_available
from hyspec.kernels.probs import inverse_cdf_rows, inverse_cdf_rows_ref, softmax_rows
from hyspec.kernels.probs.argmax import first_max
from hyspec.kernels.probs.topp import prefix_select_rows, topp_kernel_enabled
from hyspec.kernels.rng import gumbel_argmax, u01_at, u01_rows, u01_rows_ref
from hyspec.rng import Stream, u01_lanes
from hyspec.sampling import MASS_ONE, SamplingParams, check_logit_bias, fixed_mass

__all__ = [
    "SamplingTable",
    "SampledGraphKey",
    "ALL_STAGES",
    "order_key",
    "prefix_select",
    "u01_lanes",
    "u01_draws",
    "gumbel_lanes",
    "probs_batch",
    "sample_rows",
    "coupled_rows",
    "plain_tokens",
    "draft_tokens",
    "speculative_accept",
]

_GREEDY = SamplingParams(temperature=0.0, penalty_last_n=0)  # what an unused lane holds


def _signed64(seed: int) -> int:
    """A seed in 0..2**64-1 as the int64 with the same bits (two's complement)."""
    seed = int(seed) & ((1 << 64) - 1)
    return seed - (1 << 64) if seed >= 1 << 63 else seed


# --------------------------------------------------------------------------------------
# Per-lane parameters
# --------------------------------------------------------------------------------------


KEEP_ALL = (1 << 63) - 1  # a prefix_select threshold no ahead weight reaches: every valid token kept


class SamplingTable:
    """Sampling parameters of ``batch`` lanes as device tensors (filled on the host with
    :meth:`set`, read by the batched functions).

    Lanes without penalties (``SamplingParams.has_penalties`` false) hold the neutral
    values (1, 0, 0), so whatever their counts are the penalty step leaves them unchanged.
    Besides the parameters the table holds what the device would otherwise recompute
    every call: ``temp_eff`` (1 for greedy lanes), and the top-k / top-p thresholds of
    :func:`prefix_select` (``KEEP_ALL`` where the filter is off, which keeps every valid
    token: the same keep set as no filter). The fields are rows of three storages (float64,
    int64, bool), so :meth:`repeat` makes the per-row table of a verify in three copies.
    """

    # the per-lane tensor fields, each [B] (views, lane moves and row selections go over these)
    F64 = ("temperature", "temp_eff", "top_p", "min_p", "log_min_p", "repetition_penalty", "frequency_penalty",
           "presence_penalty")
    I64 = ("top_k", "topk_threshold", "topp_threshold", "seed")
    BOOL = ("coupled", "greedy", "coupled_draw", "matches")  # coupled_draw: coupled and not greedy;
    # matches: greedy or coupled (a lane whose draft is accepted iff it equals the target's own choice)
    FIELDS = F64 + I64 + BOOL
    # neutral values: greedy, no filter, no penalty
    _NEUTRAL = dict(temperature=0.0, temp_eff=1.0, top_p=1.0, min_p=0.0, log_min_p=-math.inf, repetition_penalty=1.0,
                    frequency_penalty=0.0, presence_penalty=0.0, top_k=0, topk_threshold=KEEP_ALL,
                    topp_threshold=KEEP_ALL, seed=0, coupled=False, greedy=True, coupled_draw=False,
                    matches=True)

    def __init__(self, batch: int, device: torch.device | str | None = None) -> None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.batch = batch
        self.device = dev
        self._f64 = torch.tensor([[self._NEUTRAL[n]] * batch for n in self.F64], dtype=torch.float64, device=dev)
        self._i64 = torch.tensor([[self._NEUTRAL[n]] * batch for n in self.I64], dtype=torch.int64, device=dev)
        self._bool = torch.tensor([[self._NEUTRAL[n]] * batch for n in self.BOOL], dtype=torch.bool, device=dev)
        self._bind()
        self.params: list[SamplingParams] = [_GREEDY] * batch  # host copy, for inspection

    def _bind(self) -> None:
        """Each field as a [B] view: a row of its storage."""
        for store, names in ((self._f64, self.F64), (self._i64, self.I64), (self._bool, self.BOOL)):
            for i, name in enumerate(names):
                setattr(self, name, store[i])

    def fields(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.FIELDS]

    def view(self, rows, batch: int) -> "SamplingTable":
        """A table whose every field is rows(field) (a selection of `batch` rows)."""
        out = SamplingTable.__new__(SamplingTable)
        for name in self.FIELDS:
            setattr(out, name, rows(getattr(self, name)))
        out.batch, out.device, out.params = batch, self.device, None
        return out

    def repeat(self, lanes: int, per_lane: int = 1) -> "SamplingTable":
        """The table over the first `lanes` lanes, each repeated per_lane times (a row per
        verify row, lane-major): one copy per storage (per field for a :meth:`view`)."""
        if not hasattr(self, "_f64"):  # a view: its fields are separate tensors
            return self.view(lambda t: t[:lanes].repeat_interleave(per_lane) if per_lane > 1 else t[:lanes],
                             lanes * per_lane)
        out = SamplingTable.__new__(SamplingTable)
        for name in ("_f64", "_i64", "_bool"):
            st = getattr(self, name)[:, :lanes]
            setattr(out, name, st.repeat_interleave(per_lane, dim=1) if per_lane > 1 else st)
        out._bind()
        out.batch, out.device, out.params = lanes * per_lane, self.device, None
        return out

    def set(self, lane: int, params: SamplingParams | None) -> None:
        """Write lane's parameters (None: an unused lane, greedy and neutral).  A host to
        device copy per storage; call it outside a graph capture, between replays."""
        if not hasattr(self, "_f64"):
            raise TypeError("SamplingTable.set: a view() of a table is read-only; set the lane on the table itself")
        p = _GREEDY if params is None else params
        pen = p.has_penalties
        self.params[lane] = p
        v = dict(
            temperature=float(p.temperature),
            temp_eff=1.0 if p.greedy else float(p.temperature),
            top_p=float(p.top_p), min_p=float(p.min_p),
            log_min_p=math.log(p.min_p) if p.min_p > 0 else -math.inf,
            repetition_penalty=float(p.repetition_penalty) if pen else 1.0,
            frequency_penalty=float(p.frequency_penalty) if pen else 0.0,
            presence_penalty=float(p.presence_penalty) if pen else 0.0,
            # (a k past int64, which SamplingParams and the server take, keeps every token as k >= V does)
            top_k=min(int(p.top_k), KEEP_ALL), topk_threshold=min(int(p.top_k), KEEP_ALL) if p.top_k > 0 else KEEP_ALL,
            # probs_batch's threshold: top_p in fixed-point masses, at least 1 (the top token)
            topp_threshold=max(1, int(float(p.top_p) * float(MASS_ONE))) if p.top_p < 1.0 else KEEP_ALL,
            seed=_signed64(p.seed), coupled=p.mode == "coupled", greedy=p.greedy,
            coupled_draw=p.mode == "coupled" and not p.greedy, matches=p.greedy or p.mode == "coupled")
        for store, names, dt in ((self._f64, self.F64, torch.float64), (self._i64, self.I64, torch.int64),
                                 (self._bool, self.BOOL, torch.bool)):
            store[:, lane].copy_(torch.tensor([v[n] for n in names], dtype=dt))

    def set_all(self, params: Sequence[SamplingParams | None]) -> None:
        if len(params) != self.batch:
            raise ValueError(f"expected {self.batch} lanes' params, got {len(params)}")
        for lane, p in enumerate(params):
            self.set(lane, p)


# --------------------------------------------------------------------------------------
# Philox with per-lane keys
# --------------------------------------------------------------------------------------


def gumbel_lanes(
    seeds: torch.Tensor, stream: int, positions: torch.Tensor, vocab: int, kernel: bool | None = None
) -> torch.Tensor:
    """:func:`hyspec.rng.gumbel_noise` per lane: float64 [B, vocab], counters
    ``position * 2**32 + token``.  The uniforms come from the Triton kernel
    :func:`hyspec.kernels.rng.u01_rows` on CUDA (kernel=None) and from its torch reference
    (:func:`u01_lanes` over the same counters) otherwise; both are bit-identical."""
    if kernel is None:
        kernel = positions.is_cuda and triton_available()
    if kernel:
        u = u01_rows(seeds, stream, positions, vocab)  # [B, V]
    else:
        u = u01_rows_ref(seeds, stream, positions, vocab)  # [B, V]: u01_lanes over those counters
    return -torch.log(-torch.log(u))


# --------------------------------------------------------------------------------------
# Sampling regimes: which stages a round's graphs contain
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampledGraphKey:
    """The sampling work a batch needs, from its lanes' params (part of a graph's key: a
    new regime captures its graphs once). A stage no lane uses is left out; every stage is
    the identity, bitwise, for a lane that does not use it (top-k 0, top-p 1, min-p 0,
    neutral penalties, the other mode's draw discarded), so a lane's numbers do not depend
    on the regime its batch runs under. :data:`ALL_STAGES` (every field True) is the
    general function the tests check against the reference."""

    sampled: bool = True  # some lane samples (temperature > 0); False: greedy lanes with penalties only
    top_k: bool = True  # some sampled lane has top_k > 0
    top_p: bool = True  # ... top_p < 1
    min_p: bool = True  # ... min_p > 0
    coupled: bool = True  # some sampled lane is in coupled mode
    rejection: bool = True  # some sampled lane is in rejection mode
    penalties: bool = True  # some lane (greedy or sampled) has penalties
    bias: bool = True  # some lane (greedy or sampled) has a logit_bias

    @classmethod
    def of(cls, params: Sequence[SamplingParams | None]) -> "SampledGraphKey | None":
        """The regime of these lanes; None when every lane is greedy without penalties or a
        logit bias (the argmax graphs)."""
        ps = [p for p in params if p is not None]
        smp = [p for p in ps if not p.greedy]
        pen = any(p.has_penalties for p in ps)
        bias = any(getattr(p, "logit_bias", ()) for p in ps)
        if not smp and not pen and not bias:
            return None
        return cls(sampled=bool(smp), top_k=any(p.top_k > 0 for p in smp), top_p=any(p.top_p < 1.0 for p in smp),
                   min_p=any(p.min_p > 0.0 for p in smp), coupled=any(p.mode == "coupled" for p in smp),
                   rejection=any(p.mode != "coupled" for p in smp), penalties=pen, bias=bias)


ALL_STAGES = SampledGraphKey()


# --------------------------------------------------------------------------------------
# Probabilities
# --------------------------------------------------------------------------------------


def _softmax_kept(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.softmax(torch.where(keep, x, -math.inf), dim=-1)


def fill_bias_row(row: torch.Tensor, params) -> None:
    """A lane's logit_bias row [V] float32 in place: each (id, bias) of params.logit_bias,
    -0.0 elsewhere (adding -0.0 leaves a logit as it is, bitwise, -0.0 included: the
    reference adds nothing there). An id past the row is a ValueError naming it (on CUDA
    the write would be a device-side assert)."""
    row.fill_(-0.0)
    bias = getattr(params, "logit_bias", ()) if params is not None else ()
    if bias:
        check_logit_bias(params, row.shape[0])
        ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
        row[ids.to(row.device)] = torch.tensor([b for _, b in bias], dtype=torch.float32).to(row.device)


def _penalised(logits: torch.Tensor, table: SamplingTable, counts: torch.Tensor | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """apply_penalties per lane, in the same dtype (float32 or wider) as the reference:
    bias [B, V] float32 (the lanes' logit_bias rows, -0.0 where a lane has none: adding
    -0.0 leaves every value as it is, bitwise) first, then the penalties from counts."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = logits.to(dtype)  # [B, V]
    if bias is not None:
        out = out + bias
    if counts is None:
        return out
    c = counts.to(dtype)  # [B, V]
    present = counts > 0  # [B, V]
    r = table.repetition_penalty.to(dtype).unsqueeze(1)  # [B, 1]
    fp = table.frequency_penalty.to(dtype).unsqueeze(1)  # [B, 1]
    pp = table.presence_penalty.to(dtype).unsqueeze(1)  # [B, 1]
    # neutral values (r = 1, fp = pp = 0) leave every entry bitwise unchanged
    out = torch.where(present, torch.where(out > 0, out / r, out * r), out)
    out = out - fp * c
    return out - pp * present.to(dtype)


SCAN_CHUNK = 1024  # elements per row of the chunked scans (cumsum_rows)
# logits dtypes whose ranking key the top-p kernels form themselves (bits of the key)
_FUSED_KEY_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


def cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum along dim 1 of an integer x [B, N], exact (the same as
    x.cumsum(1)), as chunks of SCAN_CHUNK: a scan of every chunk (the chunks as rows) plus
    the exclusive scan of the chunk totals. torch's CUDA scan of a 2-D tensor runs one
    thread block per 32 rows, which crawls along rows as long as a vocabulary (one block
    for a 16-row block of 151,936: about a millisecond); chunks as rows spread it out."""
    B, N = x.shape
    L = SCAN_CHUNK
    if N <= L:
        return x.cumsum(1)
    C = -(-N // L)
    xp = torch.nn.functional.pad(x, (0, C * L - N)) if C * L != N else x  # [B, C*L] (zeros add nothing)
    within = xp.reshape(B * C, L).cumsum(1).view(B, C, L)  # [B, C, L]
    total = within[:, :, -1]  # [B, C]
    ahead = total.cumsum(1) - total  # [B, C] the chunks before
    return (within + ahead.unsqueeze(2)).view(B, C * L)[:, :N]


_FLOAT_BITS = {torch.bfloat16: (torch.int16, 16), torch.float16: (torch.int16, 16),
               torch.float32: (torch.int32, 32), torch.float64: (torch.int64, 64)}
DIGIT_BITS = 16  # at most this many bits of the ranking key per pass of prefix_select (65536 bins)


def order_key(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(key [B, V], bits n): a signed integer of the float's width n (int16 / int32 /
    int64) whose order is the order of the float values: the IEEE bits with the magnitude
    flipped below zero (-0.0 + 0.0 is +0.0 first: the two compare equal)."""
    view, n = _FLOAT_BITS[values.dtype]
    bits = (values + 0.0).view(view)
    return bits ^ ((bits >> (n - 1)) & ((1 << (n - 1)) - 1)), n


def prefix_select(key: torch.Tensor, bits: int, valid: torch.Tensor, weight: torch.Tensor,
                  threshold: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """keep [B, V]: valid tokens whose *ahead weight* is below threshold [B, 1], without
    sorting. Tokens are ranked by decreasing key (:func:`order_key`), ties towards the
    lowest id; the ahead weight of a token is the sum of ``weight`` (int64 >= 0, zero
    outside ``valid``) over the tokens ranked before it. (top-k: weight 1, threshold k;
    top-p: the fixed-point masses and top_p.)

    Exact, with the same result as a sort followed by an exclusive cumulative sum: the
    ahead weight only grows along the ranking, so the kept tokens are a prefix of it,
    ending at a cut key K*: every token with key > K* is kept, every token below dropped,
    and the tokens with key == K* are ranked by id. A radix search finds K*, DIGIT_BITS
    bits per pass: a histogram of the weights per digit of the tokens that share K*'s
    higher digits (a scatter-add of integers: exact in any order) gives, for each digit,
    the weight ranked ahead of its tokens; K*'s digit is the last one whose bin, with all
    the weight ahead of it, reaches the threshold (0 when none does: then every such
    token is kept, and the refinement of digit 0 keeps them too). An exclusive cumulative
    sum in token order settles the ties at K*. A pass takes about log2(V) bits (at most
    DIGIT_BITS): its histogram is no larger than a row.

    kernel=True (16- and 32-bit keys, or the bf16 / fp16 / fp32 values themselves, whose
    key and valid mask (not -inf; valid may then be None) the kernels form as they load
    them; 64-bit keys stay here): the same search as the Triton kernels :func:`hyspec.kernels.probs.topp.prefix_select_rows` (5 or 7 launches
    instead of ~35 torch ops; this function is their reference). probs_batch uses it on
    CUDA (HYSPEC_TOPP_KERNEL=0: off), in the interpreter with HYSPEC_TOPP_KERNEL=1."""
    if kernel and bits in (16, 32):
        return prefix_select_rows(key, bits, valid, weight, threshold)
    B, V = key.shape
    width = max(4, min(DIGIT_BITS, V.bit_length() - 1))  # bits per pass
    base = torch.zeros(B, 1, dtype=torch.int64, device=key.device)  # weight ranked ahead of K*'s higher digits
    cut_key = None  # [B, 1] int64: K*'s digits found so far
    done = 0  # key bits resolved
    while done < bits:
        w = min(width, bits - done)
        shift = bits - done - w
        nbins = 1 << w
        if cut_key is None:  # the top digit of the signed key, in [0, nbins)
            digit, wd = (key >> shift if shift else key).to(torch.int64) + (nbins >> 1), weight
        else:
            digit = ((key >> shift) & (nbins - 1)).to(torch.int64)  # [B, V]
            wd = torch.where((key >> (shift + w)) == cut_key.to(key.dtype), weight, 0)
        hist = torch.zeros(B, nbins, dtype=torch.int64, device=key.device).scatter_add_(1, digit, wd)  # [B, bins]
        reach = base + cumsum_rows(hist.flip(1)).flip(1)  # [B, bins] weight ahead of digit d's bin plus its own
        cut = ((reach >= threshold).sum(1, keepdim=True) - 1).clamp(min=0)  # [B, 1] K*'s digit
        base = reach.gather(1, cut) - hist.gather(1, cut)
        cut_key = cut - (nbins >> 1) if cut_key is None else (cut_key << w) | cut
        done += w
    cut_key = cut_key.to(key.dtype)  # (it fits: a key's value)
    tie = key == cut_key  # [B, V]
    wt = torch.where(tie, weight, 0)
    before = cumsum_rows(wt) - wt  # [B, V] equal keys: the lower ids are ahead
    return valid & ((key > cut_key) | (tie & (before < threshold - base)))


def probs_batch(
    logits: torch.Tensor, table: SamplingTable, counts: torch.Tensor | None = None,
    regime: SampledGraphKey = ALL_STAGES, kernel: bool | None = None, topp_kernel: bool | None = None,
    with_best: bool = False, bias: torch.Tensor | None = None,
):
    """``row_probs`` for every lane: logits [B, V] (any float dtype), counts [B, V] (the
    lanes' ``hyspec.gpu.penalties.PenaltyWindow.counts``, None = no penalties) -> float64 probs [B, V]
    (with_best: (probs, best [B]), best = the first argmax of the penalised logits, which
    is the argmax of a greedy lane's one-hot row).

    bias [B, V] (given where some lane has a logit_bias) -> penalties -> temperature ->
    top-k -> top-p -> min-p as the reference's apply_penalties and filter_probs
    defines them, without a sort: top-k and top-p are :func:`prefix_select` over the
    (penalised) logits' ranking key (a lane with the filter off has the KEEP_ALL
    threshold, which keeps every valid token), min-p an elementwise test; greedy lanes get
    a one-hot at the argmax (lowest id on ties). ``regime`` leaves out the stages no lane
    uses.

    kernel (default: on CUDA with triton): the softmaxes run as the row kernel
    :func:`hyspec.kernels.probs.softmax_rows`, with the temperature, the keep mask, min-p
    and the greedy one-hot inside it and the top-p masses as its fixed-point output (a
    row's result then depends on that row alone, for any row count; float64 to a few
    ulps of the torch ops, which are the reference).

    topp_kernel: top-k / top-p by the Triton kernels of :mod:`hyspec.kernels.probs.topp`
    (the same keep sets, bitwise); default: with ``kernel`` on CUDA unless the environment
    variable ``HYSPEC_TOPP_KERNEL=0``, in the Triton interpreter only with ``=1``.
    """
    # [B, V] the ranking values (bias [B, V]: the lanes' logit_bias rows, given where regime.bias)
    x0 = _penalised(logits, table, counts, bias) if regime.penalties or bias is not None else logits
    B, V = x0.shape
    if kernel is None:
        kernel = x0.is_cuda and triton_available()
    # [B, 1] the first max: rank 0 (kernel: argmax_rows, or the top-p mass softmax's launches below)
    best_in_mass = bool(kernel) and regime.sampled and regime.top_p and x0.dtype in _FUSED_KEY_BITS
    best = None if best_in_mass else first_max(x0, bool(kernel)).unsqueeze(1)
    if not regime.sampled:
        p = torch.zeros(B, V, dtype=torch.float64, device=x0.device).scatter_(1, best, 1.0)
        return (p, best.squeeze(1)) if with_best else p
    temp = table.temp_eff  # [B] (1 for greedy lanes)
    if topp_kernel is None:
        topp_kernel = bool(kernel) and topp_kernel_enabled(x0.is_cuda)
    # top-p alone through the kernels on 16- / 32-bit logits: they form the ranking key from
    # the values' bits and the valid tokens (not -inf) themselves (no key or mask tensors)
    fused = bool(kernel) and topp_kernel and regime.top_p and not regime.top_k and x0.dtype in _FUSED_KEY_BITS \
        and x0.stride(1) == 1
    if kernel:  # x / t is formed inside the kernels; the finite logits are the valid tokens (x / t
        # can overflow to -inf where x cannot only for a tiny t: such a token ranks below every
        # finite one and the kernels' own x / t > -inf test gives it probability 0 all the same)
        xt = None
        keep = x0 > -math.inf if (regime.top_k or regime.top_p) and not fused else None  # [B, V]
    else:
        xt = torch.div(x0, temp.unsqueeze(1))  # [B, V] float64 (x0 widened exactly, then divided: one kernel)
        keep = xt > -math.inf  # [B, V] (no NaN or +inf: a precondition)
    if fused:
        key, bits = x0, _FUSED_KEY_BITS[x0.dtype]
    elif regime.top_k or regime.top_p:
        key, bits = order_key(x0)
    if regime.top_k:  # the k best (threshold k; KEEP_ALL for k = 0; k >= V keeps all the same)
        keep = prefix_select(key, bits, keep, keep.to(torch.int64), table.topk_threshold.unsqueeze(1), topp_kernel)
    if regime.top_p:
        # [B, V] int64, 0 outside keep
        if best_in_mass:
            mass, best = softmax_rows(x0, temp, keep, mass=True, with_best=True)
            best = best.unsqueeze(1)
        else:
            mass = softmax_rows(x0, temp, keep, mass=True) if kernel else fixed_mass(_softmax_kept(xt, keep))
        # the threshold (top_p in fixed point, >= 1) keeps the top token (nothing is ahead of
        # it; every other token has it, of positive mass, ahead): the reference's "or rank 0"
        keep = prefix_select(key, bits, keep, mass, table.topp_threshold.unsqueeze(1), topp_kernel)
    if kernel:  # min-p against x[best] / t (= the max of x / t: division by t > 0 keeps the order)
        floor = table.log_min_p if regime.min_p else None  # (min_p = 0: log_min_p = -inf keeps all)
        # greedy rows keep their top token alone
        p = softmax_rows(x0, temp, keep, only_if=table.greedy, floor=floor, top=best)
        return (p, best.squeeze(1)) if with_best else p
    if regime.min_p:
        near = (xt - xt.amax(dim=1, keepdim=True)) >= table.log_min_p.unsqueeze(1)  # [B, V]
        keep = torch.where(table.min_p.unsqueeze(1) > 0.0, keep & near, keep)
    # greedy lanes keep their top token alone: the softmax of one entry is exactly one-hot
    is_best = torch.arange(V, device=x0.device) == best  # [B, V]
    p = _softmax_kept(xt, torch.where(table.greedy.unsqueeze(1), is_best, keep))
    return (p, best.squeeze(1)) if with_best else p


# --------------------------------------------------------------------------------------
# Token choice
# --------------------------------------------------------------------------------------


def sample_rows(probs: torch.Tensor, u: torch.Tensor, chunked: bool | None = None,
                kernel: bool | None = None) -> torch.Tensor:
    """``sample_index`` per row: inverse-CDF token of probs [B, V] for uniforms u [B].

    The first token whose cumulative mass exceeds ``u * total``; if rounding leaves none,
    the last token with positive probability (token 0 for a row without mass). On the CPU
    the reference's sequential float64 scan (the same bits); on CUDA with triton
    (kernel=None) the row kernel :func:`hyspec.kernels.probs.inverse_cdf_rows`, else
    (chunked=None: CUDA) its torch form :func:`hyspec.kernels.probs.inverse_cdf_rows_ref`:
    both add the masses in another order (per 1024-token chunk, then over the chunks; the
    GPU's scan never matched the CPU's bits) and avoid torch's slow long-row scan."""
    p = probs.to(torch.float64)
    V = p.shape[1]
    if kernel is None:
        kernel = p.is_cuda and triton_available()
    if kernel:
        return inverse_cdf_rows(p, u)
    if chunked is None:
        chunked = p.is_cuda and V > SCAN_CHUNK
    if chunked:
        return inverse_cdf_rows_ref(p, u)
    cdf = torch.cumsum(p, dim=1)  # [B, V]
    target = u.to(torch.float64).unsqueeze(1) * cdf[:, -1:]  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [B]
    col = torch.arange(V, device=p.device)
    last = torch.where(p > 0, col, torch.full_like(col, -1)).amax(dim=1).clamp(min=0)  # [B]
    return torch.where(idx >= V, last, idx)


def coupled_rows(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                 kernel: bool | None = None) -> torch.Tensor:
    """``coupled_token`` per row: argmax over {p > 0} of log p + Gumbel(seed, COUPLED, pos).
    On CUDA (kernel=None) one fused Triton pass (:func:`hyspec.kernels.rng.gumbel_argmax`:
    the same uniforms and operations, the noise never stored); elsewhere the torch ops."""
    p = probs.to(torch.float64)
    if kernel is None:
        kernel = p.is_cuda and triton_available()
    if kernel:
        return gumbel_argmax(p, seeds, Stream.COUPLED, positions)
    g = gumbel_lanes(seeds, Stream.COUPLED, positions, p.shape[1], kernel=False)  # [B, V]
    score = torch.where(p > 0, torch.log(p) + g, -math.inf)
    return score.argmax(dim=1)


# the few draws of a round (u01_draws) in one Triton launch where the row kernels run;
# HYSPEC_U01_KERNEL=0 (or False here, before a graph is captured) restores the torch ops
U01_KERNEL = switch("HYSPEC_U01_KERNEL")


def u01_draws(seeds: torch.Tensor, stream: int, counters: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """float64 [B, ...]: ``u01(seeds[b], stream, counters[b, ...])``, the few uniforms of a
    round (one per lane or draft): on CUDA (kernel=None) or with kernel=True one Triton launch
    (:func:`hyspec.kernels.rng.u01_at`), else the torch ops of :func:`u01_lanes` (~250
    launches of a few elements each); the same bits."""
    if kernel is None:
        kernel = counters.is_cuda and triton_available()
    return u01_at(seeds, stream, counters) if kernel and U01_KERNEL else u01_lanes(seeds, stream, counters)


def _choose(probs: torch.Tensor, table: SamplingTable, positions: torch.Tensor, stream: int,
            regime: SampledGraphKey = ALL_STAGES, kernel: bool | None = None,
            best: torch.Tensor | None = None) -> torch.Tensor:
    """greedy lanes: argmax; coupled lanes: Gumbel-max; others: inverse CDF with ``stream``
    (a draw no lane of the regime uses is not made). kernel: as :func:`sample_rows` and
    :func:`coupled_rows` (None: on CUDA); best [B]: probs_batch's best (the argmax of a
    greedy lane's one-hot row, so no pass over the probabilities)."""
    tok = probs.argmax(dim=1) if best is None else best  # [B]; greedy lanes (their rows are one-hot)
    if not regime.sampled:
        return tok
    pos = positions.to(torch.int64)
    if regime.rejection:
        u = u01_draws(table.seed, stream, pos, kernel)  # [B]
        tok = torch.where(table.greedy, tok, sample_rows(probs, u, kernel=kernel))
    if regime.coupled:
        tok = torch.where(table.coupled_draw, coupled_rows(probs, table.seed, pos, kernel=kernel), tok)
    return tok


def plain_tokens(probs: torch.Tensor, table: SamplingTable, positions: torch.Tensor,
                 regime: SampledGraphKey = ALL_STAGES, kernel: bool | None = None,
                 best: torch.Tensor | None = None) -> torch.Tensor:
    """``plain_token`` per lane: probs [B, V], positions [B] (absolute) -> tokens [B]."""
    return _choose(probs, table, positions, Stream.PLAIN, regime, kernel, best)


def draft_tokens(q: torch.Tensor, table: SamplingTable, positions: torch.Tensor,
                 regime: SampledGraphKey = ALL_STAGES, kernel: bool | None = None,
                 best: torch.Tensor | None = None) -> torch.Tensor:
    """The drafter's token per lane (as in hyspec.core.round): greedy -> argmax q,
    coupled -> ``coupled_token``, rejection -> ``draft_token`` (stream DRAFT)."""
    return _choose(q, table, positions, Stream.DRAFT, regime, kernel, best)


def _row(x: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """x [B, R, V], j [B] -> x[b, j[b]] as [B, V]."""
    return x.gather(1, j.view(-1, 1, 1).expand(-1, 1, x.shape[2])).squeeze(1)


def speculative_accept(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    table: SamplingTable,
    positions: torch.Tensor,
    k_lane: torch.Tensor,
    regime: SampledGraphKey = ALL_STAGES,
    kernel: bool | None = None,
    best: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a round for every lane: (n accepted [B], next_token [B]).

    p [B, k+1, V] target probs (row j decides position ``positions + j``), q [B, k, V]
    the drafter's probs, drafts [B, k], positions [B] = the first draft's absolute
    position, k_lane [B] <= k the drafts lane b really has.  Per lane this equals
    ``speculative_sample`` (rejection), ``coupled_speculative`` (coupled) or greedy
    acceptance (argmax-match prefix, then the argmax) called with the first
    ``k_lane[b]`` drafts and ``p[b, :k_lane[b] + 1]``; drafts past ``k_lane`` count as
    rejected and the lane's next token is decided by row ``k_lane`` as a bonus.
    ``regime`` leaves out the coupled or the rejection work when no lane needs it;
    kernel: the row kernels for the draws (as :func:`sample_rows`; None: on CUDA);
    best [B, k+1] (or flat [B * (k+1)]): probs_batch's best per row (a greedy lane's
    argmax without a pass over p; the coupled draws of all rows then run as one call).
    """
    B, R, V = p.shape
    k = R - 1
    p = p.to(torch.float64)
    q = q.to(torch.float64)
    pos = positions.to(torch.int64)  # [B]
    kl = k_lane.to(torch.int64)  # [B]
    j = torch.arange(max(k, 1), device=p.device).unsqueeze(0)  # [1, k]
    seeds = table.seed
    if kernel is None:
        kernel = p.is_cuda and triton_available()
    coupled = regime.sampled and regime.coupled
    rejection = regime.sampled and regime.rejection

    # the target's own choice at every row, for greedy and coupled lanes: [B, k+1]; a greedy
    # row's argmax is best (given: no pass over p); a rejection lane's own is unused
    own = (p.reshape(B * R, V).argmax(dim=1) if best is None else best).view(B, R)
    if coupled:  # the coupled draws of all rows in one call
        rows = pos.unsqueeze(1) + torch.arange(R, device=p.device)  # [B, R] each row's position
        drawn = coupled_rows(p.reshape(B * R, V), seeds.repeat_interleave(R), rows.reshape(-1), kernel)
        own = torch.where(table.coupled_draw.unsqueeze(1), drawn.view(B, R), own)
    match_lane = table.matches  # [B] greedy or coupled (without rejection lanes: every lane, unread)

    if k > 0:
        d = drafts.to(torch.int64).clamp(0, V - 1)  # [B, k]; lanes' unused drafts are ignored
        accepted = own[:, :k] == d
        if rejection:
            pd = p[:, :k].gather(2, d.unsqueeze(2)).squeeze(2)  # [B, k]
            qd = q.gather(2, d.unsqueeze(2)).squeeze(2)  # [B, k]
            u_acc = u01_draws(seeds, Stream.ACCEPT, pos.unsqueeze(1) + j, kernel)  # [B, k]
            accepted = torch.where(match_lane.unsqueeze(1), accepted, u_acc * qd < pd)
        accepted &= j < kl.unsqueeze(1)  # [B, k]
        n = torch.where(accepted, torch.full_like(j, k), j.expand(B, k)).amin(dim=1)  # first rejection
    else:
        n = torch.zeros(B, dtype=torch.int64, device=p.device)
    own_n = own.gather(1, n.unsqueeze(1)).squeeze(1)  # [B]
    if not rejection:
        return n, own_n

    # sampled lanes: recovered token (residual at row n) or bonus (row n = k_lane)
    rejected = n < kl  # [B]
    u = torch.where(
        rejected,
        u01_draws(seeds, Stream.RESIDUAL, pos + n, kernel),
        u01_draws(seeds, Stream.BONUS, pos + n, kernel),
    )
    if kernel:  # the kernel reads rows n of p and q in place and forms the residual itself
        q_n = n.clamp(max=k - 1) if k > 0 else None
        sampled = inverse_cdf_rows(p, u, n, q if k > 0 else None, q_n, rejected)  # [B]
        return n, torch.where(match_lane, own_n, sampled)
    p_n = _row(p, n)  # [B, V]
    if k > 0:
        resid = (p_n - _row(q, n.clamp(max=k - 1))).clamp(min=0.0)  # [B, V]
        has_mass = (resid > 0).any(dim=1, keepdim=True)  # [B, 1] == (resid.sum() > 0)
        dist = torch.where(rejected.unsqueeze(1) & has_mass, resid, p_n)
    else:
        dist = p_n
    sampled = sample_rows(dist, u, kernel=False)  # [B]
    return n, torch.where(match_lane, own_n, sampled)
