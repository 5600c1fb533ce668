"""fla kernel path vs torch path of the GDN recurrence: the first-batch guard the training
loop runs before using fla, and the GPU self-check (``hyspec train --selfcheck``)."""

from __future__ import annotations

import torch

from hyspec.config import ModelConfig
from hyspec.model.hybrid import HybridLM
from hyspec.train.forward import loss_fn
from hyspec.train.model import init_params


def compare_gdn_paths(model: HybridLM, win: torch.Tensor, mtp_weight: float, amp: bool) -> dict:
    """Loss and gradients of one batch through the fla kernel and through torch chunked_scan
    (same autocast setting, no dropout)."""
    out = {}
    for name, flag in (("fla", True), ("torch", False)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            o = loss_fn(model, win, mtp_weight, use_fla=flag)
        o["loss"].backward()
        out[name] = (o["main"].item(), o["mtp"].item(), o["logits"].detach().float(),
                     {n: p.grad.detach().float().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    gf, gt = out["fla"][3], out["torch"][3]
    vf = torch.cat([gf[n].flatten() for n in gt])
    vt = torch.cat([gt[n].flatten() for n in gt])
    per = {n: float((gf[n] - gt[n]).norm() / gt[n].norm().clamp_min(1e-12)) for n in gt if "linear_attn" in n}
    worst = max(per, key=per.get) if per else None
    return {
        "loss_fla": out["fla"][0], "loss_torch": out["torch"][0],
        "mtp_fla": out["fla"][1], "mtp_torch": out["torch"][1],
        "logits_maxdiff": float((out["fla"][2] - out["torch"][2]).abs().max()),
        "logits_scale": float(out["torch"][2].abs().max()),
        "grad_rel_err": float((vf - vt).norm() / vt.norm()),
        "gdn_grad_rel_err_max": per[worst] if worst else 0.0,
        "gdn_grad_worst": worst,
    }


def selfcheck(device: str = "cuda") -> dict:
    """GPU self-check: the fla and torch GDN paths of a tiny model (values and gradients)
    and the fla path against HybridLM's own forward."""
    from hyspec.tiny import tiny_config

    torch.manual_seed(0)
    d = tiny_config("qwen3_5", vocab_size=512, hidden=64, layers=4)
    d["linear_value_head_dim"] = 16  # fla wants power-of-two head dims
    cfg = ModelConfig.from_dict(d)
    model = HybridLM(cfg)
    init_params(model, 0)
    model.to(device)
    win = torch.randint(0, 512, (3, 202), device=device)
    res = {}
    grads = {}
    for name in ("fla", "torch"):
        model.zero_grad()
        o = loss_fn(model, win, 0.5, use_fla=(name == "fla"))
        o["loss"].backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
        res[name] = (float(o["main"]), float(o["mtp"]), o["logits"].detach(), o["mtp_logits"].detach())
    res_out = {
        "loss_fla": res["fla"][0], "loss_torch": res["torch"][0],
        "mtp_fla": res["fla"][1], "mtp_torch": res["torch"][1],
        "logits_maxdiff": float((res["fla"][2] - res["torch"][2]).abs().max()),
        "mtp_logits_maxdiff": float((res["fla"][3] - res["torch"][3]).abs().max()),
        "grad_rel_err": float((grads["fla"] - grads["torch"]).norm() / grads["torch"].norm()),
    }
    # the reference model's own forward on one sequence
    with torch.no_grad():
        ref = model(win[0, :200])
    res_out["vs_hybridlm_maxdiff"] = float((ref - res["fla"][2][0]).abs().max())
    return res_out
