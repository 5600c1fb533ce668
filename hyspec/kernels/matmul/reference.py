"""Torch reference of :func:`hyspec.kernels.matmul.skinny_matmul`."""
from __future__ import annotations

import torch

__all__ = ["skinny_matmul_ref"]


def skinny_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: ``x [T, K] @ w [N, K].T -> [T, N]``, fp32 accumulate, output in x.dtype."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_matmul_ref: want x [T, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    return (x.float() @ w.float().t()).to(x.dtype)
