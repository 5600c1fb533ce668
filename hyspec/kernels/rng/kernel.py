"""Triton kernel and launcher of the Philox row uniforms (contract: ``hyspec/kernels/rng/__init__.py``)."""
from __future__ import annotations

import torch

from hyspec.kernels.pdl import kernels_per_mode

__all__ = ["u01_rows"]

_BLOCK = 1024


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _u01_rows_kernel(seed_ptr, pos_ptr, out_ptr, V, stream, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # token ids of this block
        s = tl.load(seed_ptr + b)  # int64: the uint64 seed's bits
        pos = tl.load(pos_ptr + b)  # int64 in [0, 2**31)
        zero = tl.zeros([BLOCK], dtype=tl.uint32)
        k0 = (s & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
        # counter = pos * 2**32 + i -> words (i, pos, stream, 0)
        c0 = i.to(tl.uint32)
        c1 = zero + pos.to(tl.uint32)
        c2 = zero + stream.to(tl.uint32)
        c3 = zero
        m0 = tl.full([BLOCK], 0xD2511F53, tl.uint32)
        m1 = tl.full([BLOCK], 0xCD9E8D57, tl.uint32)
        for r in tl.static_range(10):
            if r > 0:
                k0 = k0 + tl.full([], 0x9E3779B9, tl.uint32)  # wraps mod 2**32
                k1 = k1 + tl.full([], 0xBB67AE85, tl.uint32)
            hi0 = tl.umulhi(c0, m0)
            lo0 = c0 * m0
            hi1 = tl.umulhi(c2, m1)
            lo1 = c2 * m1
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        m = ((c0 >> 5).to(tl.int64) << 26) | (c1 >> 6).to(tl.int64)  # 53 bits
        u = m.to(tl.float64) * 1.1102230246251565e-16  # 2**-53, exact
        u = tl.where(m == 0, 5.551115123125783e-17, u)  # 2**-54
        tl.store(out_ptr + b.to(tl.int64) * V + i, u, mask=i < V)

    return _u01_rows_kernel


def u01_rows(seeds: torch.Tensor, stream: int, positions: torch.Tensor, vocab: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [B, vocab]: ``u01(seed[b], stream, positions[b] * 2**32 + i)`` for token i.

    seeds, positions: int64 [B] on the device (positions in [0, 2**31)).  No host sync;
    graph capturable."""
    B = seeds.shape[0]
    if out is None:
        out = torch.empty(B, vocab, dtype=torch.float64, device=seeds.device)
    grid = (B, -(-vocab // _BLOCK))
    _kernels()[grid](seeds.contiguous(), positions.to(torch.int64).contiguous(), out, vocab, int(stream),
                     BLOCK=_BLOCK)
    return out
