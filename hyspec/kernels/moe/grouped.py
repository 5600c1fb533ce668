"""Grouped MoE for decode / verify: every routed expert's weights read once per step.

A fixed sequence of five steps per MoE layer (router logits come from the skinny matmul,
possibly still as split-K partials that ``route`` sums; the shared expert from the runner's
own matmuls unless fused, below), in four or five launches (see after the list):

1. ``route`` (one program per row): fp32 softmax of the router logits, top-k (largest
   first, ties to the lowest expert id), ``norm_topk_prob`` renormalisation; writes the
   row's k (expert, weight) pairs and takes each pair's rank among the pairs routed to its
   expert with an atomic counter per expert.
2. ``align`` (one program): expert counts -> BM-row tiles per expert (exclusive prefix
   sum), tile -> expert map, pair -> slot (``tile_start[e] * BM + rank``), the slot list
   of every tile, the counts reset for the next call; adds the number of distinct
   experts to the per-row-count statistics.
3. ``gemm`` gate|up: one program per (tile, BN outputs): the tile's rows gathered from x
   (pair q reads row q // k) times expert e's [2I, H] weight (bf16 or block-FP8); an
   expert's weights are read once for all the rows routed to it (up to BM of them).
4. ``gemm`` down with the SiLU*mul input fused (rows in slot order).
5. ``combine`` (one program per (row, BH outputs)): sum over the row's k slots in slot
   order of ``weight * y`` in fp32, plus sigmoid(shared gate) * shared expert, rounded once.

Steps 1 and 2 are two kernels.  (Both in one program for a one-row call, one launch
fewer, was the default from fdbca47 to defb18b, then opt-in, and is gone since e6601b3: on
the H200 its route gave a third of 1,024 rows other bits than the per-row route at the 35B
preset's router size, bench/results/gpu_tests_moe_route_forms_h200.txt, because the align
code's 512-wide tensors made Triton lay the route's 256-wide softmax out two elements per
thread instead of one, so its sum ran in another order; the 80B's 512-wide softmax kept one
per thread and passed.  A kernel's compiled variant must not depend on the row count, not
even through code without float work.)  With ``defer=True`` step 5 is left to the next RMSNorm
(:class:`hyspec.kernels.common.MoePartials`), which combines the slots with the same
expression before it adds the result to the residual.

(Route and align as one single-program kernel for a few rows, one warp, was tried at
5d1a7f7 and dropped: on the H200 the 35B decode step did not get faster, that run's verify
steps were 0.2-0.35 ms slower (with tuned expert tiles too, so not all of it is the fused
kernel), and launched with another number of warps than the per-row route it broke the
row invariance on the GPU -- the softmax's sum then runs in another order -- which
tests/test_gpu_fp8_moe.py caught and the interpreter cannot.  A top-k of one packed-key
max per pick -- probability bits and reversed id in an int64 -- on one warp, at ab1eab7,
was slower on the H200: 7.55 us a call against 6.86 on the 80B-FP8 preset's decode step,
bench/results/profile_moe_route_h200.txt against profile_80b_h200_log.txt; reverted.)

The shared expert, when its weights lie like one routed expert's (``can_fuse_shared``:
Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B, shared and routed intermediate 512), runs inside
the same kernels as expert E: the router matmul carries the shared gate as its column E,
``route`` gives every row the extra slot k (expert E, weight sigmoid(gate)), the gemms
read its weights through a second base pointer. Six launches per MoE layer then (router
matmul, route, align, two gemms, combine) instead of twelve or so with the shared expert's
own matmuls and the router's split-K reduction; five on the runner (the combine deferred
to the next RMSNorm).

Row invariance (exact mode, speculative == plain): every number of row r comes from row
r's inputs only. The router is per row; an expert tile's ``tl.dot`` never mixes rows (the
same argument as the skinny matmul's 16-row tiles), whatever other rows share the tile
or in which slot of the tile the atomic rank put this row; the K loop's order and the
tile shapes are fixed by (N, K); the combine runs in slot order 0..k-1. The grid size and
the tile membership depend on the step's rows; the per-row arithmetic does not.

Shapes: T rows, H hidden, E experts, k = top_k, I expert intermediate size, Q = T k pairs,
BM rows per expert tile, P = tiles * BM slots.
"""
from __future__ import annotations

import torch

from hyspec.kernels.common import p2
from hyspec.kernels.pdl import kernels_per_mode

__all__ = ["MoeBuffers", "moe_grouped", "moe_tiles", "can_fuse_shared", "BLOCK_M", "gemm_config", "set_moe_tuned",
           "MOE_TUNED", "MOE_BUILTIN"]

BLOCK_M = 16  # rows per expert tile (a tl.dot needs >= 16)


def moe_tiles(rows: int, n_experts: int, top_k: int, block_m: int = BLOCK_M) -> int:
    """An upper bound on the expert tiles of `rows` rows: sum_e ceil(c_e / BM) <=
    distinct experts + ceil(Q / BM)."""
    q = rows * top_k
    return min(n_experts, q) + -(-q // block_m)


class MoeBuffers:
    """The grouped path's scratch for up to `rows` rows (allocated once, graph friendly;
    one set serves every MoE layer of a runner, which run one after the other).
    n_experts / top_k: capacities, counting the shared expert as one more expert and one
    more slot per row where it is fused (moe_grouped(shared_experts=...))."""

    def __init__(self, rows: int, n_experts: int, top_k: int, hidden: int, inter: int, device, dtype,
                 block_m: int = BLOCK_M) -> None:
        q = rows * top_k
        tiles = moe_tiles(rows, n_experts, top_k, block_m)
        i32 = dict(device=device, dtype=torch.int32)
        self.rows, self.n_experts, self.top_k, self.block_m, self.tiles = rows, n_experts, top_k, block_m, tiles
        self.ids = torch.zeros(q, **i32)  # [Q] expert of pair q = t * k + j
        self.wts = torch.zeros(q, device=device, dtype=torch.float32)  # [Q] its routing weight (unrounded)
        self.rank = torch.zeros(q, **i32)  # [Q] its rank among its expert's pairs
        self.slot = torch.zeros(q, **i32)  # [Q] its slot in the tiles
        self.cnt = torch.zeros(n_experts, **i32)  # [E] pairs per expert (zero between calls)
        self.tile_start = torch.zeros(n_experts, **i32)  # [E] first tile of each expert
        self.tile_expert = torch.full((tiles,), -1, **i32)  # [tiles] expert of each tile (-1: unused)
        self.pairs = torch.full((tiles * block_m,), -1, **i32)  # [P] pair in each slot (-1: padding)
        self.gu = torch.zeros(tiles * block_m, 2 * inter, device=device, dtype=dtype)  # [P, 2I] gate | up
        self.y = torch.zeros(tiles * block_m, hidden, device=device, dtype=dtype)  # [P, H] expert outputs


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    from hyspec.kernels.matmul.fp8 import e4m3_to_bf16
    from hyspec.kernels.pdl import interpreting

    bf16_of = None if interpreting() else e4m3_to_bf16()

    @triton.jit(do_not_specialize=["T", "E", "S"])
    def _route(lg_ptr, s_ls, s_lt, S, x_ptr, ids_ptr, w_ptr, rank_ptr, cnt_ptr, T, E,
               TOPK: tl.constexpr, EB: tl.constexpr, KB: tl.constexpr, RENORM: tl.constexpr, SH: tl.constexpr,
               KS: tl.constexpr, PART: tl.constexpr, PDL: tl.constexpr = False):
        # Row t = program_id. Its logits: with PART the router matmul's S split-K partials
        # (fp32), summed in the order 0..S-1 and rounded to x's dtype: the bits its reduce
        # kernel would write. KS slots per row: the TOPK routed ones, and with SH the shared
        # expert (expert E, slot TOPK, weight sigmoid(logits[t, E]): the router matmul's
        # extra column, the shared gate). Always launched with the same num_warps: the
        # softmax's and top-k's reductions are then in one fixed order for every row count.
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0)
        offs = tl.arange(0, EB)
        m = offs < E
        kk = tl.arange(0, KB)
        mk = kk < KS
        lg = tl.load(lg_ptr + t * s_lt + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(lg_ptr + t * s_lt + E, mask=SH, other=0.0).to(tl.float32)
        if PART:
            for sp in range(1, S):  # (unrolled, as a static_range, measured slower on the H200)
                lg += tl.load(lg_ptr + sp * s_ls + t * s_lt + offs, mask=m, other=0.0)
                g += tl.load(lg_ptr + sp * s_ls + t * s_lt + E, mask=SH, other=0.0)
            lg = lg.to(x_ptr.dtype.element_ty).to(tl.float32)
            g = g.to(x_ptr.dtype.element_ty).to(tl.float32)
        lg = tl.where(m, lg, float("-inf"))
        mx = tl.max(lg, 0)
        ex = tl.where(m, tl.exp(lg - mx), 0.0)
        p = ex / tl.sum(ex, 0)
        ps = tl.where(m, p, -1.0)
        wv = tl.zeros([KB], dtype=tl.float32)
        iv = tl.zeros([KB], dtype=tl.int32)
        for j in tl.static_range(TOPK):  # largest first; ties to the lowest id
            v = tl.max(ps, 0)
            i = tl.min(tl.where(ps == v, offs, EB), 0)
            wv = tl.where(kk == j, v, wv)
            iv = tl.where(kk == j, i, iv)
            ps = tl.where(offs == i, -2.0, ps)
        if RENORM:
            wv = wv / tl.sum(wv, 0)
        if SH:
            wv = tl.where(kk == TOPK, 1.0 / (1.0 + tl.exp(-g)), wv)
            iv = tl.where(kk == TOPK, E, iv)
        tl.store(ids_ptr + t * KS + kk, iv, mask=mk)
        tl.store(w_ptr + t * KS + kk, wv, mask=mk)
        r = tl.atomic_add(cnt_ptr + iv, 1, mask=mk)  # the pair's rank among its expert's pairs
        tl.store(rank_ptr + t * KS + kk, r, mask=mk)

    @triton.jit(do_not_specialize=["T", "Q", "E", "TILES"])
    def _align(ids_ptr, rank_ptr, cnt_ptr, tile_start_ptr, tile_expert_ptr, pairs_ptr, slot_ptr, stats_ptr,
               T, Q, E, TILES, NR, EB: tl.constexpr, BM: tl.constexpr, QBLK: tl.constexpr, STATS: tl.constexpr,
               PDL: tl.constexpr = False):
        # E experts in the tiles (the routed NR, and the shared expert when fused)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        offs_e = tl.arange(0, EB)
        me = offs_e < E
        c = tl.load(cnt_ptr + offs_e, mask=me, other=0)
        nt = (c + BM - 1) // BM
        ts = tl.cumsum(nt, 0) - nt  # exclusive prefix sum: first tile of each expert
        tl.store(tile_start_ptr + offs_e, ts, mask=me)
        tl.store(cnt_ptr + offs_e, tl.zeros([EB], dtype=tl.int32), mask=me)  # ready for the next call
        if STATS:  # [sum of distinct experts, calls] of this row count
            distinct = tl.sum(tl.where((c > 0) & (offs_e < NR), 1, 0), 0).to(tl.int64)  # routed ones
            tl.store(stats_ptr + 2 * T, tl.load(stats_ptr + 2 * T) + distinct)
            tl.store(stats_ptr + 2 * T + 1, tl.load(stats_ptr + 2 * T + 1) + 1)
        for i0 in range(0, TILES, QBLK):
            o = i0 + tl.arange(0, QBLK)
            tl.store(tile_expert_ptr + o, tl.full([QBLK], -1, tl.int32), mask=o < TILES)
        for i0 in range(0, TILES * BM, QBLK):
            o = i0 + tl.arange(0, QBLK)
            tl.store(pairs_ptr + o, tl.full([QBLK], -1, tl.int32), mask=o < TILES * BM)
        tl.debug_barrier()  # the clears and tile_start are visible to every thread below
        for j in range(0, tl.cdiv(T, BM)):  # an expert has at most T pairs (top-k ids are distinct)
            tl.store(tile_expert_ptr + ts + j, offs_e, mask=me & (j < nt))
        for q0 in range(0, Q, QBLK):
            q = q0 + tl.arange(0, QBLK)
            mq = q < Q
            e = tl.load(ids_ptr + q, mask=mq, other=0)
            r = tl.load(rank_ptr + q, mask=mq, other=0)
            slot = tl.load(tile_start_ptr + e, mask=mq, other=0) * BM + r
            tl.store(pairs_ptr + slot, q, mask=mq)
            tl.store(slot_ptr + q, slot, mask=mq)

    @triton.jit
    def _gemm(x_ptr, s_x, w_ptr, s_we, s_wn, s_wk, sc_ptr, s_se, s_sn, s_sk, rows_ptr, sh_w_ptr, sh_sc_ptr,
              tile_expert_ptr, pairs_ptr, y_ptr, s_y, N, K, XDIV, X_UP, NR,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr, ACT: tl.constexpr,
              FP8: tl.constexpr, QB_N: tl.constexpr, QB_K: tl.constexpr, ROW_MAP: tl.constexpr,
              IEEE: tl.constexpr, WT: tl.constexpr, SH: tl.constexpr = False, PDL: tl.constexpr = False,
              CVT: tl.constexpr = 0):
        # SH: expert NR is the shared expert, its weight (and scales) at sh_w_ptr (sh_sc_ptr)
        # with the routed experts' per-expert strides
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        tile = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(tile_expert_ptr + tile)
        if e < 0:  # an unused tile of the static grid
            return
        e64 = e.to(tl.int64)
        offs_m = tile * BM + tl.arange(0, BM)
        pr = tl.load(pairs_ptr + offs_m)
        valid = pr >= 0
        if GATHER:  # pair q reads the token row q // k
            xr = tl.where(valid, pr // XDIV, 0)
        else:  # rows already in slot order
            xr = offs_m
        offs_n = pid_n * BN + tl.arange(0, BN)
        mn = offs_n < N
        wb = w_ptr + e64 * s_we
        if SH:
            wb = tl.where(e == NR, sh_w_ptr, wb)
        if FP8:
            if ROW_MAP:
                srow = tl.load(rows_ptr + offs_n, mask=mn, other=0)
            else:
                srow = offs_n // QB_N
            sb = sc_ptr + e64 * s_se
            if SH:
                sb = tl.where(e == NR, sh_sc_ptr, sb)
            s_ptrs = sb + srow * s_sn
        DT = y_ptr.dtype.element_ty
        if WT:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            mk = offs_k < K
            xm = valid[:, None] & mk[None, :]
            xp = x_ptr + xr[:, None].to(tl.int64) * s_x + offs_k[None, :]
            xt = tl.load(xp, mask=xm, other=0.0)
            if ACT:  # x holds [gate | up]: feed silu(gate) * up, rounded like the torch MLP
                xu = tl.load(xp + X_UP, mask=xm, other=0.0).to(tl.float32)
                xg = xt.to(tl.float32)
                sg = (xg / (1.0 + tl.exp(-xg))).to(DT).to(tl.float32)
                xt = (sg * xu).to(DT)
            if WT:
                wt = tl.load(wb + offs_n[:, None] * s_wn + offs_k[None, :] * s_wk, mask=mn[:, None] & mk[None, :],
                             other=0.0)
            else:
                wt = tl.load(wb + offs_k[:, None] * s_wk + offs_n[None, :] * s_wn, mask=mk[:, None] & mn[None, :],
                             other=0.0)
            if FP8:
                if CVT == 1:
                    wt = bf16_of(wt)  # exact, in integer instructions (hyspec.kernels.matmul.fp8)
                else:
                    wt = wt.to(DT)  # exact
                sc = tl.load(s_ptrs + (k0 // QB_K) * s_sk, mask=mn, other=0.0)
                if WT:
                    if IEEE:
                        part = tl.dot(wt, tl.trans(xt), input_precision="ieee")
                    else:
                        part = tl.dot(wt, tl.trans(xt))
                    acc += part * sc[:, None]
                else:
                    if IEEE:
                        part = tl.dot(xt, wt, input_precision="ieee")
                    else:
                        part = tl.dot(xt, wt)
                    acc += part * sc[None, :]
            else:
                if WT:
                    if IEEE:
                        acc = tl.dot(wt, tl.trans(xt), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(wt, tl.trans(xt), acc)
                else:
                    if IEEE:
                        acc = tl.dot(xt, wt, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(xt, wt, acc)
        if WT:
            acc = tl.trans(acc)
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * s_y + offs_n[None, :], acc.to(DT),
                 mask=valid[:, None] & mn[None, :])

    @triton.jit(do_not_specialize=["T"])
    def _combine(y_ptr, s_y, w_ptr, slot_ptr, sh_ptr, s_sh, g_ptr, s_g, out_ptr, s_o, T, H,
                 TOPK: tl.constexpr, BH: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0)
        offs = tl.program_id(1) * BH + tl.arange(0, BH)
        m = offs < H
        DT = out_ptr.dtype.element_ty
        acc = tl.zeros([BH], dtype=tl.float32)
        for j in tl.static_range(TOPK):  # slot order: fixed per row
            wj = tl.load(w_ptr + t * TOPK + j).to(DT).to(tl.float32)  # rounded like the router's output
            sl = tl.load(slot_ptr + t * TOPK + j).to(tl.int64)
            acc += tl.load(y_ptr + sl * s_y + offs, mask=m, other=0.0).to(tl.float32) * wj
        if SHARED:
            g = tl.load(g_ptr + t * s_g).to(tl.float32)
            gate = (1.0 / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
            acc += gate * tl.load(sh_ptr + t * s_sh + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * s_o + offs, acc.to(DT), mask=m)

    return dict(route=_route, align=_align, gemm=_gemm, combine=_combine)


# Expert-matmul tiles picked on the GPU (hyspec.gpu.tune.tune_in_step: timed inside the
# decode step's CUDA graph), keyed by (N, K, act, FP8 block K or None) -- the shape only, so
# the row invariance holds whatever is chosen. Values override gemm_config's defaults.
MOE_TUNED: dict[tuple, dict] = {}
# Shipped per-shape tiles, used where MOE_TUNED has no entry. bf16 experts: the decode-step
# tune of the qwen3.5-35b-a3b preset (bench/results/qwen3.5-35b-a3b_h200_tuning.json, at
# 5d1a7f7) moved its step by 1.6 % only and shipped nothing; the tune by decode step + a
# 4-row verify (whose MoE layers read ~4 times the experts; `--tune step+verify --tune-only
# moe`, bench/results/qwen3.5-35b-a3b_h200_tuning_verify.json, at 19cefff) picked the gate|up
# tile below (verify 4.575 -> 4.496 ms, decode 3.028 -> 3.006 in the preset's runs at 7f9b934
# and b68de03); its down projection keeps the default.
# Block-FP8 experts of 512 intermediate, hidden 2048 (Qwen3-Next-80B-A3B-FP8): from that
# preset's in-step tune (bench/results/qwen3-next-80b-a3b-fp8_h200_tuning.json, at e5a8d31).
MOE_BUILTIN: dict[tuple, dict] = {
    # bf16 experts of 512 intermediate, hidden 2048 (Qwen3.5-35B-A3B): gate|up
    (1024, 2048, False, None): dict(BN=64, BK=256, WT=False, num_warps=4, num_stages=3),
    (1024, 2048, False, 128): dict(BN=32, BK=128, WT=False, num_warps=4, num_stages=4),
    (2048, 512, True, 128): dict(BN=64, BK=64, WT=True, num_warps=4, num_stages=3),
}


def set_moe_tuned(table: dict) -> None:
    """Replace the tuned expert-matmul tiles (keys (N, K, act, qb_k), values gemm_config keys)."""
    MOE_TUNED.clear()
    MOE_TUNED.update(table)


def gemm_config(N: int, K: int, act: bool, qb_k: int | None, tile: dict | None = None) -> dict:
    """Tile of an expert matmul: from (N, K) (and the quant block) only, never from T.
    tile: overrides to use instead of MOE_TUNED / MOE_BUILTIN's entry (the tuner's candidates)."""
    bn = 32 if N <= 1024 else 64
    bk = 128 if K >= 128 else max(16, p2(K))
    if qb_k is not None:
        while bk > 16 and qb_k % bk:
            bk //= 2
    cfg = dict(BN=bn, BK=bk, WT=act, num_warps=4, num_stages=3)
    key = (N, K, bool(act), qb_k)
    cfg.update(tile if tile is not None else MOE_TUNED.get(key) or MOE_BUILTIN.get(key) or {})
    if qb_k is not None and qb_k % cfg["BK"]:
        raise ValueError(f"moe gemm config for {key}: BK {cfg['BK']} does not divide the FP8 block {qb_k}")
    return cfg


def _same_layout(a, b) -> bool:
    """Whether weight b ([N, K]) can be read with expert a[0]'s strides (and scale strides,
    block, row map): the condition for running the shared expert as one more expert."""
    from hyspec.quant import Fp8Weight

    if isinstance(a, Fp8Weight) != isinstance(b, Fp8Weight):
        return False
    if isinstance(a, Fp8Weight):
        if a.block != b.block or (a.rows is None) != (b.rows is None) or \
                (a.rows is not None and not torch.equal(a.rows, b.rows)):
            return False
        if tuple(a.scale.shape[1:]) != tuple(b.scale.shape) or a.scale.stride()[1:] != b.scale.stride():
            return False
        a, b = a.w, b.w
    return a.dtype == b.dtype and tuple(a.shape[1:]) == tuple(b.shape) and a.stride()[1:] == b.stride()


def can_fuse_shared(gate_up, down, sh_gate_up, sh_down) -> bool:
    """The shared expert's [2I, H] / [H, I] weights lie like one routed expert's: it can run
    inside the grouped gemms as expert E (moe_grouped(shared_experts=...))."""
    return _same_layout(gate_up, sh_gate_up) and _same_layout(down, sh_down)


def _gemm(x, w, buf, out, tiles, n_routed, *, gather: bool, act: bool, xdiv: int, shared=None):
    from hyspec.kernels.pdl import launch_kwargs
    from hyspec.quant import Fp8Weight

    from hyspec.kernels.matmul.fp8 import int_cvt

    fp8 = isinstance(w, Fp8Weight)
    w8 = w.w if fp8 else w
    E, N, K = w8.shape
    cfg = gemm_config(N, K, act, w.block[1] if fp8 else None)
    if fp8:
        sc, qb, rows = w.scale, w.block, w.rows
        s_se, s_sn, s_sk = sc.stride(0), sc.stride(1), sc.stride(2)
    else:
        sc, qb, rows = w8, (1, 1), None
        s_se = s_sn = s_sk = 0
    sh_w = sh_sc = w8
    if shared is not None:
        sh_w = shared.w if fp8 else shared
        sh_sc = shared.scale if fp8 else sh_w
    _kernels()["gemm"][(tiles, -(-N // cfg["BN"]))](
        x, x.stride(0), w8, w8.stride(0), w8.stride(1), w8.stride(2), sc, s_se, s_sn, s_sk,
        rows if rows is not None else buf.tile_expert, sh_w, sh_sc, buf.tile_expert, buf.pairs, out, out.stride(0),
        N, K, xdiv if gather else 1, K if act else 0, n_routed,
        BM=buf.block_m, BN=cfg["BN"], BK=cfg["BK"], GATHER=gather, ACT=act, FP8=fp8, QB_N=qb[0], QB_K=qb[1],
        ROW_MAP=rows is not None, IEEE=(x.dtype == torch.float32), WT=cfg["WT"], SH=shared is not None,
        CVT=int_cvt(x.dtype) if fp8 else 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_kwargs("moe_gemm"))


def moe_grouped(x: torch.Tensor, logits: torch.Tensor, gate_up, down, buf: MoeBuffers, out: torch.Tensor, *,
                top_k: int, renorm: bool, shared_experts: tuple | None = None, shared: torch.Tensor | None = None,
                shared_gate: torch.Tensor | None = None, stats: torch.Tensor | None = None,
                defer: bool = False):
    """Routed experts of x [T, H] into out [T, H] (see the module docstring).

    logits [T, E] the router's output, or its split-K partials (a
    hyspec.kernels.common.SplitPartials over [S, >=T, E], from skinny_matmul(defer=True)):
    the route kernel then sums them in order 0..S-1 and rounds to x's dtype, the bits the
    reduce kernel would have written, with one launch fewer; gate_up [E, 2I, H] and down [E, H, I] as tensors or
    hyspec.quant.Fp8Weight. The shared expert, either
    * fused (``shared_experts=(gate_up [2I, H], down [H, I])`` laid out like one routed
      expert, can_fuse_shared): logits [T, E + 1], column E the shared gate's logit; the
      shared expert runs as expert E in the grouped gemms, slot top_k of every row; or
    * given as its output ``shared`` [T, H] and gate logit ``shared_gate`` [T, 1];
    or absent. stats: int64 [>= T+1, 2], row T gets (distinct routed experts, 1) per call.
    defer (not with ``shared``): skip the combine and return a
    :class:`hyspec.kernels.common.MoePartials` over the buffers (out is not written), for
    :func:`hyspec.kernels.rmsnorm.rmsnorm` to combine as its delta; valid until the next
    call on ``buf``."""
    from hyspec.kernels.pdl import launch_kwargs

    from hyspec.kernels.common import MoePartials, SplitPartials

    T, H = x.shape
    E = gate_up.shape[0]
    fused = shared_experts is not None
    e_all, slots = E + fused, top_k + fused
    if T > buf.rows or e_all > buf.n_experts or slots > buf.top_k:
        raise ValueError(f"moe_grouped: {T} rows, {e_all} experts, {slots} slots per row exceed the buffers' "
                         f"{buf.rows}, {buf.n_experts}, {buf.top_k}")
    part = isinstance(logits, SplitPartials)
    lg = logits.ws if part else logits
    if lg.dim() != (3 if part else 2) or lg.shape[-2] < T or lg.shape[-1] != e_all or (not part and lg.shape[0] != T):
        raise ValueError(f"moe_grouped: logits must be [{T}, {e_all}], got {tuple(lg.shape)}")
    if lg.stride(-1) != 1:
        raise ValueError("moe_grouped: the logits' last dimension must be contiguous")
    if fused and shared is not None:
        raise ValueError("moe_grouped: give the shared expert fused (shared_experts) or as its output, not both")
    if defer and shared is not None:
        raise ValueError("moe_grouped: defer=True combines in the RMSNorm, which takes no separate shared expert")
    ks = _kernels()
    lk = launch_kwargs()
    q = T * slots
    tiles = moe_tiles(T, e_all, slots, buf.block_m)
    s_ls, s_lt, n_split = (lg.stride(0), lg.stride(1), logits.S) if part else (0, lg.stride(0), 1)
    use_stats = stats is not None and stats.shape[0] > T
    qblk = min(1024, max(16, p2(buf.rows * buf.top_k)))
    ks["route"][(T,)](lg, s_ls, s_lt, n_split, x, buf.ids, buf.wts, buf.rank, buf.cnt, T, E, TOPK=top_k,
                      EB=p2(E), KB=p2(slots), RENORM=bool(renorm), SH=fused, KS=slots, PART=part, num_warps=4, **lk)
    ks["align"][(1,)](buf.ids, buf.rank, buf.cnt, buf.tile_start, buf.tile_expert, buf.pairs, buf.slot,
                      stats if use_stats else buf.ids, T, q, e_all, tiles, E, EB=p2(buf.n_experts), BM=buf.block_m,
                      QBLK=qblk, STATS=use_stats, num_warps=4, **lk)
    I2 = gate_up.shape[1]
    gu, y = buf.gu[:, :I2], buf.y[:, :H]
    sh_gu, sh_down = shared_experts if fused else (None, None)
    _gemm(x, gate_up, buf, gu, tiles, E, gather=True, act=False, xdiv=slots, shared=sh_gu)
    _gemm(gu, down, buf, y, tiles, E, gather=False, act=True, xdiv=1, shared=sh_down)
    if defer:
        return MoePartials(y, buf.wts, buf.slot, slots)
    has_shared = shared is not None
    BH = min(1024, p2(H))
    ks["combine"][(T, -(-H // BH))](y, y.stride(0), buf.wts, buf.slot, shared if has_shared else y,
                                    shared.stride(0) if has_shared else 0, shared_gate if has_shared else y,
                                    shared_gate.stride(0) if has_shared else 0, out, out.stride(0), T, H,
                                    TOPK=slots, BH=BH, SHARED=has_shared, num_warps=4, **lk)
    return out
