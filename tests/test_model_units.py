"""Model pieces: the two Gated-DeltaNet forms agree (odd head ratios and widths too),
prefill + decode equals one full forward, MoE routing matches a per-token reference,
and the norms / RoPE follow the Qwen3-Next conventions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import ARCHS
from hyspec.config import ModelConfig
from hyspec.model.gdn import GatedDeltaNet, LinearState, chunked_scan, recurrent_scan
from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import GatedRMSNorm, RMSNorm, StepCtx, apply_rope, rope_cos_sin
from hyspec.tiny import init_weights, tiny_config

ODD = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=12, linear_value_head_dim=12)
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _scan_inputs(T, Hv, Dk, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, Hv, Dk, generator=g, dtype=dtype), dim=-1) * Dk ** -0.5
    k = F.normalize(torch.randn(T, Hv, Dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(T, Hv, Dv, generator=g, dtype=dtype)
    gate = -torch.rand(T, Hv, generator=g, dtype=dtype) * 3  # log decay in (-3, 0]
    beta = torch.rand(T, Hv, generator=g, dtype=dtype)
    s0 = torch.randn(Hv, Dk, Dv, generator=g, dtype=dtype) * 0.5
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
def test_chunked_scan_equals_recurrent(T, dtype):
    q, k, v, g, beta, s0 = _scan_inputs(T, 6, 12, 20, dtype, seed=T)
    o_r, s_r, states = recurrent_scan(q, k, v, g, beta, s0, want_states=True)
    o_c, s_c = chunked_scan(q, k, v, g, beta, s0)
    tol = TOL[dtype] * 10
    torch.testing.assert_close(o_c, o_r, rtol=tol, atol=tol)
    torch.testing.assert_close(s_c, s_r, rtol=tol, atol=tol)
    assert torch.equal(states[-1], s_r) and states.shape == (T, 6, 12, 20)
    # a chunk size that does not divide T, and an input state of zeros
    o_c2, s_c2 = chunked_scan(q, k, v, g, beta, torch.zeros_like(s0), chunk=16)
    o_r2, s_r2, _ = recurrent_scan(q, k, v, g, beta, torch.zeros_like(s0))
    torch.testing.assert_close(o_c2, o_r2, rtol=tol, atol=tol)
    torch.testing.assert_close(s_c2, s_r2, rtol=tol, atol=tol)


def test_recurrent_scan_rows_do_not_depend_on_T():
    q, k, v, g, beta, s0 = _scan_inputs(9, 4, 12, 12, torch.float32)
    o, s, _ = recurrent_scan(q, k, v, g, beta, s0)
    st, outs = s0, []
    for t in range(9):
        ot, st, _ = recurrent_scan(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], st)
        outs.append(ot)
    assert torch.equal(torch.cat(outs), o) and torch.equal(st, s)


def _odd_model(arch: str, dtype: torch.dtype, seed: int = 0) -> HybridLM:
    cfg = ModelConfig.from_dict({**tiny_config(arch), **ODD})
    m = HybridLM(cfg, with_mtp=False)
    init_weights(m, torch.Generator().manual_seed(seed))
    return m.to(dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_gdn_layer_chunked_vs_recurrent_odd_heads(arch, dtype):
    """A whole Gated-DeltaNet layer (nv/nk = 3, 12-wide heads): chunked prefill and the
    row-by-row form give the same outputs and leave the same conv window / SSM state,
    in one forward or split in two."""
    m = _odd_model(arch, dtype)
    layer: GatedDeltaNet = m.model.layers[0].linear_attn
    assert (layer.nv // layer.nk, layer.dk, layer.dv) == (3, 12, 12)
    x = torch.randn(70, m.cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=dtype)
    outs = {}
    for name, ctxs in {"chunked": [StepCtx(chunked=True)], "recurrent": [StepCtx()],
                       "split": [StepCtx(chunked=True), StepCtx(start=40)]}.items():
        st = LinearState(m.cfg, "cpu", dtype)
        if len(ctxs) == 1:
            y = layer(x, ctxs[0], st)
        else:
            y = torch.cat([layer(x[:40], ctxs[0], st), layer(x[40:], ctxs[1], st)])
        outs[name] = (y, st.conv, st.ssm)
    y_none = layer(x, StepCtx(chunked=True), None)
    tol = TOL[dtype]
    for name in ("recurrent", "split"):
        for a, b in zip(outs[name], outs["chunked"]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    torch.testing.assert_close(y_none, outs["chunked"][0], rtol=tol, atol=tol)
    # the conv window holds the last W-1 conv inputs (the q|k|v projections)
    W = m.cfg.linear_conv_kernel_dim
    qkv = layer.project(x[-(W - 1):], StepCtx())[0]
    torch.testing.assert_close(outs["chunked"][1], qkv, rtol=tol, atol=tol)


def _prefill_decode_vs_full(m: HybridLM, ids: torch.Tensor, split: int, tol: float) -> None:
    with torch.no_grad():
        full = m(ids)
        cache = m.new_cache(len(ids))
        hs = [m.forward_hidden(ids[:split], cache, StepCtx(start=0, chunked=True))]
        for t in range(split, len(ids)):
            hs.append(m.forward_hidden(ids[t : t + 1], cache, StepCtx(start=t, exact=True)))
        steps = m.logits(torch.cat(hs))
        cache = m.new_cache(len(ids))
        rec = m.logits(m.forward_hidden(ids, cache, StepCtx(start=0)))  # no chunking, one forward
    torch.testing.assert_close(steps, full, rtol=tol, atol=tol)
    torch.testing.assert_close(rec, full, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_equals_full_forward(zoo, arch, dtype):
    m = zoo.model("tiny", arch, dtype)
    ids = torch.randint(0, 512, (72,), generator=torch.Generator().manual_seed(3))
    _prefill_decode_vs_full(m, ids, 66, TOL[m.dtype])


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_equals_full_forward_odd_heads(arch):
    m = _odd_model(arch, torch.float64)
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(4))
    _prefill_decode_vs_full(m, ids, 65, 1e-10)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_moe_matches_per_token_reference(zoo, arch):
    m = zoo.model("tiny", arch, "float64")
    moe = m.model.layers[0].mlp
    x = torch.randn(9, m.cfg.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    E, top = m.cfg.num_experts, m.cfg.num_experts_per_tok
    want = []
    for t in range(9):
        probs = torch.softmax(moe.gate.weight @ x[t], -1)
        w, idx = torch.topk(probs, top)
        w = w / w.sum()
        y = torch.zeros_like(x[t])
        for wi, e in zip(w, idx.tolist()):
            gu = moe.experts.gate_up_proj[e] @ x[t]
            gate, up = gu[: len(gu) // 2], gu[len(gu) // 2 :]
            y += wi * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
        sh = moe.shared_expert
        y += torch.sigmoid(moe.shared_expert_gate.weight @ x[t]) * (
            sh.down_proj.weight @ (F.silu(sh.gate_proj.weight @ x[t]) * (sh.up_proj.weight @ x[t])))
        want.append(y)
    want = torch.stack(want)
    assert E == 4 and top == 2
    torch.testing.assert_close(moe(x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(moe(x, StepCtx(exact=True)), want, rtol=1e-12, atol=1e-12)
    if arch == "qwen3_next":  # mlp_only_layers=[1]: a dense MLP there
        assert not hasattr(m.model.layers[1].mlp, "gate")


def test_norms_and_rope():
    x = torch.randn(3, 8, dtype=torch.float64)
    n = RMSNorm(8)
    xhat = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(n(x), xhat)  # zero-centred weight: a fresh norm is the identity scale
    with torch.no_grad():
        n.weight.fill_(0.5)
    torch.testing.assert_close(n(x), 1.5 * xhat)
    gn = GatedRMSNorm(8)
    z = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        gn.weight.fill_(2.0)
    torch.testing.assert_close(gn(x, z), 2.0 * xhat * F.silu(z))
    # partial neox RoPE: the first rot dims rotate in halves, the rest pass through
    q = torch.randn(4, 2, 16, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(4), 1.0 / 10000.0 ** (torch.arange(0, 4, 2) / 4), 1.0, torch.float64)
    r = apply_rope(q, cos, sin)
    assert torch.equal(r[..., 4:], q[..., 4:]) and torch.equal(r[0], q[0])  # position 0: identity
    ang = 1.0 * 1.0  # position 1, first frequency (theta^0)
    c, s = torch.tensor(ang).cos(), torch.tensor(ang).sin()
    torch.testing.assert_close(r[1, :, 0], q[1, :, 0] * c - q[1, :, 2] * s)
    torch.testing.assert_close(r[1, :, 2], q[1, :, 2] * c + q[1, :, 0] * s)
    torch.testing.assert_close(r.norm(dim=-1), q.norm(dim=-1))


def test_norms_round_like_transformers_in_bf16():
    """The norms against transformers' Qwen3.5 classes, bit for bit in bf16, where each
    cast shows (the gated norm rounds w * x̂ to the model's dtype before the gate, which it
    takes in fp32; the zero-centred one applies 1 + w in fp32), which fp32 tests cannot
    see; eps is not the default. (In fp32 the two silu formulations differ in the last bit
    for a few percent of inputs; rounded to bf16 that vanishes.)"""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5RMSNorm,
        Qwen3_5RMSNormGated,
    )

    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 4, 32, generator=g) * 3).to(dtype)
    z = (torch.randn(6, 4, 32, generator=g) * 2).to(dtype)
    w = torch.randn(32, generator=g).to(dtype)
    ours, theirs = RMSNorm(32, eps=1e-2).to(dtype), Qwen3_5RMSNorm(32, eps=1e-2).to(dtype)
    gated, their_gated = GatedRMSNorm(32, eps=1e-2).to(dtype), Qwen3_5RMSNormGated(32, eps=1e-2).to(dtype)
    with torch.no_grad():
        for n in (ours, theirs, gated, their_gated):
            n.weight.copy_(w)
        assert torch.equal(ours(x), theirs(x))
        assert torch.equal(gated(x, z), their_gated(x, z))


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_head_follows_the_qwen_layout(arch):
    """The MTP head as Qwen's checkpoints (and vLLM / SGLang) define it: fc over
    [pre_fc_norm_embedding(embedding of token t+1) | pre_fc_norm_hidden(hidden of t)], one
    full-attention block whose FFN is an MoE in the MoE families (its weights are
    mtp.layers.0.mlp.experts.*), then mtp.norm. The speculative tests only check that drafts
    never change the output, which holds whatever the head computes."""
    from hyspec.model.ffn import MoE

    cfg = ModelConfig.from_dict(tiny_config(arch))
    m = HybridLM(cfg)
    init_weights(m, torch.Generator().manual_seed(6))
    m = m.double().eval().requires_grad_(False)
    mtp = m.mtp
    assert isinstance(mtp.layers[0].mlp, MoE) == (arch != "qwen3_5") and mtp.fc.weight.shape == (64, 128)
    gen = torch.Generator().manual_seed(7)
    for n in (mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm):  # three different norms
        n.weight.normal_(0.0, 0.5, generator=gen)

    def rms(x, w):
        return x / x.pow(2).mean(-1, keepdim=True).add(cfg.rms_norm_eps).sqrt() * (1.0 + w)

    tokens = torch.tensor([5, 300, 17, 42])
    h = torch.randn(4, 64, generator=gen, dtype=torch.float64) * 3
    x = torch.cat([rms(m.model.embed_tokens.weight[tokens], mtp.pre_fc_norm_embedding.weight),
                   rms(h, mtp.pre_fc_norm_hidden.weight)], -1) @ mtp.fc.weight.T
    want = rms(mtp.layers[0](x, StepCtx(), None), mtp.norm.weight)
    torch.testing.assert_close(m.mtp_hidden(tokens, h, StepCtx(), None), want, rtol=1e-12, atol=1e-12)
