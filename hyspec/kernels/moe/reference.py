"""Torch reference of :func:`hyspec.kernels.moe.expert_gemv`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["expert_gemv_ref"]


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
