"""Triton kernels vs their torch references, run on CPU through the Triton interpreter.

TRITON_INTERPRET=1 must be set before triton is imported (it is read when kernels are
decorated).  Everything is float32: the interpreter's ``tl.dot`` mis-handles bf16 (it
multiplies the raw uint16 bit patterns), so bf16 row-invariance is checked on the GPU by
``bench/kernels_gpu.py``.  The interpreter runs ``tl.dot`` as a numpy matmul of the fixed
[16, BK] x [BK, BN] tiles, so bitwise row-invariance is meaningful here too.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from hyspec.kernels.gdn import conv_update, conv_update_ref, gdn_recurrent, gdn_recurrent_ref  # noqa: E402
from hyspec.kernels.gemm import skinny_matmul, skinny_matmul_ref  # noqa: E402

GEMM_ATOL = 1e-4  # fp32, K=200, |x|,|w| ~ N(0,1): sums ~ 14, ieee dot
GEMM_RTOL = 1e-5
GDN_ATOL = 2e-5  # fp32 recurrence, a few rows
GDN_RTOL = 1e-5
CONV_ATOL = 1e-5
CONV_RTOL = 1e-5


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- gemm
# (N, K, overrides): default heuristic; every tile full (mask-free loads, split in two);
# no split; two splits; three uneven splits [0,96) [96,192) [192,200)
GEMM_CASES = [
    (96, 200, dict()),
    (96, 256, dict(block_n=32, block_k=64, split_k=2)),
    (96, 200, dict(split_k=1)),
    (96, 200, dict(split_k=2, block_n=64)),
    (96, 200, dict(split_k=3, block_k=32, block_n=16)),
    (96, 200, dict(split_k=2, block_n=32, wt=True)),
    (64, 256, dict(split_k=1, block_n=64, block_k=128, wt=True)),
]


@pytest.mark.parametrize("N,K,cfg", GEMM_CASES, ids=["default", "even", "s1", "s2", "s3", "wt_s2", "wt_even"])
def test_skinny_matmul_matches_ref_and_is_row_invariant(N, K, cfg):
    w = _randn(N, K, seed=0)
    x = _randn(5, K, seed=1)
    y5 = skinny_matmul(x, w, **cfg)
    assert y5.shape == (5, N) and y5.dtype == torch.float32
    torch.testing.assert_close(y5, skinny_matmul_ref(x, w), atol=GEMM_ATOL, rtol=GEMM_RTOL)
    # row r depends on x[r] only: any prefix, and every single row alone, give the same bits
    for T in range(1, 5):
        assert torch.equal(skinny_matmul(x[:T], w, **cfg), y5[:T])
    for r in range(5):
        assert torch.equal(skinny_matmul(x[r : r + 1], w, **cfg)[0], y5[r])
    # other rows' values do not matter either
    x_other = x.clone()
    x_other[1:] = _randn(4, K, seed=2)
    assert torch.equal(skinny_matmul(x_other, w, **cfg)[0], y5[0])


def test_skinny_matmul_more_than_16_rows_and_strided_inputs():
    N, K = 40, 72
    w_big = _randn(N, K + 8, seed=3)
    w = w_big[:, 4 : 4 + K]  # strided weight view
    x_big = _randn(20, K + 5, seed=4)
    x = x_big[:, :K]  # strided rows
    y = skinny_matmul(x, w, split_k=2, block_k=32, block_n=16)
    torch.testing.assert_close(y, skinny_matmul_ref(x, w), atol=GEMM_ATOL, rtol=GEMM_RTOL)
    assert torch.equal(skinny_matmul(x[17:18], w, split_k=2, block_k=32, block_n=16)[0], y[17])
    out = torch.empty(20, N)
    assert skinny_matmul(x, w, split_k=2, block_k=32, block_n=16, out=out) is out
    assert torch.equal(out, y)


def test_skinny_matmul_rejects_bad_shapes():
    with pytest.raises(ValueError):
        skinny_matmul(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError):
        skinny_matmul(torch.randn(2, 8), torch.randn(4, 8).double())


# ----------------------------------------------------------------------------- gdn
def _gdn_inputs(T, Hk=2, Hv=6, Dk=60, Dv=36, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, Hk, Dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(T, Hk, Dk, generator=gen), dim=-1)
    v = torch.randn(T, Hv, Dv, generator=gen)
    g = -torch.rand(T, Hv, generator=gen) * 2
    beta = torch.rand(T, Hv, generator=gen)
    s0 = torch.randn(Hv, Dk, Dv, generator=gen)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("block_v", [None, 16])
def test_gdn_matches_ref_with_per_row_states(block_v):
    T = 5
    q, k, v, g, beta, s0 = _gdn_inputs(T)
    scale = 60 ** -0.5
    s0_copy = s0.clone()
    o, sf, states = gdn_recurrent(q, k, v, g, beta, s0, scale=scale, return_states=True, block_v=block_v)
    o_r, sf_r, states_r = gdn_recurrent_ref(q, k, v, g, beta, s0, scale=scale, return_states=True)
    assert torch.equal(s0, s0_copy)  # state is read only by default
    torch.testing.assert_close(o, o_r, atol=GDN_ATOL, rtol=GDN_RTOL)
    torch.testing.assert_close(sf, sf_r, atol=GDN_ATOL, rtol=GDN_RTOL)
    torch.testing.assert_close(states, states_r, atol=GDN_ATOL, rtol=GDN_RTOL)
    assert torch.equal(states[-1], sf)


def test_gdn_rows_at_once_equal_single_steps_bitwise():
    T = 5
    q, k, v, g, beta, s0 = _gdn_inputs(T, seed=1)
    o, sf, states = gdn_recurrent(q, k, v, g, beta, s0, scale=0.125, return_states=True)
    for T2 in range(1, T):  # every prefix: same outputs and checkpoints
        o2, sf2, st2 = gdn_recurrent(q[:T2], k[:T2], v[:T2], g[:T2], beta[:T2], s0, scale=0.125, return_states=True)
        assert torch.equal(o2, o[:T2]) and torch.equal(st2, states[:T2]) and torch.equal(sf2, states[T2 - 1])
    S = s0.clone()
    for t in range(T):  # t decode steps, chaining the state in place
        sl = slice(t, t + 1)
        ot, S2, _ = gdn_recurrent(q[sl], k[sl], v[sl], g[sl], beta[sl], S, scale=0.125, final_state=S)
        assert S2 is S
        assert torch.equal(ot[0], o[t]) and torch.equal(S, states[t])
    # restoring a per-row checkpoint and resuming gives the same rows again (rollback)
    o3, _, _ = gdn_recurrent(q[2:], k[2:], v[2:], g[2:], beta[2:], states[1], scale=0.125)
    assert torch.equal(o3, o[2:])


def test_gdn_strided_views_and_out_buffers():
    # q|k|v packed per row like a projection output, heads read through views
    T, Hk, Hv, Dk, Dv = 3, 2, 4, 20, 24
    q, k, v, g, beta, s0 = _gdn_inputs(T, Hk, Hv, Dk, Dv, seed=2)
    packed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], 1)
    qv = packed[:, : Hk * Dk].view(T, Hk, Dk)
    kv = packed[:, Hk * Dk : 2 * Hk * Dk].view(T, Hk, Dk)
    vv = packed[:, 2 * Hk * Dk :].view(T, Hv, Dv)
    gb = torch.stack([g, beta], 2)  # [T, Hv, 2]: strided g and beta
    out = torch.empty(T, Hv, Dv)
    states = torch.empty(T, Hv, Dk, Dv)
    fs = torch.empty(Hv, Dk, Dv)
    o, sf, st = gdn_recurrent(qv, kv, vv, gb[..., 0], gb[..., 1], s0, scale=0.2, out=out, states=states, final_state=fs)
    assert o is out and sf is fs and st is states
    o_r, sf_r, st_r = gdn_recurrent_ref(q, k, v, g, beta, s0, scale=0.2, return_states=True)
    torch.testing.assert_close(o, o_r, atol=GDN_ATOL, rtol=GDN_RTOL)
    torch.testing.assert_close(st, st_r, atol=GDN_ATOL, rtol=GDN_RTOL)


def test_gdn_large_heads():
    T, Hk, Hv, Dk, Dv = 2, 1, 1, 256, 256
    q, k, v, g, beta, s0 = _gdn_inputs(T, Hk, Hv, Dk, Dv, seed=3)
    o, sf, _ = gdn_recurrent(q, k, v, g, beta, s0, scale=Dk ** -0.5)
    o_r, sf_r, _ = gdn_recurrent_ref(q, k, v, g, beta, s0, scale=Dk ** -0.5)
    torch.testing.assert_close(o, o_r, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(sf, sf_r, atol=GDN_ATOL, rtol=GDN_RTOL)
    with pytest.raises(ValueError):
        gdn_recurrent(*_gdn_inputs(1, 1, 1, 300, 8), scale=1.0)


# ----------------------------------------------------------------------------- conv
@pytest.mark.parametrize("W", [4, 2])
def test_conv_update_matches_ref_and_is_row_invariant(W):
    T, C = 5, 50
    x = _randn(T, C, seed=5)
    state = _randn(C, W - 1, seed=6)
    w = _randn(C, W, seed=7)
    y, ns = conv_update(x, state, w, block_c=32)
    y_r, ns_r = conv_update_ref(x, state, w)
    torch.testing.assert_close(y, y_r, atol=CONV_ATOL, rtol=CONV_RTOL)
    assert torch.equal(ns, ns_r)
    for T2 in range(1, T):
        y2, ns2 = conv_update(x[:T2], state, w, block_c=32)
        assert torch.equal(y2, y[:T2])
        assert torch.equal(ns2, conv_update_ref(x[:T2], state, w)[1])
    with pytest.raises(ValueError):
        conv_update(x, state, w, new_state=state)
