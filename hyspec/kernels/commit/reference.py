"""Torch reference of :func:`hyspec.kernels.commit.commit_round` (the contract in
``hyspec/kernels/commit/__init__.py``)."""
from __future__ import annotations

import torch

__all__ = ["commit_round_ref"]


def commit_round_ref(argmax, verify_tokens, k_lane, stop_ids, live, pos, pending, n_keep, j, result, fill_tokens,
                     fill_start, fill_rows, fill_h, h_last, seed_hidden, nb: int, t: int, accepted=None) -> None:
    k = t - 1
    dev = argmax.device
    lanes = torch.arange(nb, device=dev)
    argmax, verify_tokens, k_lane = argmax[:nb, :t], verify_tokens[:nb, :t], k_lane[:nb]
    if accepted is not None:
        n, bonus = accepted[0][:nb], accepted[1][:nb]
    else:
        if k > 0:
            match = (argmax[:, :k] == verify_tokens[:, 1:t]).to(torch.long)
            n = torch.minimum(torch.cumprod(match, 1).sum(1), k_lane)
        else:
            n = torch.zeros(nb, device=dev, dtype=torch.long)
        bonus = argmax[lanes, n]
    nk, keep = n, bonus
    if k > 0:
        drafts = verify_tokens[:, 1:t]
        idx = torch.arange(k, device=dev)[None, :]
        stop = (drafts[:, :, None] == stop_ids[:nb, None, :]).any(-1) & (idx < n[:, None])  # [nb, k]
        first = torch.where(stop, idx, k).amin(1)  # the first accepted stop draft (k: none)
        nk = torch.minimum(n, first)
        keep = torch.where(first < n, drafts.gather(1, first.clamp(max=k - 1)[:, None])[:, 0], bonus)
    jj = nk + 1
    n_keep[:nb].copy_(nk)
    j[:nb].copy_(jj)
    fill_tokens[:nb, :t].copy_(verify_tokens)
    fill_tokens[:nb].scatter_(1, jj[:, None], keep[:, None])
    fill_h[:nb, 0].copy_(h_last[:nb])
    fill_h[:nb, 1: t + 1].copy_(seed_hidden[:nb, :t])
    h_last[:nb].copy_(seed_hidden[lanes, nk])
    lv = live[:nb]
    fill_start[:nb].copy_((pos[:nb] - 1).clamp_min(0) * lv)
    fill_rows[:nb].copy_(torch.where(lv > 0, jj + 1, torch.ones_like(jj)))
    pos[:nb].add_(jj * lv)
    pending[:nb].copy_(keep)
    result[:nb, 0].copy_(n)
    result[:nb, 1].copy_(bonus)
    if k > 0:
        result[:nb, 2: 2 + k].copy_(verify_tokens[:, 1:t])


def bad_rows_ref(logits, argmax, out, nb: int, t: int, no_bad: int) -> None:
    """out[b] (an int64 [>= nb] view) = the first j < t whose verify row logits[b * t + j]
    ([>= nb * t, V]) holds NaN or +inf, else no_bad. A row's value at its argmax
    (argmax [>= nb, >= t]; torch's and argmax_rows' pick a row's first NaN, else its
    maximum) is NaN or +inf exactly when the row holds one: a gather, no pass over V."""
    if nb == 0:
        return
    ok = logits[: nb * t].gather(1, argmax[:nb, :t].reshape(nb * t, 1)).view(nb, t) < float("inf")
    first_flagged(~ok, out, no_bad)


def first_flagged(flags, out, no_bad: int) -> None:
    """out[b] = the first j with flags[b, j] (bool [nb, t]), else no_bad (bad_rows_ref's
    last step; a masked round's flags come from the masks' own pass)."""
    nb, t = flags.shape
    rows = torch.arange(t, device=flags.device).expand(nb, t)
    out[:nb].copy_(torch.where(flags, rows, no_bad).amin(1))
