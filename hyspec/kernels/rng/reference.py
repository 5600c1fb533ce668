"""Torch reference of :func:`hyspec.kernels.rng.u01_rows`: the int64 Philox of
:mod:`hyspec.rng`, one key per lane."""
from __future__ import annotations

import torch

from hyspec.rng import u01_lanes

__all__ = ["u01_rows_ref", "gumbel_argmax_ref"]


def u01_rows_ref(seeds: torch.Tensor, stream: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 [B, vocab]: ``u01(seed[b], stream, positions[b] * 2**32 + i)`` for token i."""
    ids = torch.arange(vocab, dtype=torch.int64, device=positions.device)  # [V]
    counters = (positions.to(torch.int64).unsqueeze(1) << 32) + ids  # [B, V]
    return u01_lanes(seeds, stream, counters)


def gumbel_argmax_ref(probs: torch.Tensor, seeds: torch.Tensor, stream: int, positions: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the first argmax over {i: probs[b, i] > 0} of log probs[b, i] + Gumbel noise
    ``-log(-log u01_rows_ref(...)[b, i])`` (0 for a row without mass)."""
    p = probs.to(torch.float64)
    g = -torch.log(-torch.log(u01_rows_ref(seeds, stream, positions, p.shape[1])))  # [B, V]
    return torch.where(p > 0, torch.log(p) + g, torch.full_like(p, -float("inf"))).argmax(dim=1)
