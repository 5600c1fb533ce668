"""Triton kernel and launcher of the routed-expert GEMV (contract: ``hyspec/kernels/moe/__init__.py``)."""
from __future__ import annotations

from hyspec.kernels.pdl import kernels_per_mode, launch_kwargs

__all__ = ["expert_gemv"]


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    # Every kernel starts with the PDL prologue (hyspec.kernels.pdl): let the next kernel
    # start launching, then wait until every earlier kernel of the stream is done.  It is
    # compiled away when PDL is False (written out in each kernel: the interpreter does not
    # resolve nested jit helpers).

    @triton.jit(do_not_specialize=["Q"])
    def _expert_gemv_kernel(x_ptr, sx, w_ptr, ids_ptr, y_ptr, sy, Q, N, K, xdiv, swe, swn,
                            ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        pid_n = tl.program_id(0)
        q = tl.program_id(1)
        e = tl.load(ids_ptr + q).to(tl.int64)
        xrow = x_ptr + (q // xdiv) * sx
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = offs_n < N
        acc = tl.zeros((BLOCK_N,), tl.float32)
        DT = y_ptr.dtype.element_ty
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < K
            if ACT:
                gt = tl.load(xrow + offs_k, mask=mk, other=0.0).to(tl.float32)
                up = tl.load(xrow + K + offs_k, mask=mk, other=0.0).to(tl.float32)
                sg = (gt / (1.0 + tl.exp(-gt))).to(DT).to(tl.float32)
                xv = (sg * up).to(DT).to(tl.float32)
            else:
                xv = tl.load(xrow + offs_k, mask=mk, other=0.0).to(tl.float32)
            wt = tl.load(w_ptr + e * swe + offs_n[:, None] * swn + offs_k[None, :],
                         mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(wt * xv[None, :], axis=1)
        tl.store(y_ptr + q * sy + offs_n, acc.to(DT), mask=mn)

    return dict(expert_gemv=_expert_gemv_kernel)


def expert_gemv(x, w, ids, xdiv, out, *, act=False):
    """Triton :func:`expert_gemv_ref` into out [Q, N]."""
    Q = ids.shape[0]
    N, K = w.shape[1], w.shape[2]
    k = _kernels()["expert_gemv"]
    BN, BK = 32, 64
    k[(-(-N // BN), Q)](x, x.stride(0), w, ids, out, out.stride(0), Q, N, K, int(xdiv), w.stride(0), w.stride(1),
                        ACT=act, BLOCK_N=BN, BLOCK_K=BK, num_warps=4, **launch_kwargs())
    return out
