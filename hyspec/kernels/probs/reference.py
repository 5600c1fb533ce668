"""Torch references of :mod:`hyspec.kernels.probs` (the tests' oracle, and the CPU path)."""
from __future__ import annotations

import math

import torch

__all__ = ["CHUNK", "MASS_SCALE", "softmax_rows_ref", "inverse_cdf_rows_ref"]

CHUNK = 1024  # tokens per program of every kernel here (a constant: never a function of the row count)
MASS_SCALE = float(1 << 62)  # hyspec.sampling.MASS_ONE: fixed-point masses (checked in the tests)


def softmax_rows_ref(x: torch.Tensor, temperature: torch.Tensor, keep: torch.Tensor | None = None,
                     only: torch.Tensor | None = None, floor: torch.Tensor | None = None,
                     top: torch.Tensor | None = None, mass: bool = False) -> torch.Tensor:
    """The kernel's contract in torch ops (see the package docstring)."""
    xt = torch.div(x.to(torch.float64), temperature.unsqueeze(1))  # [B, V]
    kept = xt > -math.inf
    if keep is not None:
        kept = kept & keep
    if floor is not None:
        near = xt - xt.gather(1, top.view(-1, 1)) >= floor.unsqueeze(1)  # [B, V]
        kept = kept & near
    if only is not None:
        col = torch.arange(x.shape[1], device=x.device)
        kept = torch.where(only.unsqueeze(1) >= 0, col == only.unsqueeze(1), kept)
    p = torch.softmax(torch.where(kept, xt, -math.inf), dim=1)
    return (p * MASS_SCALE).to(torch.int64) if mass else p


def _pick_rows(x: torch.Tensor, row: torch.Tensor | None) -> torch.Tensor:
    """x [B, V], or x [B, R, V] and row [B]: the rows x[b, row[b]] as [B, V]."""
    if x.dim() == 2:
        return x
    return x.gather(1, row.view(-1, 1, 1).expand(-1, 1, x.shape[2])).squeeze(1)


def inverse_cdf_rows_ref(p: torch.Tensor, u: torch.Tensor, row: torch.Tensor | None = None,
                         q: torch.Tensor | None = None, q_row: torch.Tensor | None = None,
                         resid: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [B]: per row the first token whose running mass exceeds u * total, the
    masses added in two levels (the CHUNK-token chunk totals, then one chunk's scan);
    past the end (rounding): the last token with p > 0; 0 for a row without mass.
    The row's distribution: p[b] (p [B, V]) or p[b, row[b]] (p [B, R, V]); with q, the
    rows with resid[b] take max(p - q, 0) instead, when that has mass.

    The chunk is the first whose running total exceeds the target, the token the first
    whose running mass (the chunks before it plus the in-chunk running sum) exceeds the
    target (the last positive token of the chunk when rounding leaves none). A zero-mass
    token or chunk is never chosen: a running sum is flat across it, and the chunk's mass
    before it is at most the target (never `target - before`: a GPU may fuse it with the
    target's product into an unrounded fma)."""
    p = _pick_rows(p.to(torch.float64), row)
    if q is not None:
        r = (p - _pick_rows(q.to(torch.float64), q_row)).clamp(min=0.0)  # [B, V]
        has_mass = (r > 0).any(dim=1, keepdim=True)  # [B, 1]
        p = torch.where(resid.unsqueeze(1) & has_mass, r, p)
    B, V = p.shape
    L = CHUNK
    C = -(-V // L)
    pc = (torch.nn.functional.pad(p, (0, C * L - V)) if C * L != V else p).reshape(B, C, L)  # [B, C, L]
    running = pc.sum(2).cumsum(1)  # [B, C] mass up to the end of each chunk
    target = u.to(torch.float64).unsqueeze(1) * running[:, -1:]  # [B, 1]
    c = torch.searchsorted(running, target, right=True)  # [B, 1] (C: past the end)
    cc = c.clamp(max=C - 1)
    before = torch.where(cc > 0, running.gather(1, (cc - 1).clamp(min=0)), torch.zeros_like(target))  # [B, 1]
    rows = pc.gather(1, cc.unsqueeze(2).expand(B, 1, L)).squeeze(1)  # [B, L] the chosen chunk
    j = torch.searchsorted(before + rows.cumsum(1), target, right=True)  # [B, 1]
    col = torch.arange(L, device=p.device)
    last_j = torch.where(rows > 0, col, torch.full_like(col, -1)).amax(dim=1, keepdim=True)  # [B, 1]
    j = torch.where(j >= L, last_j, j)
    idx = torch.where(c >= C, V, cc * L + j).squeeze(1)  # [B]
    cols = torch.arange(V, device=p.device)
    last = torch.where(p > 0, cols, torch.full_like(cols, -1)).amax(dim=1).clamp(min=0)  # [B]
    return torch.where(idx >= V, last, idx)
