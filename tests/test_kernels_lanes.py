"""The per-sequence kernels with a lane axis (several sequences in one launch) against
the same kernels launched once per sequence: bitwise equal, whatever the lanes' positions.

This is what makes the batched GPU decoder batch-invariant: a lane's numbers come from
the one-lane arithmetic, only the base pointers move.  fp32 under the Triton interpreter
(see test_kernels_triton.py for why).
"""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

from hyspec.kernels import fused
from hyspec.kernels.attn import attn_decode_grouped


def _r(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


B, T = 3, 2  # lanes, rows per lane


def test_attention_lanes_equal_single_lane_calls():
    Hq, Hkv, D, L = 4, 2, 16, 40
    proj_w = Hq * 2 * D + 2 * Hkv * D
    proj = _r(B * T, proj_w, seed=1)
    qw, kw = _r(D, seed=2) * 0.1, _r(D, seed=3) * 0.1
    inv = fused.rope_inv_freq(8, 10000.0, "cpu")
    kc0, vc0 = _r(B, Hkv, L, D, seed=4), _r(B, Hkv, L, D, seed=5)
    pos = torch.tensor([3, 17, 0], dtype=torch.long)
    for attn in (fused.attn_decode, attn_decode_grouped):
        # all lanes in one launch
        kc, vc = kc0.clone(), vc0.clone()
        q = torch.zeros(B * T, Hq, D)
        fused.attn_prep(proj, qw, kw, inv, pos, 0, q, kc[0], vc[0], n_heads=Hq, n_kv=Hkv, head_dim=D, eps=1e-6,
                        rows=B * T, lanes=B, kv_lane_stride=kc.stride(0))
        out = torch.zeros(B * T, Hq * D)
        attn(q, kc[0], vc[0], pos, 0, proj, out, rows=B * T, lanes=B, kv_lane_stride=kc.stride(0))
        # one lane at a time
        kc1, vc1 = kc0.clone(), vc0.clone()
        for b in range(B):
            rows = slice(b * T, b * T + T)
            q1 = torch.zeros(T, Hq, D)
            fused.attn_prep(proj[rows], qw, kw, inv, pos[b: b + 1], 0, q1, kc1[b], vc1[b], n_heads=Hq, n_kv=Hkv,
                            head_dim=D, eps=1e-6, rows=T)
            o1 = torch.zeros(T, Hq * D)
            attn(q1, kc1[b], vc1[b], pos[b: b + 1], 0, proj[rows], o1, rows=T)
            assert torch.equal(q[rows], q1)
            assert torch.equal(out[rows], o1), (attn.__name__, b)
        assert torch.equal(kc, kc1) and torch.equal(vc, vc1)
        # and against the torch reference for lane 1
        ref = fused.attn_decode_ref(q[T: 2 * T], kc[1], vc[1], int(pos[1]),
                                    proj[T: 2 * T, : Hq * 2 * D].reshape(T, Hq, 2 * D)[:, :, D:])
        torch.testing.assert_close(out[T: 2 * T], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("update", [True, False])
def test_gdn_conv_lanes(update):
    C, W = 40, 4
    x = _r(B * T, C + 8, seed=1)
    w = _r(C, W, seed=2)
    st0 = _r(B, W - 1, C, seed=3)
    st = st0.clone()
    y = torch.zeros(B * T, C)
    xin = torch.zeros(B, 5, C)
    fused.gdn_conv(x, st[0], w, y, rows=B * T, update=update, xin=None if update else xin[0], lanes=B,
                   state_lane_stride=st.stride(0), xin_lane_stride=xin.stride(0))
    for b in range(B):
        s1 = st0[b].clone()
        y1 = torch.zeros(T, C)
        xin1 = torch.zeros(5, C)
        fused.gdn_conv(x[b * T: b * T + T], s1, w, y1, rows=T, update=update, xin=None if update else xin1)
        assert torch.equal(y[b * T: b * T + T], y1)
        assert torch.equal(st[b], s1)
        if not update:
            assert torch.equal(xin[b], xin1)


@pytest.mark.parametrize("block_v", [None, 8])
def test_gdn_step_and_replay_lanes(block_v):
    nk, nv, dk, dv = 2, 4, 8, 16
    C = 2 * nk * dk + nv * dv
    P = C + nv * dv + 2 * nv
    y = _r(B * T, C, seed=1)
    proj = _r(B * T, P, seed=2)
    A, dtb, nw = _r(nv, seed=3) * 0.1, _r(nv, seed=4) * 0.1, _r(dv, seed=5) * 0.1
    S0 = _r(B, nv, dk, dv, seed=6) * 0.1
    kw = dict(nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6, block_v=block_v)
    S = S0.clone()
    out = torch.zeros(B * T, nv * dv)
    fused.gdn_step(y, proj, A, dtb, nw, S[0], out, rows=B * T, lanes=B, state_lane_stride=S.stride(0), **kw)
    for b in range(B):
        s1 = S0[b].clone()
        o1 = torch.zeros(T, nv * dv)
        fused.gdn_step(y[b * T: b * T + T], proj[b * T: b * T + T], A, dtb, nw, s1, o1, rows=T, **kw)
        assert torch.equal(out[b * T: b * T + T], o1)
        assert torch.equal(S[b], s1)
    # replay: every lane advances by its own n + 1 rows, as a decode of those rows would
    G = 2
    y_rows = _r(G, B, T, C, seed=7)
    p_rows = _r(G, B, T, P, seed=8)
    ssm = torch.stack([S0, S0 * 0.5]).contiguous()  # [G, B, nv, dk, dv]
    A_all, dtb_all = torch.stack([A, A * 2]), torch.stack([dtb, dtb])
    n = torch.tensor([1, 0, 1])
    fused.gdn_replay(y_rows, p_rows, A_all, dtb_all, nw, ssm, n, out, lanes=B, **kw)
    for g in range(G):
        for b in range(B):
            s1 = (S0[b] * (0.5 if g else 1.0)).clone()
            rows = int(n[b]) + 1
            fused.gdn_step(y_rows[g, b, :rows], p_rows[g, b, :rows], A_all[g], dtb_all[g], nw, s1,
                           torch.zeros(rows, nv * dv), rows=rows, **kw)
            assert torch.equal(ssm[g, b], s1), (g, b)


def test_skinny_matmul_64_row_tiles_row_invariant():
    """The batched decoder's matmul tile (64 rows per program): row r is the same bits in a
    70-row call, a 3-row call and alone, and matches the reference."""
    from hyspec.kernels.gemm import skinny_matmul, skinny_matmul_ref

    w = _r(48, 96, seed=1)
    x = _r(70, 96, seed=2)
    kw = dict(block_t=64, split_k=2, block_n=16, block_k=32)
    y = skinny_matmul(x, w, **kw)
    torch.testing.assert_close(y, skinny_matmul_ref(x, w), atol=1e-4, rtol=1e-5)
    assert torch.equal(skinny_matmul(x[65:68], w, **kw), y[65:68])
    assert torch.equal(skinny_matmul(x[3:4], w, **kw)[0], y[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_window_commit_equals_the_torch_form(dtype, t):
    """gdn_window_commit (one launch: every layer and lane) leaves each lane's conv window
    bitwise as gdn_window_commit_ref does, for every kept-row count 1..t, with lanes past
    nb and the other slots' windows untouched."""
    from hyspec.kernels.gdn import gdn_window_commit, gdn_window_commit_ref

    G, S, W1, C, nb = 2, 5, 3, 300, 4  # C: not a multiple of the 256-channel block
    conv = _r(G, S, W1, C, seed=1).to(dtype)
    conv_in = _r(G, S * 4, C, seed=2).to(dtype)
    j = torch.tensor([(b % t) + 1 for b in range(nb)])  # 1..t kept rows per lane
    want = gdn_window_commit_ref(conv.clone(), conv_in, j, nb, t)
    got = gdn_window_commit(conv.clone(), conv_in, j, nb, t)
    assert torch.equal(got, want)
    assert torch.equal(got[:, nb:], conv[:, nb:])  # lanes past nb: as they were


@pytest.mark.parametrize("D,L", [(16, 40), (16, 37), (24, 40), (20, 37)])  # D == BLOCK_D or not; lane stride
# (Hkv * L * D: 1280, 1184, 1920, 1480) % 16 or not
def test_grouped_attention_launch_ways_agree_with_the_reference(D, L):
    """Every way of compiling the grouped kernel (grouped.LAUNCH: vector loads with D and the
    lane stride known to the compiler, V's load moved up) reads the same elements: each
    lane's output equals the one-lane reference, and every way's equals the old scalar way's."""
    from hyspec.kernels.attention import grouped
    from hyspec.kernels.attention.reference import attn_decode_ref

    Hq, Hkv = 4, 2
    kc0, vc0 = _r(B, Hkv, L, D, seed=6), _r(B, Hkv, L, D, seed=7)
    q = _r(B * T, Hq, D, seed=8)
    proj = _r(B * T, Hq * 2 * D + 2 * Hkv * D, seed=9)
    pos = torch.tensor([3, 17, L - T - 1], dtype=torch.long)
    saved = dict(grouped.LAUNCH)
    outs = []
    try:
        for opts in ({"vector_loads": False, "early_v": False}, {"vector_loads": True, "early_v": False},
                     {"vector_loads": True, "early_v": True}):
            grouped.LAUNCH.update(opts)
            out = torch.zeros(B * T, Hq * D)
            attn_decode_grouped(q, kc0[0], vc0[0], pos, 0, proj, out, rows=B * T, lanes=B,
                                kv_lane_stride=kc0.stride(0))
            outs.append(out)
    finally:
        grouped.LAUNCH.clear()
        grouped.LAUNCH.update(saved)
    for b in range(B):
        rows = slice(b * T, (b + 1) * T)
        gate = proj[rows, : Hq * 2 * D].reshape(T, Hq, 2 * D)[:, :, D:]
        ref = attn_decode_ref(q[rows], kc0[b], vc0[b], int(pos[b]), gate)
        torch.testing.assert_close(outs[-1][rows], ref, atol=1e-5, rtol=1e-5)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
