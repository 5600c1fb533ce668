"""Feed-forward blocks: dense SwiGLU and the routed mixture of experts with a shared expert."""

from __future__ import annotations

import torch
from torch import nn

from hyspec.config import ModelConfig
from hyspec.model.ops import Linear, StepCtx, acc_dtype, linear, sigmoid, silu


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter)
        self.up_proj = Linear(hidden, inter)
        self.down_proj = Linear(inter, hidden)

    def forward(self, x: torch.Tensor, ctx: StepCtx | None = None) -> torch.Tensor:
        return self.down_proj(silu(self.gate_proj(x, ctx)) * self.up_proj(x, ctx), ctx)


class Experts(nn.Module):
    """All routed experts as stacked weights (the loader also accepts per-expert keys):
    gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, n: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, inter))

    def one(self, e: int, x: torch.Tensor, ctx: StepCtx | None) -> torch.Tensor:
        if "gate_up_proj_scale_inv" in self._buffers or "down_proj_scale_inv" in self._buffers:
            from hyspec.quant import module_weight  # block-FP8 experts: expert e dequantized for this call

            gate, up = linear(x, module_weight(self, "gate_up_proj", x.dtype, e), ctx).chunk(2, dim=-1)
            return linear(silu(gate) * up, module_weight(self, "down_proj", x.dtype, e), ctx)
        gate, up = linear(x, self.gate_up_proj[e], ctx).chunk(2, dim=-1)
        return linear(silu(gate) * up, self.down_proj[e], ctx)


class Router(nn.Module):
    def __init__(self, n: int, hidden: int, top_k: int, renorm: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, hidden))  # [E, H]
        self.top_k, self.renorm = top_k, renorm

    def forward(self, x: torch.Tensor, ctx: StepCtx | None = None):
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k]); softmax in fp32."""
        logits = linear(x, self.weight, ctx)
        probs = torch.softmax(logits.to(acc_dtype(x.dtype)), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.renorm:
            w = w / w.sum(-1, keepdim=True)
        return w.to(x.dtype), idx


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.gate = Router(cfg.num_experts, H, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.experts = Experts(cfg.num_experts, H, cfg.moe_intermediate_size)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(H, 1)

    def forward(self, x: torch.Tensor, ctx: StepCtx | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. Tokens are grouped per expert (one matmul per hit expert)."""
        w, idx = self.gate(x, ctx)  # [T, k]
        out = torch.zeros_like(x)
        if ctx is not None and ctx.exact and x.shape[0] > 1:
            # row-invariant: every token is computed exactly as a one-token step would
            return torch.cat([self.forward(x[i : i + 1], ctx) for i in range(x.shape[0])])
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            y = self.experts.one(e, x[tok], ctx) * w[tok, slot, None]
            out.index_add_(0, tok, y)
        if self.has_shared:
            out = out + sigmoid(self.shared_expert_gate(x, ctx)) * self.shared_expert(x, ctx)
        return out
