"""The Triton runner's weights, packed once at load: one matmul per projection group.

Per target layer a SimpleNamespace with the weights the runner's kernels read:

    ln1, ln2       [H] input / post-attention RMSNorm weights
    attention      w_in [(Hq + 2 Hkv) D, H] (q | k | v), w_out [H, Hq D], qn / kn [D]
    Gated DeltaNet w_in [2kd + 2vd + 2nv, H] (q | k | v | z | b | a), w_out [H, vd],
                   conv_w [C, W], A_log / dt_bias [Hv], norm_w [Dv]
    dense FFN      w_gu [2I, H] (gate | up), w_down [H, I]
    MoE FFN        moe (the module: routed experts), w_gu None; shared expert sh_gu [2I, H],
                   sh_down [H, I], sh_gate [1, H]

The packed tensors are the model's own storage where the layout allows (pack_views: the
parameters become views into them), so no second copy stays on the device.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from hyspec.config import FULL
from hyspec.model.ffn import MoE


def pack_gdn_in(mod) -> torch.Tensor:
    """The GDN input projections as one [2kd + 2vd + 2nv, H] weight with output columns
    [q (all key heads) | k | v | z | b | a] (Qwen3-Next's per-key-head groups unpacked)."""
    nk, nv, dk, dv = mod.nk, mod.nv, mod.dk, mod.dv
    if mod.family == "qwen3_next":
        cached = getattr(mod, "_hyspec_packed_in", None)
        if cached is not None:  # one re-ordered copy per model, shared by every runner
            return cached
        r = nv // nk
        W = mod.in_proj_qkvz.weight  # [nk * (2dk + 2 r dv), H]
        H = W.shape[1]
        Wg = W.view(nk, 2 * dk + 2 * r * dv, H)
        q, k, v, z = torch.split(Wg, [dk, dk, r * dv, r * dv], dim=1)
        BA = mod.in_proj_ba.weight.view(nk, 2 * r, H)
        b, a = BA[:, :r], BA[:, r:]
        parts = [q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H), z.reshape(-1, H),
                 b.reshape(-1, H), a.reshape(-1, H)]
        # a re-ordered copy: Qwen3-Next's layout is per key head, and the model's modules keep
        # theirs (reading a packed layout would change the reference's matmul shapes)
        mod._hyspec_packed_in = torch.cat(parts, 0).contiguous()
        return mod._hyspec_packed_in
    return pack_views([mod.in_proj_qkv.weight, mod.in_proj_z.weight, mod.in_proj_b.weight, mod.in_proj_a.weight])


def pack_views(params) -> torch.Tensor:
    """One [sum N_i, K] weight for weights [N_i, K] stacked by rows, held once: the
    parameters become views into it (the model's modules then read the packed tensor),
    and a later runner on the same model finds and reuses it. Packed at load, once, like
    gpt-fast's load hook; no second copy of these weights stays on the device."""
    prev = getattr(params[0], "_hyspec_packed", None)
    if prev is not None:
        off = 0
        for p in params:
            if p.data.data_ptr() != prev[off: off + p.shape[0]].data_ptr():
                break
            off += p.shape[0]
        else:
            if off == prev.shape[0]:
                return prev
    packed = torch.cat([p.data for p in params], 0).contiguous()
    off = 0
    for p in params:
        n = p.shape[0]
        p.data = packed[off: off + n]
        off += n
    params[0]._hyspec_packed = packed
    return packed


def pack_layer(layer, gdn_index: int | None = None, layer_index: int | None = None) -> SimpleNamespace:
    """A decoder layer's packed weights (module docstring); gdn_index: its index among the
    Gated-DeltaNet layers (their state slot), layer_index: its index in the model."""
    packed = SimpleNamespace(ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight)
    if layer.layer_type == FULL:
        attn = layer.self_attn
        packed.kind = "attn"
        packed.index = layer_index
        packed.w_in = pack_views([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        packed.w_out = attn.o_proj.weight
        packed.qn, packed.kn = attn.q_norm.weight, attn.k_norm.weight
    else:
        gdn = layer.linear_attn
        packed.kind = "gdn"
        packed.g = gdn_index
        packed.w_in = pack_gdn_in(gdn)
        packed.w_out = gdn.out_proj.weight
        packed.conv_w = gdn.conv1d.weight[:, 0, :].contiguous()
        packed.A_log, packed.dt_bias, packed.norm_w = gdn.A_log, gdn.dt_bias, gdn.norm.weight
    mlp = layer.mlp
    if isinstance(mlp, MoE):
        packed.moe = mlp
        packed.w_gu = None
        if mlp.has_shared:
            se = mlp.shared_expert
            packed.sh_gu = pack_views([se.gate_proj.weight, se.up_proj.weight])
            packed.sh_down = se.down_proj.weight
            packed.sh_gate = mlp.shared_expert_gate.weight
    else:
        packed.moe = None
        packed.w_gu = pack_views([mlp.gate_proj.weight, mlp.up_proj.weight])
        packed.w_down = mlp.down_proj.weight
    return packed


def layer_weight_bytes(packed: SimpleNamespace, with_moe: bool = True) -> int:
    """Bytes of a packed layer's matmul weights (routed experts: all of them, with_moe)."""
    n = 0
    for w in (packed.w_in, packed.w_out, packed.w_gu, getattr(packed, "w_down", None)):
        if w is not None:
            n += w.numel() * w.element_size()
    if with_moe and packed.moe is not None:
        n += sum(p.numel() * p.element_size() for p in packed.moe.parameters())
    return n
