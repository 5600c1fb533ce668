"""Torch reference of :func:`hyspec.kernels.matmul.skinny_matmul`."""
from __future__ import annotations

import torch

__all__ = ["skinny_matmul_ref", "skinny_matmul_fp8_ref"]


def skinny_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: ``x [T, K] @ w [N, K].T -> [T, N]``, fp32 accumulate, output in x.dtype."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_matmul_ref: want x [T, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    return (x.float() @ w.float().t()).to(x.dtype)


def skinny_matmul_fp8_ref(x: torch.Tensor, w, *, act: bool = False) -> torch.Tensor:
    """Reference of :func:`hyspec.kernels.matmul.skinny_matmul_fp8`: dequantize the
    :class:`hyspec.quant.Fp8Weight` in fp32 (``fp8 * scale`` per block), then ``x @ w.T`` in
    fp32, output in x.dtype.  act: x is [T, 2K] = [gate | up], fed as silu(gate) * up
    rounded to x.dtype (as the kernel and the torch MLP round it)."""
    wd = w.dequantize(torch.float32)
    if act:
        K = wd.shape[1]
        g, u = x[:, :K].float(), x[:, K:].float()
        x = ((g / (1.0 + torch.exp(-g))).to(x.dtype).float() * u).to(x.dtype)
    return (x.float() @ wd.t()).to(x.dtype)
