"""Torch reference of :func:`hyspec.kernels.rng.u01_rows`: the int64 Philox of
:mod:`hyspec.rng`, one key per lane."""
from __future__ import annotations

import torch

from hyspec.rng import u01_lanes

__all__ = ["u01_rows_ref"]


def u01_rows_ref(seeds: torch.Tensor, stream: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 [B, vocab]: ``u01(seed[b], stream, positions[b] * 2**32 + i)`` for token i."""
    ids = torch.arange(vocab, dtype=torch.int64, device=positions.device)  # [V]
    counters = (positions.to(torch.int64).unsqueeze(1) << 32) + ids  # [B, V]
    return u01_lanes(seeds, stream, counters)
