"""hyspec.kernels.probs (the sampled path's row softmax and inverse CDF) against their
torch references, and row invariance: a row's output is bitwise the same alone and in
batches of any size. Triton runs in the CPU interpreter here and on the GPU where CUDA is
available (then these tests check the compiled kernels)."""
from __future__ import annotations

import math

import pytest
import torch

from hyspec.kernels.common import triton_available
from kernel_grid import kernel_device, mass_edge_rows

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

RTOL = 1e-13  # kernel vs torch softmax, per kept entry: the sums run in another order (a few ulps)
Vk = 2 * 1024 + 452  # three chunks, the last one partial



def _cases(B: int, V: int = Vk, seed: int = 0, dtype=torch.float32):
    """(x [B, V], temperature [B], keep [B, V], only [B], floor [B], top [B]) with -inf
    entries, whole masked chunks, rows kept down to one token, greedy rows, min-p rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g, dtype=torch.float64) * 3
    x[0::4, ::3] = -math.inf  # forbidden tokens
    x[1::4, : 2 * 1024] = -math.inf  # the first two chunks without a finite entry
    x[2::5] = torch.round(x[2::5])  # ties
    x = x.to(dtype)
    temperature = torch.tensor([[0.3, 0.8, 1.0, 1.7, 1e-3][b % 5] for b in range(B)], dtype=torch.float64)
    keep = torch.rand(B, V, generator=g) < 0.8
    top = x.argmax(1)
    keep[:, :] |= torch.arange(V) == top[:, None]  # (the top token is kept, as in probs_batch)
    keep[3::4] = False
    keep[3::4, V - 1] = True  # one kept token (the top one), in the partial chunk
    x[3::4, V - 1] = 30.0
    top = x.argmax(1)
    only = torch.where(torch.arange(B) % 3 == 2, top, -1)  # greedy rows
    floor = torch.where(torch.arange(B) % 2 == 1, torch.tensor(math.log(0.05), dtype=torch.float64), -math.inf)
    return x, temperature, keep, only, floor, top


def _assert_close(got, want):
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert torch.equal(got == 0, want == 0)  # the same kept tokens, exactly
    # (relative, plus an absolute 1e-300 for subnormal probabilities, which have fewer bits)
    assert bool(((got - want).abs() <= RTOL * want + 1e-300).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_softmax_rows_equals_torch(dtype) -> None:
    from hyspec.kernels.probs import softmax_rows, softmax_rows_ref
    from hyspec.kernels.probs.reference import MASS_SCALE
    from hyspec.sampling import MASS_ONE, fixed_mass

    assert MASS_SCALE == float(MASS_ONE)
    dev = kernel_device()
    B = 12
    x, t, keep, only, floor, top = (a.to(dev) for a in _cases(B, dtype=dtype))
    for kw in ({}, {"keep": keep}, {"keep": keep, "only": only}, {"keep": keep, "floor": floor, "top": top},
               {"only": only, "floor": floor, "top": top}):
        got = softmax_rows(x, t, **kw)
        want = softmax_rows_ref(x, t, **kw)
        _assert_close(got, want)
        assert float((got.sum(1) - 1).abs().max()) < 1e-12
        mass = softmax_rows(x, t, mass=True, **kw)  # the same probabilities, as fixed-point masses
        assert mass.dtype == torch.int64 and torch.equal(mass, fixed_mass(got))
        if "only" in kw:  # greedy rows: exactly one-hot at the top token
            g = only >= 0
            assert torch.equal(got[g], torch.zeros_like(got[g]).scatter_(1, top[g, None], 1.0))
    # a row kept down to one token is exactly one-hot
    got = softmax_rows(x, t, keep)
    assert torch.equal(got[3::4, -1], torch.ones_like(got[3::4, -1]))
    # only_if (flags, with top): the same rows as only = where(flags, top, -1)
    flags = torch.arange(B, device=dev) % 3 == 0
    for kw in ({"keep": keep}, {"keep": keep, "floor": floor}):
        want = softmax_rows(x, t, only=torch.where(flags, top, -1), top=top, **kw)
        assert torch.equal(softmax_rows(x, t, only_if=flags, top=top, **kw), want)
        assert not torch.equal(softmax_rows(x, t, only_if=~flags, top=top, **kw), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_softmax_rows_with_best_is_torchs_argmax(dtype) -> None:
    """softmax_rows(with_best=True): the same probabilities or masses, and best == torch's
    x.argmax(-1) (ties across chunks to the lowest id, a row's first NaN, all -inf rows),
    whatever is kept."""
    from hyspec.kernels.probs import softmax_rows

    dev = kernel_device()
    B = 12
    x, t, keep, only, floor, top = _cases(B, dtype=dtype)
    x[5, 100] = x[5, 1500] = x[5, 2200] = 50.0  # the max in three chunks: the first wins
    x[6] = -math.inf  # no finite entry: torch says 0
    x[7, 1800] = math.nan  # NaN: the first NaN, as torch's argmax
    x[7, 2300] = math.nan
    x[8, :] = 1.0  # all equal: 0
    x, t, keep, floor, top = (a.to(dev) for a in (x, t, keep, floor, top))
    want = x.argmax(-1)
    assert [int(want[b]) for b in (5, 6, 7, 8)] == [100, 0, 1800, 0]
    for kw in ({}, {"keep": keep}, {"keep": keep, "mass": True}):
        p, best = softmax_rows(x, t, with_best=True, **kw)
        assert best.dtype == torch.int64 and torch.equal(best, want), kw
        ok = torch.arange(B, device=dev) != 7  # (the NaN row's probabilities are NaN)
        assert torch.equal(p[ok], softmax_rows(x, t, **kw)[ok])



def test_softmax_rows_strided_rows_token_zero_and_floor_edge() -> None:
    """Rows read through their strides (x and keep as views of wider rows: a verify row
    logits[:, j] reaches the kernel so), a greedy row whose token is 0 (only = 0 and
    only_if with top = 0: exactly one-hot there), and min-p's floor met with equality
    (x / t - top == floor keeps the token, as the reference's >=)."""
    from hyspec.kernels.probs import softmax_rows, softmax_rows_ref

    dev = kernel_device()
    B = 6
    x, t, keep, _, floor, top = _cases(B, seed=11)
    wide = torch.full((B, Vk + 37), 7.0)
    wide[:, :Vk] = x
    kwide = torch.zeros(B, Vk + 37, dtype=torch.bool)
    kwide[:, :Vk] = keep
    # (the views made on the device: .to(device) of a strided view is a contiguous copy)
    xs, ks = wide.to(dev)[:, :Vk], kwide.to(dev)[:, :Vk]  # row stride Vk + 37
    assert xs.stride(0) != Vk and ks.stride(0) != Vk
    t, floor, top = (a.to(dev) for a in (t, floor, top))
    for kw in ({}, {"floor": floor, "top": top}):
        got = softmax_rows(xs, t, ks, **kw)
        _assert_close(got, softmax_rows_ref(xs.contiguous(), t, ks.contiguous(), **kw))
        assert torch.equal(got, softmax_rows(xs.contiguous(), t, ks.contiguous(), **kw))
    # x and keep of different row strides (a verify row logits[:, j] beside a [B, V] keep): each
    # read through its own stride
    for xa, ka in ((xs, keep.to(dev)), (x.to(dev), ks)):
        assert xa.stride(0) != ka.stride(0)
        _assert_close(softmax_rows(xa, t, ka), softmax_rows_ref(xa.contiguous(), t, ka.contiguous()))
    # greedy rows at token 0
    y = x.clone()
    y[:, 0] = 40.0  # every row's top token is token 0
    y, top0 = y.to(dev), torch.zeros(B, dtype=torch.int64, device=dev)
    one_hot = torch.zeros(B, Vk, dtype=torch.float64, device=dev)
    one_hot[:, 0] = 1.0
    g = torch.arange(B, device=dev) % 2 == 0
    only0 = torch.where(g, 0, -1)
    got = softmax_rows(y, t, only=only0)
    assert torch.equal(got[g], one_hot[g]) and bool((got[~g, 1:] > 0).any())
    got = softmax_rows(y, t, only_if=g, top=top0)
    assert torch.equal(got[g], one_hot[g]) and bool((got[~g, 1:] > 0).any())
    # the floor met exactly: tokens at top - 1 kept, tokens below dropped (temperature 1)
    z = torch.full((2, Vk), -3.0)
    z[:, 5] = 2.0  # the top
    z[:, 1500:1510] = 1.0  # exactly floor = -1 below it
    z[:, 2400] = 1.0 - 2.0**-20  # just under
    z = z.to(dev)
    one = torch.ones(2, dtype=torch.float64, device=dev)
    fl = torch.full((2,), -1.0, dtype=torch.float64, device=dev)
    tp = torch.full((2,), 5, dtype=torch.int64, device=dev)
    got = softmax_rows(z, one, floor=fl, top=tp)
    assert torch.equal((got > 0).nonzero()[:, 1].unique().cpu(), torch.tensor([5] + list(range(1500, 1510))))
    _assert_close(got, softmax_rows_ref(z, one, floor=fl, top=tp))


def test_softmax_rows_rejects_floor_or_only_if_without_top() -> None:
    """min-p's floor and only_if name each row's top token: without top (or only_if with
    only as well) the call is refused before any launch."""
    from hyspec.kernels.probs import softmax_rows

    x = torch.zeros(2, 8)
    t = torch.ones(2, dtype=torch.float64)
    flags = torch.tensor([True, False])
    with pytest.raises(ValueError, match="floor needs top"):
        softmax_rows(x, t, floor=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="only_if needs top and no only"):
        softmax_rows(x, t, only_if=flags)
    with pytest.raises(ValueError, match="only_if needs top and no only"):
        softmax_rows(x, t, only=torch.zeros(2, dtype=torch.int64), only_if=flags, top=torch.zeros(2, dtype=torch.int64))

def test_inverse_cdf_rows_equals_torch() -> None:
    """Tokens == the torch two-level inverse CDF (and the sequential scan) for rows with
    zeros, zero-mass chunks, the mass in the partial last chunk, no mass (token 0),
    targets past the end (the last positive token), dyadic masses with targets exactly on
    a step, strided rows."""
    from hyspec.gpu.sampling import sample_rows
    from hyspec.kernels.probs import CHUNK, inverse_cdf_rows, inverse_cdf_rows_ref

    dev = kernel_device()
    gen = torch.Generator().manual_seed(3)
    Vc = 5 * CHUNK - 37
    p = mass_edge_rows(Vc, CHUNK, gen)
    reps = 40
    rows = p.repeat(reps, 1)  # [6 * reps, V]: each row with many uniforms
    u = torch.rand(rows.shape[0], generator=gen, dtype=torch.float64).clamp(min=2.0**-54)
    u[:6] = 1 - 2.0**-53  # u * total at or past the end
    u[6:12] = 2.0**-54
    got = inverse_cdf_rows(rows.to(dev), u.to(dev)).cpu()
    assert torch.equal(got, inverse_cdf_rows_ref(rows, u))
    assert torch.equal(got, sample_rows(rows, u, chunked=False))
    ok = rows.gather(1, got[:, None])[:, 0] > 0
    assert bool(ok[rows.sum(1) > 0].all()) and bool((got[3::6] == 0).all())
    # dyadic masses in different chunks, targets exactly on a step: the next token, as the scan's
    q = torch.zeros(4, Vc, dtype=torch.float64)
    q[:, [3, CHUNK + 9, 2 * CHUNK, Vc - 1]] = 0.25
    uq = torch.tensor([0.25, 0.5, 0.75, 0.125], dtype=torch.float64)
    assert torch.equal(inverse_cdf_rows(q.to(dev), uq.to(dev)).cpu(), sample_rows(q, uq, chunked=False))
    # strided rows (a [B, 2, V] view), as speculative_accept passes p[:, r]
    pr = torch.stack([p, p.flip(1)], 1).to(dev)  # [6, 2, V]
    for r in range(2):
        want = inverse_cdf_rows_ref(pr[:, r].cpu(), u[:6])
        assert torch.equal(inverse_cdf_rows(pr[:, r], u[:6].to(dev)).cpu(), want)



def test_inverse_cdf_rows_past_the_end() -> None:
    """u * total at the total (u = 1, the bound of the rounding the contract allows for):
    the last token with mass of the row, wherever it lies (chunks without mass after it);
    for a residual row, the residual's last token with mass (not p's); rows read through
    a [B, R, V] view whose rows are wider than V."""
    from hyspec.kernels.probs import CHUNK, inverse_cdf_rows, inverse_cdf_rows_ref

    dev = kernel_device()
    V = 3 * CHUNK - 300
    p = torch.zeros(4, V, dtype=torch.float64)
    p[0, 5:10] = 0.2  # chunk 0 alone: token 9
    p[1, [3, CHUNK + 17]] = 0.5  # the middle chunk's token last: CHUNK + 17
    p[2, [7, V - 1]] = 0.5  # the partial last chunk: V - 1
    p[3, 2 * CHUNK + 1] = 1.0
    one = torch.ones(4, dtype=torch.float64)
    want = torch.tensor([9, CHUNK + 17, V - 1, 2 * CHUNK + 1])
    assert torch.equal(inverse_cdf_rows_ref(p, one), want)
    assert torch.equal(inverse_cdf_rows(p.to(dev), one.to(dev)).cpu(), want)
    # residual rows: max(p - q, 0) has its last token with mass before p's
    q = p.clone()
    q[:, :CHUNK // 2] = 0.0  # the residual: p's mass in the first half chunk
    resid = torch.tensor([True, True, True, False])
    want_r = torch.tensor([9, 3, 7, 2 * CHUNK + 1])
    assert torch.equal(inverse_cdf_rows_ref(p, one, q=q, resid=resid), want_r)
    got = inverse_cdf_rows(p.to(dev), one.to(dev), q=q.to(dev), resid=resid.to(dev)).cpu()
    assert torch.equal(got, want_r)
    # [B, R, V] views of wider rows (stride(1) != V), with row / q_row picks
    wide = torch.zeros(4, 2, V + 40, dtype=torch.float64)
    wide[:, 1, :V] = p
    wq = torch.zeros(4, 3, V + 40, dtype=torch.float64)
    wq[:, 2, :V] = q
    u = torch.tensor([0.3, 0.7, 0.99, 0.5], dtype=torch.float64)
    row, q_row = torch.ones(4, dtype=torch.int64), torch.full((4,), 2, dtype=torch.int64)
    for uu in (u, one):
        want = inverse_cdf_rows_ref(p, uu, q=q, resid=resid)
        got = inverse_cdf_rows(wide[..., :V].to(dev), uu.to(dev), row.to(dev), wq[..., :V].to(dev), q_row.to(dev),
                               resid.to(dev)).cpu()
        assert torch.equal(got, want)

def test_inverse_cdf_rows_targets_on_chunk_boundaries() -> None:
    """Targets on and a few floats around every step of the running mass (the boundaries
    between chunks and inside them), over 8 chunks whose totals are exact (two tokens of
    equal mass each, mid-chunk) but whose running sums round: the total and the mass
    before the chosen chunk are the running sums in chunk order, as the reference's cumsum
    (another order of the same adds, e.g. a tree sum, may round to a neighbouring float and
    move the token across a step: to the next token, or to a token without mass)."""
    from hyspec.kernels.probs import CHUNK, inverse_cdf_rows, inverse_cdf_rows_ref

    dev = kernel_device()
    C, R = 8, 4
    V = C * CHUNK - 100
    g = torch.Generator().manual_seed(26)
    first = torch.arange(C) * CHUNK + 100 + torch.randint(0, 300, (C,), generator=g)  # two tokens a chunk
    second = first + 200 + torch.randint(0, 300, (C,), generator=g)
    m = torch.rand(R, C, generator=g, dtype=torch.float64) + 0.1
    p = torch.zeros(R, V, dtype=torch.float64)
    p[:, first], p[:, second] = m, m  # chunk totals 2 m: exact
    ends = (2 * m).cumsum(1)  # [R, C] the running mass at each chunk's end
    t = 2 * m  # (the data tells the orders apart: a tree sum of the chunk totals rounds otherwise)
    assert bool(((((t[:, 0] + t[:, 1]) + (t[:, 2] + t[:, 3])) + ((t[:, 4] + t[:, 5]) + (t[:, 6] + t[:, 7])))
                 != ends[:, -1]).any())
    steps = torch.cat([ends[:, :-1], ends - m], 1)  # ... and at each chunk's first token
    u = [steps / ends[:, -1:]]
    for d in (1.0, -1.0):  # and 1, 2 floats above and below each step
        v = u[0]
        for _ in range(2):
            v = torch.nextafter(v, torch.full_like(v, d))
            u.append(v)
    u = torch.stack(u, 2).reshape(R, -1)  # [R, (2C - 1) * 5]
    rows = p.repeat_interleave(u.shape[1], 0)
    u = u.reshape(-1)
    want = inverse_cdf_rows_ref(rows, u)
    assert set(want.tolist()) == set(first.tolist() + second.tolist())  # (both sides of every step)
    got = inverse_cdf_rows(rows.to(dev), u.to(dev)).cpu()
    # every pick has mass (on an H100 the kernel's target - before, fused with u * total into
    # one fma, went below the chunk's mass before it: the chunk's first, massless, token came out)
    assert bool((rows.gather(1, got.unsqueeze(1)) > 0).all())
    if dev.type == "cpu":  # the interpreter adds in the reference's order: the same tokens
        assert torch.equal(got, want)
    else:  # a GPU's scan adds the chunk totals in its own order: at most one step away
        massive = torch.sort(torch.cat([first, second])).values
        step = (torch.searchsorted(massive, got) - torch.searchsorted(massive, want)).abs()
        assert int(step.max()) <= 1


def _residual_case(B: int, R: int = 3, seed: int = 4):
    """(p [B, R, V], q [B, R - 1, V], row [B], q_row [B], resid [B]): rows whose residual
    has mass (some only in the partial last chunk), rows where q covers p (no residual
    mass: p itself), rows that are not residual rows."""
    from hyspec.kernels.probs import CHUNK

    g = torch.Generator().manual_seed(seed)
    V = 3 * CHUNK - 300
    p = torch.softmax(torch.randn(B, R, V, generator=g, dtype=torch.float64) * 2, -1)
    p[:, :, 1::4] = 0.0
    q = torch.softmax(torch.randn(B, R - 1, V, generator=g, dtype=torch.float64) * 2, -1)
    row = torch.randint(0, R, (B,), generator=g)
    q_row = row.clamp(max=R - 2)
    resid = torch.rand(B, generator=g) < 0.7
    for b in range(0, B, 4):  # q == p at the row: no residual mass
        q[b, q_row[b]] = p[b, row[b]]
    for b in range(1, B, 4):  # the residual's mass in the last chunk only
        q[b, q_row[b]] = p[b, row[b]]
        q[b, q_row[b], -5:] = 0.0
    return p, q, row, q_row, resid


def test_inverse_cdf_residual_equals_torch() -> None:
    """The residual form (speculative sampling's recovered token: rows n of p and q read
    in place) == its torch reference (the gathers, max(p - q, 0), the mass test)."""
    from hyspec.kernels.probs import inverse_cdf_rows, inverse_cdf_rows_ref

    dev = kernel_device()
    B = 64
    p, q, row, q_row, resid = _residual_case(B)
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        u = torch.rand(B, generator=g, dtype=torch.float64)
        want = inverse_cdf_rows_ref(p, u, row, q, q_row, resid)
        got = inverse_cdf_rows(*(a.to(dev) for a in (p, u, row, q, q_row, resid))).cpu()
        assert torch.equal(got, want)
        assert torch.equal(inverse_cdf_rows(p.to(dev), u.to(dev), row.to(dev)).cpu(), inverse_cdf_rows_ref(p, u, row))
    pn = p[torch.arange(B), row]
    res = (pn - q[torch.arange(B), q_row]).clamp(min=0)
    assert bool((res[1::4, -5:] > 0).any()) and not bool((res[0::4] > 0).any())


def _alone_and_in_batches(fn, B: int):
    """fn(rows [n] index tensor) -> [n, ...] outputs; asserts row r's output is bitwise the
    same in the B-row call, alone, and in a 3-row batch."""
    full = fn(torch.arange(B))
    for r in range(B):
        assert torch.equal(fn(torch.tensor([r]))[0], full[r]), ("alone", r)
        at = r % 3  # its place in the batch
        idx = [(r + 5) % B, (r + 11) % B]
        idx.insert(at, r)
        assert torch.equal(fn(torch.tensor(idx))[at], full[r]), ("batch of 3", r, at)


def test_row_kernels_are_row_invariant() -> None:
    """Row r of a 16-row call == row r alone == row r inside 3-row batches, bitwise: the
    softmax (probabilities and masses, with every option) and the inverse CDF (plain and
    residual)."""
    from hyspec.kernels.probs import inverse_cdf_rows, softmax_rows

    dev = kernel_device()
    B = 16
    x, t, keep, only, floor, top = (a.to(dev) for a in _cases(B, seed=5))
    _alone_and_in_batches(lambda i: softmax_rows(x[i], t[i], keep[i]), B)
    _alone_and_in_batches(lambda i: softmax_rows(x[i], t[i], keep[i], only[i], floor[i], top[i]), B)
    _alone_and_in_batches(lambda i: softmax_rows(x[i], t[i], None, only[i], mass=True), B)
    p = softmax_rows(x, t, keep)
    u = torch.rand(B, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dev)
    _alone_and_in_batches(lambda i: inverse_cdf_rows(p[i], u[i]), B)
    p3, q3, row, q_row, resid = (a.to(dev) for a in _residual_case(B))
    _alone_and_in_batches(lambda i: inverse_cdf_rows(p3[i], u[i], row[i], q3[i], q_row[i], resid[i]), B)


def test_sampling_on_the_kernels_is_row_invariant() -> None:
    """hyspec.gpu.sampling with kernel=True (what the BatchDecoder runs): probabilities
    (penalties, top-k, top-p, min-p, greedy and sampled lanes), plain tokens and a
    speculative round's (n, next token) of a lane are bitwise the same alone and in a
    batch; and they match the torch path (tokens equal, probabilities to RTOL)."""
    from hyspec.gpu.penalties import PenaltyWindow
    from hyspec.gpu.sampling import SamplingTable, plain_tokens, probs_batch, speculative_accept
    from hyspec.sampling import SamplingParams

    dev = kernel_device()
    V = 3000
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=1, mode="coupled"),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_k=50, seed=2),
              SamplingParams(temperature=0.7, min_p=0.02, top_p=0.9, seed=3, presence_penalty=0.5, penalty_last_n=8),
              SamplingParams(temperature=1.0, seed=4, mode="coupled", top_k=7, repetition_penalty=1.3),
              SamplingParams(temperature=0.9, seed=5)]
    B, K = len(params), 2
    g = torch.Generator().manual_seed(8)
    table = SamplingTable(B, dev)
    window = PenaltyWindow(B, V, capacity=64, device=dev)
    for b, prm in enumerate(params):
        table.set(b, prm)
        window.load(b, torch.randint(0, V, (6,), generator=g).tolist(), prm)
    logits = (torch.randn(B, K + 1, V, generator=g) * 4).to(dev)  # float32, as the decoder's
    q_logits = logits[:, :K] + (torch.randn(B, K, V, generator=g) * 0.5).to(dev)
    pos = torch.arange(B, device=dev) * 7 + 30
    drafts = logits[:, :K].argmax(2)

    def round_of(i, kernel):
        tb = table.view(lambda f: f[i], len(i))
        counts = window.counts[i]
        p = torch.stack([probs_batch(logits[i, r].contiguous(), tb, counts, kernel=kernel) for r in range(K + 1)], 1)
        q = torch.stack([probs_batch(q_logits[i, r].contiguous(), tb, counts, kernel=kernel) for r in range(K)], 1)
        n, nxt = speculative_accept(p, q, drafts[i], tb, pos[i], torch.full((len(i),), K, device=dev),
                                    kernel=kernel)
        plain = plain_tokens(p[:, 0], tb, pos[i], kernel=kernel)
        return p, torch.stack([n, nxt, plain], 1)

    full_p, full_tok = round_of(torch.arange(B), True)
    for r in range(B):
        p1, tok1 = round_of(torch.tensor([r]), True)
        assert torch.equal(p1[0], full_p[r]) and torch.equal(tok1[0], full_tok[r]), r
    if dev.type == "cpu":  # the torch path (the reference) on the same rows
        ref_p, ref_tok = round_of(torch.arange(B), False)
        _assert_close(full_p, ref_p)
        assert torch.equal(full_tok, ref_tok)
