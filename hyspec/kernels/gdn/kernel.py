"""Triton kernels and launchers of the Gated-DeltaNet conv, step (scan), replay and gated
norm (contract: ``hyspec/kernels/gdn/__init__.py``)."""
from __future__ import annotations

from hyspec.kernels.common import p2
from hyspec.kernels.pdl import kernels_per_mode, launch_kwargs

__all__ = ["gdn_conv", "gdn_step", "gdn_replay", "gdn_window_commit"]


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    # Every kernel starts with the PDL prologue (hyspec.kernels.pdl): let the next kernel
    # start launching, then wait until every earlier kernel of the stream is done.  It is
    # compiled away when PDL is False (written out in each kernel: the interpreter does not
    # resolve nested jit helpers).

    @triton.jit(do_not_specialize=["T", "update", "save", "sxin", "sst_b", "sxin_b"])
    def _gdn_conv_kernel(x_ptr, sx, st_ptr, w_ptr, y_ptr, sy, xin_ptr, sxin, T, C, update, save, sst_b, sxin_b,
                         W: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)
        lane = tl.program_id(1).to(tl.int64)  # T rows per lane, lane-major; own window / slab
        x_ptr += lane * T * sx
        y_ptr += lane * T * sy
        st_ptr += lane * sst_b
        xin_ptr += lane * sxin_b
        offs = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        mc = offs < C
        DT = y_ptr.dtype.element_ty
        for t in range(T):
            acc = tl.zeros((BLOCK_C,), tl.float32)
            for j in tl.static_range(W):
                i = t + j - (W - 1)  # row of x; negative: state row W-1+i
                if i < 0:
                    xv = tl.load(st_ptr + (W - 1 + i) * C + offs, mask=mc, other=0.0).to(tl.float32)
                else:
                    xv = tl.load(x_ptr + i * sx + offs, mask=mc, other=0.0).to(tl.float32)
                wj = tl.load(w_ptr + offs * W + j, mask=mc, other=0.0).to(tl.float32)
                prod = (xv * wj).to(DT).to(tl.float32)
                if j == 0:
                    acc = prod
                else:
                    acc = (acc + prod).to(DT).to(tl.float32)
            y = acc / (1.0 + tl.exp(-acc))
            tl.store(y_ptr + t * sy + offs, y.to(DT), mask=mc)
            if save != 0:
                xr = tl.load(x_ptr + t * sx + offs, mask=mc, other=0.0)
                tl.store(xin_ptr + t * sxin + offs, xr, mask=mc)
        if update != 0:
            # new window = last W-1 rows of cat(state, x); ascending order is safe in place
            for i in tl.static_range(W - 1):
                src = T + i - (W - 1)
                if src < 0:
                    v = tl.load(st_ptr + (W - 1 + src) * C + offs, mask=mc, other=0.0)
                else:
                    v = tl.load(x_ptr + src * sx + offs, mask=mc, other=0.0)
                tl.store(st_ptr + i * C + offs, v.to(st_ptr.dtype.element_ty), mask=mc)

    @triton.jit(do_not_specialize=["T", "st_t", "sy", "sp", "so", "mode", "replay", "sy_g", "sp_g", "ss_g", "sa_g",
                                   "NB", "sy_b", "sp_b", "ss_b", "so_b"])
    def _gdn_step_kernel(y_ptr, sy, p_ptr, sp, alog_ptr, dtb_ptr, nw_ptr, s_ptr, st_ptr, st_t, o_ptr, so,
                         T, R, KD, C, VD, NV, DK, DV, scale, eps, mode, replay, n_ptr, sy_g, sp_g, ss_g, sa_g,
                         NB, sy_b, sp_b, ss_b, so_b, BK: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr,
                         PVF: tl.constexpr = False, PF: tl.constexpr = False, PDL: tl.constexpr = False,
                         NBP: tl.constexpr = 1, ONE_RED: tl.constexpr = True, EVEN: tl.constexpr = False,
                         STREAM: tl.constexpr = False, DVC: tl.constexpr = 0):
        # One binary for the decode step (mode 1: final state in place), the verify (mode 0:
        # state read, nothing written; or mode 2: the state after every row to st_ptr) and the
        # commit replay (replay=1, mode 1: rows 0..n of every layer, layer = program_id(2),
        # no output).  Every flag and stride is a runtime value, so the state arithmetic is
        # the same instructions in all of them: bitwise the same states.
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        # PVF: a head's Dv blocks are neighbouring programs (they read one row of the state
        # together); PF: the next row's vectors are loaded before this row's arithmetic;
        # NBP: Dv blocks per program, one after the other, the next block's state loading
        # while this one is updated.  None of them changes an operation on a value.
        # ONE_RED: per row one reduction over Dk of the state (k.S and q.S of the state
        # before the row, together) and one of the row's vectors (k.k, q.q, q.k), with
        # q.S_t = e q.S_{t-1} + (q.k) delta; else the reference's order (decay, k.S, update,
        # then q.S_t: two dependent state reductions and two norms per row).  The two
        # forms round differently; decode, verify and replay always share one.
        # STREAM: cache hints on the state's exact tiles (load evict_first, final store .cs):
        # the same values, another L2 policy (b2 at 64 lanes: decode 90.5 -> 88.8 us per
        # layer, 16 lanes 27.4 -> 26.9; bench/results/gdn_stream_h200_log.txt; HYSPEC_GDN_STREAM=0 off).
        # EVEN: the tiles cover Dk and Dv exactly (no masks on the state).  The state's
        # offsets inside a head are int32 (the head's base is a scalar int64 pointer): a
        # [Dk, block] tile of int64 offsets, pointers and masks kept across the row loop
        # took registers enough to spill (the one-reduction kernel on 2 warps at b2's
        # shapes: 255 per thread, 12 spilled; 232 and none without: gdn_bench at b33b848
        # and f666dc9).
        # DVC: Dv (the state rows' stride inside a head) as a compile-time constant, the tile's
        # offsets int64: then a thread's state values sit at one base plus immediates (LDG
        # [R+0x1000] ...) instead of one 64-bit address computed per value (int32 offsets
        # sign-extended one by one).  Offline for sm_90 (bench/sass_stats.py, 16-wide
        # blocks): 888 -> 720 SASS instructions, 128 -> 80 registers; on the H200
        # (bench/results/gdn_const_parts_h200.json, at 6121b06) 16-wide blocks decode 64
        # lanes in 77.4 us per layer against 88.1, 32-wide ones (the runner's since) in
        # 72.4; the same bits as the runtime stride in every case checked.  Only address
        # arithmetic changes: decode, verify and replay stay one binary.
        if PVF:
            pv = tl.program_id(0)
            h = tl.program_id(1)
        else:
            h = tl.program_id(0)
            pv = tl.program_id(1)
        pid2 = tl.program_id(2).to(tl.int64)  # (layer, lane) = divmod(pid2, NB); T rows per lane
        lane = pid2 % NB
        lay = pid2 // NB
        y_ptr += lay * sy_g + lane * sy_b
        p_ptr += lay * sp_g + lane * sp_b
        s_ptr += lay * ss_g + lane * ss_b + h.to(tl.int64) * DK * DV
        st_ptr += lay * ss_g + lane * ss_b + h.to(tl.int64) * DK * DV
        o_ptr += lane * so_b
        alog_ptr += lay * sa_g
        dtb_ptr += lay * sa_g
        if replay != 0:
            T = tl.load(n_ptr + lane).to(tl.int32) + 1
        hk = h // R
        ok = tl.arange(0, BK)
        mk = ok < DK
        A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        dtb = tl.load(dtb_ptr + h).to(tl.float32)
        DT = o_ptr.dtype.element_ty
        SDT = s_ptr.dtype.element_ty  # the state's storage dtype (fp32, or bf16 / fp16)
        for j in tl.static_range(NBP):
            ov = (pv * NBP + j) * BV + tl.arange(0, BV)
            mv = ov < DV
            m2 = mk[:, None] & mv[None, :]
            if DVC != 0:  # the head's row stride known at compile time: int64 offsets, immediates
                soff = ok.to(tl.int64)[:, None] * DVC + ov.to(tl.int64)[None, :]
            else:
                soff = ok[:, None] * DV + ov[None, :]  # int32: inside the head
            if j == 0:
                if EVEN and STREAM:  # read once per call: first out of L2
                    S = tl.load(s_ptr + soff, eviction_policy="evict_first").to(tl.float32)
                elif EVEN:
                    S = tl.load(s_ptr + soff).to(tl.float32)
                else:
                    S = tl.load(s_ptr + soff, mask=m2, other=0.0).to(tl.float32)
            else:
                S = S_next  # noqa: F821 - loaded by the block before (static loop)
            if j + 1 < NBP:  # noqa: F841 below: S_next is read by the next block (static loop)
                if EVEN:
                    S_next = tl.load(s_ptr + soff + BV).to(tl.float32)  # noqa: F841
                else:
                    S_next = tl.load(s_ptr + soff + BV, mask=mk[:, None] & (ov[None, :] + BV < DV),  # noqa: F841
                                     other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + ov, mask=mv, other=0.0).to(tl.float32)
            if PF:
                kn = tl.load(y_ptr + KD + hk * DK + ok, mask=mk, other=0.0)  # row 0 (T >= 1 always)
                vn = tl.load(y_ptr + 2 * KD + h * DV + ov, mask=mv, other=0.0)
                bn = tl.load(p_ptr + C + VD + h)
                an = tl.load(p_ptr + C + VD + NV + h)
                qn = tl.load(y_ptr + hk * DK + ok, mask=mk, other=0.0)
            for t in range(T):
                yrow = y_ptr + t * sy
                prow = p_ptr + t * sp
                if PF:
                    k = kn.to(tl.float32)
                    v = vn.to(tl.float32)
                    b = bn.to(tl.float32)
                    a = an.to(tl.float32)
                    q = qn.to(tl.float32)
                    tn = tl.minimum(t + 1, T - 1)  # the next row (the last row again at the end: unused)
                    kn = tl.load(y_ptr + tn * sy + KD + hk * DK + ok, mask=mk, other=0.0)
                    vn = tl.load(y_ptr + tn * sy + 2 * KD + h * DV + ov, mask=mv, other=0.0)
                    bn = tl.load(p_ptr + tn * sp + C + VD + h)
                    an = tl.load(p_ptr + tn * sp + C + VD + NV + h)
                    qn = tl.load(y_ptr + tn * sy + hk * DK + ok, mask=mk, other=0.0)
                else:
                    k = tl.load(yrow + KD + hk * DK + ok, mask=mk, other=0.0).to(tl.float32)
                    v = tl.load(yrow + 2 * KD + h * DV + ov, mask=mv, other=0.0).to(tl.float32)
                    b = tl.load(prow + C + VD + h).to(tl.float32)
                    a = tl.load(prow + C + VD + NV + h).to(tl.float32)
                    q = tl.load(yrow + hk * DK + ok, mask=mk, other=0.0).to(tl.float32)
                beta = 1.0 / (1.0 + tl.exp(-b))
                xa = a + dtb
                spl = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(tl.minimum(xa, 20.0))))
                g = A * spl
                if ONE_RED:
                    e = tl.exp(g)
                    # k.k, q.q, q.k in one reduction
                    vec = tl.sum(tl.join(tl.join(k * k, q * q), tl.join(q * k, q * k)), axis=0)
                    kkqq, qk2 = tl.split(vec)
                    kk, qq = tl.split(kkqq)
                    qk, _qk = tl.split(qk2)
                    rk = tl.rsqrt(kk + 1e-6)
                    rq = tl.rsqrt(qq + 1e-6) * scale
                    k = k * rk
                    q = q * rq
                    qf = qk * (rk * rq)
                    # k.S and q.S of the state before this row, in one reduction
                    red = tl.sum(tl.join(k[:, None] * S, q[:, None] * S), axis=0)
                    kS, qS = tl.split(red)
                    delta = (v - kS * e) * beta
                    S = S * e
                    S = S + k[:, None] * delta[None, :]
                    o = qS * e + qf * delta  # q.S after the row
                    # a narrower state dtype (bf16): rounded after every row, as a decode
                    # step's store rounds it, so verify, replay and decode keep equal bits
                    # (a no-op for an fp32 state: the same binary as before)
                    S = S.to(SDT).to(tl.float32)
                else:
                    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
                    S = S * tl.exp(g)
                    kS = tl.sum(k[:, None] * S, axis=0)
                    delta = (v - kS) * beta
                    S = S + k[:, None] * delta[None, :]
                    S_o = S  # the output reads the state before its rounding
                    S = S.to(SDT).to(tl.float32)
                if mode == 2:
                    if EVEN:
                        tl.store(st_ptr + t * st_t + soff, S.to(st_ptr.dtype.element_ty))
                    else:
                        tl.store(st_ptr + t * st_t + soff, S.to(st_ptr.dtype.element_ty), mask=m2)
                elif mode == 1:
                    if t == T - 1:
                        if EVEN and STREAM:  # written once, read by the next call: no L2 residency hint
                            tl.store(st_ptr + soff, S.to(SDT), cache_modifier=".cs")
                        elif EVEN:
                            tl.store(st_ptr + soff, S.to(SDT))
                        else:
                            tl.store(st_ptr + soff, S.to(SDT), mask=m2)
                if replay == 0:
                    if not ONE_RED:
                        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
                        o = tl.sum(q[:, None] * S_o, axis=0)  # noqa: F821 - set in the not ONE_RED branch
                    if NORM:  # this program holds the whole head: gated RMSNorm here
                        z = tl.load(prow + C + h * DV + ov, mask=mv, other=0.0).to(tl.float32)
                        ob = o.to(DT).to(tl.float32)
                        var = tl.sum(ob * ob, axis=0) / DV
                        xh = (ob * tl.rsqrt(var + eps)).to(DT).to(tl.float32)
                        yv = (nw * xh).to(DT).to(tl.float32)
                        out = yv * (z / (1.0 + tl.exp(-z)))
                        tl.store(o_ptr + t * so + h * DV + ov, out.to(DT), mask=mv)
                    else:  # a slice of the head: raw o (rounded like the model), normed by _gated_norm_kernel
                        tl.store(o_ptr + t * so + h * DV + ov, o.to(DT), mask=mv)

    @triton.jit(do_not_specialize=["T"])
    def _gated_norm_kernel(o_ptr, so, p_ptr, sp, nw_ptr, T, C, DV, eps, BV: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        r = tl.program_id(0)
        h = tl.program_id(1)
        ov = tl.arange(0, BV)
        mv = ov < DV
        DT = o_ptr.dtype.element_ty
        ob = tl.load(o_ptr + r * so + h * DV + ov, mask=mv, other=0.0).to(tl.float32)
        z = tl.load(p_ptr + r * sp + C + h * DV + ov, mask=mv, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + ov, mask=mv, other=0.0).to(tl.float32)
        var = tl.sum(ob * ob, axis=0) / DV
        xh = (ob * tl.rsqrt(var + eps)).to(DT).to(tl.float32)
        yv = (nw * xh).to(DT).to(tl.float32)
        out = yv * (z / (1.0 + tl.exp(-z)))
        tl.store(o_ptr + r * so + h * DV + ov, out.to(DT), mask=mv)

    @triton.jit(do_not_specialize=["T", "sg", "ss", "sig"])
    def _window_commit_kernel(conv_ptr, sg, ss, in_ptr, sig, j_ptr, T, C, W1: tl.constexpr, BLOCK_C: tl.constexpr,
                              PDL: tl.constexpr = False):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)
        lane = tl.program_id(1).to(tl.int64)
        g = tl.program_id(2).to(tl.int64)
        offs = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        mc = offs < C
        j = tl.load(j_ptr + lane)
        win = conv_ptr + g * sg + lane * ss
        rows = in_ptr + g * sig + lane * T * C
        # ascending rows in place: row w's source j + w >= w + 1 is never a row written before it
        for w in tl.static_range(W1):
            src = j + w  # row of cat(window, new rows)
            old = tl.load(win + tl.minimum(src, W1 - 1) * C + offs, mask=mc, other=0.0)
            new = tl.load(rows + tl.maximum(src - W1, 0) * C + offs, mask=mc, other=0.0)
            tl.store(win + w * C + offs, tl.where(src < W1, old, new), mask=mc)

    return dict(gdn_conv=_gdn_conv_kernel, gdn_step=_gdn_step_kernel, gated_norm=_gated_norm_kernel,
                window_commit=_window_commit_kernel)


def _env_launch() -> dict:
    from hyspec.envknobs import number, switch

    return {"num_warps": number("HYSPEC_GDN_WARPS") or None,
            "pv_first": switch("HYSPEC_GDN_PV_FIRST"), "prefetch": switch("HYSPEC_GDN_PREFETCH"),
            "one_reduction": switch("HYSPEC_GDN_ONE_REDUCTION"),
            "decode_blocks": number("HYSPEC_GDN_DECODE_BLOCKS"),
            "decode_blocks_min_lanes": number("HYSPEC_GDN_DECODE_BLOCKS_MIN_LANES"),
            "stream": switch("HYSPEC_GDN_STREAM"), "const_dv": switch("HYSPEC_GDN_CONST_DV")}


# How the step kernel is launched (decode, verify and replay alike: they must run one
# binary).  num_warps None: 2 for tiles below 2048 elements, 4 from 2048 (Dk 128 x a
# 16-wide Dv block, the runner's default: 128 registers per thread on 4 warps, 232 on 2;
# bench/results/gdn_bench_h200.json at f666dc9) up to 8191, else 8; pv_first: grid
# (Dv blocks, heads, ...) instead of (heads, Dv blocks, ...); prefetch: the next row's
# vectors load during this row's arithmetic.  None of them changes an operation on a
# value; num_warps changes how tl.sum splits a reduction (so the bits may differ from
# another setting's, never between decode, verify and replay).  one_reduction: the form of
# the row arithmetic (the kernel's ONE_RED; it changes the rounding, so it is one setting
# for every call of a process; a replay computes q's sums too, unused: a replay that
# reduced k alone gave other bits in the interpreter, whose sums of a joined tensor run
# in another order).  decode_blocks: Dv blocks per program of a decode step
# (one row per lane, state written) from decode_blocks_min_lanes lanes up; the per-block
# arithmetic is the same instructions, so the bits are those of one block per program
# (bench/gdn_bench.py checks it for every way it times; verify and replay keep one block).
# It is off (1): two blocks helped at b33b848, when the kernel spilled, and lost at
# f666dc9 (batch 16: 28.3 vs 27.8 us per layer on 2 warps, 32.7 vs 27.4 on 4).
# stream: cache hints on the state (evict-first load, streaming final store; the same
# values, a little faster at 16-64 lanes: the kernel's STREAM).  const_dv: Dv compiled in
# (the kernel's DVC: immediate offsets, fewer instructions and registers; the same values).
# Benches set these (bench/gdn_bench.py); HYSPEC_GDN_WARPS / _PV_FIRST / _PREFETCH /
# _ONE_REDUCTION / _DECODE_BLOCKS / _DECODE_BLOCKS_MIN_LANES / _STREAM / _CONST_DV at import (measured
# on the H200 with bench/gdn_bench.py, docs/gpu.md).
STEP_LAUNCH = _env_launch()
LAST: dict = {}  # the compiled step kernel of the last gdn_step call (benches read its registers)


def _step_grid(nv, nvb, third):
    return (nvb, nv, third) if STEP_LAUNCH["pv_first"] else (nv, nvb, third)


def _step_meta(BK, BV, norm, nbp, dk, dv) -> dict:
    nw = STEP_LAUNCH["num_warps"] or (2 if BK * BV < 2048 else 4 if BK * BV < 8192 else 8)
    even = dk == BK and dv % BV == 0
    return dict(BK=BK, BV=BV, NORM=norm, PVF=bool(STEP_LAUNCH["pv_first"]), PF=bool(STEP_LAUNCH["prefetch"]),
                NBP=nbp, ONE_RED=bool(STEP_LAUNCH["one_reduction"]), EVEN=even,
                STREAM=bool(STEP_LAUNCH["stream"]), DVC=dv if even and STEP_LAUNCH["const_dv"] else 0,
                num_warps=nw, **launch_kwargs())


def _decode_blocks(nvb, lanes, rows_per_lane, mode, blocks_per_program) -> int:
    """Dv blocks per program: the caller's (it must divide the head's block count), else
    STEP_LAUNCH's for a decode step of enough lanes when it divides the block count, else
    one.  Dividing keeps every program's blocks inside the head, so whether the state
    needs masks (EVEN) is the same for every call of a shape: decode, verify and replay
    compile the same masking whatever the block count."""
    if blocks_per_program is not None:
        nbp = int(blocks_per_program)
        if nbp < 1 or nvb % nbp:
            raise ValueError(f"gdn_step: blocks_per_program={blocks_per_program} must divide the head's {nvb} "
                             "Dv blocks")
        return nbp
    nbp = STEP_LAUNCH["decode_blocks"] if (
        rows_per_lane == 1 and mode == 1 and lanes >= STEP_LAUNCH["decode_blocks_min_lanes"]) else 1
    return nbp if nbp >= 1 and nvb % nbp == 0 else 1


def gdn_conv(x, state, weight, y, *, rows, update: bool, xin=None, lanes=1, state_lane_stride=0,
             xin_lane_stride=0):
    """Triton :func:`gdn_conv_ref`. x: [T, >=C] rows (only the first C columns are read),
    state [W-1, C] (updated in place when update), weight [C, W], y [T, C] out; xin
    (optional [T, C]) receives a copy of the new rows (for a later commit).  lanes > 1:
    rows // lanes rows per sequence (lane-major), lane b with its own window
    ``state + b * state_lane_stride`` and slab ``xin + b * xin_lane_stride``."""
    C, W = weight.shape
    k = _kernels()["gdn_conv"]
    # 256 channels per program.  64- and 128-channel blocks ran 1 % faster on the H200 but
    # made speculative output differ from plain there (bench/results/step_anatomy_h200.json; the
    # interpreter agrees bitwise, cause not found): keep the block that passes every check.
    BC = 256
    xi = xin if xin is not None else y
    k[(-(-C // BC), lanes)](x, x.stride(0), state, weight, y, y.stride(0), xi, xi.stride(0), rows // lanes, C,
                            int(update), int(xin is not None), int(state_lane_stride), int(xin_lane_stride), W=W, BLOCK_C=BC, num_warps=4, **launch_kwargs())
    return y


def gdn_window_commit(conv, conv_in, j, nb: int, t: int):
    """Triton :func:`gdn_window_commit_ref`: every layer's and lane's conv window advanced
    past the lane's kept rows in one launch (copies only: bitwise the reference's)."""
    G, S, W1, C = conv.shape
    if conv.stride(3) != 1 or conv.stride(2) != C or conv_in.stride(-1) != 1 or conv_in.stride(1) != C:
        raise ValueError("gdn_window_commit: rows of C contiguous channels expected")
    BC = 256
    _kernels()["window_commit"][(-(-C // BC), nb, G)](conv, conv.stride(0), conv.stride(1), conv_in,
                                                      conv_in.stride(0), j, t, C, W1=W1, BLOCK_C=BC, num_warps=4,
                                                      **launch_kwargs())
    return conv


def gdn_step(y, proj, A_log, dt_bias, norm_w, state, out, *, nk, nv, dk, dv, eps, rows, states=None,
             block_v=None, keep_state=False, lanes=1, state_lane_stride=0, blocks_per_program=None):
    """Triton :func:`gdn_step_ref`. With states ([>=T, Hv, Dk, Dv] fp32) the state after
    every row goes there and ``state`` is left alone; with ``keep_state`` nothing is
    written back (a verify whose commit replays the accepted rows: :func:`gdn_replay`);
    otherwise ``state`` ends updated in place (a decode step). Same compiled kernel in
    every case. block_v < Dv splits each head's Dv over several programs (more
    parallelism) and applies the gated norm in a second kernel; the choice must not depend
    on the row count (it does not here).  lanes > 1: rows // lanes rows per sequence
    (lane-major), lane b's state at ``state + b * state_lane_stride`` (not with states).
    blocks_per_program: Dv blocks per program (None: STEP_LAUNCH's choice; the bits do not
    depend on it)."""
    if states is not None and lanes > 1:
        raise ValueError("gdn_step: per-row states are recorded for one lane only")
    if states is not None:
        st, st_t, mode = states, states.stride(0), 2
    else:
        st, st_t, mode = state, 0, 0 if keep_state else 1
    BK, BV, norm = _gdn_blocks(dk, dv, block_v)
    ks = _kernels()
    TL = rows // lanes
    nvb = -(-dv // BV)
    nbp = _decode_blocks(nvb, lanes, TL, mode, blocks_per_program)
    LAST["gdn_step"] = ks["gdn_step"][_step_grid(nv, -(-nvb // nbp), lanes)](
        y, y.stride(0), proj, proj.stride(0), A_log, dt_bias, norm_w, state, st, st_t, out, out.stride(0),
        TL, nv // nk, nk * dk, 2 * nk * dk + nv * dv, nv * dv, nv, dk, dv, float(dk ** -0.5), float(eps),
        mode, 0, state, 0, 0, 0, 0, lanes, TL * y.stride(0), TL * proj.stride(0), int(state_lane_stride),
        TL * out.stride(0), **_step_meta(BK, BV, norm, nbp, dk, dv))
    if not norm:
        ks["gated_norm"][(rows, nv)](out, out.stride(0), proj, proj.stride(0), norm_w, rows,
                                     2 * nk * dk + nv * dv, dv, float(eps), BV=p2(dv), num_warps=4, **launch_kwargs())
    return out


def _gdn_blocks(dk, dv, block_v):
    BK, BVf = p2(dk), p2(dv)
    BV = BVf if block_v is None or block_v >= BVf else p2(block_v)
    return BK, BV, BV == BVf


def gdn_replay(y_rows, p_rows, A_log_all, dt_bias_all, norm_w, ssm, n, out_like, *, nk, nv, dk, dv, eps,
               block_v=None, lanes=0):
    """Advance the state of every Gated-DeltaNet layer by the rows a verify saw, in place,
    with the very kernel (and so the very arithmetic) of :func:`gdn_step`: layer g's state
    ``ssm[g]`` [Hv, Dk, Dv] takes rows 0..n of ``y_rows[g]`` [t, C] / ``p_rows[g]`` [t, P]
    (n: int64 [1] device tensor, the accepted drafts; rows = n + 1). One launch for all
    layers (a grid axis over them). ``A_log_all`` / ``dt_bias_all`` [G, Hv] stacked per
    layer; ``out_like`` any tensor of the output dtype (not written).  lanes > 0: a lane
    axis after the layer axis (y_rows [G, B, t, C], p_rows [G, B, t, P], ssm [G, B, Hv,
    Dk, Dv], n [B]); the first ``lanes`` lanes advance, each by its own n[b] + 1 rows."""
    G = ssm.shape[0]
    BK, BV, norm = _gdn_blocks(dk, dv, block_v)
    if lanes:
        yg, pg = y_rows[0, 0], p_rows[0, 0]
        NB, sy_b, sp_b, ss_b = lanes, y_rows.stride(1), p_rows.stride(1), ssm.stride(1)
    else:
        yg, pg = y_rows[0], p_rows[0]
        NB, sy_b, sp_b, ss_b = 1, 0, 0, 0
    _kernels()["gdn_step"][_step_grid(nv, -(-dv // BV), G * NB)](
        yg, yg.stride(0), pg, pg.stride(0), A_log_all, dt_bias_all, norm_w, ssm, ssm, 0, out_like,
        out_like.stride(0), 0, nv // nk, nk * dk, 2 * nk * dk + nv * dv, nv * dv, nv, dk, dv, float(dk ** -0.5),
        float(eps), 1, 1, n, y_rows.stride(0), p_rows.stride(0), ssm.stride(0), A_log_all.stride(0),
        NB, sy_b, sp_b, ss_b, 0, **_step_meta(BK, BV, norm, 1, dk, dv))
    return ssm
