"""Grouped-query decode / verify attention (Triton): a drop-in for
:func:`hyspec.kernels.attention.attn_decode` that serves every query head of a kv head from
one program.

Why: ``attn_decode`` runs one program per (q head, row, split); the REP = Hq/Hkv
programs of a kv head each stream the same K/V blocks and reduce them with vector
sums.  Here one program per (kv head, row, split) loads the REP query rows of its kv
head as a [G, BLOCK_D] tile (G = max(16, next_pow2(REP)); the extra rows are zero and
never stored, ``tl.dot`` needs M >= 16) and does both products on the tensor cores:

    scores [G, BLOCK_N] = (q_tile @ k_tile.T) * D**-0.5      (fp32 accumulate)
    acc    [G, BLOCK_D] = acc * alpha + p.to(v dtype) @ v_tile

with the usual online softmax (m, l per query row, the formulas of ``attn_decode``'s kernel,
vectorised over G).  fp32 inputs use ``input_precision="ieee"``; bf16 the default.

Keys come in blocks of ``BLOCK_N = 32``; block b belongs to split b % NS with the
constant ``NS = GROUPED_SPLITS = 16``.  A split walks only blocks that exist, so one
that has none stores m = -inf, l = 0 and no NaN is ever formed (exp(-inf - M) = 0 in the
combine).  Partials go to the workspace in exactly the layout of ``attn_decode``
(per q head h = hk*REP + g: base ((r*HQ + h)*NS + s)*(BLOCK_D + 2), acc, then m, then
l), so its fixed-order combine kernel (with NS = 16) finishes the job and applies the
sigmoid gate with the same rounding.

Row invariance (the contract of ``hyspec.kernels``): the program for (hk, r, s) reads q
row r, the position ``pos + off + r`` and the cache only; its tile shapes, block walk and
reduction order depend on constexprs fixed by the head shape, never on the row count.
T and off are ``do_not_specialize``, so a t-row call and t 1-row calls (off + r) run the
same binary and produce the same bits, and the combine is per (row, head) in a fixed
order.  NS is a module constant, never chosen from T.

Programmatic dependent launch: with ``PDL`` the kernel releases its dependents first
thing and waits for its predecessors before its first load (see ``hyspec.kernels.pdl``).
"""
from __future__ import annotations

import torch

from hyspec.kernels.attention.kernel import launch_combine
from hyspec.kernels.common import p2
from hyspec.kernels.pdl import kernels_per_mode, launch_kwargs

__all__ = ["attn_decode_grouped", "GROUPED_SPLITS", "BLOCK_N"]

GROUPED_SPLITS = 16  # NS: key-block sets per (row, kv head); a constant, never chosen from T
BLOCK_N = 32  # keys per block


@kernels_per_mode
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "off", "TL", "skv"])
    def _attn_grouped_partial_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, off, ws_ptr, T, HQ, D, L, scale, TL, skv,
                                     REP: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                                     BLOCK_D: tl.constexpr, NS: tl.constexpr, IEEE: tl.constexpr,
                                     PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        hk = tl.program_id(0)
        r = tl.program_id(1)
        s = tl.program_id(2)
        lane = r // TL  # lane-major rows, each lane with its own cache and position
        n_keys = tl.load(pos_ptr + lane).to(tl.int64) + off + (r - lane * TL) + 1
        offs_g = tl.arange(0, G)
        offs_d = tl.arange(0, BLOCK_D)
        mg = offs_g < REP
        md = offs_d < D
        h = hk * REP + offs_g  # q heads of this kv head (rows >= REP are padding)
        q_off = (r * HQ + h)[:, None] * D + offs_d[None, :]
        KT = kc_ptr.dtype.element_ty
        q = tl.load(q_ptr + q_off, mask=mg[:, None] & md[None, :], other=0.0).to(KT)
        m_i = tl.full((G,), float("-inf"), tl.float32)
        l_i = tl.zeros((G,), tl.float32)
        acc = tl.zeros((G, BLOCK_D), tl.float32)
        n_blocks = ((n_keys + BLOCK_N - 1) // BLOCK_N).to(tl.int32)
        base = hk.to(tl.int64) * L * D + lane.to(tl.int64) * skv
        for b in range(s, n_blocks, NS):  # only blocks that exist: m_new is finite below
            offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = offs_n < n_keys
            kv_off = base + offs_n[:, None] * D + offs_d[None, :]
            mk = valid[:, None] & md[None, :]
            k = tl.load(kc_ptr + kv_off, mask=mk, other=0.0)
            if IEEE:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(k))
            sc = tl.where(valid[None, :], sc * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            v = tl.load(vc_ptr + kv_off, mask=mk, other=0.0)
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            if IEEE:
                pv = tl.dot(pr.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(pr.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        wbase = ((r * HQ + h) * NS + s) * (BLOCK_D + 2)  # [G]
        tl.store(ws_ptr + wbase[:, None] + offs_d[None, :], acc, mask=mg[:, None])
        tl.store(ws_ptr + wbase + BLOCK_D, m_i, mask=mg)
        tl.store(ws_ptr + wbase + BLOCK_D + 1, l_i, mask=mg)

    return _attn_grouped_partial_kernel


def attn_decode_grouped(q, kc, vc, pos, off, proj, out, *, rows, ws=None, lanes=1, kv_lane_stride=0):
    """Same contract as :func:`hyspec.kernels.attention.attn_decode` (reference
    :func:`~hyspec.kernels.attention.attn_decode_ref`): q [T, Hq, D] contiguous, caches
    kc/vc [Hkv, L, D]; row r attends keys 0..pos+off+r (pos: int64 [1] tensor); the gate
    is read from proj (per q head [q D | gate D] at column h*2*D); out [T, Hq*D] receives
    attn * sigmoid(gate). ws: optional fp32 workspace of >= T*Hq*16*(BLOCK_D+2) floats."""
    T = rows
    Hq, D = q.shape[1], q.shape[2]
    Hkv, L = kc.shape[0], kc.shape[1]
    if Hq % Hkv:
        raise ValueError(f"attn_decode_grouped: Hq={Hq} is not a multiple of Hkv={Hkv}")
    if q.stride(-1) != 1 or q.stride(1) != D or q.stride(0) != Hq * D:
        raise ValueError("attn_decode_grouped: q must be contiguous [T, Hq, D]")
    rep = Hq // Hkv
    BD = max(16, p2(D))  # tl.dot needs K, N >= 16
    G = max(16, p2(rep))
    NS = GROUPED_SPLITS
    need = T * Hq * NS * (BD + 2)
    if ws is None or ws.numel() < need:
        ws = torch.empty(need, device=q.device, dtype=torch.float32)
    _kernel()[(Hkv, T, NS)](q, kc, vc, pos, int(off), ws, T, Hq, D, L, float(D ** -0.5), T // lanes, int(kv_lane_stride),
                            REP=rep, G=G, BLOCK_N=BLOCK_N, BLOCK_D=BD, NS=NS,
                            IEEE=kc.dtype == torch.float32, num_warps=4 if BD <= 128 else 8,
                            **launch_kwargs())
    launch_combine(ws, proj, out, T, Hq, D, BD, NS)
    return out
