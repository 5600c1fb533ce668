"""Former home of the grouped-query decode attention, kept so old imports work: it now
lives in :mod:`hyspec.kernels.attention.grouped` (with the other attention kernels)."""
from __future__ import annotations

from hyspec.kernels.attention.grouped import (  # noqa: F401
    BLOCK_N,
    GROUPED_ROWS,
    GROUPED_SPLITS,
    _kernel,
    attn_decode_grouped,
)
from hyspec.kernels.attention.kernel import launch_combine as _combine  # noqa: F401
from hyspec.kernels.common import p2 as _p2  # noqa: F401

__all__ = ["attn_decode_grouped", "GROUPED_ROWS", "GROUPED_SPLITS", "BLOCK_N"]
