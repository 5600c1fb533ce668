"""hyspec.kernels.moe.moe_grouped (router top-k on the device, pairs grouped by expert,
grouped gemms, slot-order combine) under the Triton interpreter: against the torch
reference for plain and block-FP8 experts (with a row map, as per-expert gate | up of
non-block sizes load), bitwise row invariance (each row alone, other rows changed), the
distinct-expert counter, and that experts no row is routed to are never read."""
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from kernel_grid import assert_rel, rnd  # noqa: E402

from hyspec.kernels.moe import MoeBuffers, moe_grouped, moe_grouped_ref  # noqa: E402
from hyspec.quant import Fp8Weight, quantize  # noqa: E402

T, H, E, K_TOP, INTER = 5, 32, 6, 2, 24


def experts(fp8: bool):
    gu, dn = rnd(E, 2 * INTER, H, seed=1, scale=H ** -0.5), rnd(E, H, INTER, seed=2, scale=INTER ** -0.5)
    if not fp8:
        return gu, dn
    block = (16, 16)
    # gate | up quantized separately and stacked (INTER = 24 is not a multiple of 16): a row map
    (qg, sg), (qu, su) = quantize(gu[:, :INTER], block), quantize(gu[:, INTER:], block)
    half = torch.arange(INTER) // 16
    rows = torch.cat([half, half + 2]).to(torch.int32)
    return (Fp8Weight(torch.cat([qg, qu], 1), torch.cat([sg, su], 1), block, rows),
            Fp8Weight(*quantize(dn, block), block))


def run(x, logits, gu, dn, shared=None, gate=None, stats=None, buf=None, fused=None):
    buf = buf or MoeBuffers(8, E + 1, K_TOP + 1, H, INTER, "cpu", torch.float32)
    out = torch.empty(x.shape[0], H)
    moe_grouped(x, logits, gu, dn, buf, out, top_k=K_TOP, renorm=True, shared=shared, shared_gate=gate, stats=stats,
                shared_experts=fused)
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_moe_grouped_matches_ref_and_is_row_invariant(fp8):
    gu, dn = experts(fp8)
    x, logits = rnd(T, H, seed=3), rnd(T, E, seed=4, scale=2.0)
    sh, g = rnd(T, H, seed=5), rnd(T, 1, seed=6)
    buf = MoeBuffers(8, E + 1, K_TOP + 1, H, INTER, "cpu", torch.float32)
    stats = torch.zeros(9, 2, dtype=torch.int64)
    y = run(x, logits, gu, dn, sh, g, stats, buf)
    assert_rel("moe", y, moe_grouped_ref(x, logits, gu, dn, top_k=K_TOP, renorm=True, shared=sh, shared_gate=g),
               1e-5)
    distinct = torch.topk(logits, K_TOP).indices.unique().numel()
    assert stats[T].tolist() == [distinct, 1] and int(buf.cnt.abs().sum()) == 0
    for r in range(T):  # row r alone: the same bits
        assert torch.equal(run(x[r: r + 1], logits[r: r + 1], gu, dn, sh[r: r + 1], g[r: r + 1], buf=buf)[0], y[r])
    # other rows (other experts, other tile mates) change nothing in row 0
    x2, l2 = x.clone(), logits.clone()
    x2[1:], l2[1:] = rnd(T - 1, H, seed=7), rnd(T - 1, E, seed=8, scale=2.0)
    assert torch.equal(run(x2, l2, gu, dn, sh, g, buf=buf)[0], y[0])


def test_moe_grouped_reads_only_the_routed_experts():
    gu, dn = experts(False)
    x = rnd(3, H, seed=9)
    logits = torch.full((3, E), -5.0)
    logits[:, 1], logits[0, 4], logits[1, 2], logits[2, 4] = 3.0, 2.0, 2.5, 1.0  # experts 1, 2, 4 only
    y = run(x, logits, gu, dn)
    gu2, dn2 = gu.clone(), dn.clone()
    for e in (0, 3, 5):  # never routed: poisoned weights must not reach the output
        gu2[e], dn2[e] = float("nan"), float("nan")
    assert torch.equal(run(x, logits, gu2, dn2), y)


def test_moe_grouped_shared_expert_fused_as_expert_e():
    """The shared expert run inside the grouped kernels (expert E, slot k, gate = logits[:, E])
    equals the reference and the unfused path's result up to rounding, row invariant."""
    gu, dn = experts(True)
    sgu, sdn = gu[0], dn[0]  # an fp8 expert laid out like the routed ones (same row map)
    gu2, dn2 = experts(True)
    x, logits = rnd(T, H, seed=10), rnd(T, E + 1, seed=11, scale=2.0)
    y = run(x, logits, gu2, dn2, fused=(sgu, sdn))
    want = moe_grouped_ref(x, logits, gu2, dn2, top_k=K_TOP, renorm=True, shared_experts=(sgu, sdn))
    assert_rel("moe fused shared", y, want, 1e-5)
    stats = torch.zeros(9, 2, dtype=torch.int64)
    buf = MoeBuffers(8, E + 1, K_TOP + 1, H, INTER, "cpu", torch.float32)
    for r in (0, T - 1):
        assert torch.equal(run(x[r: r + 1], logits[r: r + 1], gu2, dn2, fused=(sgu, sdn), stats=stats, buf=buf)[0],
                           y[r])
    # one-row calls: K_TOP distinct routed experts each (the fused shared expert not counted),
    # and the per-expert counts reset for the next call
    assert stats[1].tolist() == [2 * K_TOP, 2] and int(buf.cnt.abs().sum()) == 0


@pytest.mark.parametrize("fused", [False, True], ids=["routed", "shared-fused"])
def test_router_split_partials_change_no_bit(fused):
    """The router logits may come as split-K partials, which the route kernel sums in order
    and rounds (the reduce kernel's bits): the same output and distinct-expert count as the
    reduced logits."""
    from hyspec.kernels.common import SplitPartials

    gu, dn = experts(False)
    sh = (gu[0], dn[0]) if fused else None
    cols = E + 1 if fused else E
    x = rnd(T, H, seed=12)
    parts = torch.stack([rnd(T, cols, seed=13 + s, scale=2.0) for s in range(3)])  # [S, T, E (+1)]
    partials = SplitPartials(torch.cat([parts, torch.zeros(3, 2, cols)], 1), 3)  # workspace rows past T
    reduced = partials.value(T, torch.float32)
    results = []
    for lg in (reduced, partials):
        stats = torch.zeros(9, 2, dtype=torch.int64)
        results.append((run(x, lg, gu, dn, stats=stats, fused=sh), stats[T].tolist()))
    (y0, s0), (y1, s1) = results
    assert_rel("moe vs ref", y0, moe_grouped_ref(x, reduced, gu, dn, top_k=K_TOP, renorm=True,
                                                 shared_experts=sh), 1e-5)
    assert torch.equal(y1, y0) and s1 == s0
    assert torch.equal(run(x[1:2], SplitPartials(partials.ws[:, 1:], 3), gu, dn, fused=sh)[0], y0[1])


def test_moe_tuned_tiles_are_used_and_stay_exact(monkeypatch):
    """A tile picked by the in-step tuner (MOE_TUNED, keyed by shape only) reaches the
    expert matmuls, still matches the reference and keeps each row's bits when it runs
    alone; FP8 tiles that straddle a scale block are refused; the tuner's key names round
    trip and its candidate moves are valid tiles."""
    from hyspec.gpu.tune import _moe_candidates, moe_key_name, parse_moe_key
    from hyspec.kernels.moe import grouped

    monkeypatch.setattr(grouped, "MOE_TUNED", {})
    gu, dn = experts(False)
    x, logits = rnd(T, H, seed=20), rnd(T, E, seed=21, scale=2.0)
    before = run(x, logits, gu, dn)
    grouped.set_moe_tuned({(2 * INTER, H, False, None): dict(BN=16, BK=16, num_warps=2),
                           (H, INTER, True, None): dict(BN=16, BK=16, WT=False, num_stages=2)})
    assert grouped.gemm_config(2 * INTER, H, False, None)["BK"] == 16
    y = run(x, logits, gu, dn)
    assert_rel("moe tuned", y, moe_grouped_ref(x, logits, gu, dn, top_k=K_TOP, renorm=True), 1e-5)
    assert_rel("moe tuned vs default tile", y, before, 1e-5)
    assert torch.equal(run(x[2:3], logits[2:3], gu, dn)[0], y[2])
    grouped.set_moe_tuned({(64, 256, False, 128): dict(BK=256)})
    with pytest.raises(ValueError, match="FP8 block"):
        grouped.gemm_config(64, 256, False, 128)
    for key in (("moe", 1024, 2048, False, None), ("moe", 2048, 512, True, 128)):
        assert ("moe",) + parse_moe_key(moe_key_name(key)) == key
        cands = _moe_candidates(key, {})
        assert len(cands) > 5 and all(c["BK"] <= key[2] and (not key[4] or key[4] % c["BK"] == 0) for c in cands)


@pytest.mark.parametrize("fused", [False, True], ids=["routed", "shared-fused"])
def test_router_partials_are_rounded_like_the_reduce_kernel(fused):
    """bf16: the route kernel's sum of the router's split-K partials is rounded to bf16
    exactly as the skinny matmul's reduce kernel rounds it (two experts whose logits differ
    only below bf16's precision tie after rounding: the tie goes to the lower id), so the
    ids, weights and output equal those from the reduced logits bit for bit (a review's
    test: compared with the reduce kernel, not torch, whose bf16 cast the interpreter does
    not share)."""
    from hyspec.kernels.common import SplitPartials
    from hyspec.kernels.matmul.kernel import _kernels as mm_kernels

    t, inter = 3, 16
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5).bfloat16()
    dn = (torch.randn(E, H, inter, generator=g) * inter ** -0.5).bfloat16()
    x = torch.randn(t, H, generator=g).bfloat16()
    cols = E + fused
    base = torch.full((t, cols), -3.0)
    base[:, 1] = 1.0
    base[:, 4] = 1.0 + 2 ** -10  # equal to expert 1 once rounded to bf16
    if fused:
        base[:, E] = 0.3 + 2 ** -12
    p0 = base * 0.5
    ws = torch.cat([torch.stack([p0, base - p0, torch.zeros(t, cols)]), torch.zeros(3, 2, cols)], 1)
    reduced = torch.empty(t, cols, dtype=torch.bfloat16)
    mm_kernels()[1][(1, t)](ws, reduced, t, cols, 3, ws.stride(0), ws.stride(1), reduced.stride(0), 1, BLOCK=1024)
    sh = (gu[0], dn[0]) if fused else None
    res = []
    for lg in (reduced, SplitPartials(ws, 3)):
        buf = MoeBuffers(8, E + 1, K_TOP + 1, H, inter, "cpu", torch.bfloat16)
        out = torch.empty(t, H, dtype=torch.bfloat16)
        moe_grouped(x, lg, gu, dn, buf, out, top_k=K_TOP, renorm=True, shared_experts=sh)
        n = t * (K_TOP + fused)
        res.append((out.clone(), buf.ids[:n].clone(), buf.wts[:n].clone()))
    (o0, i0, w0), (o1, i1, w1) = res
    assert i0.view(t, -1)[:, 0].tolist() == [1] * t  # the tie went to the lower id: rounding happened
    assert torch.equal(i0, i1) and torch.equal(w0, w1) and torch.equal(o0, o1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["routed", "shared-fused"])
def test_deferred_combine_in_the_rmsnorm_changes_no_bit(fused, dtype):
    """moe_grouped(defer=True) leaves the slot combine to the next RMSNorm (MoePartials as
    its delta): the residual and normed rows are bitwise those of the combine kernel's
    output added by the norm, row by row, and MoePartials.value (torch) gives the combine's
    result (fp32 only: Triton's interpreter truncates fp32 -> bf16 where torch and the GPU
    round to nearest).  A slot weight read from the wrong pair fails it."""
    from hyspec.kernels.common import MoePartials
    from hyspec.kernels.rmsnorm import rmsnorm

    gu, dn = experts(False)
    gu, dn = gu.to(dtype), dn.to(dtype)
    sh = (gu[0], dn[0]) if fused else None
    x = rnd(T, H, seed=20).to(dtype)
    logits = rnd(T, E + 1 if fused else E, seed=21, scale=2.0).to(dtype)
    resid0, w = rnd(T, H, seed=22).to(dtype), rnd(H, seed=23, scale=0.1).to(dtype)
    buf = MoeBuffers(8, E + 1, K_TOP + 1, H, INTER, "cpu", dtype)
    kw = dict(top_k=K_TOP, renorm=True, shared_experts=sh)

    def norm(delta, rows, first=0):
        resid, out = resid0[first:first + rows].clone(), torch.empty(rows, H, dtype=dtype)
        rmsnorm(resid, w, 1e-6, out=out, delta=delta, resid_out=resid, rows=rows)
        return resid, out

    combined = moe_grouped(x, logits, gu, dn, buf, torch.empty(T, H, dtype=dtype), **kw)
    want = norm(combined, T)
    parts = moe_grouped(x, logits, gu, dn, buf, torch.full((T, H), float("nan"), dtype=dtype), defer=True, **kw)
    assert isinstance(parts, MoePartials) and parts.KS == K_TOP + fused
    if dtype == torch.float32:
        assert torch.equal(parts.value(T, dtype), combined)
    got = norm(parts, T)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # a planted bug: every row reads its first slot's weight for all its slots
    bad = MoePartials(parts.y, parts.wts[:T * parts.KS].view(T, -1)[:, :1].expand(T, parts.KS).reshape(-1).contiguous(),
                      parts.slot, parts.KS)
    assert not torch.equal(norm(bad, T)[0], want[0])
    one = norm(moe_grouped(x[2:3], logits[2:3], gu, dn, buf, torch.empty(1, H, dtype=dtype), defer=True, **kw), 1, 2)
    assert torch.equal(one[0][0], want[0][2]) and torch.equal(one[1][0], want[1][2])  # row 2 alone
    with pytest.raises(ValueError, match="defer"):
        moe_grouped(x, logits[:, :E], gu, dn, buf, torch.empty(T, H, dtype=dtype), top_k=K_TOP, renorm=True,
                    shared=x, shared_gate=logits[:, :1], defer=True)


def test_moe_fp8_tile_narrower_than_the_scale_block(monkeypatch):
    """FP8 experts whose tile steps K in 16s inside 32-wide scale blocks (BK < the block's K,
    as the shipped 80B down-projection tile: BK 64 in 128-wide blocks): each step takes the
    scale column of the block it lies in; the reference's values, row invariant.  Also: a
    stats tensor without row T is not written (its row T is past the caller's view)."""
    from hyspec.kernels.moe import grouped

    block = (16, 32)
    gu, dn = rnd(E, 2 * INTER, H, seed=30, scale=H ** -0.5), rnd(E, H, INTER, seed=31, scale=INTER ** -0.5)
    (qg, sg), (qu, su) = quantize(gu[:, :INTER], block), quantize(gu[:, INTER:], block)
    half = torch.arange(INTER) // 16
    gu8 = Fp8Weight(torch.cat([qg, qu], 1), torch.cat([sg, su], 1), block, torch.cat([half, half + 2]).to(torch.int32))
    dn8 = Fp8Weight(*quantize(dn, block), block)
    g = torch.Generator().manual_seed(32)  # scales that differ visibly from block to block
    gu8.scale, dn8.scale = gu8.scale * torch.rand(gu8.scale.shape, generator=g).add(0.5), \
        dn8.scale * torch.rand(dn8.scale.shape, generator=g).add(0.5)
    monkeypatch.setattr(grouped, "MOE_TUNED", {(2 * INTER, H, False, 32): dict(BK=16),
                                               (H, INTER, True, 32): dict(BK=16)})
    assert grouped.gemm_config(2 * INTER, H, False, 32)["BK"] == 16
    x, logits = rnd(T, H, seed=33), rnd(T, E, seed=34, scale=2.0)
    big = torch.zeros(T + 1, 2, dtype=torch.int64)
    y = run(x, logits, gu8, dn8, stats=big[:T])
    assert_rel("moe fp8 BK < block", y, moe_grouped_ref(x, logits, gu8, dn8, top_k=K_TOP, renorm=True), 1e-5)
    assert torch.equal(run(x[3:4], logits[3:4], gu8, dn8)[0], y[3])
    assert not big.any()
