"""Triton kernel and launcher of the Philox row uniforms (contract: ``hyspec/kernels/rng/__init__.py``)."""
from __future__ import annotations

import torch

from hyspec.kernels.common import p2
from hyspec.kernels.pdl import kernels_per_mode

__all__ = ["u01_rows", "u01_at", "gumbel_argmax"]

_BLOCK = 1024

_philox_u01 = None  # the kernels' Philox helper (a jit function), bound by _bind_philox()


@kernels_per_mode
def _philox():
    """The Philox4x32-10 uniform of one (key, counter) per element, as a Triton function
    (inlined by the kernels below): the 32-bit words as uint32, ``umulhi`` and wrapping
    ``*`` for the 32x32 -> 64 bit products, the 53-bit mantissa of hyspec.rng.u01."""
    import triton
    import triton.language as tl

    @triton.jit
    def philox_u01(s, c0, c1, c2, BLOCK: tl.constexpr):
        """float64 [BLOCK]: u01 of key s (int64: the uint64 seed's bits; a scalar or [BLOCK])
        at the counter words (c0, c1, c2, 0) (uint32 [BLOCK]; c2 the stream)."""
        k0 = (s & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c3 = tl.zeros([BLOCK], dtype=tl.uint32)
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
        return tl.where(m == 0, 5.551115123125783e-17, u)  # 2**-54

    return philox_u01


def _bind_philox() -> None:
    """Bind the module global the kernels call to the helper of the process's Triton mode
    (a global, not a closure variable: the interpreter runs a kernel's source with its
    module's globals only). One global serves one mode: a process runs these kernels either
    interpreted or compiled, as tests/conftest.py decides once per process; switching
    modes within a process is not supported here."""
    global _philox_u01
    _philox_u01 = _philox()


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    _bind_philox()

    @triton.jit(do_not_specialize=["stream"])  # (a stream of 1 would become a constant without .to)
    def _u01_rows_kernel(seed_ptr, pos_ptr, out_ptr, V, stream, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # token ids of this block
        s = tl.load(seed_ptr + b)  # int64: the uint64 seed's bits
        pos = tl.load(pos_ptr + b)  # int64 in [0, 2**31)
        zero = tl.zeros([BLOCK], dtype=tl.uint32)
        # counter = pos * 2**32 + i -> words (i, pos, stream, 0)
        u = _philox_u01(s, i.to(tl.uint32), zero + pos.to(tl.uint32), zero + stream.to(tl.uint32), BLOCK)
        tl.store(out_ptr + b.to(tl.int64) * V + i, u, mask=i < V)

    @triton.jit(do_not_specialize=["stream"])  # (a stream of 1 would become a constant without .to)
    def _u01_at_kernel(seed_ptr, cnt_ptr, out_ptr, n, per_row, stream, BLOCK: tl.constexpr):
        e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat element ids
        live = e < n
        s = tl.load(seed_ptr + e // per_row, mask=live, other=0)  # the element's row's key
        c = tl.load(cnt_ptr + e, mask=live, other=0)  # int64 counter in [0, 2**63)
        zero = tl.zeros([BLOCK], dtype=tl.uint32)
        u = _philox_u01(s, (c & 0xFFFFFFFF).to(tl.uint32), (c >> 32).to(tl.uint32), zero + stream.to(tl.uint32),
                       BLOCK)
        tl.store(out_ptr + e, u, mask=live)

    return _u01_rows_kernel, _u01_at_kernel


def u01_rows(seeds: torch.Tensor, stream: int, positions: torch.Tensor, vocab: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [B, vocab]: ``u01(seed[b], stream, positions[b] * 2**32 + i)`` for token i.

    seeds, positions: int64 [B] on the device (positions in [0, 2**31)).  No host sync;
    graph capturable."""
    B = seeds.shape[0]
    if out is None:
        out = torch.empty(B, vocab, dtype=torch.float64, device=seeds.device)
    elif out.shape != (B, vocab) or out.dtype != torch.float64 or out.device != seeds.device \
            or not out.is_contiguous():  # (the kernel writes rows of `vocab` one after another)
        raise ValueError(f"u01_rows: out must be a contiguous float64 [{B}, {vocab}] on {seeds.device}, got "
                         f"{out.dtype} {tuple(out.shape)} (contiguous: {out.is_contiguous()})")
    grid = (B, -(-vocab // _BLOCK))
    _kernels()[0][grid](seeds.contiguous(), positions.to(torch.int64).contiguous(), out, vocab, int(stream),
                     BLOCK=_BLOCK)
    return out


_AT_BLOCK = 128


def u01_at(seeds: torch.Tensor, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """float64 [B, ...]: ``u01(seeds[b], stream, counters[b, ...])`` elementwise, in one launch:
    :func:`hyspec.rng.u01_lanes` (the torch form, ~250 elementwise launches) bit for bit.

    seeds: int64 [B]; counters: integer [B, ...] (or [B]) in [0, 2**63), on the device.
    No host sync; graph capturable."""
    c = counters.to(torch.int64).contiguous()
    B = seeds.shape[0]
    if c.shape[0] != B:
        raise ValueError(f"u01_at: counters {tuple(c.shape)} do not start with the {B} rows of seeds")
    out = torch.empty(c.shape, dtype=torch.float64, device=c.device)
    n = c.numel()
    if n == 0:
        return out
    _kernels()[1][(-(-n // _AT_BLOCK),)](seeds.to(torch.int64).contiguous(), c, out, n, max(1, n // B),
                                          int(stream), BLOCK=_AT_BLOCK)
    return out


_GUMBEL_BLOCK = 1024
# warps per chunk program of the Gumbel-max launch (integer Philox, three float64 logs and a
# max per token: no float sum, so any setting gives the same tokens; bench/sampling_warps.py)
GUMBEL_WARPS = 4


@kernels_per_mode
def _gumbel_kernels():
    import triton
    import triton.language as tl

    _bind_philox()

    @triton.jit(do_not_specialize=["stream"])  # (a stream of 1 would become a constant without .to)
    def _gumbel_max_kernel(p_ptr, stride_p, seed_ptr, pos_ptr, score_ptr, idx_ptr, V, n_chunks, stream,
                           BLOCK: tl.constexpr):
        """Chunk c of row b: the max over its tokens of log p + Gumbel noise (-inf where p = 0)
        and its first index. The uniforms are _u01_rows_kernel's, word for word."""
        b = tl.program_id(0)
        c = tl.program_id(1)
        i = c * BLOCK + tl.arange(0, BLOCK)  # token ids of this chunk
        s = tl.load(seed_ptr + b)
        pos = tl.load(pos_ptr + b)
        zero = tl.zeros([BLOCK], dtype=tl.uint32)
        u = _philox_u01(s, i.to(tl.uint32), zero + pos.to(tl.uint32), zero + stream.to(tl.uint32), BLOCK)
        p = tl.load(p_ptr + b.to(tl.int64) * stride_p + i, mask=i < V, other=0.0)
        g = -tl.log(-tl.log(u))
        score = tl.where(p > 0, tl.log(tl.where(p > 0, p, 1.0)) + g, float("-inf"))
        tl.store(score_ptr + b * n_chunks + c, tl.max(score, 0))
        tl.store(idx_ptr + b * n_chunks + c, c * BLOCK + tl.argmax(score, 0, tie_break_left=True))

    @triton.jit
    def _first_best_kernel(score_ptr, idx_ptr, out_ptr, n_chunks, NC: tl.constexpr):
        """Row b: the index of its first best chunk (torch's argmax: the first of equal
        maxima) -> out[b] = that chunk's token."""
        b = tl.program_id(0)
        j = tl.arange(0, NC)
        sc = tl.load(score_ptr + b * n_chunks + j, mask=j < n_chunks, other=float("-inf"))
        c = tl.argmax(sc, 0, tie_break_left=True)
        tl.store(out_ptr + b, tl.load(idx_ptr + b * n_chunks + c))

    return _gumbel_max_kernel, _first_best_kernel


def gumbel_argmax(probs: torch.Tensor, seeds: torch.Tensor, stream: int, positions: torch.Tensor) -> torch.Tensor:
    """int64 [B]: per row b, the first argmax over tokens i with probs[b, i] > 0 of
    ``log probs[b, i] - log(-log u01(seeds[b], stream, positions[b] * 2**32 + i))`` (0 for a
    row without mass): Gumbel-max sampling in one pass, without the [B, V] noise tensor.

    probs: float64 [B, V] (rows may be strided); seeds, positions: int64 [B]. Chunks of
    1024 tokens each give their best (first on ties), the first best chunk wins. No host
    sync; graph capturable."""
    B, V = probs.shape
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    n_chunks = -(-V // _GUMBEL_BLOCK)
    score = torch.empty(B, n_chunks, dtype=torch.float64, device=probs.device)
    idx = torch.empty(B, n_chunks, dtype=torch.int64, device=probs.device)
    out = torch.empty(B, dtype=torch.int64, device=probs.device)
    chunks_k, best_k = _gumbel_kernels()
    chunks_k[(B, n_chunks)](probs, probs.stride(0), seeds.contiguous(), positions.to(torch.int64).contiguous(),
                            score, idx, V, n_chunks, int(stream), BLOCK=_GUMBEL_BLOCK, num_warps=GUMBEL_WARPS)
    best_k[(B,)](score, idx, out, n_chunks, NC=p2(n_chunks))  # the first best chunk's token
    return out
