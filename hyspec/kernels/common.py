"""Helpers shared by the op folders: block sizes, argument checks, the deferred split-K
result that the skinny matmul hands to the RMSNorm, and the triton import check.

(The launch helpers -- ``kernels_per_mode`` and programmatic dependent launch -- live in
:mod:`hyspec.kernels.pdl`.)
"""
from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["p2", "check_rows", "SplitPartials", "triton_available"]


def p2(n: int) -> int:
    """The next power of two >= n (1 for n <= 1): a block size covering n elements."""
    return 1 << max(0, (int(n) - 1).bit_length())


def check_rows(name, t, *lastdim_contig):
    for x in lastdim_contig:
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"{name}: every tensor needs a contiguous last dim")


class SplitPartials:
    """A matmul result still split in K: fp32 partials ``ws [S, >=T, N]`` whose sum over s
    (in order 0..S-1, rounded to the output dtype) is the product -- what
    :func:`hyspec.kernels.matmul.skinny_matmul` returns with ``defer=True``;
    :func:`hyspec.kernels.rmsnorm.rmsnorm` takes it as ``delta`` and does the reduction
    itself (one kernel launch fewer)."""

    __slots__ = ("ws", "S")

    def __init__(self, ws: torch.Tensor, S: int) -> None:
        self.ws, self.S = ws, S

    def value(self, rows: int, dtype) -> torch.Tensor:
        """The reduced product [rows, N] (torch; for callers that cannot fuse)."""
        acc = self.ws[0, :rows].clone()
        for s in range(1, self.S):
            acc += self.ws[s, :rows]
        return acc.to(dtype)


@lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when triton imports (checked once, then cached)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True
