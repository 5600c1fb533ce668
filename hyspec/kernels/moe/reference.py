"""Torch reference of :func:`hyspec.kernels.moe.expert_gemv`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["expert_gemv_ref", "moe_grouped_ref"]


def expert_gemv_ref(x, w, ids, xdiv, *, act=False):
    """Row q: x[q // xdiv] @ w[ids[q]].T (fp32 accumulate). x [T, K] (act: [T, 2K] as
    gate | up, fed as silu(gate) * up rounded like the model), w [E, N, K], ids [Q]."""
    Q = ids.shape[0]
    rows = torch.arange(Q, device=x.device) // xdiv
    xr = x[rows]
    if act:
        K = xr.shape[1] // 2
        xr = F.silu(xr[:, :K]) * xr[:, K:]
    return torch.stack([(xr[q].float() @ w[int(ids[q])].float().t()) for q in range(Q)]).to(x.dtype)


def _weight(w, e: int) -> torch.Tensor:
    """Expert e of a stacked weight (tensor or hyspec.quant.Fp8Weight), fp32."""
    from hyspec.quant import Fp8Weight

    if isinstance(w, Fp8Weight):
        return w[e].dequantize(torch.float32)
    return w[e].float()


def moe_grouped_ref(x, logits, gate_up, down, *, top_k: int, renorm: bool, shared=None, shared_gate=None):
    """Reference of :func:`hyspec.kernels.moe.moe_grouped`, one row and one slot at a time:
    fp32 softmax, top-k, renormalised, weights rounded to x.dtype; per slot the expert's
    gate | up (fp32 product, rounded), silu(gate) * up rounded, down (fp32, rounded); the
    slots' ``w * y`` summed in fp32 in slot order, plus sigmoid(shared_gate) (rounded) *
    shared; rounded once. Block-FP8 experts are dequantized in fp32."""
    T = x.shape[0]
    dt = x.dtype
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    w = w.to(dt).float()
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    for t in range(T):
        for j in range(top_k):
            e = int(idx[t, j])
            gu = (x[t].float() @ _weight(gate_up, e).t()).to(dt).float()
            inter = gu.shape[0] // 2
            g, u = gu[:inter], gu[inter:]
            a = ((g / (1.0 + torch.exp(-g))).to(dt).float() * u).to(dt).float()
            y = (a @ _weight(down, e).t()).to(dt).float()
            out[t] += y * w[t, j]
    if shared is not None:
        gate = (1.0 / (1.0 + torch.exp(-shared_gate.float()))).to(dt).float()
        out += gate * shared.float()
    return out.to(dt)
