"""Sampling inside the BatchDecoder's graphs: the per-lane draws of a round, on the device.

Batch invariance (a lane's numbers independent of how many lanes the round has) needs
every float row reduction (the probabilities' softmax, the inverse CDF's sums) computed
per row whatever the row count. On CUDA, and on the CPU under the Triton interpreter
(where the decoder's other kernels run too), they are the row kernels of
:mod:`hyspec.kernels.probs`, so the round samples its rows as they are. Without them
(torch ops: torch's GPU softmax / sum / cumsum pick their kernel from the tensor's shape)
they run on fixed SAMPLE_BLOCK-row blocks (:func:`blocked`). The exact steps (argmax,
integer scans and histograms, integer Philox, the per-row Gumbel-max kernel, the accept
comparisons) are row-invariant as they are. The draws
use the counter-based RNG of hyspec.gpu.sampling at the positions the engine core uses
(streams PLAIN, DRAFT, and the accept / residual / bonus streams of speculative_accept);
``regime`` (hyspec.gpu.sampling.SampledGraphKey) leaves out what no lane needs.
"""
from __future__ import annotations

import torch

from hyspec.gpu import sampling as dsamp
from hyspec.kernels.common import triton_available
from hyspec.kernels.pdl import interpreting

SAMPLE_BLOCK = 16  # rows per sampling call of the torch ops (a fixed shape: batch invariance on the GPU)


def row_kernels(device: torch.device) -> bool:
    """Whether the draws on `device` use the row kernels (CUDA, or the Triton interpreter)."""
    return triton_available() and (device.type == "cuda" or interpreting())


def table_rows(table: dsamp.SamplingTable, lanes: int, per_lane: int = 1) -> dsamp.SamplingTable:
    """The table over the first `lanes` lanes, each repeated per_lane times (one per row)."""
    return table.repeat(lanes, per_lane)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])


def blocked(fn, n: int, *row_args):
    """fn over row-aligned args (tensors or SamplingTables) in fixed SAMPLE_BLOCK-row calls
    (the last one padded with copies of its first row); outputs concatenated back to n rows."""
    outs = []
    for s in range(0, n, SAMPLE_BLOCK):
        e = min(n, s + SAMPLE_BLOCK)
        args = [_pad_rows(a[s:e], SAMPLE_BLOCK) if isinstance(a, torch.Tensor)
                else a.view(lambda t: _pad_rows(t[s:e], SAMPLE_BLOCK), SAMPLE_BLOCK)
                for a in row_args]
        out = fn(*args)
        outs.append(tuple(o[: e - s] for o in out) if isinstance(out, tuple) else out[: e - s])
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(x) for x in zip(*outs))
    return torch.cat(outs)


def _exact_choice(regime: dsamp.SampledGraphKey) -> bool:
    """The regime's token choices and accept test are exact per row (argmax, integer
    Philox, the per-row Gumbel-max kernel, comparisons; no inverse CDF, whose float
    cumulative sum is the one row reduction left): they need no fixed-shape blocks."""
    return not (regime.sampled and regime.rejection)


def _probs(logits, table, regime, counts, bias=None):
    """(probs_batch of the rows, their best [rows] or None): as they are with the row
    kernels, else over fixed blocks (best None: the choices take the argmax of p).
    bias [rows, V]: the rows' logit_bias (None: no lane has one)."""
    if row_kernels(logits.device):
        return dsamp.probs_batch(logits, table, counts, regime, kernel=True, with_best=True, bias=bias)
    rows = [logits, table] + [t for t in (counts, bias) if t is not None]

    def probs(lg, tb, *rest):
        it = iter(rest)
        c = next(it) if counts is not None else None
        b = next(it) if bias is not None else None
        return dsamp.probs_batch(lg, tb, c, regime, kernel=False, bias=b)

    return blocked(probs, logits.shape[0], *rows), None


def _choose(fn, probs, table, positions, regime, best=None):
    """fn(probs, table, positions, regime, kernel, best) per row: in blocks (without best)
    unless the choice is exact or made by the row kernels."""
    kernel = row_kernels(probs.device)
    if kernel or _exact_choice(regime):
        return fn(probs, table, positions, regime, kernel, best)
    return blocked(lambda p, tb, ps: fn(p, tb, ps, regime, False), probs.shape[0], probs, table, positions)


def plain_draws(logits: torch.Tensor, table: dsamp.SamplingTable, positions: torch.Tensor,
                regime: dsamp.SampledGraphKey = dsamp.ALL_STAGES, counts: torch.Tensor | None = None,
                with_best: bool = False, bias: torch.Tensor | None = None):
    """Tokens [nb] of plain decoding from logits [nb, V] at positions [nb] (stream PLAIN);
    counts [nb, V]: the lanes' penalty windows (regime.penalties); bias [nb, V]: their
    logit_bias rows (regime.bias). with_best: (tokens, best [nb] or None): the rows' first
    argmax of their penalised logits, NaN first (as torch's argmax), where the row kernels
    made it (None: the torch ops')."""
    probs, best = _probs(logits, table, regime, counts, bias)
    tokens = _choose(dsamp.plain_tokens, probs, table, positions, regime, best)
    return (tokens, best) if with_best else tokens


def draft_draws(logits: torch.Tensor, table: dsamp.SamplingTable, positions: torch.Tensor,
                regime: dsamp.SampledGraphKey = dsamp.ALL_STAGES, counts: torch.Tensor | None = None,
                with_best: bool = False, bias: torch.Tensor | None = None):
    """(the drafter's distributions q [nb, V] float64, drafts [nb]) at positions [nb] (stream
    DRAFT); with_best: and the rows' best [nb] or None, as plain_draws gives it; bias as
    plain_draws takes it."""
    q, best = _probs(logits, table, regime, counts, bias)
    drafts = _choose(dsamp.draft_tokens, q, table, positions, regime, best)
    return (q, drafts, best) if with_best else (q, drafts)


def softmax_of_rows(x: torch.Tensor) -> torch.Tensor:
    """float64 softmax [B, V] of each row of x [B, V] (temperature 1), each row's numbers
    independent of the row count: the row kernel (hyspec.kernels.probs.softmax_rows) where
    the draws use it, else torch's softmax over fixed SAMPLE_BLOCK-row blocks."""
    if row_kernels(x.device):
        from hyspec.kernels.probs import softmax_rows

        return softmax_rows(x.contiguous(), torch.ones(x.shape[0], dtype=torch.float64, device=x.device))
    return blocked(lambda a: torch.softmax(a.double(), -1), x.shape[0], x)


def sums_of_rows(x: torch.Tensor) -> torch.Tensor:
    """[B]: each row's sum of x [B, V], in fixed SAMPLE_BLOCK-row calls (a reduction of one
    fixed shape: a row's sum does not depend on the row count)."""
    return blocked(lambda a: a.sum(-1), x.shape[0], x)


def accept_sampled(dec, nb: int, t: int, regime: dsamp.SampledGraphKey = dsamp.ALL_STAGES, plain: bool = True,
                   k_lane: torch.Tensor | None = None):
    """(n accepted [nb], next token [nb]) per lane from the verify logits (still in the
    runner's logits buffer): target probabilities per row (penalised with the lane's
    window plus the drafts before the row), then the rejection / coupled test
    (hyspec.gpu.sampling.speculative_accept) at the first draft's position pos + 1;
    plain lanes (plain: some lane has k = 0) take their row-0 token as plain decoding
    does (stream PLAIN); a speculative lane drafting nothing this round (its last token)
    draws it as the bonus of an empty round, as the engine core does. k_lane [nb]: the
    drafts each lane has (default: dec.k_lane; a masked round passes dec.k_round)."""
    k = t - 1
    V = dec.cfg.vocab_size
    logits = dec.runner.bufs.logits[: nb * t]  # [nb * t, V]
    counts = dec.verify_counts(nb, t).view(nb * t, V) if regime.penalties else None  # [nb * t, V]
    probs, best = _probs(logits, table_rows(dec.sampling_table, nb, t), regime, counts, dec.bias_rows(nb, t, regime))
    probs = probs.view(nb, t, V)  # best: [nb * t] or None
    table = table_rows(dec.sampling_table, nb)
    first_pos = dec.pos[:nb] + 1  # [nb] the first draft's position
    k_lane = dec.k_lane[:nb] if k_lane is None else k_lane  # [nb] drafts per lane (masked rounds: k_round)
    if k > 0:
        drafts = dec.verify_tokens[:nb, 1:t]  # [nb, k]
        q = dec.draft_probs[:nb, :k]  # [nb, k, V]

        def accept(p, tb, ps, regime, kernel, q, d, kl, best=None):
            return dsamp.speculative_accept(p, q, d, tb, ps, kl, regime, kernel, best)

        kernel = row_kernels(probs.device)
        if kernel or _exact_choice(regime):
            n, next_token = accept(probs, table, first_pos, regime, kernel, q, drafts, k_lane, best)
        else:
            n, next_token = blocked(lambda p, tb, ps, q, d, kl: accept(p, tb, ps, regime, False, q, d, kl),
                                    nb, probs, table, first_pos, q, drafts, k_lane)
    else:
        n = torch.zeros(nb, device=dec.dev, dtype=torch.long)

        def bonus_of_empty_round(p, tb, ps, regime, kernel, best=None):
            no_drafts = p.new_zeros(p.shape[0], 0, dtype=torch.long)
            return dsamp.speculative_accept(p, p[:, :0], no_drafts, tb, ps, torch.zeros_like(ps), regime, kernel,
                                            best)[1]

        next_token = _choose(bonus_of_empty_round, probs, table, first_pos, regime, best)
    if not plain:
        return n, next_token
    best0 = None if best is None else best.view(nb, t)[:, 0]
    plain_tok = _choose(dsamp.plain_tokens, probs[:, 0], table, first_pos, regime, best0)
    return n, torch.where(dec.spec_lane[:nb] == 0, plain_tok, next_token)
