"""The batched training forward and loss (same math as ``HybridLM.forward`` / ``mtp_hidden``,
per sequence), built from the modules' own parameters and row-wise sub-functions:

* row-wise parts (projections, norms, MLP, the GDN gated norm) run on flattened [B*T, H];
* the depthwise causal conv is ``F.conv1d(groups=C)`` over a left pad of W-1, then SiLU;
* the Gated-DeltaNet recurrence is flash-linear-attention's ``chunk_gated_delta_rule`` on
  CUDA when ``fla`` is importable and usable for training, else ``chunked_scan_batched`` (our
  torch ``chunked_scan`` math batched over sequences, autograd). fla 0.6.0 refuses its gated
  backward on Hopper (H100/H200) with 3.4 <= Triton < 3.7.1 unless TileLang is installed
  (fla issue #640); that case is detected up front and the torch path is used;
* full attention is ``F.scaled_dot_product_attention(is_causal=True)`` with our q/k norms,
  partial RoPE and sigmoid output gate.

Loss = CE(next token) + mtp_weight * CE(MTP), where MTP row i is fed exactly as inference
feeds the drafter, ``fc(cat(norm_e(embed(t_{i+1})), norm_h(h_i)))`` with h_i the target's
output of ``model.norm``, at RoPE position i, and predicts t_{i+2}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyspec.config import FULL
from hyspec.model.attention import GatedAttention
from hyspec.model.gdn import GatedDeltaNet, chunked_scan, l2norm
from hyspec.model.hybrid import DecoderLayer, HybridLM
from hyspec.model.ops import apply_rope, rope_cos_sin, rope_frequencies

_FLA = None
FLA_UNUSABLE_REASON: str | None = None


def fla_kernel():
    """flash-linear-attention's chunk_gated_delta_rule, or None (lazy import). None also
    where fla itself refuses the training backward: on Hopper with 3.4 <= Triton < 3.7.1 and
    no TileLang, fla 0.6 raises in the gated chunk_bwd_dqkwg (fla issue #640)."""
    global _FLA, FLA_UNUSABLE_REASON
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            _FLA = chunk_gated_delta_rule
        except Exception as e:  # not installed / no triton
            _FLA, FLA_UNUSABLE_REASON = False, f"fla not importable ({e.__class__.__name__})"
        if _FLA:
            try:
                import importlib.util

                import fla.utils as fu

                bad = (getattr(fu, "IS_NVIDIA_HOPPER", False) and getattr(fu, "TRITON_ABOVE_3_4_0", False)
                       and not getattr(fu, "TRITON_ABOVE_3_7_1", True)
                       and importlib.util.find_spec("tilelang") is None)
            except Exception:
                bad = False
            if bad:
                _FLA = False
                FLA_UNUSABLE_REASON = ("fla refuses the gated backward on Hopper with Triton < 3.7.1 and no "
                                       "tilelang (fla #640)")
    return _FLA or None


def chunked_scan_batched(q, k, v, g, beta, chunk: int = 64) -> torch.Tensor:
    """The model's ``chunked_scan`` from a zero state over a batch of sequences:
    q, k [B, T, Hv, Dk] (l2-normed, expanded to value heads, q scaled), v [B, T, Hv, Dv],
    g, beta [B, T, Hv] -> o [B, T, Hv, Dv]. Runs in the inputs' dtype with autocast off."""
    with torch.autocast(q.device.type, enabled=False):
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1])
        return chunked_scan(q, k, v, g, beta, state, chunk)[0]


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def gdn_batched(mod: GatedDeltaNet, x: torch.Tensor, use_fla: bool) -> torch.Tensor:
    """x [B, T, H] -> [B, T, H]: GatedDeltaNet.forward for each sequence from a zero state."""
    B, T, _ = x.shape
    qkv, z, b, a = mod.project(_flat(x), None)  # [BT, C], [BT, Hv, Dv], [BT, Hv] x2
    C, W = qkv.shape[-1], mod.W
    w = mod.conv1d.weight.to(qkv.dtype)  # [C, 1, W]
    y = F.conv1d(F.pad(qkv.view(B, T, C).transpose(1, 2), (W - 1, 0)), w, groups=C)  # [B, C, T]
    y = F.silu(y).transpose(1, 2).reshape(B * T, C)
    nk, nv, dk, dv = mod.nk, mod.nv, mod.dk, mod.dv
    if use_fla:
        kern = fla_kernel()
        kd = nk * dk
        kdt = y.dtype  # bf16 under autocast, fp32 otherwise
        q = l2norm(y[:, :kd].float().view(B, T, nk, dk)).to(kdt)
        k = l2norm(y[:, kd:2 * kd].float().view(B, T, nk, dk)).to(kdt)
        v = y[:, 2 * kd:].reshape(B, T, nv, dv).to(kdt)
        beta = torch.sigmoid(b.float()).view(B, T, nv).to(kdt)
        g = (-mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias.float())).view(B, T, nv)
        # GVA: value head h reads key head h // (nv // nk), as repeat_interleave in prepare()
        o, _ = kern(q, k, v, g, beta, scale=dk ** -0.5, output_final_state=False)
        o = o.reshape(B * T, nv, dv)
    else:
        q, k, v, g, beta = mod.prepare(y, b, a)  # [BT, Hv, Dk] (expanded, q scaled), state dtype
        q, k, v = (t.view(B, T, nv, -1) for t in (q, k, v))
        o = chunked_scan_batched(q, k, v, g.view(B, T, nv), beta.view(B, T, nv))
        o = o.reshape(B * T, nv, dv)
    o = mod.norm(o.to(x.dtype), z)  # [BT, Hv, Dv]
    return mod.out_proj(o.reshape(B * T, nv * dv)).view(B, T, -1)


def attn_batched(mod: GatedAttention, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H] -> [B, T, H]: GatedAttention.forward (no cache, start 0) per sequence."""
    B, T, _ = x.shape
    D, nh, nkv = mod.head_dim, mod.n_heads, mod.n_kv
    xf = _flat(x)
    qg = mod.q_proj(xf).view(B, T, nh, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    q = mod.q_norm(q)
    k = mod.k_norm(mod.k_proj(xf).view(B, T, nkv, D))
    v = mod.v_proj(xf).view(B, T, nkv, D)
    cos, sin = rope_cos_sin(torch.arange(T, device=x.device), *rope_frequencies(mod.rope_cfg, x.device), x.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    dt = v.dtype
    q, k, v = (t.to(dt).transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
    if nh != nkv:
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D ** -0.5)
    out = out.transpose(1, 2).reshape(B * T, nh * D)
    out = out * torch.sigmoid(gate.reshape(B * T, nh * D))
    return mod.o_proj(out).view(B, T, -1)


def layer_batched(layer: DecoderLayer, x: torch.Tensor, use_fla: bool, dropout: float = 0.0) -> torch.Tensor:
    """DecoderLayer.forward over [B, T, H] (dropout on the two residual branches, training only)."""
    B, T, H = x.shape
    h = layer.input_layernorm(x)
    if layer.layer_type == FULL:
        h = attn_batched(layer.self_attn, h)
    else:
        h = gdn_batched(layer.linear_attn, h, use_fla)
    if dropout:
        h = F.dropout(h, dropout, training=True)
    x = x + h
    m = layer.mlp(_flat(layer.post_attention_layernorm(x))).view(B, T, H)
    if dropout:
        m = F.dropout(m, dropout, training=True)
    return x + m


def resolve_fla(x: torch.Tensor, use_fla: bool | None) -> bool:
    if use_fla is None:
        use_fla = x.is_cuda and fla_kernel() is not None
    if use_fla and fla_kernel() is None:
        raise RuntimeError(f"use_fla=True but fla's kernel is unusable here: {FLA_UNUSABLE_REASON}")
    return use_fla


def batched_hidden(model: HybridLM, ids: torch.Tensor, use_fla: bool | None = None,
                   dropout: float = 0.0) -> torch.Tensor:
    """ids [B, T] -> post-final-norm hidden [B, T, H] (= forward_hidden per sequence)."""
    if model.cfg.has_moe:
        raise NotImplementedError("batched training forward supports dense models only")
    x = model.model.embed_tokens(ids)
    use_fla = resolve_fla(x, use_fla)
    for layer in model.model.layers:
        x = layer_batched(layer, x, use_fla, dropout)
    return model.model.norm(x)


def batched_mtp_hidden(model: HybridLM, tokens: torch.Tensor, h_prev: torch.Tensor,
                       use_fla: bool | None = None, dropout: float = 0.0) -> torch.Tensor:
    """tokens [B, T'] (t_{i+1}) paired with h_prev [B, T', H] (h_i) -> MTP hidden [B, T', H]
    (= mtp_hidden(tokens, h_prev, StepCtx(start=0), None) per sequence)."""
    mtp = model.mtp
    e = model.model.embed_tokens(tokens)
    x = torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(h_prev)], dim=-1)
    B, T, _ = x.shape
    x = mtp.fc(_flat(x)).view(B, T, -1)
    x = layer_batched(mtp.layers[0], x, resolve_fla(x, use_fla), dropout)
    return mtp.norm(x)


def batched_logits(model: HybridLM, h: torch.Tensor) -> torch.Tensor:
    """h [..., H] -> fp32 logits [..., V] through the (tied) LM head."""
    return F.linear(h, model.head_weight).float()


def loss_fn(model: HybridLM, win: torch.Tensor, mtp_weight: float, use_fla: bool | None = None,
            dropout: float = 0.0, mask: torch.Tensor | None = None) -> dict:
    """win [B, T+2] token windows. Target rows i < T predict win[i+1] from win[:i+1]; MTP
    row i takes (win[i+1], h_i) and predicts win[i+2]. mask [B, T+2] (optional) marks real
    tokens; a row counts when its target is real. Returns sums and counts (for eval) and
    the training loss."""
    T = win.shape[1] - 2
    ids = win[:, :T]
    h = batched_hidden(model, ids, use_fla, dropout)
    logits = batched_logits(model, h)
    V = logits.shape[-1]
    tgt = win[:, 1:T + 1]
    ce = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), reduction="none").view_as(tgt)
    out = {"logits": logits}
    m1 = torch.ones_like(ce) if mask is None else mask[:, 1:T + 1].to(ce.dtype)
    out["main_sum"], out["main_n"] = (ce * m1).sum(), m1.sum()
    out["main_correct"] = ((logits.argmax(-1) == tgt).to(ce.dtype) * m1).sum()
    loss = out["main_sum"] / m1.sum().clamp_min(1)
    out["main"] = loss
    if model.has_mtp:
        hm = batched_mtp_hidden(model, win[:, 1:T + 1], h, use_fla, dropout)
        ml = batched_logits(model, hm)
        tgt2 = win[:, 2:T + 2]
        ce2 = F.cross_entropy(ml.reshape(-1, V), tgt2.reshape(-1), reduction="none").view_as(tgt2)
        m2 = torch.ones_like(ce2) if mask is None else mask[:, 2:T + 2].to(ce2.dtype)
        out["mtp_sum"], out["mtp_n"] = (ce2 * m2).sum(), m2.sum()
        out["mtp_correct"] = ((ml.argmax(-1) == tgt2).to(ce2.dtype) * m2).sum()
        out["mtp"] = out["mtp_sum"] / m2.sum().clamp_min(1)
        out["mtp_logits"] = ml
        loss = loss + mtp_weight * out["mtp"]
    out["loss"] = loss
    return out

