"""What both GPU decoders share outside the graphs: which state slot each layer uses, and
the eager prefill of a prompt into one sequence's state.

The prefill runs the model's own modules (it is not graph-captured: a prompt's length
varies), with flash-linear-attention's chunked kernel for Gated DeltaNet on CUDA when it
imports, else the torch chunked scan.
"""
from __future__ import annotations

import sys

import torch

from hyspec.config import FULL
from hyspec.model.gdn import chunked_scan
from hyspec.model.ops import StepCtx


def layer_indices(cfg) -> tuple[dict[int, int], dict[int, int]]:
    """({layer: g} for the Gated-DeltaNet layers, {layer: a} for the attention layers):
    each layer's index into the decoders' per-kind state (conv/ssm [G, ...], kv_k[a])."""
    gdn_index: dict[int, int] = {}
    attn_index: dict[int, int] = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == FULL:
            attn_index[i] = len(attn_index)
        else:
            gdn_index[i] = len(gdn_index)
    return gdn_index, attn_index


def _fla_chunk():
    """flash-linear-attention's chunked gated delta rule, or None (imported lazily)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    return chunk_gated_delta_rule


def fla_off(dec, why: str) -> None:
    """Turn fla off for this decoder, with one line on stderr (prefill checks use_fla first,
    so it is said once)."""
    dec.use_fla = False
    print(f"hyspec.gpu: prefill falls back to the torch chunked Gated-DeltaNet scan ({why})", file=sys.stderr)


def prefill_into(dec, prompt: list[int], kv: dict, conv_of, ssm_of, start: int = 0):
    """Run prompt tokens at positions start.. through dec.model's own modules into one
    sequence's state: kv {layer index: KVBuffer}, conv_of(g) / ssm_of(g) the g-th
    Gated-DeltaNet layer's conv window [W-1, C] and state [Hv, Dk, Dv] (zeroed by the
    caller for start = 0; a resumed sequence's state, with its KV rows below start, else). Uses
    flash-linear-attention's chunked kernel on CUDA when dec.use_fla and it imports
    (fla_off turns it off loudly when it cannot), else the torch chunked scan.
    Returns (pre [P, H], post [P, H], logits [1, V] of the last row)."""
    model = dec.model
    ids = torch.tensor(prompt, device=dec.dev)
    ctx = StepCtx(start=start, chunked=True)
    x = model.model.embed_tokens(ids)
    for i, layer in enumerate(model.model.layers):
        h = layer.input_layernorm(x)
        if layer.layer_type == FULL:
            h = layer.self_attn(h, ctx, kv[i])
        else:
            g = dec.gdn_index[i]
            h = _gdn_prefill(dec, layer.linear_attn, h, ctx, conv_of(g), ssm_of(g))
        x = x + h
        x = x + layer.mlp(layer.post_attention_layernorm(x), ctx)
    post = model.model.norm(x)
    return x, post, model.logits(post[-1:])


def _gdn_prefill(dec, mod, x, ctx, conv, ssm):
    """GatedDeltaNet.forward (chunked) on one sequence's conv window / state; fla on CUDA."""
    T = x.shape[0]
    qkv, z, b, a = mod.project(x, ctx)
    xcat = torch.cat([conv.to(qkv.dtype), qkv])
    y = mod.conv(xcat)
    o = None
    if dec.use_fla and y.is_cuda:
        o = _fla_prefill(dec, mod, y, b, a, ssm)
    if o is None:
        q, k, v, gg, beta = mod.prepare(y, b, a)
        o, s_final = chunked_scan(q, k, v, gg, beta, ssm)
        ssm.copy_(s_final)
    conv.copy_(xcat[T:])
    o = mod.norm(o.to(x.dtype), z)
    return mod.out_proj(o.reshape(T, -1), ctx)


def _fla_prefill(dec, mod, y, b, a, ssm):
    fn = _fla_chunk()
    if fn is None:
        fla_off(dec, "flash-linear-attention (fla) is not importable")
        return None
    T = y.shape[0]
    nk, nv, dk, dv = mod.nk, mod.nv, mod.dk, mod.dv
    kd = nk * dk
    try:
        q = y[:, :kd].reshape(1, T, nk, dk)
        k = y[:, kd : 2 * kd].reshape(1, T, nk, dk)
        v = y[:, 2 * kd :].reshape(1, T, nv, dv)
        beta = torch.sigmoid(b.float()).to(y.dtype).reshape(1, T, nv)
        gg = (-mod.A_log.float().exp() * torch.nn.functional.softplus(a.float() + mod.dt_bias.float()))
        o, fs = fn(q.contiguous(), k.contiguous(), v.contiguous(), g=gg.reshape(1, T, nv).contiguous(),
                   beta=beta.contiguous(), scale=dk ** -0.5, initial_state=ssm[None].to(torch.float32, copy=True),
                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    except Exception as e:  # pragma: no cover - GPU only
        fla_off(dec, f"fla chunk_gated_delta_rule failed: {type(e).__name__}: {e}")
        return None
    ssm.copy_(fs[0].to(ssm.dtype))
    return o[0].float()
