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
  tensors ``[B]``.
* :func:`probs_batch` (= ``row_probs``; penalties from per-lane token counts),
  :func:`plain_tokens`, :func:`draft_tokens`, :func:`speculative_accept`.
* the penalty window (per-lane token counts kept on the device) and the verify rows'
  penalised probabilities: :mod:`hyspec.gpu.penalties` (tested against the reference;
  the graph round does not use penalties yet: the engine core serves them).

Preconditions the reference checks and this module cannot (checking would need a host
sync): logits have no NaN or ``+inf`` and every row has a finite entry; probability rows
are non-negative with positive mass (a row without mass yields token 0 where the
reference raises); positions are in ``[0, 2**31)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hyspec.kernels.common import triton_available
from hyspec.kernels.rng import u01_rows, u01_rows_ref
from hyspec.rng import Stream, u01_lanes
from hyspec.sampling import SamplingParams

__all__ = [
    "SamplingTable",
    "u01_lanes",
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


class SamplingTable:
    """Sampling parameters of ``batch`` lanes as device tensors (filled on the host with
    :meth:`set`, read by the batched functions).

    Lanes without penalties (``SamplingParams.has_penalties`` false) hold the neutral
    values (1, 0, 0), so whatever their counts are the penalty step leaves them unchanged.
    """

    # the per-lane tensor fields, each [B] (views, lane moves and row selections go over these)
    FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
              "presence_penalty", "seed", "coupled", "greedy")

    def __init__(self, batch: int, device: torch.device | str | None = None) -> None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        f64 = {"dtype": torch.float64, "device": dev}
        i64 = {"dtype": torch.int64, "device": dev}
        self.batch = batch
        self.device = dev
        self.temperature = torch.zeros(batch, **f64)  # [B] 0 = greedy
        self.top_k = torch.zeros(batch, **i64)  # [B] 0 = off
        self.top_p = torch.ones(batch, **f64)  # [B] 1 = off
        self.min_p = torch.zeros(batch, **f64)  # [B] 0 = off
        self.repetition_penalty = torch.ones(batch, **f64)  # [B] 1 = off
        self.frequency_penalty = torch.zeros(batch, **f64)  # [B] 0 = off
        self.presence_penalty = torch.zeros(batch, **f64)  # [B] 0 = off
        self.seed = torch.zeros(batch, **i64)  # [B] the uint64 seed's bits as int64
        self.coupled = torch.zeros(batch, dtype=torch.bool, device=dev)  # [B] mode == "coupled"
        self.greedy = torch.ones(batch, dtype=torch.bool, device=dev)  # [B] temperature == 0
        self.params: list[SamplingParams] = [_GREEDY] * batch  # host copy, for inspection

    def fields(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.FIELDS]

    def view(self, rows, batch: int) -> "SamplingTable":
        """A table whose every field is rows(field) (a selection of `batch` rows)."""
        out = SamplingTable.__new__(SamplingTable)
        for name in self.FIELDS:
            setattr(out, name, rows(getattr(self, name)))
        out.batch, out.device, out.params = batch, self.device, None
        return out

    def set(self, lane: int, params: SamplingParams | None) -> None:
        """Write lane's parameters (None: an unused lane, greedy and neutral).  A host to
        device copy per field; call it outside a graph capture, between replays."""
        p = _GREEDY if params is None else params
        pen = p.has_penalties
        self.params[lane] = p
        self.temperature[lane] = float(p.temperature)
        self.top_k[lane] = int(p.top_k)
        self.top_p[lane] = float(p.top_p)
        self.min_p[lane] = float(p.min_p)
        self.repetition_penalty[lane] = float(p.repetition_penalty) if pen else 1.0
        self.frequency_penalty[lane] = float(p.frequency_penalty) if pen else 0.0
        self.presence_penalty[lane] = float(p.presence_penalty) if pen else 0.0
        self.seed[lane] = _signed64(p.seed)
        self.coupled[lane] = p.mode == "coupled"
        self.greedy[lane] = p.greedy

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
# Probabilities
# --------------------------------------------------------------------------------------


def _softmax_kept(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.softmax(torch.where(keep, x, torch.full_like(x, -math.inf)), dim=-1)


def _penalised(logits: torch.Tensor, table: SamplingTable, counts: torch.Tensor | None) -> torch.Tensor:
    """apply_penalties per lane, in the same dtype (float32 or wider) as the reference."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = logits.to(dtype)  # [B, V]
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


def probs_batch(
    logits: torch.Tensor, table: SamplingTable, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """``row_probs`` for every lane: logits [B, V] (any float dtype), counts [B, V] (the
    lanes' ``hyspec.gpu.penalties.PenaltyWindow.counts``, None = no penalties) -> float64 probs [B, V].

    Penalties -> temperature -> top-k -> top-p -> min-p, each a mask over the row sorted
    by decreasing logit (stable: ties keep ascending ids); greedy lanes get a one-hot at
    the argmax (lowest id on ties).
    """
    x = _penalised(logits, table, counts).to(torch.float64)  # [B, V]
    V = x.shape[1]
    greedy = table.greedy.unsqueeze(1)  # [B, 1]
    onehot = torch.zeros_like(x).scatter_(1, x.argmax(dim=1, keepdim=True), 1.0)  # [B, V]

    temp = torch.where(table.greedy, torch.ones_like(table.temperature), table.temperature)  # [B]
    xs, order = torch.sort(x / temp.unsqueeze(1), dim=1, descending=True, stable=True)  # [B, V]
    col = torch.arange(V, device=x.device).unsqueeze(0)  # [1, V] rank in the sorted row
    keep = torch.isfinite(xs)  # [B, V]; column 0 is finite

    k = table.top_k.unsqueeze(1)  # [B, 1]
    keep &= ~((k > 0) & (col >= k))  # top-k (k >= V keeps everything)

    top_p = table.top_p.unsqueeze(1)  # [B, 1]
    cum = torch.cumsum(_softmax_kept(xs, keep), dim=1)  # [B, V]
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # [B, V]
    keep = torch.where(top_p < 1.0, keep & ((mass_before < top_p) | (col == 0)), keep)

    min_p = table.min_p.unsqueeze(1)  # [B, 1]
    ps = _softmax_kept(xs, keep)  # [B, V]
    keep = torch.where(min_p > 0.0, keep & (ps >= min_p * ps[:, :1]), keep)

    ps = _softmax_kept(xs, keep)  # [B, V], sorted order
    sampled = torch.zeros_like(ps).scatter_(1, order, ps)  # [B, V], token order
    return torch.where(greedy, onehot, sampled)


# --------------------------------------------------------------------------------------
# Token choice
# --------------------------------------------------------------------------------------


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``sample_index`` per row: inverse-CDF token of probs [B, V] for uniforms u [B].

    The first token whose cumulative mass exceeds ``u * total``; if rounding leaves none,
    the last token with positive probability (token 0 for a row without mass)."""
    p = probs.to(torch.float64)
    V = p.shape[1]
    cdf = torch.cumsum(p, dim=1)  # [B, V]
    target = u.to(torch.float64).unsqueeze(1) * cdf[:, -1:]  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [B]
    col = torch.arange(V, device=p.device)
    last = torch.where(p > 0, col, torch.full_like(col, -1)).amax(dim=1).clamp(min=0)  # [B]
    return torch.where(idx >= V, last, idx)


def coupled_rows(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``coupled_token`` per row: argmax over {p > 0} of log p + Gumbel(seed, COUPLED, pos)."""
    p = probs.to(torch.float64)
    g = gumbel_lanes(seeds, Stream.COUPLED, positions, p.shape[1])  # [B, V]
    score = torch.where(p > 0, torch.log(p) + g, torch.full_like(p, -math.inf))
    return score.argmax(dim=1)


def _choose(probs: torch.Tensor, table: SamplingTable, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """greedy lanes: argmax; coupled lanes: Gumbel-max; others: inverse CDF with ``stream``."""
    pos = positions.to(torch.int64)
    u = u01_lanes(table.seed, stream, pos)  # [B]
    tok = torch.where(table.coupled, coupled_rows(probs, table.seed, pos), sample_rows(probs, u))
    return torch.where(table.greedy, probs.argmax(dim=1), tok)


def plain_tokens(probs: torch.Tensor, table: SamplingTable, positions: torch.Tensor) -> torch.Tensor:
    """``plain_token`` per lane: probs [B, V], positions [B] (absolute) -> tokens [B]."""
    return _choose(probs, table, positions, Stream.PLAIN)


def draft_tokens(q: torch.Tensor, table: SamplingTable, positions: torch.Tensor) -> torch.Tensor:
    """The drafter's token per lane (as in hyspec.core.round): greedy -> argmax q,
    coupled -> ``coupled_token``, rejection -> ``draft_token`` (stream DRAFT)."""
    return _choose(q, table, positions, Stream.DRAFT)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a round for every lane: (n accepted [B], next_token [B]).

    p [B, k+1, V] target probs (row j decides position ``positions + j``), q [B, k, V]
    the drafter's probs, drafts [B, k], positions [B] = the first draft's absolute
    position, k_lane [B] <= k the drafts lane b really has.  Per lane this equals
    ``speculative_sample`` (rejection), ``coupled_speculative`` (coupled) or greedy
    acceptance (argmax-match prefix, then the argmax) called with the first
    ``k_lane[b]`` drafts and ``p[b, :k_lane[b] + 1]``; drafts past ``k_lane`` count as
    rejected and the lane's next token is decided by row ``k_lane`` as a bonus.
    """
    B, R, V = p.shape
    k = R - 1
    p = p.to(torch.float64)
    q = q.to(torch.float64)
    pos = positions.to(torch.int64)  # [B]
    kl = k_lane.to(torch.int64)  # [B]
    j = torch.arange(max(k, 1), device=p.device).unsqueeze(0)  # [1, k]
    seeds = table.seed

    # the target's own choice at every row, for greedy and coupled lanes: [B, k+1]
    own = torch.stack(
        [
            torch.where(table.greedy, p[:, r].argmax(dim=1), coupled_rows(p[:, r], seeds, pos + r))
            for r in range(R)
        ],
        dim=1,
    )
    match_lane = table.greedy | table.coupled  # [B]

    if k > 0:
        d = drafts.to(torch.int64).clamp(0, V - 1)  # [B, k]; lanes' unused drafts are ignored
        pd = p[:, :k].gather(2, d.unsqueeze(2)).squeeze(2)  # [B, k]
        qd = q.gather(2, d.unsqueeze(2)).squeeze(2)  # [B, k]
        u_acc = u01_lanes(seeds, Stream.ACCEPT, pos.unsqueeze(1) + j)  # [B, k]
        accepted = torch.where(match_lane.unsqueeze(1), own[:, :k] == d, u_acc * qd < pd)
        accepted &= j < kl.unsqueeze(1)  # [B, k]
        n = torch.where(accepted, torch.full_like(j, k), j.expand(B, k)).amin(dim=1)  # first rejection
    else:
        n = torch.zeros(B, dtype=torch.int64, device=p.device)

    # sampled lanes: recovered token (residual at row n) or bonus (row n = k_lane)
    p_n = _row(p, n)  # [B, V]
    rejected = n < kl  # [B]
    if k > 0:
        resid = (p_n - _row(q, n.clamp(max=k - 1))).clamp(min=0.0)  # [B, V]
        has_mass = (resid > 0).any(dim=1, keepdim=True)  # [B, 1] == (resid.sum() > 0)
        dist = torch.where(rejected.unsqueeze(1) & has_mass, resid, p_n)
    else:
        dist = p_n
    u = torch.where(
        rejected,
        u01_lanes(seeds, Stream.RESIDUAL, pos + n),
        u01_lanes(seeds, Stream.BONUS, pos + n),
    )
    sampled = sample_rows(dist, u)  # [B]
    own_n = own.gather(1, n.unsqueeze(1)).squeeze(1)  # [B]
    return n, torch.where(match_lane, own_n, sampled)
