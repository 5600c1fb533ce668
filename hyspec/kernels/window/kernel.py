"""Triton kernel of the penalty window's pushes (contract: ``hyspec/kernels/window/__init__.py``)."""
from __future__ import annotations

import torch

from hyspec.kernels.pdl import kernels_per_mode

__all__ = ["window_push"]


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _window_push_kernel(last_n_ptr, length_ptr, ring_ptr, s_ring, counts_ptr, s_counts, tok_ptr, s_tb, s_ti,
                            nv_ptr, V, M: tl.constexpr):
        b = tl.program_id(0)
        n = tl.load(last_n_ptr + b)  # N: -1 the whole history, 0 none, else the ring's length
        L = tl.load(length_ptr + b)
        nv = tl.load(nv_ptr + b)
        ring = ring_ptr + b.to(tl.int64) * s_ring
        counts = counts_ptr + b.to(tl.int64) * s_counts
        for i in tl.static_range(M):
            a = i < nv
            t = tl.load(tok_ptr + b.to(tl.int64) * s_tb + i * s_ti).to(tl.int64)
            ring_lane = a & (n > 0)
            slot = L % tl.maximum(n, 1)
            old = tl.load(ring + slot)
            evict = ring_lane & (L >= n) & (old >= 0) & (old < V)
            add = a & (n != 0) & (t >= 0) & (t < V)
            tl.atomic_add(counts + tl.minimum(tl.maximum(old, 0), V - 1), -1, mask=evict)
            tl.atomic_add(counts + tl.minimum(tl.maximum(t, 0), V - 1), 1, mask=add)
            tl.store(ring + slot, t, mask=ring_lane)
            tl.debug_barrier()  # the next token's load may read this slot (N = 1)
            L += a.to(tl.int64)
        tl.store(length_ptr + b, L)

    return _window_push_kernel


def window_push(last_n: torch.Tensor, length: torch.Tensor, ring: torch.Tensor, counts: torch.Tensor,
                tokens: torch.Tensor, n_valid: torch.Tensor) -> None:
    """Append tokens[b, :n_valid[b]] to each lane's window in place (one launch; see the
    module contract). last_n, length: int64 [B] (contiguous); ring: int64 [B, C] and
    counts: int32 [B, V], rows may be strided views; tokens: int [B, m]; n_valid: [B]."""
    B = last_n.shape[0]
    if length.shape != (B,) or ring.shape[0] != B or counts.shape[0] != B or tokens.dim() != 2 \
            or tokens.shape[0] != B or n_valid.shape != (B,):
        raise ValueError(f"window_push: {B} lanes, but length {tuple(length.shape)}, ring {tuple(ring.shape)}, "
                         f"counts {tuple(counts.shape)}, tokens {tuple(tokens.shape)}, n_valid {tuple(n_valid.shape)}")
    if last_n.stride(0) != 1 or length.stride(0) != 1 or ring.stride(1) != 1 or counts.stride(1) != 1:
        raise ValueError("window_push: last_n, length and the rows of ring and counts must be contiguous")
    if B == 0 or tokens.shape[1] == 0:
        return
    tok = tokens.to(torch.int64)
    nv = n_valid.to(torch.int64).contiguous()
    _kernels()[(B,)](last_n, length, ring, ring.stride(0), counts, counts.stride(0), tok, tok.stride(0), tok.stride(1), nv,
                     counts.shape[1], M=tokens.shape[1], num_warps=1)
