"""Triton kernels and launchers of attention prep, split-key decode and the fixed-order
combine (contract: ``hyspec/kernels/attention/__init__.py``)."""
from __future__ import annotations

import torch

from hyspec.envknobs import switch
from hyspec.kernels.common import p2
from hyspec.kernels.pdl import interpreting, kernels_per_mode, launch_kwargs

__all__ = ["attn_prep", "attn_decode", "launch_combine", "rope_inv_freq", "attn_splits", "ATTN_SPLITS",
           "INTERP_SPLITS", "ATTN_BLOCK_N"]

ATTN_SPLITS = 8  # NS: key-block sets per (row, head); a constant, never chosen from T
# NS in Triton's CPU interpreter, which runs one program at a time: there a split only adds
# programs (each ~60 interpreted ops), and 8 of them made attention ~1/3 of an interpreted
# decode step's time.  Still a constant (never chosen from T), still more than one split.
INTERP_SPLITS = 2
ATTN_BLOCK_N = 32  # keys per block
# The combine's form: the NS partials as one tile, the sums over them a reduction tree (every
# load in flight at once), or (False) a loop over the splits in order.  The two round
# differently; a constant for a process (HYSPEC_ATTN_COMBINE_TILE=0|1), never chosen per call.
COMBINE_TILE = switch("HYSPEC_ATTN_COMBINE_TILE")


def attn_splits() -> int:
    """The split count attn_decode uses by default: ATTN_SPLITS on the GPU, INTERP_SPLITS
    in the interpreter (the same kernel; tests/test_op_attention.py runs both counts)."""
    return INTERP_SPLITS if interpreting() else ATTN_SPLITS


def rope_inv_freq(rot: int, theta: float, device) -> torch.Tensor:
    """Plain RoPE's inv_freq [rot/2] fp32, as hyspec.model.ops.rope_frequencies computes it
    (which also gives the scaled types' frequencies and YaRN's cos / sin scaling)."""
    return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    # Every kernel starts with the PDL prologue (hyspec.kernels.pdl): let the next kernel
    # start launching, then wait until every earlier kernel of the stream is done.  It is
    # compiled away when PDL is False (written out in each kernel: the interpreter does not
    # resolve nested jit helpers).

    @triton.jit(do_not_specialize=["T", "off", "TL", "skv"])
    def _attn_prep_kernel(p_ptr, sp, qw_ptr, kw_ptr, invf_ptr, pos_ptr, off, q_ptr, kc_ptr, vc_ptr,
                          T, HQ, HKV, D, ROT, L, eps, TL, skv,
                          BLOCK_D: tl.constexpr, PDL: tl.constexpr = False, ROPE_SCALE: tl.constexpr = 1.0):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        r = tl.program_id(0)
        hh = tl.program_id(1)
        lane = r // TL  # rows are lane-major: lane b holds rows b*TL .. b*TL + TL-1
        p = tl.load(pos_ptr + lane).to(tl.int64) + off + (r - lane * TL)
        kc_ptr += lane.to(tl.int64) * skv
        vc_ptr += lane.to(tl.int64) * skv
        offs = tl.arange(0, BLOCK_D)
        md = offs < D
        k_col0 = HQ * 2 * D
        v_col0 = k_col0 + HKV * D
        row = p_ptr + r * sp
        if hh >= HQ + HKV:  # a value head: copy into the cache
            hv = hh - HQ - HKV
            v = tl.load(row + v_col0 + hv * D + offs, mask=md, other=0.0)
            tl.store(vc_ptr + (hv * L + p) * D + offs, v.to(vc_ptr.dtype.element_ty), mask=md)
        else:
            is_q = hh < HQ
            col = tl.where(is_q, hh * 2 * D, k_col0 + (hh - HQ) * D)
            half = ROT // 2
            inrot = offs < ROT
            lo = offs < half
            part = tl.where(inrot, tl.where(lo, offs + half, offs - half), offs)
            x = tl.load(row + col + offs, mask=md, other=0.0).to(tl.float32)
            xp = tl.load(row + col + part, mask=md, other=0.0).to(tl.float32)
            wq = tl.load(qw_ptr + offs, mask=md, other=0.0).to(tl.float32)
            wk = tl.load(kw_ptr + offs, mask=md, other=0.0).to(tl.float32)
            wqp = tl.load(qw_ptr + part, mask=md, other=0.0).to(tl.float32)
            wkp = tl.load(kw_ptr + part, mask=md, other=0.0).to(tl.float32)
            w = tl.where(is_q, wq, wk)
            wp = tl.where(is_q, wqp, wkp)
            fi = tl.where(inrot, tl.where(lo, offs, offs - half), 0)
            invf = tl.load(invf_ptr + fi, mask=inrot, other=0.0)  # (loaded before the reduction: latency)
            inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            DT = q_ptr.dtype.element_ty
            xn = (x * inv * (1.0 + w)).to(DT).to(tl.float32)
            xpn = (xp * inv * (1.0 + wp)).to(DT).to(tl.float32)
            ang = p.to(tl.float32) * invf
            c = tl.cos(ang)
            s = tl.sin(ang)
            if ROPE_SCALE != 1.0:  # YaRN's attention scaling (compiled out for plain RoPE)
                c = c * ROPE_SCALE
                s = s * ROPE_SCALE
            c = c.to(DT).to(tl.float32)
            s = s.to(DT).to(tl.float32)
            rot = tl.where(lo, -xpn, xpn)
            yr = (xn * c).to(DT).to(tl.float32) + (rot * s).to(DT).to(tl.float32)
            y = tl.where(inrot, yr, xn).to(DT)
            if is_q:
                tl.store(q_ptr + (r * HQ + hh) * D + offs, y, mask=md)
            else:
                tl.store(kc_ptr + ((hh - HQ) * L + p) * D + offs, y, mask=md)

    @triton.jit(do_not_specialize=["T", "off", "TL", "skv"])
    def _attn_partial_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, off, ws_ptr, T, HQ, REP, D, L, scale, TL, skv,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NS: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        h = tl.program_id(0)
        r = tl.program_id(1)
        s = tl.program_id(2)
        hk = h // REP
        lane = r // TL
        n_keys = tl.load(pos_ptr + lane).to(tl.int64) + off + (r - lane * TL) + 1
        offs_d = tl.arange(0, BLOCK_D)
        md = offs_d < D
        q = tl.load(q_ptr + (r * HQ + h) * D + offs_d, mask=md, other=0.0).to(tl.float32) * scale
        m_i = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), axis=0)
        l_i = tl.sum(tl.zeros((BLOCK_N,), tl.float32), axis=0)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        n_blocks = ((n_keys + BLOCK_N - 1) // BLOCK_N).to(tl.int32)
        base = hk.to(tl.int64) * L * D + lane.to(tl.int64) * skv
        for b in range(s, n_blocks, NS):
            offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = offs_n < n_keys
            kv_off = base + offs_n[:, None] * D + offs_d[None, :]
            mk = valid[:, None] & md[None, :]
            k = tl.load(kc_ptr + kv_off, mask=mk, other=0.0).to(tl.float32)
            sc = tl.sum(k * q[None, :], axis=1)
            sc = tl.where(valid, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=0))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new)
            v = tl.load(vc_ptr + kv_off, mask=mk, other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(pr, axis=0)
            acc = acc * alpha + tl.sum(pr[:, None] * v, axis=0)
            m_i = m_new
        wbase = ((r * HQ + h) * NS + s) * (BLOCK_D + 2)
        tl.store(ws_ptr + wbase + offs_d, acc)
        tl.store(ws_ptr + wbase + BLOCK_D, m_i)
        tl.store(ws_ptr + wbase + BLOCK_D + 1, l_i)

    @triton.jit(do_not_specialize=["T"])
    def _attn_combine_kernel(ws_ptr, p_ptr, sp, o_ptr, so, T, HQ, D,
                             BLOCK_D: tl.constexpr, NS: tl.constexpr, PDL: tl.constexpr = False,
                             TILE: tl.constexpr = False, NSP: tl.constexpr = 16):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        r = tl.program_id(0)
        h = tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_D)
        md = offs_d < D
        wrow = (r * HQ + h) * NS * (BLOCK_D + 2)
        DT = o_ptr.dtype.element_ty
        # the gate first: its load's latency overlaps the partials' (same values)
        gate = tl.load(p_ptr + r * sp + h * 2 * D + D + offs_d, mask=md, other=0.0).to(tl.float32)
        sg = tl.sigmoid(gate).to(DT).to(tl.float32)
        if TILE:  # the NS partials as one [NSP, BLOCK_D] tile: every load in flight at once,
            # the sums a fixed reduction tree over the splits (another order than the loop's)
            offs_s = tl.arange(0, NSP)
            ms_ = offs_s < NS
            pb = wrow + offs_s * (BLOCK_D + 2)
            m = tl.load(ws_ptr + pb + BLOCK_D, mask=ms_, other=float("-inf"))
            lsp = tl.load(ws_ptr + pb + BLOCK_D + 1, mask=ms_, other=0.0)
            tile = tl.load(ws_ptr + pb[:, None] + offs_d[None, :], mask=ms_[:, None] & md[None, :], other=0.0)
            M = tl.max(m, axis=0)
            w = tl.exp(m - M)
            Lsum = tl.sum(lsp * w, axis=0)
            acc = tl.sum(tile * w[:, None], axis=0)
        else:
            M = tl.load(ws_ptr + wrow + BLOCK_D)
            for s in tl.static_range(1, NS):
                M = tl.maximum(M, tl.load(ws_ptr + wrow + s * (BLOCK_D + 2) + BLOCK_D))
            Lsum = tl.sum(tl.zeros((BLOCK_D,), tl.float32), axis=0)
            acc = tl.zeros((BLOCK_D,), tl.float32)
            for s in tl.static_range(NS):  # fixed order 0..NS-1
                b = wrow + s * (BLOCK_D + 2)
                w = tl.exp(tl.load(ws_ptr + b + BLOCK_D) - M)
                Lsum += tl.load(ws_ptr + b + BLOCK_D + 1) * w
                acc += tl.load(ws_ptr + b + offs_d) * w
        o = (acc / Lsum).to(DT).to(tl.float32)
        tl.store(o_ptr + r * so + h * D + offs_d, (o * sg).to(DT), mask=md)

    return dict(attn_prep=_attn_prep_kernel, attn_partial=_attn_partial_kernel, attn_combine=_attn_combine_kernel)


def attn_prep(proj, q_w, k_w, inv_freq, pos, off, q_out, kc, vc, *, n_heads, n_kv, head_dim, eps, rows,
              lanes=1, kv_lane_stride=0, rope_scale: float = 1.0):
    """Triton :func:`attn_prep_ref` with the position read from device memory
    (pos: int64 [1] tensor; the rows sit at pos + off + r).  lanes > 1: the rows are
    ``lanes`` sequences of rows // lanes rows each (lane-major); lane b's rows sit at
    pos[b] + off + r in its own cache ``kc + b * kv_lane_stride`` (kc / vc: lane 0's
    [Hkv, L, D] view of a per-lane slab)."""
    D = head_dim
    k = _kernels()["attn_prep"]
    k[(rows, n_heads + 2 * n_kv)](proj, proj.stride(0), q_w, k_w, inv_freq, pos, int(off), q_out, kc, vc,
                                  rows, n_heads, n_kv, D, 2 * inv_freq.shape[0], kc.shape[1], float(eps),
                                  rows // lanes, int(kv_lane_stride), BLOCK_D=p2(D), num_warps=4 if D <= 128 else 8,
                                  ROPE_SCALE=float(rope_scale), **launch_kwargs())
    return q_out


def attn_decode(q, kc, vc, pos, off, proj, out, *, rows, ws=None, lanes=1, kv_lane_stride=0, splits=None):
    """Triton :func:`attn_decode_ref`: q [T, Hq, D] contiguous, caches [Hkv, L, D]; the
    gate is read from proj (per q head [q D | gate D]); out [T, Hq*D]; ``splits`` the NS
    (default :func:`attn_splits`; ws must hold T * Hq * NS * (p2(D) + 2) floats)."""
    T = rows
    NS = attn_splits() if splits is None else int(splits)
    Hq, D = q.shape[1], q.shape[2]
    BD = p2(D)
    if ws is None or ws.numel() < T * Hq * NS * (BD + 2):
        ws = torch.empty(T * Hq * NS * (BD + 2), device=q.device, dtype=torch.float32)
    ks = _kernels()
    nw = 4 if D <= 128 else 8
    ks["attn_partial"][(Hq, T, NS)](q, kc, vc, pos, int(off), ws, T, Hq, Hq // kc.shape[0], D,
                                    kc.shape[1], float(D ** -0.5), T // lanes, int(kv_lane_stride),
                                    BLOCK_N=ATTN_BLOCK_N, BLOCK_D=BD, NS=NS, num_warps=nw, **launch_kwargs())
    launch_combine(ws, proj, out, T, Hq, D, BD, NS)
    return out


def launch_combine(ws, proj, out, T, Hq, D, BD, NS):
    """The fixed-order combine of NS attention partials (layout of ``attn_decode``'s ws): the
    splits one after the other, or with COMBINE_TILE as one tile and a reduction tree."""
    _kernels()["attn_combine"][(T, Hq)](ws, proj, proj.stride(0), out, out.stride(0), T, Hq, D,
                                        BLOCK_D=BD, NS=NS, TILE=COMBINE_TILE, NSP=p2(NS), num_warps=4,
                                        **launch_kwargs())
