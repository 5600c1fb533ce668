"""hyspec.kernels.attention over a grid of odd head shapes (Triton interpreter on CPU):
attn_prep (norms, RoPE, KV write) and the split-key attn_decode vs the torch references,
and bitwise row invariance of both (a t-row call == t one-row calls at off = r).  The
grouped decode has its own grid (tests/test_kernels_attn.py); fp32 only, as there."""
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from kernel_grid import assert_rel, rnd  # noqa: E402

from hyspec.kernels.attention import (  # noqa: E402
    ATTN_SPLITS,
    INTERP_SPLITS,
    attn_decode,
    attn_decode_ref,
    attn_prep,
    attn_prep_ref,
    rope_inv_freq,
)

# (T, Hq, Hkv, D, rot, pos): rows sit at pos..pos+T-1, row r sees pos+r+1 keys
CASES = [
    (1, 1, 1, 4, 4, 0),  # one key, all splits but the first empty, full rotary
    (2, 3, 1, 12, 4, 31),  # REP 3, keys straddle the first 32-key block edge
    (3, 4, 2, 20, 8, 64),  # D not a power of two, partial rotary, three blocks
    (2, 6, 3, 40, 16, 290),  # 10 blocks: with 8 splits two walk two blocks, with 2 each walks five
]


@pytest.mark.parametrize("tile", [True, False])  # the combine's two forms (kernel.COMBINE_TILE)
@pytest.mark.parametrize("splits", [ATTN_SPLITS, INTERP_SPLITS, 3])  # the GPU's NS, the interpreter's, not a power of 2
@pytest.mark.parametrize("T,Hq,Hkv,D,rot,pos", CASES)
def test_attention_grid(T, Hq, Hkv, D, rot, pos, splits, tile, monkeypatch):
    from hyspec.kernels.attention import kernel

    monkeypatch.setattr(kernel, "COMBINE_TILE", tile)
    L = pos + T + 3
    proj = rnd(T, Hq * 2 * D + 2 * Hkv * D, seed=1)
    qw, kw = rnd(D, seed=2, scale=0.1), rnd(D, seed=3, scale=0.1)
    invf = rope_inv_freq(rot, 1e4, "cpu")
    kc0, vc0 = rnd(Hkv, L, D, seed=4), rnd(Hkv, L, D, seed=5)
    kc, vc, kr, vr = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
    posd = torch.tensor([pos])
    dims = dict(n_heads=Hq, n_kv=Hkv, head_dim=D, eps=1e-6)
    q = torch.empty(T, Hq, D)
    attn_prep(proj, qw, kw, invf, posd, 0, q, kc, vc, rows=T, **dims)
    qr = attn_prep_ref(proj, qw, kw, invf, pos, kr, vr, **dims)
    assert_rel("q", q, qr, 1e-5)
    assert_rel("k cache", kc, kr, 1e-5)
    assert torch.equal(vc, vr)
    o = torch.empty(T, Hq * D)
    BD = 1 << (D - 1).bit_length()
    per = T * Hq * (BD + 2)  # workspace floats per split
    ws = torch.full((per * ATTN_SPLITS,), float("nan"))
    attn_decode(q, kc, vc, posd, 0, proj, o, rows=T, splits=splits, ws=ws)
    # the partials of exactly `splits` splits were written (the rest of the workspace untouched)
    assert not ws[: per * splits].isnan().any() and ws[per * splits:].isnan().all()
    gate = proj[:, : Hq * 2 * D].view(T, Hq, 2 * D)[..., D:]
    assert_rel("attention", o, attn_decode_ref(q, kc, vc, pos, gate), 1e-5)
    kc1, vc1 = kc0.clone(), vc0.clone()
    for r in range(T):
        q1, o1 = torch.empty(1, Hq, D), torch.empty(1, Hq * D)
        attn_prep(proj[r: r + 1], qw, kw, invf, posd, r, q1, kc1, vc1, rows=1, **dims)
        assert torch.equal(q1[0], q[r])
        attn_decode(q1, kc, vc, posd, r, proj[r: r + 1], o1, rows=1, splits=splits)
        assert torch.equal(o1[0], o[r]), r
    assert torch.equal(kc1, kc) and torch.equal(vc1, vc)


def test_attention_prep_with_yarn_scaling():
    """attn_prep's ROPE_SCALE (YaRN's cos / sin scaling, rounded after the product) against
    the reference with the same scale; a scale of 1 leaves the unscaled kernel's bits."""
    T, Hq, Hkv, D, rot, pos = 3, 4, 2, 16, 8, 5
    proj = rnd(T, Hq * 2 * D + 2 * Hkv * D, seed=1)
    qw, kw = rnd(D, seed=2, scale=0.1), rnd(D, seed=3, scale=0.1)
    invf = rope_inv_freq(rot, 1e4, "cpu")
    dims = dict(n_heads=Hq, n_kv=Hkv, head_dim=D, eps=1e-6)
    outs = {}
    for scale in (1.0, 1.1386):
        kc, vc = torch.zeros(Hkv, pos + T, D), torch.zeros(Hkv, pos + T, D)
        kr, vr = kc.clone(), vc.clone()
        q = torch.empty(T, Hq, D)
        attn_prep(proj, qw, kw, invf, torch.tensor([pos]), 0, q, kc, vc, rows=T, rope_scale=scale, **dims)
        qr = attn_prep_ref(proj, qw, kw, invf, pos, kr, vr, rope_scale=scale, **dims)
        assert_rel("q", q, qr, 1e-5)
        assert_rel("k cache", kc, kr, 1e-5)
        outs[scale] = q
    assert not torch.allclose(outs[1.0], outs[1.1386])


@pytest.mark.parametrize("tile", [True, False])
def test_attention_combine_with_scores_far_from_zero(tile, monkeypatch):
    """Scores of hundreds (a row whose keys all score about -300, but the last split's
    -150): the combine's maximum must be the splits' own, over every split, for the
    exp(m - M) weights to stay finite and nonzero (a stand-in maximum of 0, or one that
    missed a split, gives NaN here, though it is a no-op for moderate scores)."""
    from hyspec.kernels.attention import kernel

    monkeypatch.setattr(kernel, "COMBINE_TILE", tile)
    Hq, Hkv, D, pos, splits = 2, 1, 16, 95, 3  # 96 keys: three blocks, one per split
    q = rnd(1, Hq, D, seed=1)
    u = q[0, 0] / q[0, 0].norm() ** 2 * D ** 0.5  # q[0, 0] . (c * u) * D**-0.5 == c
    c = torch.full((pos + 1,), -300.0)
    c[64:] = -150.0  # the last split's block
    c += rnd(pos + 1, seed=2)
    kc = (c[:, None] * u[None, :]).reshape(Hkv, pos + 1, D)
    vc = rnd(Hkv, pos + 1, D, seed=3)
    proj = rnd(1, Hq * 2 * D + 2 * Hkv * D, seed=4)
    o = torch.empty(1, Hq * D)
    attn_decode(q, kc, vc, torch.tensor([pos]), 0, proj, o, rows=1, splits=splits)
    gate = proj[:, : Hq * 2 * D].view(1, Hq, 2 * D)[..., D:]
    ref = attn_decode_ref(q, kc, vc, pos, gate)
    assert ref.isfinite().all()
    assert_rel("attention", o, ref, 1e-4)  # scores of 150: their rounding, amplified by exp
