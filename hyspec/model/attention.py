"""Gated full attention (Qwen3-Next / Qwen3.5) over a preallocated KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyspec.config import ModelConfig
from hyspec.model.ops import Linear, RMSNorm, StepCtx, acc_dtype, apply_rope, rope_cos_sin, rope_frequencies, sigmoid


class KVBuffer:
    """Preallocated keys/values of one attention layer: k, v [Hkv, L, D]; rows < len are valid."""

    def __init__(self, n_kv: int, max_len: int, head_dim: int, device, dtype) -> None:
        self.k = torch.zeros(n_kv, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(n_kv, max_len, head_dim, device=device, dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rope_cfg = cfg  # RoPE's frequencies are formed per call on the positions' device (no copy)
        H, D = cfg.hidden_size, cfg.head_dim
        # q_proj packs, per head, [q (D) | gate (D)]
        self.q_proj = Linear(H, self.n_heads * D * 2)
        self.k_proj = Linear(H, self.n_kv * D)
        self.v_proj = Linear(H, self.n_kv * D)
        self.o_proj = Linear(self.n_heads * D, H)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: StepCtx, kv: KVBuffer | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. With kv, this forward's keys/values are written at rows
        ctx.start .. ctx.start+T-1 and attention sees rows 0 .. start+r for query row r."""
        return self.forward_batch(x, [ctx], [kv], [x.shape[0]])

    def forward_batch(self, x: torch.Tensor, ctxs: list[StepCtx], kvs: list, sizes: list[int]) -> torch.Tensor:
        """Rows of several sequences stacked (x [N, H]): projections, norms, gate and output
        projection on all rows; RoPE positions, the KV write and attention per sequence."""
        N, D = x.shape[0], self.head_dim
        qg = self.q_proj(x, ctxs[0]).view(N, self.n_heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]  # [N, Hq, D] each
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x, ctxs[0]).view(N, self.n_kv, D))  # [N, Hkv, D]
        v = self.v_proj(x, ctxs[0]).view(N, self.n_kv, D)
        outs = [self._attend_one(*parts, ctx, kv) for *parts, ctx, kv in
                zip(q.split(sizes), k.split(sizes), v.split(sizes), ctxs, kvs)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [N, Hq * D]
        out = out * sigmoid(gate.reshape(N, self.n_heads * D))
        return self.o_proj(out, ctxs[0])

    def _attend_one(self, q, k, v, ctx: StepCtx, kv: KVBuffer | None) -> torch.Tensor:
        """One sequence: q [T, Hq, D], k, v [T, Hkv, D] at positions ctx.start.. -> [T, Hq * D]."""
        T, D = q.shape[0], self.head_dim
        pos = torch.arange(ctx.start, ctx.start + T, device=q.device)
        cos, sin = rope_cos_sin(pos, *rope_frequencies(self.rope_cfg, pos.device), q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None:  # whole sequence in one go (training, scoring without cache)
            if ctx.start != 0:
                raise ValueError("attention without a KV cache must start at position 0")
            keys, vals = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, T, D]
        else:
            end = ctx.start + T
            if end > kv.capacity:
                raise ValueError(f"context full: {end} tokens exceed the cache's max length {kv.capacity}")
            kv.k[:, ctx.start:end] = k.transpose(0, 1)
            kv.v[:, ctx.start:end] = v.transpose(0, 1)
            keys, vals = kv.k[:, :end], kv.v[:, :end]
        out = self._attend(q.transpose(0, 1), keys, vals, ctx)  # [Hq, T, D]
        return out.transpose(0, 1).reshape(T, self.n_heads * D)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, ctx: StepCtx) -> torch.Tensor:
        """q [Hq, T, D]; keys/vals [Hkv, S, D] with S = start + T. Causal: row r sees keys <= start+r."""
        Hq, T, D = q.shape
        S = keys.shape[1]
        rep = Hq // keys.shape[0]
        keys = keys.repeat_interleave(rep, dim=0)  # [Hq, S, D]
        vals = vals.repeat_interleave(rep, dim=0)
        scale = D ** -0.5
        if ctx.exact:
            # one query row at a time over exactly the keys a decode step would see
            rows = []
            for r in range(T):
                n = S - T + r + 1
                rows.append(_softmax_attend(q[:, r : r + 1], keys[:, :n], vals[:, :n], scale, None))
            return torch.cat(rows, dim=1)
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            mask = _causal_mask(T, S, q.device)
            return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale)
        return _softmax_attend(q, keys, vals, scale, _causal_mask(T, S, q.device))


def _causal_mask(T: int, S: int, device) -> torch.Tensor:
    """[T, S] bool, True where query row r may see key column c (c <= S - T + r)."""
    r = torch.arange(T, device=device)[:, None]
    c = torch.arange(S, device=device)[None, :]
    return c <= (S - T + r)


def _softmax_attend(q, keys, vals, scale, mask):
    """Plain attention; softmax in fp32 (fp64 for fp64 models), output in q's dtype."""
    acc = acc_dtype(q.dtype)
    scores = (q @ keys.transpose(-1, -2)) * scale  # [Hq, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.to(acc), dim=-1).to(q.dtype)
    return probs @ vals
