"""Triton kernel and launcher of the round's commit bookkeeping (contract:
``hyspec/kernels/commit/__init__.py``)."""
from __future__ import annotations

from hyspec.kernels.common import p2
from hyspec.kernels.pdl import kernels_per_mode, launch_kwargs

__all__ = ["commit_round", "bad_rows"]


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "H", "NS"])
    def _commit_kernel(am_ptr, s_am, vt_ptr, s_vt, kl_ptr, st_ptr, s_st, live_ptr, pos_ptr, pend_ptr, nin_ptr, bin_ptr,
                       nk_ptr, j_ptr, res_ptr, s_res, ft_ptr, s_ft, fs_ptr, fr_ptr, fh_ptr, s_fh_b, s_fh_r,
                       hl_ptr, s_hl, sd_ptr, s_sd_b, s_sd_r, T, H, NS,
                       TB: tl.constexpr, NSTOP: tl.constexpr, BH: tl.constexpr, GREEDY: tl.constexpr,
                       PDL: tl.constexpr = False):
        # program (lane b, hidden chunk c): every program works out its lane's n_keep (a few
        # integers); chunk 0 writes the lane's integers, every chunk copies its hiddens
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        K = T - 1
        r = tl.arange(0, TB)  # TB >= T + 2: verify rows, fill rows (t + 1) and result columns (2 + k)
        vt = tl.load(vt_ptr + b * s_vt + r, mask=r < T, other=-2)  # pending, d_0 .. d_{k-1}
        dr = tl.load(vt_ptr + b * s_vt + r + 1, mask=r < K, other=-2)  # d_r (r < k)
        if GREEDY:
            am = tl.load(am_ptr + b * s_am + r, mask=r < T, other=-3)
            match = (am == dr) & (r < K)
            n = tl.min(tl.where(match, TB, r), axis=0)  # the first mismatch (row k never matches)
            n = tl.minimum(n, tl.load(kl_ptr + b).to(tl.int32))
            bonus = tl.sum(tl.where(r == n, am, 0), axis=0)
        else:
            n = tl.load(nin_ptr + b).to(tl.int32)
            bonus = tl.load(bin_ptr + b)
        so = tl.arange(0, NSTOP)
        st = tl.load(st_ptr + b * s_st + so, mask=so < NS, other=-1)  # -1: no stop id (drafts >= 0, padding -2)
        hit = tl.max((dr[:, None] == st[None, :]).to(tl.int32), axis=1) > 0
        first = tl.min(tl.where(hit & (r < n), r, K), axis=0)
        nk = tl.minimum(n, first)
        dfirst = tl.sum(tl.where(r == first, dr, 0), axis=0)
        keep = tl.where(first < n, dfirst, bonus)
        jj = nk + 1
        if c == 0:
            tl.store(nk_ptr + b, nk.to(tl.int64))
            tl.store(j_ptr + b, jj.to(tl.int64))
            ft = tl.where(r == jj, keep, vt)  # fill tokens: the verify rows, keep at row j
            tl.store(ft_ptr + b * s_ft + r, ft, mask=(r < T) | (r == jj))
            lv = tl.load(live_ptr + b)
            p = tl.load(pos_ptr + b)
            tl.store(fs_ptr + b, tl.maximum(p - 1, 0) * lv)
            tl.store(fr_ptr + b, tl.where(lv > 0, jj + 1, 1).to(tl.int64))
            tl.store(pos_ptr + b, p + jj * lv)
            tl.store(pend_ptr + b, keep)
            # result: n, bonus, then the drafts d_0 .. d_{k-1} (verify rows 1 .. k)
            dres = tl.load(vt_ptr + b * s_vt + r - 1, mask=(r >= 2) & (r < K + 2), other=0)
            res = tl.where(r == 0, n.to(tl.int64), tl.where(r == 1, bonus, dres))
            tl.store(res_ptr + b * s_res + r, res, mask=r < K + 2)
        oh = c * BH + tl.arange(0, BH)
        mh = oh < H
        old = tl.load(hl_ptr + b * s_hl + oh, mask=mh)
        tl.store(fh_ptr + b * s_fh_b + oh, old, mask=mh)
        for i in range(T):
            tl.store(fh_ptr + b * s_fh_b + (i + 1) * s_fh_r + oh, tl.load(sd_ptr + b * s_sd_b + i * s_sd_r + oh, mask=mh),
                     mask=mh)
        tl.store(hl_ptr + b * s_hl + oh, tl.load(sd_ptr + b * s_sd_b + nk.to(tl.int64) * s_sd_r + oh, mask=mh),
                 mask=mh)

    return _commit_kernel


def commit_round(argmax, verify_tokens, k_lane, stop_ids, live, pos, pending, n_keep, j, result, fill_tokens,
                 fill_start, fill_rows, fill_h, h_last, seed_hidden, nb: int, t: int, accepted=None) -> None:
    """Triton :func:`commit_round_ref` (the contract in ``hyspec/kernels/commit/__init__.py``)."""
    if nb == 0:
        return
    if result.shape[1] < t + 1 or fill_tokens.shape[1] < t + 1 or fill_h.shape[1] < t + 1:
        raise ValueError(f"commit_round: {t} verify rows need result [.., >= {t + 1}] and fill rows >= {t + 1}")
    for name, x in (("argmax", argmax), ("verify_tokens", verify_tokens), ("stop_ids", stop_ids), ("result", result),
                    ("fill_tokens", fill_tokens), ("fill_h", fill_h), ("h_last", h_last),
                    ("seed_hidden", seed_hidden)):
        if x.stride(-1) != 1:
            raise ValueError(f"commit_round: {name} needs a contiguous last dim")
    if accepted is not None and any(x.dim() != 1 or x.shape[0] < nb or x.stride(0) != 1 for x in accepted):
        raise ValueError("commit_round: accepted must be two contiguous 1-D tensors of >= nb lanes (n, bonus)")
    H = h_last.shape[-1]
    BH = min(1024, p2(H))
    n_in, b_in = accepted if accepted is not None else (n_keep, n_keep)
    _kernels()[(nb, -(-H // BH))](
        argmax, argmax.stride(0), verify_tokens, verify_tokens.stride(0), k_lane, stop_ids, stop_ids.stride(0),
        live, pos, pending, n_in, b_in, n_keep, j, result, result.stride(0), fill_tokens, fill_tokens.stride(0),
        fill_start, fill_rows, fill_h, fill_h.stride(0), fill_h.stride(1), h_last, h_last.stride(0),
        seed_hidden, seed_hidden.stride(0), seed_hidden.stride(1), t, H, stop_ids.shape[1],
        TB=p2(t + 2), NSTOP=p2(stop_ids.shape[1]), BH=BH, GREEDY=accepted is None, num_warps=4, **launch_kwargs())


@kernels_per_mode
def _bad_kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])
    def _bad_rows_kernel(x_ptr, s_x, am_ptr, s_am, out_ptr, s_out, T, NO_BAD, TB: tl.constexpr):
        # program (lane b): its T rows' values at their argmax; the first NaN / +inf one
        b = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, TB)
        mr = r < T
        idx = tl.load(am_ptr + b * s_am + r, mask=mr, other=0)
        v = tl.load(x_ptr + (b * T + r) * s_x + idx, mask=mr, other=0.0).to(tl.float32)
        bad = ((v != v) | (v == float("inf"))) & mr
        first = tl.min(tl.where(bad, r, NO_BAD), 0)
        tl.store(out_ptr + b * s_out, first.to(tl.int64))

    return _bad_rows_kernel


def bad_rows(logits, argmax, out, nb: int, t: int, no_bad: int) -> None:
    """Triton :func:`bad_rows_ref`: out[b] = the first j < t whose row logits[b * t + j]
    holds NaN or +inf (its value at argmax[b, j] is one), else no_bad; one launch."""
    if nb == 0:
        return
    if logits.stride(-1) != 1 or argmax.stride(-1) != 1:
        raise ValueError("bad_rows: logits and argmax need a contiguous last dim")
    if argmax.dim() != 2 or argmax.shape[0] < nb or argmax.shape[1] < t or logits.shape[0] < nb * t:
        raise ValueError(f"bad_rows: want argmax [>= {nb}, >= {t}] and logits [>= {nb * t}, V]")
    _bad_kernels()[(nb,)](logits, logits.stride(0), argmax, argmax.stride(0), out, out.stride(0), t, no_bad,
                          TB=p2(t), num_warps=1)
