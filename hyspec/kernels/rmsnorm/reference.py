"""Torch reference of :func:`hyspec.kernels.rmsnorm.rmsnorm`."""
from __future__ import annotations

import torch

__all__ = ["rmsnorm_ref"]


def rmsnorm_ref(x, weight, eps, *, ids=None, delta=None):
    """x [T, N] (or an embedding table [V, N] with ids [T]); optional delta [T, N] added
    first (rounded to x.dtype, like ``x + h`` in the model). Returns (resid [T, N], y [T, N])."""
    if ids is not None:
        x = x[ids]
    if delta is not None:
        x = x + delta
    xf = x.float()
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return x, (xhat * (1.0 + weight.float())).to(x.dtype)
