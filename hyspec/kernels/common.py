"""Helpers shared by the op folders: block sizes, argument checks, the deferred results
that the skinny matmul (split-K partials) and the grouped MoE (per-slot expert outputs)
hand to the RMSNorm, and the triton import check.

(The launch helpers -- ``kernels_per_mode`` and programmatic dependent launch -- live in
:mod:`hyspec.kernels.pdl`.)
"""
from __future__ import annotations

import re
from functools import lru_cache

import torch

__all__ = ["p2", "check_rows", "SplitPartials", "MoePartials", "triton_available"]


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


class MoePartials:
    """A grouped-MoE result before its combine: the expert outputs ``y [P, H]`` (model dtype,
    one row per tile slot), and per (row t, slot j) pair ``q = t * KS + j`` its routing
    weight ``wts [Q]`` (fp32) and its slot ``slot [Q]`` (int32).  Row t of the result is
    ``sum_j y[slot[q]] * wts[q]`` (each weight rounded to y's dtype first; fp32 sums in slot
    order 0..KS-1), rounded to y's dtype -- what
    :func:`hyspec.kernels.moe.moe_grouped` returns with ``defer=True``;
    :func:`hyspec.kernels.rmsnorm.rmsnorm` takes it as ``delta`` and does the combine itself
    (one kernel launch fewer per MoE layer).  Only for the forms without a separately
    computed shared expert (fused as slot KS-1, or none)."""

    __slots__ = ("y", "wts", "slot", "KS")

    def __init__(self, y: torch.Tensor, wts: torch.Tensor, slot: torch.Tensor, KS: int) -> None:
        self.y, self.wts, self.slot, self.KS = y, wts, slot, KS

    def value(self, rows: int, dtype) -> torch.Tensor:
        """The combined result [rows, H] (torch, for callers that cannot fuse; the products
        and sums in fp32 in slot order, as the kernels do, which may contract a product and
        its sum into one fused multiply-add on a GPU)."""
        q = torch.arange(rows * self.KS, device=self.y.device)
        w = self.wts[q].to(self.y.dtype).float().view(rows, self.KS)
        ys = self.y[self.slot[q].long()].float().view(rows, self.KS, -1)
        acc = ys[:, 0] * w[:, :1]
        for j in range(1, self.KS):
            acc = acc + ys[:, j] * w[:, j:j + 1]
        return acc.to(dtype)


TRITON_MIN = (3, 4)  # the kernels are built inside functions: older compilers see module globals only


@lru_cache(maxsize=None)
def triton_unusable() -> str | None:
    """Why the Triton kernels cannot run here, or None when they can (checked once, then
    cached): triton does not import, or it is older than 3.4, whose compiler fails on every
    kernel ("NameError: tl is not defined"; torch 2.4-2.7's CUDA wheels pin 3.0-3.3)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as e:
        return f"triton does not import ({type(e).__name__}: {e})"
    version = getattr(triton, "__version__", "0")
    if tuple(int(x) for x in re.findall(r"\d+", version)[:2]) < TRITON_MIN:
        return (f"triton {version} is older than {'.'.join(map(str, TRITON_MIN))}, whose compiler the kernels need "
                "(pip install 'triton>=3.4'; torch >= 2.8 brings one)")
    return None


def triton_available() -> bool:
    """True when the Triton kernels can run here (triton_unusable() is None)."""
    return triton_unusable() is None
