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


def _expert(x, gu_w, down_w, dt):
    """One expert on one row: gate | up (fp32 product, rounded), silu(gate) * up rounded,
    down (fp32, rounded); fp32 weights."""
    gu = (x.float() @ gu_w.t()).to(dt).float()
    inter = gu.shape[-1] // 2
    g, u = gu[..., :inter], gu[..., inter:]
    a = ((g / (1.0 + torch.exp(-g))).to(dt).float() * u).to(dt).float()
    return (a @ down_w.t()).to(dt).float()


def moe_grouped_ref(x, logits, gate_up, down, *, top_k: int, renorm: bool, shared=None, shared_gate=None,
                    shared_experts=None):
    """Reference of :func:`hyspec.kernels.moe.moe_grouped`, one row and one slot at a time:
    fp32 softmax, top-k, renormalised, weights rounded to x.dtype; per slot the expert
    (``_expert``); the slots' ``w * y`` summed in fp32 in slot order, plus
    sigmoid(shared_gate) (rounded) * shared; rounded once. shared_experts=(gate_up, down):
    the shared expert computed like a routed one, its gate logit logits[:, E]. Block-FP8
    experts are dequantized in fp32."""
    T = x.shape[0]
    dt = x.dtype
    if shared_experts is not None:
        E = logits.shape[1] - 1
        sg, sd = (w.dequantize(torch.float32) if not isinstance(w, torch.Tensor) else w.float()
                  for w in shared_experts)
        shared = torch.stack([_expert(x[t], sg, sd, dt) for t in range(T)])
        shared_gate, logits = logits[:, E:], logits[:, :E]
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    w = w.to(dt).float()
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    for t in range(T):
        for j in range(top_k):
            e = int(idx[t, j])
            out[t] += _expert(x[t], _weight(gate_up, e), _weight(down, e), dt) * w[t, j]
    if shared is not None:
        gate = (1.0 / (1.0 + torch.exp(-shared_gate.float()))).to(dt).float()
        out += gate * shared.float()
    return out.to(dt)
