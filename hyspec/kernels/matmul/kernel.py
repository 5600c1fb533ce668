"""Triton kernels and launcher of the skinny matmul (contract and the row-invariance
argument: ``hyspec/kernels/matmul/__init__.py``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hyspec.kernels.common import SplitPartials, triton_available
from hyspec.kernels.matmul.config import _cdiv, _config_cached
from hyspec.kernels.pdl import kernels_per_mode, launch_kwargs

__all__ = ["skinny_matmul", "silu_mul", "linear", "BLOCK_T", "MAX_SKINNY_ROWS"]

BLOCK_T = 16  # the x-tile height; every row count <= 16 runs in one padded tile
MAX_SKINNY_ROWS = 16  # the dispatcher sends T <= this to the Triton kernel


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])
    def _skinny_kernel(
        x_ptr, w_ptr, out_ptr, ws_ptr,
        T, N, K, K_PER_SPLIT,
        stride_xt, stride_xk,
        stride_wn, stride_wk,
        stride_ot, stride_on,
        stride_ws_s, stride_ws_t,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DIRECT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
        W_I64: tl.constexpr, ACT: tl.constexpr = False, X_UP: tl.constexpr = 0,
        PDL: tl.constexpr = False, WT: tl.constexpr = False, LATE: tl.constexpr = False,
    ):
        # row tiles vary fastest: the programs of one weight tile run together, so a call
        # with many row tiles reads each weight tile from HBM once (the others hit L2)
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
        if W_I64:  # weights with >= 2**31 elements: 64-bit offsets
            w_rows = offs_n.to(tl.int64) * stride_wn
        else:
            w_rows = offs_n * stride_wn
        if PDL:  # hyspec.kernels.pdl: wait for the kernels ahead before touching x
            tl.extra.cuda.gdc_wait()
            if not LATE:  # LATE: the next kernel launches after this one's K loop (below)
                tl.extra.cuda.gdc_launch_dependents()
        if WT:
            acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + offs_kb
            x_ptrs = x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xk
            if WT:  # the weight tile as it lies in memory, [BLOCK_N, BLOCK_K]
                w_ptrs = w_ptr + w_rows[:, None] + offs_k[None, :] * stride_wk
            else:  # a tile of w.T, [BLOCK_K, BLOCK_N]
                w_ptrs = w_ptr + offs_k[:, None] * stride_wk + w_rows[None, :]
            # EVEN_K / EVEN_N (set from the shapes only) drop the masks that would otherwise
            # stop the weight stream from being loaded in 16-byte vectors
            if EVEN_K:
                xt = tl.load(x_ptrs, mask=mask_t[:, None], other=0.0)  # [BLOCK_T, BLOCK_K]
                if ACT:  # x holds [gate | up]: feed silu(gate) * up, rounded like the torch MLP
                    xu = tl.load(x_ptrs + X_UP * stride_xk, mask=mask_t[:, None], other=0.0).to(tl.float32)
                    xg = xt.to(tl.float32)
                    sg = (xg / (1.0 + tl.exp(-xg))).to(x_ptr.dtype.element_ty).to(tl.float32)
                    xt = (sg * xu).to(x_ptr.dtype.element_ty)
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
                    sg = (xg / (1.0 + tl.exp(-xg))).to(x_ptr.dtype.element_ty).to(tl.float32)
                    xt = (sg * xu).to(x_ptr.dtype.element_ty)
                if WT:
                    wt = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                else:
                    wt = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            # every output row comes from its own x row only (the MMA never mixes rows or,
            # with WT, columns of x.T), so padded rows change nothing
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
        if PDL and LATE:  # the weight stream is done: let the next kernel launch
            tl.extra.cuda.gdc_launch_dependents()
        if WT:
            acc = tl.trans(acc)
        mask = mask_t[:, None] & mask_n[None, :]
        if DIRECT:
            tl.store(
                out_ptr + offs_t[:, None] * stride_ot + offs_n[None, :] * stride_on,
                acc.to(out_ptr.dtype.element_ty), mask=mask,
            )
        else:
            tl.store(
                ws_ptr + pid_s * stride_ws_s + offs_t[:, None] * stride_ws_t + offs_n[None, :],
                acc, mask=mask,
            )

    @triton.jit(do_not_specialize=["T"])
    def _splitk_reduce_kernel(
        ws_ptr, out_ptr, T, N, S, stride_ws_s, stride_ws_t, stride_ot, stride_on,
        BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    ):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        # one program per (row, BLOCK columns); sums the S partials in the fixed order 0..S-1
        pid_n = tl.program_id(0)
        t = tl.program_id(1)
        offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
        mask = offs_n < N
        acc = tl.load(ws_ptr + t * stride_ws_t + offs_n, mask=mask, other=0.0)
        for s in range(1, S):
            acc += tl.load(ws_ptr + s * stride_ws_s + t * stride_ws_t + offs_n, mask=mask, other=0.0)
        tl.store(out_ptr + t * stride_ot + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["T"])
    def _silu_mul_kernel(x_ptr, out_ptr, T, I, stride_xt, stride_ot, BLOCK: tl.constexpr,
                         EVEN: tl.constexpr):
        # x [T, 2I] = [gate | up] -> out [T, I] = silu(gate) * up, each rounded to x's dtype
        # with the very expression _skinny_kernel's ACT x-load uses (the same bits)
        t = tl.program_id(1)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        row = x_ptr + t.to(tl.int64) * stride_xt
        if EVEN:
            xt = tl.load(row + offs)
            xu = tl.load(row + I + offs).to(tl.float32)
        else:
            mask = offs < I
            xt = tl.load(row + offs, mask=mask, other=0.0)
            xu = tl.load(row + I + offs, mask=mask, other=0.0).to(tl.float32)
        xg = xt.to(tl.float32)
        sg = (xg / (1.0 + tl.exp(-xg))).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (sg * xu).to(x_ptr.dtype.element_ty)
        if EVEN:
            tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, y)
        else:
            tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, y, mask=mask)

    return _skinny_kernel, _splitk_reduce_kernel, _silu_mul_kernel


_REDUCE_BLOCK = 1024


def skinny_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    split_k: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    wt: bool | None = None,
    out: torch.Tensor | None = None,
    act: bool = False,
    ws: torch.Tensor | None = None,
    defer: bool = False,
    block_t: int = BLOCK_T,
):
    """Triton ``x [T, K] @ w [N, K].T -> [T, N]`` (fp32 accumulate, output x.dtype).

    Made for T <= 16 (one padded 16-row tile); larger T runs as several 16-row tiles and
    stays row-invariant.  Row r of the result is bitwise independent of T and of the
    other rows' values for a fixed ``(N, K)`` and fixed keyword overrides.
    ``split_k`` etc. override :func:`skinny_config`: the K split (split_k, and BK where
    it changes the split's K ranges) must not be chosen from T by the caller, or the row
    invariance is lost.  ``out`` (optional, [T, N], x.dtype) receives
    the result and is returned.  fp32 inputs use exact ``ieee`` dot products (no TF32).
    ``defer=True``: when the config splits K, skip the reduce kernel and return a
    :class:`hyspec.kernels.common.SplitPartials` over the workspace instead (its consumer,
    ``hyspec.kernels.rmsnorm.rmsnorm``, reduces in the same order); with one split the
    product is returned.
    ``block_t``: rows per program (16, or 64 for many-row batched calls: each weight tile is
    then loaded once for 64 rows). On the H200 a row's bits were measured not to depend on
    block_t (nor on BK or the stage count) at a fixed K split, and the batched decoder
    picks it from T there (``hyspec.gpu.runner_triton``); the Triton interpreter's dots
    do change with the tile's width.
    """
    if block_t not in (16, 32, 64, 128):
        raise ValueError(f"skinny_matmul: block_t must be 16, 32, 64 or 128, got {block_t}")
    kx = 2 * w.shape[1] if act and w.dim() == 2 else (w.shape[1] if w.dim() == 2 else -1)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != kx:
        raise ValueError(f"skinny_matmul: want x [T, {'2K' if act else 'K'}] and w [N, K], got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"skinny_matmul: x is {x.dtype} but w is {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"skinny_matmul: x on {x.device} but w on {w.device}")
    T = x.shape[0]
    N, K = w.shape
    if out is None:
        out = torch.empty((T, N), device=x.device, dtype=x.dtype)
    elif out.shape != (T, N) or out.dtype != x.dtype:
        raise ValueError(f"skinny_matmul: out must be [{T}, {N}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if T == 0:
        return out
    cfg = _config_cached(N, K, split_k, block_n, block_k, num_warps, num_stages, wt, act)
    mm_kernel, reduce_kernel, _ = _kernels()
    n_tblocks = _cdiv(T, block_t)
    t_pad = n_tblocks * block_t  # workspace rows: strides then do not depend on T (T <= 16)
    direct = cfg.split_k == 1
    if direct:
        ws = out  # unused placeholder pointer
        sws_s, sws_t = 0, 0
    else:
        # a caller-given workspace keeps its strides whatever T is (graph-friendly)
        if ws is None or ws.dim() != 3 or ws.shape[0] < cfg.split_k or ws.shape[1] < t_pad or ws.shape[2] != N \
                or ws.dtype != torch.float32 or ws.stride(2) != 1:
            ws = torch.empty((cfg.split_k, t_pad, N), device=x.device, dtype=torch.float32)
        sws_s, sws_t = ws.stride(0), ws.stride(1)
    grid = (n_tblocks, _cdiv(N, cfg.block_n), cfg.split_k)
    mm_kernel[grid](
        x, w, out, ws,
        T, N, K, cfg.k_per_split,
        x.stride(0), x.stride(1),
        w.stride(0), w.stride(1),
        out.stride(0), out.stride(1),
        sws_s, sws_t,
        BLOCK_T=block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DIRECT=direct, IEEE=(x.dtype == torch.float32),
        EVEN_K=(K % cfg.block_k == 0), EVEN_N=(N % cfg.block_n == 0),
        W_I64=((N - 1) * abs(w.stride(0)) + (K - 1) * abs(w.stride(1)) >= 2**31),
        ACT=act, X_UP=K if act else 0, WT=cfg.wt,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs("matmul"),
    )
    if not direct:
        if defer:
            return SplitPartials(ws, cfg.split_k)
        reduce_kernel[(_cdiv(N, _REDUCE_BLOCK), T)](
            ws, out, T, N, cfg.split_k, sws_s, sws_t, out.stride(0), out.stride(1),
            BLOCK=_REDUCE_BLOCK, num_warps=4, **launch_kwargs(),
        )
    return out


_ACT_BLOCK = 1024


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, 2I] = [gate | up] -> [T, I]``: silu(gate) * up, each product rounded to x's
    dtype exactly as ``skinny_matmul(..., act=True)`` rounds the input it feeds, so
    ``skinny_matmul(silu_mul(x), w, **cfg)`` gives the bits of ``skinny_matmul(x, w,
    act=True, **cfg)``.  For calls of many rows, where every column tile of the fused
    kernel would recompute the activation of all its rows (the batched decoder's 32- and
    64-row tiles)."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul: want x [T, 2I], got {tuple(x.shape)}")
    T, I = x.shape[0], x.shape[1] // 2
    if x.stride(1) != 1:
        raise ValueError("silu_mul: x's rows must be contiguous")
    if out is None:
        out = torch.empty((T, I), device=x.device, dtype=x.dtype)
    elif out.shape != (T, I) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"silu_mul: out must be [{T}, {I}] {x.dtype} with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if T == 0:
        return out
    _, _, kernel = _kernels()
    kernel[(_cdiv(I, _ACT_BLOCK), T)](x, out, T, I, x.stride(0), out.stride(0), BLOCK=_ACT_BLOCK,
                                      EVEN=(I % _ACT_BLOCK == 0), num_warps=4)
    return out


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (no bias): the row-invariant Triton kernel on CUDA for 2-D x with
    T <= 16 rows and triton importable, ``torch.nn.functional.linear`` otherwise."""
    if (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_SKINNY_ROWS
        and x.is_cuda
        and w.is_cuda
        and w.dim() == 2
        and x.dtype == w.dtype
        and triton_available()
    ):
        return skinny_matmul(x, w)
    return F.linear(x, w)
