"""Greedy choice over vocabulary rows: ``argmax_rows(x) == x.argmax(-1)`` bitwise, as two
Triton launches over (row, ARGMAX_CHUNK-token) programs and one program per row.

torch's CUDA argmax of a few [V]-rows runs one thread block per row: about 9 us for
V = 151,936 on the H200 (bench/results/b2_h200_profile_log.txt), paid by every decode
step and by every draft and verify of a speculative round.  Here each chunk program
finds its first maximum (and its first NaN), and a row program takes the first chunk
with the row's maximum (any NaN first: torch's argmax returns the first NaN of a row
that has one).  Exact: comparisons only, in float32 (lossless for bf16 / fp16 / fp32
logits), ties to the lower index in both stages.  No host sync; graph capturable; a
row's result depends on that row alone.
"""
from __future__ import annotations

import torch

from hyspec.kernels.common import p2
from hyspec.kernels.pdl import kernels_per_mode

__all__ = ["argmax_rows", "first_max", "ARGMAX_CHUNK", "ARGMAX_MAX_ROWS"]

ARGMAX_CHUNK = 4096
ARGMAX_MAX_ROWS = 65535  # rows are the chunk kernel's grid axis 1 (CUDA's limit there)


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _chunk_max_kernel(x_ptr, sx, val_ptr, idx_ptr, nan_ptr, V, n_chunks, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        b = tl.program_id(1)
        i = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + b.to(tl.int64) * sx + i, mask=i < V, other=float("-inf")).to(tl.float32)
        isnan = x != x
        first_nan = tl.min(tl.where(isnan, i, 2147483647), 0)
        x = tl.where(isnan, float("-inf"), x)
        m = tl.max(x, 0)
        first = tl.min(tl.where(x == m, i, 2147483647), 0)  # ties: the lowest index, spelled out
        o = b * n_chunks + c
        tl.store(val_ptr + o, m)
        tl.store(idx_ptr + o, first)
        tl.store(nan_ptr + o, first_nan)

    @triton.jit
    def _row_pick_kernel(val_ptr, idx_ptr, nan_ptr, out_ptr, n_chunks, NC: tl.constexpr):
        b = tl.program_id(0)
        j = tl.arange(0, NC)
        mj = j < n_chunks
        v = tl.load(val_ptr + b * n_chunks + j, mask=mj, other=float("-inf"))
        n = tl.min(tl.load(nan_ptr + b * n_chunks + j, mask=mj, other=2147483647), 0)
        ids = tl.load(idx_ptr + b * n_chunks + j, mask=mj, other=0)  # all chunks' (no load after the max)
        c = tl.min(tl.where(v == tl.max(v, 0), j, NC), 0)  # the first chunk holding the row's maximum
        tok = tl.sum(tl.where(j == c, ids, 0), 0)
        tl.store(out_ptr + b, tl.where(n < 2147483647, n, tok).to(tl.int64))

    return _chunk_max_kernel, _row_pick_kernel


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [B]: ``x.argmax(-1)`` of x [B, V] (rows with contiguous columns; float16,
    bfloat16 or float32), into ``out`` when given."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"argmax_rows: want a float16/bfloat16/float32 [B, V] with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)}")
    B, V = x.shape
    if B > ARGMAX_MAX_ROWS or V >= 2**31 - 1:
        raise ValueError(f"argmax_rows: at most {ARGMAX_MAX_ROWS} rows of < 2**31 - 1 entries, got {B} x {V}")
    if out is None:
        out = torch.empty(B, device=x.device, dtype=torch.int64)
    elif out.shape != (B,) or out.dtype != torch.int64 or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"argmax_rows: out must be a contiguous int64 [{B}] on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if B == 0:
        return out
    if V == 0:
        raise ValueError("argmax_rows: empty rows")
    C = -(-V // ARGMAX_CHUNK)
    val = torch.empty(B, C, device=x.device, dtype=torch.float32)
    idx = torch.empty(B, C, device=x.device, dtype=torch.int32)
    nan = torch.empty(B, C, device=x.device, dtype=torch.int32)
    chunk_max, row_pick = _kernels()
    chunk_max[(C, B)](x, x.stride(0), val, idx, nan, V, C, BLOCK=ARGMAX_CHUNK, num_warps=8)
    row_pick[(B,)](val, idx, nan, out, C, NC=p2(C), num_warps=1)
    return out


def first_max(x: torch.Tensor, kernel: bool) -> torch.Tensor:
    """``x.argmax(-1)`` of rows x [B, V]: through :func:`argmax_rows` when ``kernel`` and x
    suits it (float16 / bfloat16 / float32, contiguous rows, at most ARGMAX_MAX_ROWS rows),
    else torch's; the same ids either way."""
    if kernel and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] <= ARGMAX_MAX_ROWS \
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return argmax_rows(x)
    return x.argmax(-1)
