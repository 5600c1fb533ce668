"""Triton kernels and launchers of the probability rows (contract: ``hyspec/kernels/probs/__init__.py``)."""
from __future__ import annotations

import torch

from hyspec.kernels.common import p2
from hyspec.kernels.pdl import kernels_per_mode
from hyspec.kernels.probs.reference import CHUNK, MASS_SCALE

__all__ = ["softmax_rows", "inverse_cdf_rows"]


@kernels_per_mode
def _softmax_kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["sx", "sk", "so"])
    def _softmax_kernel(x_ptr, sx, t_ptr, keep_ptr, sk, only_ptr, floor_ptr, top_ptr, pm_ptr, ps_ptr, out_ptr, so,
                        V, n_chunks, MASS_SCALE: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_ONLY: tl.constexpr,
                        HAS_FLOOR: tl.constexpr, OUT_MASS: tl.constexpr, NORMALISE: tl.constexpr,
                        BLOCK: tl.constexpr, NC: tl.constexpr):
        """Chunk c of row b. First launch: the max m of its kept values and the sum of
        exp(value - m) -> pm, ps [B, n_chunks]. Second launch (NORMALISE): the row's max M
        and sum S from all its chunk partials (each program of the row reduces them alike),
        then exp(value - M) / S."""
        b = tl.program_id(0)
        c = tl.program_id(1)
        i = c * BLOCK + tl.arange(0, BLOCK)  # token ids of this chunk
        inside = i < V
        row = x_ptr + b.to(tl.int64) * sx
        t = tl.load(t_ptr + b)
        xt = tl.load(row + i, mask=inside, other=float("-inf")).to(tl.float64) / t
        kept = inside & (xt > float("-inf"))
        if HAS_KEEP:
            kept = kept & (tl.load(keep_ptr + b.to(tl.int64) * sk + i, mask=inside, other=0) != 0)
        if HAS_FLOOR:  # min-p: within floor (a log ratio) of the row's top value
            top = tl.load(row + tl.load(top_ptr + b)).to(tl.float64) / t
            kept = kept & (xt - top >= tl.load(floor_ptr + b))
        if HAS_ONLY:  # a row with only >= 0 keeps that token alone
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
                 top: torch.Tensor | None = None, mass: bool = False) -> torch.Tensor:
    """float64 [B, V] (int64 masses with mass=True): the softmax of each row's kept
    x / temperature (see the package docstring). Two launches over (rows, chunks)."""
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
    on = only.to(torch.int64).contiguous() if only is not None else t
    fl = floor.to(torch.float64).contiguous() if floor is not None else t
    tp = top.to(torch.int64).reshape(B).contiguous() if top is not None else t
    flags = dict(HAS_KEEP=keep is not None, HAS_ONLY=only is not None, HAS_FLOOR=floor is not None)
    kernel = _softmax_kernels()
    for normalise in (False, True):
        kernel[(B, C)](x, x.stride(0), t, kp, sk, on, fl, tp, pm, ps, out, out.stride(0), V, C,
                       MASS_SCALE=MASS_SCALE, OUT_MASS=mass, NORMALISE=normalise, BLOCK=CHUNK, NC=p2(C), **flags)
    return out


@kernels_per_mode
def _cdf_kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["sp"])
    def _cdf_partials_kernel(p_ptr, sp, tot_ptr, last_ptr, V, n_chunks, BLOCK: tl.constexpr):
        """Chunk c of row b: its total mass and its last token with p > 0 (-1: none)."""
        b = tl.program_id(0)
        c = tl.program_id(1)
        i = c * BLOCK + tl.arange(0, BLOCK)
        p = tl.load(p_ptr + b.to(tl.int64) * sp + i, mask=i < V, other=0.0)
        tl.store(tot_ptr + b * n_chunks + c, tl.sum(p, 0))
        tl.store(last_ptr + b * n_chunks + c, tl.max(tl.where(p > 0, i, -1), 0))

    @triton.jit(do_not_specialize=["sp"])
    def _cdf_pick_kernel(p_ptr, sp, u_ptr, tot_ptr, last_ptr, out_ptr, V, n_chunks, BLOCK: tl.constexpr,
                         NC: tl.constexpr):
        """Row b: the chunk where the running sum of chunk totals first exceeds u * total,
        then the token inside it by a scan of that chunk alone."""
        b = tl.program_id(0)
        j = tl.arange(0, NC)
        inside = j < n_chunks
        running = tl.cumsum(tl.load(tot_ptr + b * n_chunks + j, mask=inside, other=0.0), 0)  # [NC]
        total = tl.sum(tl.where(j == n_chunks - 1, running, 0.0), 0)
        target = tl.load(u_ptr + b) * total
        c = tl.sum((inside & (running <= target)).to(tl.int32), 0)  # n_chunks: past the end
        cc = tl.minimum(c, n_chunks - 1)
        before = tl.sum(tl.where(j == cc - 1, running, 0.0), 0)  # 0 for the first chunk
        i = tl.arange(0, BLOCK)
        rows = tl.load(p_ptr + b.to(tl.int64) * sp + cc * BLOCK + i, mask=cc * BLOCK + i < V, other=0.0)
        k = tl.sum((tl.cumsum(rows, 0) <= target - before).to(tl.int32), 0)
        last_k = tl.max(tl.where(rows > 0, i, -1), 0)
        k = tl.where(k >= BLOCK, last_k, k)
        last = tl.maximum(tl.max(tl.load(last_ptr + b * n_chunks + j, mask=inside, other=-1), 0), 0)
        idx = tl.where(c >= n_chunks, last, cc * BLOCK + k)
        tl.store(out_ptr + b, idx.to(tl.int64))

    return _cdf_partials_kernel, _cdf_pick_kernel


def inverse_cdf_rows(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the inverse-CDF token of each float64 row p [B, V] (rows may be strided)
    for the uniforms u [B] (see the package docstring). Two launches."""
    B, V = p.shape
    if p.stride(1) != 1:
        p = p.contiguous()
    C = -(-V // CHUNK)
    tot = torch.empty(B, C, dtype=torch.float64, device=p.device)
    last = torch.empty(B, C, dtype=torch.int32, device=p.device)
    out = torch.empty(B, dtype=torch.int64, device=p.device)
    partials, pick = _cdf_kernels()
    partials[(B, C)](p, p.stride(0), tot, last, V, C, BLOCK=CHUNK)
    pick[(B,)](p, p.stride(0), u.to(torch.float64).contiguous(), tot, last, out, V, C, BLOCK=CHUNK, NC=p2(C))
    return out
