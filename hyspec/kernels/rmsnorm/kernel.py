"""Triton kernel and launcher of the fused RMSNorm (contract: ``hyspec/kernels/rmsnorm/__init__.py``)."""
from __future__ import annotations

import torch

from hyspec.kernels.common import MoePartials, SplitPartials, check_rows, p2
from hyspec.kernels.pdl import kernels_per_mode, launch_kwargs

__all__ = ["rmsnorm"]


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    # Every kernel starts with the PDL prologue (hyspec.kernels.pdl): let the next kernel
    # start launching, then wait until every earlier kernel of the stream is done.  It is
    # compiled away when PDL is False (written out in each kernel: the interpreter does not
    # resolve nested jit helpers).

    @triton.jit(do_not_specialize=["T"])
    def _rmsnorm_kernel(x_ptr, ids_ptr, d_ptr, w_ptr, res_ptr, out_ptr, T, N, sx, sd, sr, so, eps, sds,
                        mw_ptr, ms_ptr,
                        GATHER: tl.constexpr, ADD: tl.constexpr, STORE_RES: tl.constexpr, BLOCK: tl.constexpr,
                        DS: tl.constexpr = 0, PDL: tl.constexpr = False, W_FIRST: tl.constexpr = True,
                        KS: tl.constexpr = 0):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        r = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < N
        if W_FIRST:  # the weight's load issued first, not behind the row's reduction (its latency then overlaps)
            w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if GATHER:
            row = tl.load(ids_ptr + r).to(tl.int64)
            x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
        else:
            x = tl.load(x_ptr + r * sx + offs, mask=m, other=0.0)
        if ADD:
            if KS > 0:  # delta = a grouped MoE's KS slot outputs per row, combined in slot order
                # (the expression of hyspec.kernels.moe.grouped's combine kernel)
                dacc = tl.zeros([BLOCK], dtype=tl.float32)
                for j in tl.static_range(KS):
                    wj = tl.load(mw_ptr + r * KS + j).to(x_ptr.dtype.element_ty).to(tl.float32)
                    sl = tl.load(ms_ptr + r * KS + j).to(tl.int64)
                    dacc += tl.load(d_ptr + sl * sd + offs, mask=m, other=0.0).to(tl.float32) * wj
                d = dacc.to(x_ptr.dtype.element_ty)
            elif DS > 0:  # delta = the DS fp32 split-K partials of a matmul, summed in order 0..DS-1
                dacc = tl.load(d_ptr + r * sd + offs, mask=m, other=0.0)
                for s in tl.static_range(1, DS):
                    dacc += tl.load(d_ptr + s * sds + r * sd + offs, mask=m, other=0.0)
                d = dacc.to(x_ptr.dtype.element_ty)
            else:
                d = tl.load(d_ptr + r * sd + offs, mask=m, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE_RES:
            tl.store(res_ptr + r * sr + offs, x, mask=m)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / N
        if not W_FIRST:
            w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        y = xf * tl.rsqrt(var + eps) * (1.0 + w)
        tl.store(out_ptr + r * so + offs, y.to(out_ptr.dtype.element_ty), mask=m)

    return dict(rmsnorm=_rmsnorm_kernel)


def rmsnorm(x, weight, eps, *, out, ids=None, delta=None, resid_out=None, rows=None, w_first=True):
    """Triton :func:`rmsnorm_ref`. x [T, N] (or table [V, N] with ids [T]); writes y into
    out [T, N] and, with resid_out, the (gathered / added) input rows into resid_out
    (may alias x). rows: T (default out.shape[0]). delta may be a :class:`SplitPartials`
    or a :class:`MoePartials` (whose y has x's dtype).
    w_first: the weight's load placed before the row's reduction (the same values; False:
    after it, the earlier form, kept for the side-by-side timing)."""
    T = out.shape[0] if rows is None else rows
    N = out.shape[1]
    ds = ks = 0
    mw = ms = x
    if isinstance(delta, MoePartials):
        d, sds, ks, mw, ms = delta.y, 0, delta.KS, delta.wts, delta.slot
        if d.dtype != x.dtype or d.shape[1] != N or d.stride(1) != 1 or delta.wts.numel() < T * ks:
            raise ValueError(f"rmsnorm: MoE partials must be [P, {N}] of {x.dtype} with >= {T} x {ks} pairs, "
                             f"got {tuple(d.shape)} {d.dtype}, {delta.wts.numel()} pairs")
    elif isinstance(delta, SplitPartials):
        ds, d, sds = delta.S, delta.ws, delta.ws.stride(0)
        if d.dtype != torch.float32 or d.shape[2] != N or d.stride(2) != 1 or d.shape[1] < T:
            raise ValueError(f"rmsnorm: split partials must be fp32 [S, >={T}, {N}], got {tuple(d.shape)} {d.dtype}")
        d = d[0]
    else:
        d = delta if delta is not None else x
        sds = 0
    check_rows("rmsnorm", T, x, out, d, resid_out)
    k = _kernels()["rmsnorm"]
    r = resid_out if resid_out is not None else out
    k[(T,)](x, ids if ids is not None else x, d, weight, r, out, T, N,
            x.stride(0), d.stride(0), r.stride(0), out.stride(0), float(eps), sds, mw, ms,
            GATHER=ids is not None, ADD=delta is not None, STORE_RES=resid_out is not None,
            BLOCK=p2(N), DS=ds, W_FIRST=bool(w_first), KS=ks, num_warps=4 if N <= 4096 else 8, **launch_kwargs())
    return out
