"""Triton kernels and launchers of the probability rows (contract: ``hyspec/kernels/probs/__init__.py``)."""
from __future__ import annotations

import torch

from hyspec.kernels.common import p2
from hyspec.kernels.pdl import kernels_per_mode
from hyspec.kernels.probs.reference import CHUNK, MASS_SCALE

__all__ = ["softmax_rows", "inverse_cdf_rows"]

# warps per program of the softmax's two launches and of the inverse CDF's two (a program:
# one CHUNK-token chunk of a row, or the CDF's per-row pick). One constant for every call: the
# float64 sums and scans add in an order that depends on it, and a row's numbers must not
# depend on the call it is in (the plain step's, the drafter's and the verify's calls of a
# round alike). bench/sampling_warps.py times the choices.
SOFTMAX_WARPS = 4
CDF_WARPS = 4


@kernels_per_mode
def _softmax_kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["sx", "sk", "so"])
    def _softmax_kernel(x_ptr, sx, t_ptr, keep_ptr, sk, only_ptr, floor_ptr, top_ptr, pm_ptr, ps_ptr, out_ptr, so,
                        V, n_chunks, bv_ptr, bi_ptr, bn_ptr, best_ptr,
                        MASS_SCALE: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_ONLY: tl.constexpr,
                        HAS_FLOOR: tl.constexpr, OUT_MASS: tl.constexpr, NORMALISE: tl.constexpr,
                        BLOCK: tl.constexpr, NC: tl.constexpr, ONLY_IF: tl.constexpr = False,
                        WITH_BEST: tl.constexpr = False):
        """Chunk c of row b. First launch: the max m of its kept values and the sum of
        exp(value - m) -> pm, ps [B, n_chunks]. Second launch (NORMALISE): the row's max M
        and sum S from all its chunk partials (each program of the row reduces them alike),
        then exp(value - M) / S.
        WITH_BEST: also the row's x.argmax() (of the raw values, whatever is kept: torch's,
        the first NaN of a row that has one, else the first maximum), as argmax_rows finds
        it: the first launch keeps each chunk's first maximum and first NaN, the second
        launch's program 0 picks the first chunk holding the row's."""
        b = tl.program_id(0)
        c = tl.program_id(1)
        i = c * BLOCK + tl.arange(0, BLOCK)  # token ids of this chunk
        inside = i < V
        row = x_ptr + b.to(tl.int64) * sx
        t = tl.load(t_ptr + b)
        xv = tl.load(row + i, mask=inside, other=float("-inf"))
        xt = xv.to(tl.float64) / t
        if WITH_BEST:
            if NORMALISE:
                if c == 0:
                    jb = tl.arange(0, NC)
                    mb = jb < n_chunks
                    bv = tl.load(bv_ptr + b * n_chunks + jb, mask=mb, other=float("-inf"))
                    bn = tl.min(tl.load(bn_ptr + b * n_chunks + jb, mask=mb, other=2147483647), 0)
                    bi = tl.load(bi_ptr + b * n_chunks + jb, mask=mb, other=0)
                    cb = tl.min(tl.where(bv == tl.max(bv, 0), jb, NC), 0)  # the first chunk with the row's max
                    tok = tl.sum(tl.where(jb == cb, bi, 0), 0)
                    tl.store(best_ptr + b, tl.where(bn < 2147483647, bn, tok).to(tl.int64))
            else:
                xf = xv.to(tl.float32)  # exact for bf16 / fp16 / fp32
                isnan = xf != xf
                first_nan = tl.min(tl.where(isnan, i, 2147483647), 0)
                xf = tl.where(isnan, float("-inf"), xf)
                mx = tl.max(xf, 0)
                tl.store(bv_ptr + b * n_chunks + c, mx)
                tl.store(bi_ptr + b * n_chunks + c, tl.min(tl.where(xf == mx, i, 2147483647), 0))  # ties: lowest
                tl.store(bn_ptr + b * n_chunks + c, first_nan)
        kept = inside & (xt > float("-inf"))
        if HAS_KEEP:
            kept = kept & (tl.load(keep_ptr + b.to(tl.int64) * sk + i, mask=inside, other=0) != 0)
        if HAS_FLOOR:  # min-p: within floor (a log ratio) of the row's top value
            top = tl.load(row + tl.load(top_ptr + b)).to(tl.float64) / t
            kept = kept & (xt - top >= tl.load(floor_ptr + b))
        if HAS_ONLY:  # a row with only >= 0 keeps that token alone
            if ONLY_IF:  # only_ptr: a flag per row; the token is the row's top
                only = tl.where(tl.load(only_ptr + b) != 0, tl.load(top_ptr + b), -1)
            else:
                only = tl.load(only_ptr + b)
            kept = tl.where(only >= 0, i == only, kept)
        v = tl.where(kept, xt, float("-inf"))
        if NORMALISE:
            j = tl.arange(0, NC)
            pm = tl.load(pm_ptr + b * n_chunks + j, mask=j < n_chunks, other=float("-inf"))
            ps = tl.load(ps_ptr + b * n_chunks + j, mask=j < n_chunks, other=0.0)
            M = tl.max(pm, 0)
            S = tl.sum(tl.where(pm > float("-inf"), ps * tl.exp(pm - M), 0.0), 0)
            p = tl.where(kept, tl.exp(v - M) / S, 0.0)
            dst = out_ptr + b.to(tl.int64) * so + i
            if OUT_MASS:
                tl.store(dst, (p * MASS_SCALE).to(tl.int64), mask=inside)
            else:
                tl.store(dst, p, mask=inside)
        else:
            m = tl.max(v, 0)
            s = tl.sum(tl.where(kept, tl.exp(v - tl.where(m > float("-inf"), m, 0.0)), 0.0), 0)
            tl.store(pm_ptr + b * n_chunks + c, m)
            tl.store(ps_ptr + b * n_chunks + c, s)

    return _softmax_kernel


def softmax_rows(x: torch.Tensor, temperature: torch.Tensor, keep: torch.Tensor | None = None,
                 only: torch.Tensor | None = None, floor: torch.Tensor | None = None,
                 top: torch.Tensor | None = None, mass: bool = False,
                 only_if: torch.Tensor | None = None, with_best: bool = False):
    """float64 [B, V] (int64 masses with mass=True): the softmax of each row's kept
    x / temperature (see the package docstring). Two launches over (rows, chunks).
    only_if [B] bool (with top): the rows that keep their top token alone, the same as
    only = where(only_if, top, -1) without forming it.
    with_best: (that, best [B] int64 = x.argmax(-1), the same ids as torch, made in the same
    two launches: a sampling site's first maximum without argmax_rows' two)."""
    if only_if is not None:
        if only is not None or top is None:
            raise ValueError("softmax_rows: only_if needs top and no only")
        only = only_if.view(torch.uint8) if only_if.dtype == torch.bool else only_if
    B, V = x.shape
    if x.stride(1) != 1 or (keep is not None and keep.stride(1) != 1):
        raise ValueError("softmax_rows: rows need a contiguous last dim")
    if floor is not None and top is None:
        raise ValueError("softmax_rows: floor needs top (the index of each row's largest x)")
    dev = x.device
    C = -(-V // CHUNK)
    pm = torch.empty(B, C, dtype=torch.float64, device=dev)
    ps = torch.empty(B, C, dtype=torch.float64, device=dev)
    out = torch.empty(B, V, dtype=torch.int64 if mass else torch.float64, device=dev)
    t = temperature.to(torch.float64).contiguous()
    kp = keep.view(torch.uint8) if keep is not None else x  # (unread without HAS_KEEP)
    sk = keep.stride(0) if keep is not None else 0
    on = (only.contiguous() if only_if is not None else only.to(torch.int64).contiguous()) if only is not None else t
    fl = floor.to(torch.float64).contiguous() if floor is not None else t
    tp = top.to(torch.int64).reshape(B).contiguous() if top is not None else t
    flags = dict(HAS_KEEP=keep is not None, HAS_ONLY=only is not None, HAS_FLOOR=floor is not None,
                 ONLY_IF=only_if is not None, WITH_BEST=with_best)
    if with_best:
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"softmax_rows: with_best needs float16 / bfloat16 / float32 values, got {x.dtype}")
        bv = torch.empty(B, C, dtype=torch.float32, device=dev)
        bi = torch.empty(B, C, dtype=torch.int32, device=dev)
        bn = torch.empty(B, C, dtype=torch.int32, device=dev)
        best = torch.empty(B, dtype=torch.int64, device=dev)
        best_args = (bv, bi, bn, best)
    else:
        best_args = (t, t, t, t)
    kernel = _softmax_kernels()
    for normalise in (False, True):
        kernel[(B, C)](x, x.stride(0), t, kp, sk, on, fl, tp, pm, ps, out, out.stride(0), V, C, *best_args,
                       MASS_SCALE=MASS_SCALE, OUT_MASS=mass, NORMALISE=normalise, BLOCK=CHUNK, NC=p2(C),
                       num_warps=SOFTMAX_WARPS, **flags)
    return (out, best) if with_best else out


@kernels_per_mode
def _cdf_kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["sp", "spr", "sq", "sqr"])
    def _cdf_kernel(p_ptr, sp, spr, prow_ptr, q_ptr, sq, sqr, qrow_ptr, resid_ptr, u_ptr, tot_ptr, last_ptr, out_ptr,
                    V, n_chunks, HAS_Q: tl.constexpr, PICK: tl.constexpr, BLOCK: tl.constexpr, NC: tl.constexpr):
        """Row b's distribution: p[b, prow[b]], or (HAS_Q) where resid[b] and it has mass
        max(p[b, prow[b]] - q[b, qrow[b]], 0). First launch, chunk c: its total mass and its
        last token with mass (-1: none) -> tot, last [B, 2, n_chunks] (p's, then the
        residual's). Second launch (PICK), one program per row: the chunk where the running
        sum of chunk totals first exceeds u * total, then the token by a scan of that chunk."""
        b = tl.program_id(0)
        p_row = p_ptr + b.to(tl.int64) * sp + tl.load(prow_ptr + b) * spr
        q_row = q_ptr + b.to(tl.int64) * sq + tl.load(qrow_ptr + b) * sqr  # (unread without HAS_Q)
        parts = b * 2 * n_chunks
        if PICK:
            j = tl.arange(0, NC)
            inside = j < n_chunks
            tot = tl.load(tot_ptr + parts + j, mask=inside, other=0.0)
            last = tl.load(last_ptr + parts + j, mask=inside, other=-1)
            use_r = False
            if HAS_Q:  # the residual has mass iff a chunk total is positive (sums of values >= 0)
                tot_r = tl.load(tot_ptr + parts + n_chunks + j, mask=inside, other=0.0)
                use_r = (tl.load(resid_ptr + b) != 0) & (tl.max(tot_r, 0) > 0)
                tot = tl.where(use_r, tot_r, tot)
                last = tl.where(use_r, tl.load(last_ptr + parts + n_chunks + j, mask=inside, other=-1), last)
            running = tl.cumsum(tot, 0)  # [NC]
            total = tl.sum(tl.where(j == n_chunks - 1, running, 0.0), 0)
            target = tl.load(u_ptr + b) * total
            c = tl.sum((inside & (running <= target)).to(tl.int32), 0)  # n_chunks: past the end
            cc = tl.minimum(c, n_chunks - 1)
            before = tl.sum(tl.where(j == cc - 1, running, 0.0), 0)  # 0 for the first chunk
            t = tl.arange(0, BLOCK)
            i = cc * BLOCK + t
            rows = tl.load(p_row + i, mask=i < V, other=0.0)
            if HAS_Q:
                rows = tl.where(use_r, tl.maximum(rows - tl.load(q_row + i, mask=i < V, other=0.0), 0.0), rows)
            # the mass before the chunk plus the in-chunk running sum, against the target itself: never
            # target - before, which a GPU build may contract with target's u * total into one fma
            # (unrounded: below `before` where the rounded target equals it, and the chunk's first,
            # massless, token was picked -- seen on an H100); before <= target holds for the rounded
            # target, so the chunk's leading zero-mass tokens always count
            k = tl.sum((before + tl.cumsum(rows, 0) <= target).to(tl.int32), 0)
            k = tl.where(k >= BLOCK, tl.max(tl.where(rows > 0, t, -1), 0), k)
            idx = tl.where(c >= n_chunks, tl.maximum(tl.max(last, 0), 0), cc * BLOCK + k)
            tl.store(out_ptr + b, idx.to(tl.int64))
        else:
            c = tl.program_id(1)
            i = c * BLOCK + tl.arange(0, BLOCK)
            pv = tl.load(p_row + i, mask=i < V, other=0.0)
            tl.store(tot_ptr + parts + c, tl.sum(pv, 0))
            tl.store(last_ptr + parts + c, tl.max(tl.where(pv > 0, i, -1), 0))
            if HAS_Q:
                r = tl.maximum(pv - tl.load(q_row + i, mask=i < V, other=0.0), 0.0)
                tl.store(tot_ptr + parts + n_chunks + c, tl.sum(r, 0))
                tl.store(last_ptr + parts + n_chunks + c, tl.max(tl.where(r > 0, i, -1), 0))

    return _cdf_kernel


def _rows3(x: torch.Tensor, row: torch.Tensor | None, B: int):
    """(x as [B, R, V] with a contiguous last dim, the row index per b [B] int64)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        x = x.unsqueeze(1)
    if row is None:
        row = torch.zeros(B, dtype=torch.int64, device=x.device)
    return x, row.to(torch.int64).contiguous()


def inverse_cdf_rows(p: torch.Tensor, u: torch.Tensor, row: torch.Tensor | None = None,
                     q: torch.Tensor | None = None, q_row: torch.Tensor | None = None,
                     resid: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [B]: the inverse-CDF token of each row's distribution for the uniforms u [B]
    (see the package docstring): p float64 [B, V] or [B, R, V] with row [B] (rows may be
    strided); with q [B, V] or [B, Rq, V] (q_row [B]) and resid [B] bool, a resid row
    samples max(p - q, 0) when that has mass. Two launches."""
    B, V = p.shape[0], p.shape[-1]
    p3, prow = _rows3(p, row, B)
    if q is not None:
        q3, qrow = _rows3(q, q_row, B)
        rs = resid.to(torch.int8).contiguous()
    else:
        q3, qrow, rs = p3, prow, prow
    C = -(-V // CHUNK)
    tot = torch.empty(B, 2, C, dtype=torch.float64, device=p.device)
    last = torch.empty(B, 2, C, dtype=torch.int32, device=p.device)
    out = torch.empty(B, dtype=torch.int64, device=p.device)
    uu = u.to(torch.float64).contiguous()
    kernel = _cdf_kernels()
    for pick, grid in ((False, (B, C)), (True, (B,))):
        kernel[grid](p3, p3.stride(0), p3.stride(1), prow, q3, q3.stride(0), q3.stride(1), qrow, rs, uu, tot, last,
                     out, V, C, HAS_Q=q is not None, PICK=pick, BLOCK=CHUNK, NC=p2(C), num_warps=CDF_WARPS)
    return out
