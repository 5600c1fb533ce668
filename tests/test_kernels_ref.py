"""CPU tests of the plain-torch kernel references (no triton needed)."""
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hyspec.kernels.fused import gdn_conv_ref, gdn_step_ref
from hyspec.kernels import gemm
from hyspec.kernels.gemm import linear, skinny_config, skinny_matmul_ref
from hyspec.model.gdn import recurrent_scan

FP32_ATOL = 1e-5
FP32_RTOL = 1e-5


def _gdn_inputs(T=5, Hk=2, Hv=6, Dk=60, Dv=36, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, Hk, Dk, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(T, Hk, Dk, generator=gen), dim=-1).to(dtype)
    v = torch.randn(T, Hv, Dv, generator=gen).to(dtype)
    g = -torch.rand(T, Hv, generator=gen) * 2  # log decay in (-2, 0]
    beta = torch.rand(T, Hv, generator=gen)
    s0 = torch.randn(Hv, Dk, Dv, generator=gen)
    return q, k, v, g, beta, s0


def _gdn_dead_simple(q, k, v, g, beta, s0, scale):
    """Element-by-element loops in float64: the recurrence exactly as written."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    r = Hv // Hk
    S = s0.double().clone()
    o = torch.zeros(T, Hv, Dv, dtype=torch.float64)
    states = torch.zeros(T, Hv, Dk, Dv, dtype=torch.float64)
    for t in range(T):
        for h in range(Hv):
            kk = k[t, h // r].double()
            qq = q[t, h // r].double() * scale
            S[h] *= torch.exp(g[t, h].double())
            kS = torch.zeros(Dv, dtype=torch.float64)
            for i in range(Dk):
                kS += kk[i] * S[h, i]
            delta = (v[t, h].double() - kS) * beta[t, h].double()
            for i in range(Dk):
                S[h, i] += kk[i] * delta
            for i in range(Dk):
                o[t, h] += qq[i] * S[h, i]
        states[t] = S
    return o, S, states


def _step_inputs(T=5, nk=2, nv=6, dk=60, dv=36, seed=0):
    """Inputs of fused.gdn_step_ref: conv output y [T, C] (q | k | v, raw: not l2-normed),
    proj [T, C + Hv*Dv + 2*Hv] (its z | b | a columns after the first C), A_log, dt_bias,
    norm weight, state [Hv, Dk, Dv] fp32."""
    gen = torch.Generator().manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    y = torch.randn(T, C, generator=gen)
    proj = torch.randn(T, C + nv * dv + 2 * nv, generator=gen)
    A_log = (torch.rand(nv, generator=gen) * 3 + 0.1).log()
    dt_bias = torch.randn(nv, generator=gen)
    norm_w = 1 + 0.1 * torch.randn(dv, generator=gen)
    s0 = torch.randn(nv, dk, dv, generator=gen) * 0.5
    return y, proj, A_log, dt_bias, norm_w, s0


def test_skinny_matmul_ref():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 200, generator=gen)
    w = torch.randn(96, 200, generator=gen)
    y = skinny_matmul_ref(x, w)
    assert y.shape == (3, 96) and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), atol=1e-4, rtol=1e-5)
    yb = skinny_matmul_ref(x.bfloat16(), w.bfloat16())
    assert yb.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        skinny_matmul_ref(x, w[:, :100])


def test_linear_cpu_falls_back_to_torch():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=gen)
    w = torch.randn(48, 64, generator=gen)
    assert torch.equal(linear(x, w), F.linear(x, w))
    x3 = torch.randn(2, 3, 64, generator=gen)
    assert torch.equal(linear(x3, w), F.linear(x3, w))


# (N, K) of the model's projections at a few sizes, plus odd shapes (K not a multiple of BK,
# tiny N, huge N), so the properties below are checked where the defaults change.
_GEMM_SHAPES = [(96, 200), (48, 64), (1024, 1024), (2048, 4096), (4096, 2048), (8192, 2048),
                (2048, 8192), (151936, 2048), (248320, 4096), (512, 100_000), (33, 7777)]


def _check_skinny_config(c, N, K):
    for name in ("block_n", "block_k"):
        val = getattr(c, name)
        assert val >= 16 and val & (val - 1) == 0, f"{name}={val} is not a power of two >= 16"
    assert c.split_k >= 1
    assert c.k_per_split % c.block_k == 0, "each split must cover whole BK steps"
    # the splits cover K, and none is empty: the last one starts before K
    assert c.split_k * c.k_per_split >= K
    assert (c.split_k - 1) * c.k_per_split < K


@pytest.mark.parametrize("N,K", _GEMM_SHAPES)
def test_skinny_config_properties(N, K):
    c = skinny_config(N, K)
    _check_skinny_config(c, N, K)
    assert skinny_config(N, K) == c, "the config is a function of (N, K) only"
    if c.split_k > 1:  # split-K only when the column tiles alone leave programs idle...
        n_tiles = -(-N // c.block_n)
        assert n_tiles * c.split_k // 2 < gemm._TARGET_PROGRAMS
        # ...and never so far that a split streams fewer than _MIN_K_PER_SPLIT columns
        assert c.k_per_split >= gemm._MIN_K_PER_SPLIT


def test_skinny_config_never_sees_the_row_count():
    # T is not an argument: split-K (and with it the reduction order) cannot depend on it,
    # so a row gives the same bits whether it is decoded alone or in a batch of <= 16.
    assert "T" not in inspect.signature(skinny_config).parameters
    assert gemm.BLOCK_T == 16 and gemm.MAX_SKINNY_ROWS <= gemm.BLOCK_T


@pytest.mark.parametrize("split_k", [1, 2, 3, 4, 7, 64])
@pytest.mark.parametrize("block_k", [16, 32, 128])
def test_skinny_config_requested_split_never_leaves_an_empty_split(split_k, block_k):
    for N, K in _GEMM_SHAPES:
        c = skinny_config(N, K, split_k=split_k, block_k=block_k)
        _check_skinny_config(c, N, K)
        assert c.block_k == block_k
        assert c.split_k <= split_k  # fewer only where a requested split would be empty
        if -(-K // block_k) >= split_k and (K // block_k) % split_k == 0 and K % block_k == 0:
            assert c.split_k == split_k  # the K blocks divide evenly: the request is kept


@pytest.mark.parametrize("bad", [dict(block_n=48), dict(block_k=8), dict(block_k=96), dict(split_k=0)])
def test_skinny_config_rejects_bad_overrides(bad):
    with pytest.raises(ValueError):
        skinny_config(96, 200, **bad)
    with pytest.raises(ValueError):
        skinny_config(0, 200)


def test_recurrent_scan_vs_dead_simple_loop():
    # the model's scan takes q, k already expanded to the value heads and q already scaled
    q, k, v, g, beta, s0 = _gdn_inputs(T=3, Hk=2, Hv=4, Dk=12, Dv=7)
    scale = 12 ** -0.5
    r = v.shape[1] // q.shape[1]
    before = s0.clone()
    o, sf, states = recurrent_scan(q.repeat_interleave(r, 1) * scale, k.repeat_interleave(r, 1), v, g, beta, s0,
                                   want_states=True)
    assert torch.equal(s0, before)  # the state passed in is not modified
    o64, sf64, st64 = _gdn_dead_simple(q, k, v, g, beta, s0, scale)
    torch.testing.assert_close(o.double(), o64, atol=FP32_ATOL, rtol=FP32_RTOL)
    torch.testing.assert_close(sf.double(), sf64, atol=FP32_ATOL, rtol=FP32_RTOL)
    torch.testing.assert_close(states.double(), st64, atol=FP32_ATOL, rtol=FP32_RTOL)
    assert torch.equal(states[-1], sf)


def test_gdn_step_ref_rows_at_once_equal_single_steps():
    nk, nv, dk, dv = 2, 6, 60, 36
    y, proj, A_log, dtb, nw, s0 = _step_inputs(nk=nk, nv=nv, dk=dk, dv=dv, seed=1)
    kw = dict(nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6)
    before = s0.clone()
    o, sf, states = gdn_step_ref(y, proj, A_log, dtb, nw, s0, **kw, return_states=True)
    assert torch.equal(s0, before)  # the state passed in is not modified
    assert o.shape == (y.shape[0], nv * dv) and states.shape == (y.shape[0], nv, dk, dv)
    S = s0
    for t in range(y.shape[0]):
        sl = slice(t, t + 1)
        ot, S, st = gdn_step_ref(y[sl], proj[sl], A_log, dtb, nw, S, **kw, return_states=True)
        assert torch.equal(ot[0], o[t]) and torch.equal(S, states[t]) and torch.equal(st[0], S)
    assert torch.equal(S, sf)


def test_gdn_step_ref_vs_transformers():
    """The fast path's reference step (l2norm, head grouping, q scale, gates, scan, gated
    RMSNorm) against transformers' Qwen3-Next pieces: its recurrent delta rule with the
    in-kernel l2norm and its gated RMSNorm, with b / a turned into beta / g as in
    Qwen3NextGatedDeltaNet.forward."""
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    T, nk, nv, dk, dv, eps = 5, 2, 6, 60, 36, 1e-6
    y, proj, A_log, dtb, nw, s0 = _step_inputs(T, nk, nv, dk, dv)
    o, sf, _ = gdn_step_ref(y, proj, A_log, dtb, nw, s0, nk=nk, nv=nv, dk=dk, dv=dv, eps=eps)
    kd, vd = nk * dk, nv * dv
    C = 2 * kd + vd
    q, k = y[:, :kd].reshape(T, nk, dk), y[:, kd : 2 * kd].reshape(T, nk, dk)
    v = y[:, 2 * kd : C].reshape(T, nv, dv)
    z = proj[:, C : C + vd].reshape(T, nv, dv)
    b, a = proj[:, C + vd : C + vd + nv], proj[:, C + vd + nv :]
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dtb)
    o_hf, sf_hf = mod.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=s0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    norm = mod.Qwen3NextRMSNormGated(dv, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(nw)
        out_hf = norm(o_hf[0], z).reshape(T, vd)
    torch.testing.assert_close(o, out_hf, atol=FP32_ATOL, rtol=FP32_RTOL)
    torch.testing.assert_close(sf, sf_hf[0], atol=FP32_ATOL, rtol=FP32_RTOL)


def _conv_dead_simple(x, state, w):
    """x [T, C], state [C, W-1] (channel-major, oldest first), w [C, W]; float64 loops."""
    T, C = x.shape
    W = w.shape[1]
    xx = torch.cat([state.double(), x.double().t()], 1)
    y = torch.zeros(T, C, dtype=torch.float64)
    for t in range(T):
        for c in range(C):
            y[t, c] = sum(w[c, j].double() * xx[c, t + j] for j in range(W))
    return F.silu(y), xx[:, -(W - 1):]


def test_gdn_conv_ref_vs_dead_simple_loop():
    # gdn_conv_ref keeps the window row-major: state [W-1, C], oldest row first
    gen = torch.Generator().manual_seed(3)
    for T in (1, 2, 5):
        x = torch.randn(T, 10, generator=gen)
        state = torch.randn(3, 10, generator=gen)
        w = torch.randn(10, 4, generator=gen)
        before = state.clone()
        y, ns = gdn_conv_ref(x, state, w)
        assert torch.equal(state, before)
        y64, ns64 = _conv_dead_simple(x, state.t(), w)
        torch.testing.assert_close(y.double(), y64, atol=FP32_ATOL, rtol=FP32_RTOL)
        assert ns.shape == (3, 10) and torch.equal(ns.double(), ns64.t())


def test_gdn_conv_ref_vs_transformers():
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    gen = torch.Generator().manual_seed(4)
    T, C, W = 3, 12, 4
    x = torch.randn(T, C, generator=gen)
    state = torch.randn(W - 1, C, generator=gen)
    w = torch.randn(C, W, generator=gen)
    y, ns = gdn_conv_ref(x, state, w)
    # transformers keeps the last W inputs channel-major [B, C, W]; the oldest one never
    # reaches the output
    hf_state = torch.cat([torch.randn(C, 1, generator=gen), state.t()], 1)[None].clone()
    y_hf = mod.causal_conv1d_update(x.t()[None].contiguous(), hf_state, w, None, "silu")
    torch.testing.assert_close(y, y_hf[0].t(), atol=FP32_ATOL, rtol=FP32_RTOL)
    assert torch.equal(ns, hf_state[0, :, 1:].t())


def test_kernel_modules_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # make `import triton` fail
        "import hyspec.kernels.gemm as g, hyspec.kernels.fused, hyspec.kernels.attn, hyspec.kernels.pdl\n"
        "import hyspec.kernels.philox, hyspec.kernels.rmsnorm, hyspec.kernels.attention, hyspec.kernels.gdn\n"
        "import hyspec.kernels.moe, hyspec.kernels.matmul, hyspec.kernels.rng\n"
        "assert not g.triton_available()\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_flat_kernel_modules_reexport_the_op_folders():
    """fused / attn / gemm / philox are shims: the very objects of hyspec/kernels/<op>/, so
    old imports and the config tables they expose act on the code that runs."""
    from hyspec.kernels import attention, attn, fused, gdn, matmul, moe, philox, rmsnorm, rng
    from hyspec.kernels.matmul import config

    for name in fused.__all__:
        home = next(m for m in (rmsnorm, attention, gdn, moe) if hasattr(m, name))
        assert getattr(fused, name) is getattr(home, name), name
    assert set(fused._kernels()) == {"rmsnorm", "attn_prep", "attn_partial", "attn_combine", "gdn_conv",
                                     "gdn_step", "gated_norm", "window_commit", "expert_gemv"}
    assert attn.attn_decode_grouped is attention.attn_decode_grouped and attn.GROUPED_SPLITS == 16
    for name in gemm.__all__:
        assert getattr(gemm, name) is getattr(matmul, name), name
    assert gemm.TUNED is config.TUNED and gemm.BUILTIN is config.BUILTIN
    assert gemm._config_cached is config._config_cached
    assert philox.u01_rows is rng.u01_rows
