"""Held-out evaluation of a model: loss, perplexity and top-1 accuracy (target and MTP)."""

from __future__ import annotations

import math

import torch

from hyspec.model.hybrid import HybridLM
from hyspec.train.data import eval_windows
from hyspec.train.forward import loss_fn


@torch.no_grad()
def evaluate(model: HybridLM, stream: torch.Tensor, T: int, batch: int, device, mtp_weight: float,
             use_fla: bool | None, amp: bool, max_tokens: int | None = None) -> dict:
    """Held-out next-token / MTP loss (nats per token), perplexity and top-1 accuracy."""
    wins, masks = eval_windows(stream, T, max_tokens)
    tot = {k: 0.0 for k in ("main_sum", "main_n", "main_correct", "mtp_sum", "mtp_n", "mtp_correct")}
    for i in range(0, wins.shape[0], batch):
        w, m = wins[i:i + batch], masks[i:i + batch]
        if w.shape[0] < batch:  # keep one batch shape (kernel autotune caches); pad rows are masked
            pad = batch - w.shape[0]
            w = torch.cat([w, w[:1].expand(pad, -1)])
            m = torch.cat([m, torch.zeros(pad, m.shape[1], dtype=torch.bool)])
        w, m = w.to(device), m.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            o = loss_fn(model, w, mtp_weight, use_fla, 0.0, m)
        for k in tot:
            if k in o:
                tot[k] += float(o[k])
    res = {"tokens": int(tot["main_n"]), "loss": tot["main_sum"] / max(tot["main_n"], 1),
           "top1": tot["main_correct"] / max(tot["main_n"], 1)}
    res["ppl"] = math.exp(res["loss"])
    if model.has_mtp:
        res["mtp_loss"] = tot["mtp_sum"] / max(tot["mtp_n"], 1)
        res["mtp_ppl"] = math.exp(res["mtp_loss"])
        res["mtp_top1"] = tot["mtp_correct"] / max(tot["mtp_n"], 1)
    return res

