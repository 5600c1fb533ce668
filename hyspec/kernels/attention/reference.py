"""Torch references of :func:`hyspec.kernels.attention.attn_prep` and
:func:`~hyspec.kernels.attention.attn_decode` (also the reference of
:func:`~hyspec.kernels.attention.attn_decode_grouped`)."""
from __future__ import annotations

import torch

__all__ = ["attn_prep_ref", "attn_decode_ref"]


def attn_prep_ref(proj, q_w, k_w, inv_freq, pos, kc, vc, *, n_heads, n_kv, head_dim, eps, rope_scale=1.0):
    """proj [T, Hq*2D + 2*Hkv*D] (per q head [q D | gate D], then k, then v).
    Returns q [T, Hq, D]; writes k (normed, roped) and v into kc/vc [Hkv, L, D] rows pos+r."""
    T = proj.shape[0]
    D = head_dim
    dt = proj.dtype
    q = proj[:, : n_heads * 2 * D].view(T, n_heads, 2 * D)[..., :D]
    k = proj[:, n_heads * 2 * D : n_heads * 2 * D + n_kv * D].view(T, n_kv, D)
    v = proj[:, n_heads * 2 * D + n_kv * D :].view(T, n_kv, D)

    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(dt)

    rot = 2 * inv_freq.shape[0]
    p = torch.arange(pos, pos + T, device=proj.device).float()
    fr = p[:, None] * inv_freq[None, :]
    emb = torch.cat([fr, fr], -1)
    cos, sin = emb.cos(), emb.sin()
    if rope_scale != 1.0:  # YaRN's attention scaling
        cos, sin = cos * rope_scale, sin * rope_scale
    cos, sin = cos.to(dt), sin.to(dt)

    def rope(x):
        xr, xp = x[..., :rot], x[..., rot:]
        h = rot // 2
        rotated = torch.cat([-xr[..., h:], xr[..., :h]], -1)
        return torch.cat([xr * cos[:, None] + rotated * sin[:, None], xp], -1)

    qo = rope(norm(q, q_w))
    kc[:, pos : pos + T] = rope(norm(k, k_w)).transpose(0, 1)
    vc[:, pos : pos + T] = v.transpose(0, 1)
    return qo


def attn_decode_ref(q, kc, vc, pos, gate):
    """q [T, Hq, D]; row r attends keys 0..pos+r of kc/vc [Hkv, L, D] (fp32 softmax);
    gate [T, Hq, D]. Returns (attn * sigmoid(gate)) [T, Hq*D] in q.dtype."""
    T, Hq, D = q.shape
    rep = Hq // kc.shape[0]
    out = []
    for r in range(T):
        n = pos + r + 1
        k = kc[:, :n].float().repeat_interleave(rep, 0)
        v = vc[:, :n].float().repeat_interleave(rep, 0)
        s = (k @ q[r].float()[:, :, None])[..., 0] * D ** -0.5  # [Hq, n]
        out.append(torch.softmax(s, -1)[:, None, :] @ v)  # [Hq, 1, D]
    o = torch.cat(out, 1).transpose(0, 1).to(q.dtype)  # [T, Hq, D]
    return (o * torch.sigmoid(gate)).reshape(T, Hq * D)
