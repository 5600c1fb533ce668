"""Grouped-query decode / verify attention (Triton): a drop-in for
:func:`hyspec.kernels.attention.attn_decode` that serves every query head of a kv head from
one program.

Why: ``attn_decode`` runs one program per (q head, row, split); the REP = Hq/Hkv
programs of a kv head each stream the same K/V blocks and reduce them with vector
sums.  Here one program per (kv head, group of TG = GROUPED_ROWS consecutive rows of a
lane, split) loads the REP query rows of its kv head for each of the group's rows as a
[G, BLOCK_D] tile (G = max(16, next_pow2(REP * TG)); tile row i is the group's row
i // REP, q head i % REP; rows past the call's are zero and never stored, ``tl.dot``
needs M >= 16), so a verify's rows of one lane read the lane's keys once, and does both
products on the tensor cores:

    scores [G, BLOCK_N] = (q_tile @ k_tile.T) * D**-0.5      (fp32 accumulate)
    acc    [G, BLOCK_D] = acc * alpha + p.to(v dtype) @ v_tile

with the usual online softmax (m, l per query row, the formulas of ``attn_decode``'s kernel,
vectorised over G).  fp32 inputs use ``input_precision="ieee"``; bf16 the default.

Keys come in blocks of ``BLOCK_N = 32``; block b belongs to split b % NS with the
constant ``NS = GROUPED_SPLITS = 16``.  A split walks only blocks that exist (for its
group's last row), so a row without a block in it stores m = -inf, l = 0 (exp(-inf - M) =
0 in the combine; the NaN such a row forms inside the kernel is discarded by the
``tl.where`` below, never stored).  Partials go to the workspace in exactly the layout of
``attn_decode`` (row r, q head h = hk*REP + i % REP for tile row i: base ((r*HQ + h)*NS +
s)*(BLOCK_D + 2), acc, then m, then l), so its fixed-order combine kernel (with NS = 16) finishes the job and applies the
sigmoid gate with the same rounding.

Row invariance (the contract of ``hyspec.kernels``): a row's numbers come from q row r,
the position ``pos + off + r`` and the cache only.  The group walks the key blocks of its
last row; a block that holds none of a row's keys leaves that row's m, l and acc exactly
as they were (``tl.where``, not arithmetic with zeros: a row whose split has no block yet
would form NaN), and a row's keys are masked per row, so a row computes what its one-row
call computes (a tile row of an MMA does not depend on the other rows; the tile shape is
fixed by REP and TG, constants, never by the row count).  One condition: the keys and
values of the group's later rows are loaded too (zero weight for the earlier rows), so
they must be finite -- they are the call's own rows, written by ``attn_prep`` from the
model's projections; a non-finite value there would make an earlier row NaN where its
one-row call is not (0 * inf in the ``p @ v`` product).
T and off are ``do_not_specialize``, so a t-row call and t 1-row calls (off + r) run the
same binary and produce the same bits, and the combine is per (row, head) in a fixed
order.  NS is a module constant, never chosen from T.

The option ``CHUNKED`` (below; off by default) splits a row's keys by its own key count
instead: partials are chunks of 1, 2, 4 or 8 blocks, as many as the row needs, in a
workspace of ``grouped_partials(L)`` partials per (row, head), combined by the chunk
combine kernel in chunk order; programs take chunks p, p + P, ... (P from the call's size,
which changes no value).

Programmatic dependent launch: with ``PDL`` the kernel releases its dependents first
thing and waits for its predecessors before its first load (see ``hyspec.kernels.pdl``).
"""
from __future__ import annotations

import torch

from hyspec.envknobs import switch
from hyspec.kernels.attention.kernel import launch_combine
from hyspec.kernels.common import p2
from hyspec.kernels.pdl import interpreting, kernels_per_mode, launch_kwargs

__all__ = ["attn_decode_grouped", "GROUPED_SPLITS", "GROUPED_ROWS", "BLOCK_N", "CHUNKED", "LAUNCH",
           "grouped_partials", "grouped_workspace_floats"]

GROUPED_SPLITS = 16  # NS: key-block sets per (row, kv head); a constant, never chosen from T
GROUPED_ROWS = 4  # TG: a lane's rows per program (a verify's rows read the lane's keys once); a constant
BLOCK_N = 32  # keys per block
# The partials of a row with CHUNKED (off by default: HYSPEC_ATTN_CHUNKED=1 for a process): its keys' blocks in chunks of 2^j blocks,
# j = the least of 0..MAX_LEVEL with blocks <= PARTIALS_PER_LEVEL * 2^j (MAX_LEVEL if none),
# combined in chunk order: up to 512 keys a row has one partial per 32-key block, up to
# 1,024 one per 64, up to 2,048 one per 128, then one per 256 keys (16 or more partials).
# A row's chunks follow from its own position only (never from T, the lanes, the cache
# length or the program count), so a row has the same bits in any call.  Programs take
# chunks p, p + P, ... with P from the call's size.  Measured on the H200 (b2's shapes,
# bench/results/attn_levels_h200.json, at f9ac2a4): one lane at 32k keys 107.3 -> 41.4 us a
# layer, but slower below that and in batches (one lane at 640 / 4,096 keys 7.95 -> 10.42 /
# 17.74 -> 20.99 us, 64 lanes at 640 keys 54.2 -> 66.8 us; b2's decode 645 -> 638 tok/s at
# batch 1, 19,264 -> 18,867 at 64), so it is an option for long single-sequence contexts.
# CHUNKED = False (the default): block b in split b % GROUPED_SPLITS, 16 partials per row
# whatever its keys, one program per split.  The two forms give other bits (each is exact
# and batch invariant on its own): set it before any decoding.
CHUNKED = switch("HYSPEC_ATTN_CHUNKED")
PARTIALS_PER_LEVEL = 16
MAX_LEVEL = 3  # chunks of at most 2^3 blocks = 256 keys (the kernel's level test goes up to 3)
assert 0 <= MAX_LEVEL <= 3, "the kernels' level test goes up to 3"
# How the partial kernel is compiled and launched; none of these changes a value (tested
# bitwise in tests/test_kernels_lanes.py on the CPU; on the H200 by bench/attn_bench.py,
# which times the ways: bench/results/attn_ways_h200.json).  vector_loads: D and the lanes'
# cache stride known to the compiler (D == BLOCK_D, stride a multiple of 16), so the q, K
# and V tiles load in 16-byte vectors (the lane stride, unspecialised, left the compiler
# unsure of a lane's alignment: 2-byte loads, 64 per thread and block); early_v: the V
# tile's load issued with K's, before the scores; num_warps: 4 (8 for D = 256 until the vector loads, which made 4
# the faster: b2's decode at 64 lanes and ~640 keys 77.0 -> 53.1 us, one lane at 32k keys
# 252.5 -> 127.6 us, at da17ab5); num_stages / maxnreg: Triton's compile options (None:
# its defaults).
# programs_target: about how many programs a call launches (P = programs_target / (kv heads
# x row groups), at most the cache's chunks; no value depends on P).
LAUNCH = {"vector_loads": True, "early_v": True, "num_warps": 4, "num_stages": None, "maxnreg": None,
          "programs_target": 1024}


@kernels_per_mode
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "off", "TL", "skv", "NGRP", "NP", "P"])
    def _attn_grouped_partial_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, off, ws_ptr, T, HQ, D, L, scale, TL, skv, NGRP,
                                     NP, P, REP: tl.constexpr, TG: tl.constexpr, G: tl.constexpr,
                                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NS: tl.constexpr,
                                     CHUNKED: tl.constexpr, PPL: tl.constexpr, MAXL: tl.constexpr,
                                     IEEE: tl.constexpr,
                                     PDL: tl.constexpr, EVEN_D: tl.constexpr = False, SKV_UNIT: tl.constexpr = 1,
                                     EARLY_V: tl.constexpr = False):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        hk = tl.program_id(0)
        rg = tl.program_id(1)  # (lane, group of TG consecutive rows of the lane)
        s = tl.program_id(2)  # this program's first partial; it takes every P-th after it
        lane = rg // NGRP
        j0 = (rg - lane * NGRP) * TG  # the group's first row within the lane
        # tile row i: the lane's row j0 + i // REP, q head hk*REP + i % REP
        offs_i = tl.arange(0, G)
        jr = j0 + offs_i // REP
        mi = (offs_i < REP * TG) & (jr < TL)
        r = lane * TL + jr  # the call's row
        h = hk * REP + offs_i % REP
        pos0 = tl.load(pos_ptr + lane).to(tl.int64) + off
        n_keys = pos0 + jr + 1  # [G]: row r attends keys 0..pos+off+r
        n_last = pos0 + tl.minimum(j0 + TG, TL)  # keys of the group's last row
        offs_d = tl.arange(0, BLOCK_D)
        if EVEN_D:  # D == BLOCK_D, compiled in
            md = offs_d < BLOCK_D
            q_off = (r * HQ + h)[:, None] * BLOCK_D + offs_d[None, :]
        else:
            md = offs_d < D
            q_off = (r * HQ + h)[:, None] * D + offs_d[None, :]
        KT = kc_ptr.dtype.element_ty
        q = tl.load(q_ptr + q_off, mask=mi[:, None] & md[None, :], other=0.0).to(KT)
        n_blocks = ((n_last + BLOCK_N - 1) // BLOCK_N).to(tl.int32)
        # skv in units of SKV_UNIT elements (16 when the lane stride is a multiple of 16: the
        # compiler then knows every lane's cache is as aligned as lane 0's)
        if EVEN_D:
            base = hk.to(tl.int64) * L * BLOCK_D + lane.to(tl.int64) * skv * SKV_UNIT
        else:
            base = hk.to(tl.int64) * L * D + lane.to(tl.int64) * skv * SKV_UNIT
        # CHUNKED: a row of nb key blocks has level j = the least of 0..MAXL with nb <= PPL * 2^j
        # (MAXL if none): its partial c is chunk c of 2^j blocks (blocks c*2^j ..), as many as
        # it has keys for.  The group walks the chunks of its last row's level jg; a row one
        # level below (the rows of a group differ by fewer than TG keys, so only at a level's
        # edge) takes each chunk as its two halves: its partial 2c is stored at the chunk's
        # middle and its state restarted.  Else: split c = blocks c, c + NS, ... (NS of them,
        # each stored, empty or not).
        if CHUNKED:
            nb_row = ((n_keys + BLOCK_N - 1) // BLOCK_N).to(tl.int32)  # [G]
            j_row = tl.where(nb_row > PPL, 1, 0) + tl.where(nb_row > 2 * PPL, 1, 0) + tl.where(nb_row > 4 * PPL, 1, 0)
            j_row = tl.minimum(j_row, MAXL)
            jg = (tl.where(n_blocks > PPL, 1, 0) + tl.where(n_blocks > 2 * PPL, 1, 0)
                  + tl.where(n_blocks > 4 * PPL, 1, 0))
            jg = tl.minimum(jg, MAXL)
            cbg = 1 << jg  # blocks per chunk of the group's level
            half = cbg // 2
            lo = j_row < jg  # [G] rows one level below
            any_lo = tl.max(tl.where(mi & lo, 1, 0), axis=0) > 0
            n_units = (n_blocks + cbg - 1) // cbg
        else:
            n_units = NS
        for c in range(s, n_units, P):
            m_i = tl.full((G,), float("-inf"), tl.float32)
            l_i = tl.zeros((G,), tl.float32)
            acc = tl.zeros((G, BLOCK_D), tl.float32)
            if CHUNKED:
                b_lo = c * cbg
                b_hi = tl.minimum(b_lo + cbg, n_blocks)
                b_step = 1
            else:
                b_lo = c
                b_hi = n_blocks
                b_step = NS
            for b in range(b_lo, b_hi, b_step):  # blocks that exist for the group's last row
                if CHUNKED:
                    if any_lo:
                        if b == b_lo + half:  # the lower rows' first half ends: partial 2c, restart
                            wl = ((r * HQ + h) * NP + 2 * c) * (BLOCK_D + 2)
                            ml = mi & lo
                            tl.store(ws_ptr + wl[:, None] + offs_d[None, :], acc, mask=ml[:, None])
                            tl.store(ws_ptr + wl + BLOCK_D, m_i, mask=ml)
                            tl.store(ws_ptr + wl + BLOCK_D + 1, l_i, mask=ml)
                            acc = tl.where(lo[:, None], 0.0, acc)
                            l_i = tl.where(lo, 0.0, l_i)
                            m_i = tl.where(lo, float("-inf"), m_i)
                offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
                if EVEN_D:
                    kv_off = base + offs_n[:, None] * BLOCK_D + offs_d[None, :]
                else:
                    kv_off = base + offs_n[:, None] * D + offs_d[None, :]
                mk = (offs_n < n_last)[:, None] & md[None, :]
                k = tl.load(kc_ptr + kv_off, mask=mk, other=0.0)
                if EARLY_V:  # both tiles' loads in flight before the scores (the same values)
                    v = tl.load(vc_ptr + kv_off, mask=mk, other=0.0)
                if IEEE:
                    sc = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    sc = tl.dot(q, tl.trans(k))
                valid = offs_n[None, :] < n_keys[:, None]  # [G, BLOCK_N]: the row's own keys
                on = b * BLOCK_N < n_keys  # [G]: the block holds keys of the row (else the row stays as it is)
                sc = tl.where(valid, sc * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                alpha = tl.exp(m_i - m_new)
                pr = tl.where(valid, tl.exp(sc - m_new[:, None]), 0.0)
                if not EARLY_V:
                    v = tl.load(vc_ptr + kv_off, mask=mk, other=0.0)
                l_new = l_i * alpha + tl.sum(pr, axis=1)
                if IEEE:
                    pv = tl.dot(pr.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(pr.to(v.dtype), v)
                acc = tl.where(on[:, None], acc * alpha[:, None] + pv, acc)
                l_i = tl.where(on, l_new, l_i)
                m_i = tl.where(on, m_new, m_i)
            if CHUNKED:  # the lower rows' second half (or their first, if the chunk ends before it)
                idx = tl.where(lo & (b_hi > b_lo + half), 2 * c + 1, tl.where(lo, 2 * c, c))
            else:
                idx = tl.zeros((G,), tl.int32) + c
            wbase = ((r * HQ + h) * NP + idx) * (BLOCK_D + 2)  # [G]
            tl.store(ws_ptr + wbase[:, None] + offs_d[None, :], acc, mask=mi[:, None])
            tl.store(ws_ptr + wbase + BLOCK_D, m_i, mask=mi)
            tl.store(ws_ptr + wbase + BLOCK_D + 1, l_i, mask=mi)

    @triton.jit(do_not_specialize=["T", "off", "TL", "NP"])
    def _attn_chunk_combine_kernel(ws_ptr, p_ptr, sp, o_ptr, so, pos_ptr, off, T, TL, HQ, D, NP,
                                   BLOCK_N: tl.constexpr, PPL: tl.constexpr, MAXL: tl.constexpr,
                                   BLOCK_D: tl.constexpr, MB: tl.constexpr, PDL: tl.constexpr = False):
        # row r's partials are its own chunks at its own level (as the partial kernel sets
        # them), combined MB at a time in a fixed order (a tile's sum, then the next tile):
        # the count and the order follow the row's position only
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        r = tl.program_id(0)
        h = tl.program_id(1)
        lane = r // TL
        n_keys = tl.load(pos_ptr + lane).to(tl.int64) + off + (r - lane * TL) + 1
        nb = ((n_keys + BLOCK_N - 1) // BLOCK_N).to(tl.int32)
        j = tl.minimum(tl.where(nb > PPL, 1, 0) + tl.where(nb > 2 * PPL, 1, 0) + tl.where(nb > 4 * PPL, 1, 0), MAXL)
        cb = 1 << j
        n_c = (nb + cb - 1) // cb
        offs_d = tl.arange(0, BLOCK_D)
        md = offs_d < D
        wrow = (r * HQ + h).to(tl.int64) * NP * (BLOCK_D + 2)
        DT = o_ptr.dtype.element_ty
        gate = tl.load(p_ptr + r * sp + h * 2 * D + D + offs_d, mask=md, other=0.0).to(tl.float32)
        sg = tl.sigmoid(gate).to(DT).to(tl.float32)
        offs_c = tl.arange(0, MB)
        M = tl.max(tl.full((MB,), float("-inf"), tl.float32), axis=0)
        for c0 in range(0, n_c, MB):  # the maximum (exact in any order)
            cc = c0 + offs_c
            ms = tl.load(ws_ptr + wrow + cc * (BLOCK_D + 2) + BLOCK_D, mask=cc < n_c, other=float("-inf"))
            M = tl.maximum(M, tl.max(ms, axis=0))
        Lsum = tl.sum(tl.zeros((MB,), tl.float32), axis=0)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for c0 in range(0, n_c, MB):  # fixed order: tile by tile
            cc = c0 + offs_c
            mc = cc < n_c
            pb = wrow + cc * (BLOCK_D + 2)
            w = tl.exp(tl.load(ws_ptr + pb + BLOCK_D, mask=mc, other=float("-inf")) - M)
            Lsum += tl.sum(tl.load(ws_ptr + pb + BLOCK_D + 1, mask=mc, other=0.0) * w, axis=0)
            tile = tl.load(ws_ptr + pb[:, None] + offs_d[None, :], mask=mc[:, None] & md[None, :], other=0.0)
            acc += tl.sum(tile * w[:, None], axis=0)
        o = (acc / Lsum).to(DT).to(tl.float32)
        tl.store(o_ptr + r * so + h * D + offs_d, (o * sg).to(DT), mask=md)

    return _attn_grouped_partial_kernel, _attn_chunk_combine_kernel


def _compile_options() -> dict:
    opts = {}
    if LAUNCH["num_stages"]:
        opts["num_stages"] = LAUNCH["num_stages"]
    if LAUNCH["maxnreg"]:
        opts["maxnreg"] = LAUNCH["maxnreg"]
    return opts


def _units_max(L: int) -> int:
    """Chunks of the group's level a call over a cache of L rows may walk (at most)."""
    nb = -(-L // BLOCK_N)
    return max(PARTIALS_PER_LEVEL, -(-nb // (1 << MAX_LEVEL)))


def grouped_partials(L: int) -> int:
    """Partials per (row, q head) the workspace holds for a cache of L rows (CHUNKED: a row's
    chunks; a row one level below its group's may take up to 2 x PARTIALS_PER_LEVEL)."""
    return max(2 * PARTIALS_PER_LEVEL, _units_max(L)) if CHUNKED else GROUPED_SPLITS


def grouped_workspace_floats(rows: int, Hq: int, D: int, L: int) -> int:
    """fp32 workspace ``attn_decode_grouped`` needs for ``rows`` rows over a cache of L rows."""
    return rows * Hq * grouped_partials(L) * (max(16, p2(D)) + 2)


def _programs(L: int, groups: int) -> int:
    """Programs per (kv head, row group): enough to fill the GPU at this call's size, never
    more than the chunks there can be.  Which program computes a partial changes none of
    its values, so this may follow the batch."""
    if not CHUNKED:
        return GROUPED_SPLITS
    units = _units_max(L)
    if interpreting():  # one program at a time: few, but still more than one chunk each
        return min(units, 2)
    return max(1, min(units, -(-LAUNCH["programs_target"] // groups)))


def attn_decode_grouped(q, kc, vc, pos, off, proj, out, *, rows, ws=None, lanes=1, kv_lane_stride=0,
                        programs=None):
    """Same contract as :func:`hyspec.kernels.attention.attn_decode` (reference
    :func:`~hyspec.kernels.attention.attn_decode_ref`): q [T, Hq, D] contiguous, caches
    kc/vc [Hkv, L, D]; row r attends keys 0..pos+off+r (pos: int64 [1] tensor); the gate
    is read from proj (per q head [q D | gate D] at column h*2*D); out [T, Hq*D] receives
    attn * sigmoid(gate). ws: optional fp32 workspace of >= grouped_workspace_floats(T, Hq,
    D, L) floats. programs: programs per (kv head, row group) (default: from the call's
    size); it changes no value."""
    T = rows
    Hq, D = q.shape[1], q.shape[2]
    Hkv, L = kc.shape[0], kc.shape[1]
    if Hq % Hkv:
        raise ValueError(f"attn_decode_grouped: Hq={Hq} is not a multiple of Hkv={Hkv}")
    if q.stride(-1) != 1 or q.stride(1) != D or q.stride(0) != Hq * D:
        raise ValueError("attn_decode_grouped: q must be contiguous [T, Hq, D]")
    rep = Hq // Hkv
    BD = max(16, p2(D))  # tl.dot needs K, N >= 16
    TG = GROUPED_ROWS
    G = max(16, p2(rep * TG))
    NP = grouped_partials(L)
    TL = T // lanes
    ngrp = -(-TL // TG)
    need = T * Hq * NP * (BD + 2)
    if ws is None or ws.numel() < need:
        ws = torch.empty(need, device=q.device, dtype=torch.float32)
    P = _programs(L, Hkv * lanes * ngrp) if programs is None else int(programs)
    if not CHUNKED and P != GROUPED_SPLITS:
        raise ValueError("attn_decode_grouped: the interleaved splits take one program per split")
    fast = LAUNCH["vector_loads"]
    unit = 16 if fast and kv_lane_stride % 16 == 0 else 1
    partial, combine = _kernel()
    partial[(Hkv, lanes * ngrp, P)](q, kc, vc, pos, int(off), ws, T, Hq, D, L, float(D ** -0.5), TL,
                                    int(kv_lane_stride) // unit, ngrp, NP, P, REP=rep, TG=TG, G=G,
                                    BLOCK_N=BLOCK_N, BLOCK_D=BD, NS=GROUPED_SPLITS, CHUNKED=CHUNKED,
                                    PPL=PARTIALS_PER_LEVEL, MAXL=MAX_LEVEL,
                                    IEEE=kc.dtype == torch.float32, EVEN_D=fast and D == BD, SKV_UNIT=unit,
                                    EARLY_V=LAUNCH["early_v"],
                                    num_warps=LAUNCH["num_warps"] or (4 if BD <= 128 else 8),
                                    **_compile_options(), **launch_kwargs())
    if CHUNKED:
        combine[(T, Hq)](ws, proj, proj.stride(0), out, out.stride(0), pos, int(off), T, TL, Hq, D, NP,
                         BLOCK_N=BLOCK_N, PPL=PARTIALS_PER_LEVEL, MAXL=MAX_LEVEL, BLOCK_D=BD, MB=16, num_warps=4,
                         **launch_kwargs())
    else:
        launch_combine(ws, proj, out, T, Hq, D, BD, NS=GROUPED_SPLITS)
    return out
