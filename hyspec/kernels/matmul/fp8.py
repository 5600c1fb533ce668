"""Skinny matmul with block-FP8 weights: ``y = x @ dequant(w8, scale).T`` without ever
building the dequantized weight (contract: ``hyspec/kernels/matmul/__init__.py``).

The weight streams from memory as float8_e4m3fn (1 byte per element), is converted to
x's dtype in registers (exact: every e4m3 value is a bf16 / fp16 / fp32 value), and each
``BLOCK_K``-wide step's product is taken with a fresh fp32 ``tl.dot`` and added to the
accumulator times the step's block scale (one fp32 scale per output column: the scale
row of that column, the scale column of the step's quant block). ``BLOCK_K`` divides the
quant block's K size, so a step never straddles two scale columns.

Row invariance is the bf16 kernel's: 16-row x tiles (the MMA never mixes rows), tile /
split-K from (N, K) only (the bf16 config, with BK the quant block's step), split
partials reduced in order 0..S-1, ``T`` passed with ``do_not_specialize``.
"""
from __future__ import annotations

import torch

from hyspec.envknobs import switch
from hyspec.kernels.common import SplitPartials
from hyspec.kernels.matmul.config import SkinnyConfig, _cdiv, _config_cached, skinny_config
from hyspec.kernels.matmul.kernel import BLOCK_T, _kernels as _bf16_kernels
from hyspec.kernels.pdl import interpreting, kernels_per_mode, launch_kwargs

__all__ = ["skinny_matmul_fp8", "fp8_config", "e4m3_to_bf16", "int_cvt"]


# e4m3 -> bf16 in integer instructions (CVT 1): the PTX cvt path (e4m3x2 -> f16x2, then each
# f16 -> bf16) costs three conversions per pair of weights, which bound the FP8 matmuls'
# issue rate on the H200 (bench/results/fp8_probe_ncu_h200.txt). Here four e4m3 bytes become
# four bf16 with two masks, then per pair a byte permute that puts the magnitude in each
# half's high byte, a shift by 4 (e4m3's 3 mantissa bits line up with bf16's top 3), a permute
# of the sign bits and an or: the bf16 with the e4m3's exponent field, i.e. the value times
# 2^-120 (e4m3's subnormals become bf16 subnormals of the same mantissa). One bf16x2 multiply
# by 2^120 (exact: a power of two, no rounding, subnormals kept) gives the e4m3's value.
# The one code it does not keep is e4m3fn's NaN (S.1111.111), which comes out as +-480
# where Triton's conversion gives NaN; quantized checkpoints hold no NaN weights.
_E4M3_BF16_ASM = """
{
.reg .b32 m, s, z, c, t, u;
mov.b32 z, 0;
mov.b32 c, 0x7B807B80;
and.b32 m, $2, 0x7F7F7F7F;
and.b32 s, $2, 0x80808080;
prmt.b32 t, m, z, 0x1404;
shr.b32 t, t, 4;
prmt.b32 u, s, z, 0x1404;
or.b32 t, t, u;
mul.rn.bf16x2 $0, t, c;
prmt.b32 t, m, z, 0x3424;
shr.b32 t, t, 4;
prmt.b32 u, s, z, 0x3424;
or.b32 t, t, u;
mul.rn.bf16x2 $1, t, c;
}
"""


def int_cvt(dtype) -> int:
    """The kernels' CVT flag: 1 when the weights' e4m3 -> bf16 conversion runs in integer
    instructions (bf16 activations, compiled for a GPU, ``HYSPEC_FP8_CVT`` unset or not 0), else 0
    (Triton's conversion; the interpreter cannot run inline PTX). Both give the same bits."""
    return int(dtype == torch.bfloat16 and not interpreting() and switch("HYSPEC_FP8_CVT"))


@kernels_per_mode
def e4m3_to_bf16():
    """A jit helper ``f(w)``: a float8_e4m3fn tensor's values as bfloat16 (exact), four at a
    time in integer instructions (see _E4M3_BF16_ASM); GPU only (inline PTX)."""
    import triton
    import triton.language as tl

    asm = tl.constexpr(_E4M3_BF16_ASM)

    @triton.jit
    def _e4m3_to_bf16(w):
        return tl.inline_asm_elementwise(asm, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)

    return _e4m3_to_bf16


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    bf16_of = None if interpreting() else e4m3_to_bf16()

    @triton.jit(do_not_specialize=["T"])
    def _skinny_fp8_kernel(
        x_ptr, w_ptr, s_ptr, r_ptr, out_ptr, ws_ptr,
        T, N, K, K_PER_SPLIT,
        stride_xt, stride_xk,
        stride_wn, stride_wk,
        stride_sn, stride_sk,
        stride_ot, stride_on,
        stride_ws_s, stride_ws_t,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        QB_N: tl.constexpr, QB_K: tl.constexpr, ROW_MAP: tl.constexpr,
        DIRECT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
        W_I64: tl.constexpr, ACT: tl.constexpr = False, X_UP: tl.constexpr = 0,
        PDL: tl.constexpr = False, WT: tl.constexpr = False, CVT: tl.constexpr = 0,
        LATE: tl.constexpr = False,
    ):
        pid_t = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_kb = tl.arange(0, BLOCK_K)
        mask_t = offs_t < T
        mask_n = offs_n < N
        k_lo = pid_s * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        if W_I64:
            w_rows = offs_n.to(tl.int64) * stride_wn
        else:
            w_rows = offs_n * stride_wn
        # each output column's scale row: n // QB_N, or the packed weight's row map
        if ROW_MAP:
            s_row = tl.load(r_ptr + offs_n, mask=mask_n, other=0)
        else:
            s_row = offs_n // QB_N
        s_ptrs = s_ptr + s_row * stride_sn
        if PDL:  # hyspec.kernels.pdl: wait for the kernels ahead before touching x
            tl.extra.cuda.gdc_wait()
            if not LATE:  # LATE: the next kernel launches after this one's K loop (below)
                tl.extra.cuda.gdc_launch_dependents()
        DT = x_ptr.dtype.element_ty
        if WT:
            acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + offs_kb
            x_ptrs = x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xk
            if WT:
                w_ptrs = w_ptr + w_rows[:, None] + offs_k[None, :] * stride_wk
            else:
                w_ptrs = w_ptr + offs_k[:, None] * stride_wk + w_rows[None, :]
            if EVEN_K:
                xt = tl.load(x_ptrs, mask=mask_t[:, None], other=0.0)
                if ACT:
                    xu = tl.load(x_ptrs + X_UP * stride_xk, mask=mask_t[:, None], other=0.0).to(tl.float32)
                    xg = xt.to(tl.float32)
                    sg = (xg / (1.0 + tl.exp(-xg))).to(DT).to(tl.float32)
                    xt = (sg * xu).to(DT)
                if EVEN_N:
                    wt = tl.load(w_ptrs)
                elif WT:
                    wt = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
                else:
                    wt = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = offs_k < k_hi
                xt = tl.load(x_ptrs, mask=mask_t[:, None] & mask_k[None, :], other=0.0)
                if ACT:
                    xu = tl.load(x_ptrs + X_UP * stride_xk, mask=mask_t[:, None] & mask_k[None, :],
                                 other=0.0).to(tl.float32)
                    xg = xt.to(tl.float32)
                    sg = (xg / (1.0 + tl.exp(-xg))).to(DT).to(tl.float32)
                    xt = (sg * xu).to(DT)
                if WT:
                    wt = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                else:
                    wt = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if CVT == 1:
                wt = bf16_of(wt)  # e4m3 -> bf16 in integer instructions: exact
            else:
                wt = wt.to(DT)  # e4m3 -> the activation dtype: exact
            # the step's block scale, one per output column (BLOCK_K divides QB_K)
            sc = tl.load(s_ptrs + (k0 // QB_K) * stride_sk, mask=mask_n, other=0.0)
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
        if PDL and LATE:  # the weight stream is done: let the next kernel launch
            tl.extra.cuda.gdc_launch_dependents()
        if WT:
            acc = tl.trans(acc)
        mask = mask_t[:, None] & mask_n[None, :]
        if DIRECT:
            tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_n[None, :] * stride_on,
                     acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + pid_s * stride_ws_s + offs_t[:, None] * stride_ws_t + offs_n[None, :], acc, mask=mask)

    return _skinny_fp8_kernel


def _k_step(qb_k: int) -> int:
    """The largest power of two (<= 128) dividing the quant block's K size."""
    b = 128
    while b > 1 and qb_k % b:
        b //= 2
    return b


def fp8_config(N: int, K: int, block: tuple[int, int], act: bool = False, **overrides) -> SkinnyConfig:
    """The fp8 kernel's config for an [N, K] weight with quant block `block`: the bf16
    config of (N, K) (TUNED / BUILTIN / defaults, or the overrides) with BK set to the
    largest power of two <= 128 dividing the block's K size; from (N, K, block) only, never
    from T."""
    keys = ("split_k", "block_n", "block_k", "num_warps", "num_stages", "wt")
    c = _config_cached(N, K, *(overrides.get(k) for k in keys), act)
    # BK is always the quant block's own step (128 for 128-wide blocks), whatever the bf16
    # config or an override says: measured on the H200 (tests/test_gpu_tile_heights.py),
    # BK 64 with 128-wide blocks gave a row other bits at a 16/32-row tile than at 64 rows
    step = _k_step(block[1])
    bk = step if K >= step else min(c.block_k, step)  # (a K below one step keeps its own BK)
    if bk < 16:
        raise ValueError(f"fp8 matmul: quant block {list(block)} has no K step >= 16 (its K size must be a multiple "
                         f"of 16)")
    if bk == c.block_k:
        return c
    return skinny_config(N, K, split_k=c.split_k, block_n=c.block_n, block_k=bk, num_warps=c.num_warps,
                         num_stages=c.num_stages, wt=c.wt)


def skinny_matmul_fp8(x: torch.Tensor, w, *, out: torch.Tensor | None = None, act: bool = False,
                      ws: torch.Tensor | None = None, defer: bool = False, block_t: int = BLOCK_T, **overrides):
    """``x [T, K] (act: [T, 2K]) @ dequant(w).T -> [T, N]`` in x.dtype, w a
    :class:`hyspec.quant.Fp8Weight` ([N, K] float8_e4m3fn + scale grid [+ row map]).

    Same keywords and row-invariance contract as :func:`skinny_matmul` (``out``, ``ws``,
    ``defer``, ``block_t`` and the config overrides, BK clamped to the quant block)."""
    if block_t not in (16, 32, 64, 128):
        raise ValueError(f"skinny_matmul_fp8: block_t must be 16, 32, 64 or 128, got {block_t}")
    w8, scale = w.w, w.scale
    if w8.dim() != 2:
        raise ValueError(f"skinny_matmul_fp8: want a 2-D weight, got {tuple(w8.shape)}")
    N, K = w8.shape
    if x.dim() != 2 or x.shape[1] != (2 * K if act else K):
        raise ValueError(f"skinny_matmul_fp8: want x [T, {'2K' if act else 'K'}] for w [{N}, {K}], got "
                         f"{tuple(x.shape)}")
    if x.device != w8.device:
        raise ValueError(f"skinny_matmul_fp8: x on {x.device} but w on {w8.device}")
    T = x.shape[0]
    if out is None:
        out = torch.empty((T, N), device=x.device, dtype=x.dtype)
    elif out.shape != (T, N) or out.dtype != x.dtype:
        raise ValueError(f"skinny_matmul_fp8: out must be [{T}, {N}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if T == 0:
        return out
    cfg = fp8_config(N, K, w.block, act, **overrides)
    kernel = _kernels()
    n_tblocks = _cdiv(T, block_t)
    t_pad = n_tblocks * block_t
    direct = cfg.split_k == 1
    if direct:
        ws = out
        sws_s, sws_t = 0, 0
    else:
        if ws is None or ws.dim() != 3 or ws.shape[0] < cfg.split_k or ws.shape[1] < t_pad or ws.shape[2] != N \
                or ws.dtype != torch.float32 or ws.stride(2) != 1:
            ws = torch.empty((cfg.split_k, t_pad, N), device=x.device, dtype=torch.float32)
        sws_s, sws_t = ws.stride(0), ws.stride(1)
    rows = w.rows
    kernel[(n_tblocks, _cdiv(N, cfg.block_n), cfg.split_k)](
        x, w8, scale, rows if rows is not None else scale, out, ws,
        T, N, K, cfg.k_per_split,
        x.stride(0), x.stride(1),
        w8.stride(0), w8.stride(1),
        scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1),
        sws_s, sws_t,
        BLOCK_T=block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        QB_N=w.block[0], QB_K=w.block[1], ROW_MAP=rows is not None,
        DIRECT=direct, IEEE=(x.dtype == torch.float32),
        EVEN_K=(K % cfg.block_k == 0), EVEN_N=(N % cfg.block_n == 0),
        W_I64=((N - 1) * abs(w8.stride(0)) + (K - 1) * abs(w8.stride(1)) >= 2**31),
        ACT=act, X_UP=K if act else 0, WT=cfg.wt, CVT=int_cvt(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs("matmul"),
    )
    if not direct:
        if defer:
            return SplitPartials(ws, cfg.split_k)
        _, reduce_kernel, _ = _bf16_kernels()
        reduce_kernel[(_cdiv(N, 1024), T)](
            ws, out, T, N, cfg.split_k, sws_s, sws_t, out.stride(0), out.stride(1),
            BLOCK=1024, num_warps=4, **launch_kwargs(),
        )
    return out
