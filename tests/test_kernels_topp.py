"""hyspec.kernels.probs.topp (the top-k / top-p cut as Triton kernels) against the torch
prefix_select, bitwise (integer math), and row invariance; probs_batch with it against
probs_batch without it. Interpreter on the CPU; compiled kernels where CUDA is available."""
from __future__ import annotations

import math

import pytest
import torch

from hyspec.kernels.common import triton_available
from hyspec.kernels.pdl import interpreting
from kernel_grid import kernel_device

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

V = 2 * 1024 + 333  # three chunks, the last one partial



def _logits(B: int, dtype, seed: int = 0) -> torch.Tensor:
    """[B, V]: row kinds by b % 4: plain, -inf tokens, few distinct values (ties across
    chunks), everything but a handful of tokens -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g, dtype=torch.float64) * 3
    x[1::4, ::3] = -math.inf
    x[1::4, 1024:2048] = -math.inf  # a chunk without a valid token
    x[2::4] = torch.round(x[2::4] / 2)  # ~10 distinct values: big ties spanning chunks
    x[3::4] = -math.inf
    x[3::4, 5::700] = 1.0  # four equal valid tokens
    return x.to(dtype)


def _case(B: int, dtype, topp: bool, seed: int = 0):
    """(key, bits, valid, weight, threshold [B, 1]) with thresholds by b % 5: 1, within a
    tie at the key of the row's 40th-ranked token, beyond the total, 0, the total."""
    from hyspec.gpu.sampling import order_key
    from hyspec.sampling import fixed_mass

    x = _logits(B, dtype, seed)
    valid = x > -math.inf
    key, bits = order_key(x)
    if topp:
        weight = fixed_mass(torch.softmax(x.to(torch.float64) / 0.8, dim=1))
    else:
        weight = valid.to(torch.int64)
    total = weight.sum(1)
    k40 = key.to(torch.int64).sort(1, descending=True).values[:, 39:40]  # [B, 1]
    above = torch.where(key.to(torch.int64) > k40, weight, 0).sum(1)
    at = torch.where(key.to(torch.int64) == k40, weight, 0).sum(1)
    thr = torch.stack([torch.ones_like(total), above + at // 2 + 1, total + 5, torch.zeros_like(total), total], 1)
    threshold = thr.gather(1, (torch.arange(B) % 5).unsqueeze(1))  # [B, 1]
    dev = kernel_device()
    return key.to(dev), bits, valid.to(dev), weight.to(dev), threshold.to(dev)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("topp", [False, True], ids=["topk", "topp"])
def test_prefix_select_kernel_equals_torch(dtype, topp) -> None:
    from hyspec.gpu.sampling import prefix_select
    from hyspec.kernels.probs.topp import prefix_select_rows

    key, bits, valid, weight, thr = _case(20, dtype, topp)
    got = prefix_select_rows(key, bits, valid, weight, thr)
    want = prefix_select(key, bits, valid, weight, thr)
    assert got.dtype == torch.bool and torch.equal(got, want)
    n = want.sum(1)
    assert bool((n[3::5] == 0).all()) and bool((n[2::5] == valid.sum(1)[2::5]).all())  # none / all kept
    assert bool((n[0::5] == valid[0::5].any(1).to(torch.int64)).all())  # threshold 1: the top token alone
    assert torch.equal(prefix_select(key, bits, valid, weight, thr, kernel=True), got)
    order = torch.sort(key.to(torch.int64), dim=1, descending=True, stable=True).indices  # ties: lowest id first
    ranked = weight.gather(1, order)
    ahead = torch.empty_like(ranked).scatter_(1, order, ranked.cumsum(1) - ranked)  # [B, V] in token order
    assert torch.equal(got, valid & (ahead < thr))  # the definition, by a sort


def test_prefix_select_kernel_with_copies_of_the_bins(monkeypatch) -> None:
    """The histogram's atomics spread over copies of the bins and block totals (a launch
    setting): the same keep sets as the torch search."""
    from hyspec.gpu.sampling import prefix_select
    from hyspec.kernels.probs import topp

    key, bits, valid, weight, thr = _case(5, torch.bfloat16, True, seed=2)
    want = prefix_select(key, bits, valid, weight, thr)
    monkeypatch.setattr(topp, "HIST_FEW_ROWS", {})
    monkeypatch.setitem(topp.HIST_LAUNCH, "MREP", 3)
    monkeypatch.setitem(topp.HIST_LAUNCH, "REP", 2)
    assert torch.equal(topp.prefix_select_rows(key, bits, valid, weight, thr), want)
    x = _logits(5, torch.float32, seed=4)  # two passes: the second pass's bins in copies too
    k32, b32 = order_key_of(x)
    v32 = (x > -math.inf).to(key.device)
    w32 = v32.to(torch.int64)
    t32 = torch.tensor([[1], [7], [40], [300], [2000]], device=key.device)
    assert torch.equal(topp.prefix_select_rows(k32, b32, v32, w32, t32), prefix_select(k32, b32, v32, w32, t32))


def order_key_of(x):
    from hyspec.gpu.sampling import order_key

    key, bits = order_key(x)
    return key.to(kernel_device()), bits


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32])
def test_prefix_select_kernel_raw_keys(dtype) -> None:
    """Any keys of the width, the extremes included (the minimum key is the one digit 0
    leads to when nothing reaches the threshold), random weights and thresholds."""
    from hyspec.gpu.sampling import KEEP_ALL, prefix_select
    from hyspec.kernels.probs.topp import prefix_select_rows

    dev = kernel_device()
    g = torch.Generator().manual_seed(7)
    info = torch.iinfo(dtype)
    B = 7
    key = torch.randint(info.min, info.max + 1, (B, V), generator=g, dtype=torch.int64)
    key[:, ::50] = info.min
    key[:, 1::50] = info.max
    key[1::2] = key[1::2] // (1 << (info.bits - 6))  # 64 distinct keys: ties
    valid = torch.rand(B, V, generator=g) < 0.9
    weight = torch.where(valid, torch.randint(0, 1 << 40, (B, V), generator=g), 0)
    total = weight.sum(1, keepdim=True)
    # the last row: KEEP_ALL, the threshold of a lane whose filter is off (every valid token kept)
    threshold = torch.cat([total[:2] + 1, total[2:4] // 3, torch.tensor([[1], [1 << 62], [KEEP_ALL]])])
    args = key.to(dtype).to(dev), info.bits, valid.to(dev), weight.to(dev), threshold.to(dev)
    want = prefix_select(*args)
    assert torch.equal(prefix_select_rows(*args), want)
    assert bool(want[:2].eq(valid[:2].to(dev)).all())
    assert bool(want[6].eq(valid[6].to(dev)).all())


def test_prefix_select_kernel_tie_order() -> None:
    """Equal keys rank by id: the lowest ids win, across chunks."""
    from hyspec.kernels.probs.topp import prefix_select_rows

    dev = kernel_device()
    key = torch.zeros(1, V, dtype=torch.int16, device=dev)
    valid = torch.ones(1, V, dtype=torch.bool, device=dev)
    keep = prefix_select_rows(key, 16, valid, valid.to(torch.int64), torch.tensor([[1500]], device=dev))
    assert torch.equal(keep[0], torch.arange(V, device=dev) < 1500)


def test_prefix_select_kernel_row_invariant() -> None:
    from hyspec.kernels.probs.topp import prefix_select_rows

    key, bits, valid, weight, thr = _case(16, torch.float32, True, seed=3)
    whole = prefix_select_rows(key, bits, valid, weight, thr)
    for rows in (range(0, 3), range(5, 8)):
        r = list(rows)
        assert torch.equal(prefix_select_rows(key[r], bits, valid[r], weight[r], thr[r]), whole[r])
    for b in (0, 2, 7):
        assert torch.equal(prefix_select_rows(key[b:b + 1], bits, valid[b:b + 1], weight[b:b + 1], thr[b:b + 1]),
                           whole[b:b + 1])


def test_prefix_select_kernel_strided_rows() -> None:
    """key, valid and weight as views of wider rows, each of its own row stride (the
    contract asks only for a contiguous last dim): each read through its own stride, in
    the histogram passes and the tie scan, the keep sets of contiguous copies; from the
    values' bits (valid None) too."""
    from hyspec.gpu.sampling import prefix_select
    from hyspec.kernels.probs.topp import prefix_select_rows

    def wide(a, extra):
        w = torch.zeros(a.shape[0], V + extra, dtype=a.dtype, device=a.device)
        w[:, :V] = a
        return w[:, :V]

    key, bits, valid, weight, thr = _case(5, torch.bfloat16, True, seed=6)
    want = prefix_select(key, bits, valid, weight, thr)
    ks, vs, ws = wide(key, 3), wide(valid, 17), wide(weight, 40)
    assert len({ks.stride(0), vs.stride(0), ws.stride(0)}) == 3
    assert torch.equal(prefix_select_rows(ks, bits, vs, ws, thr), want)
    x = _logits(5, torch.bfloat16, seed=6).to(key.device)
    assert torch.equal(prefix_select_rows(wide(x, 3), bits, None, ws, thr), want)
    # one key for every token: the cut is the tie scan's, on each token's own weight
    g = torch.Generator().manual_seed(6)
    tie_w = torch.randint(1, 1000, (2, V), generator=g).to(key.device)
    tie_key = torch.zeros(2, V, dtype=torch.int16, device=key.device)
    ones = torch.ones(2, V, dtype=torch.bool, device=key.device)
    half = tie_w.sum(1, keepdim=True) // 2
    want = prefix_select(tie_key, 16, ones, tie_w, half)
    assert torch.equal(prefix_select_rows(wide(tie_key, 3), 16, wide(ones, 17), wide(tie_w, 40), half), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_probs_batch_with_topp_kernel(dtype) -> None:
    """probs_batch with the top-k / top-p kernels equals probs_batch without them, bitwise
    (the same keep sets into the same softmax)."""
    from hyspec.gpu.sampling import SamplingTable, probs_batch
    from hyspec.sampling import SamplingParams

    B = 8
    dev = kernel_device()
    x = _logits(B, dtype, seed=5).to(dev)
    table = SamplingTable(B, dev)
    params = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=0.7, top_k=20),
              SamplingParams(temperature=1.0, top_k=50, top_p=0.5), SamplingParams(temperature=0.5, top_p=0.3),
              SamplingParams(temperature=1.2, top_k=1), None, SamplingParams(temperature=0.9, top_p=0.999),
              SamplingParams(temperature=0.8, top_k=3000, min_p=0.05)]
    table.set_all(params)
    kernel = dev.type == "cuda" or interpreting()
    want = probs_batch(x, table, kernel=kernel, topp_kernel=False)
    got = probs_batch(x, table, kernel=kernel, topp_kernel=True)
    assert torch.equal(got, want)
    assert bool(((want > 0).sum(1)[[1, 4]] == torch.tensor([20, 1], device=dev)).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalties"])
def test_probs_batch_best_is_the_argmax(dtype, penalties) -> None:
    """probs_batch(with_best=True)'s best is the first argmax of the (penalised) logits on
    every path: with the row kernels a top-p regime takes it from the mass softmax's
    launches, others from argmax_rows; greedy lanes' one-hot rows sit at it."""
    from hyspec.gpu.sampling import SampledGraphKey, SamplingTable, _penalised, probs_batch
    from hyspec.sampling import SamplingParams

    B = 6
    dev = kernel_device()
    x = _logits(B, dtype, seed=13)
    x[5, 50] = x[5, 1700] = 40.0  # the max twice, in two chunks: the first
    x = x.to(dev)
    pen = dict(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1) if penalties else {}
    params = [SamplingParams(temperature=0.8, top_p=0.9, **pen), None,
              SamplingParams(temperature=1.0, top_k=40, top_p=0.5, **pen),
              SamplingParams(temperature=0.7, top_p=0.95, min_p=0.1), SamplingParams(temperature=1.1, top_k=5),
              SamplingParams(temperature=0.9, top_p=0.8, **pen)]
    table = SamplingTable(B, dev)
    table.set_all(params)
    regime = SampledGraphKey.of(params)
    assert regime.top_p and regime.sampled and regime.penalties == penalties
    counts = None
    if penalties:
        g = torch.Generator().manual_seed(3)
        counts = torch.randint(0, 3, (B, V), generator=g).to(dev)
        counts[5, 50], counts[5, 1700] = 2, 0  # a penalty moves row 5's max to token 1700
    want = _penalised(x, table, counts).argmax(-1) if penalties else x.argmax(-1)
    kernel = dev.type == "cuda" or interpreting()
    p, best = probs_batch(x, table, counts, regime, kernel=kernel, with_best=True)
    assert torch.equal(best, want)
    assert int(want[5]) == (1700 if penalties else 50)
    assert float(p[1, want[1]]) == 1.0 and float(p[1].sum()) == 1.0  # the greedy lane: one-hot at best
    p_t, best_t = probs_batch(x, table, counts, regime, kernel=False, with_best=True)
    assert torch.equal(best_t, want)
    only_topk = SampledGraphKey.of([params[4], None])  # no top-p: argmax_rows (or torch's)
    _, best_k = probs_batch(x[4:6], table.view(lambda t: t[4:6], 2), None if counts is None else counts[4:6],
                            only_topk, kernel=kernel, with_best=True)
    assert torch.equal(best_k, x[4:6].argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(), reason="needs CUDA (compiled kernels)")
def test_prefix_select_kernel_cuda_graph() -> None:
    """Captured once (sync debugging set to raise), replayed with other thresholds and
    weights in the same tensors: each replay equals the torch prefix_select."""
    from hyspec.gpu.sampling import prefix_select
    from hyspec.kernels.probs.topp import prefix_select_rows

    key, bits, valid, weight, thr = _case(16, torch.bfloat16, True)
    w = weight.clone()
    t = thr.clone()
    prefix_select_rows(key, bits, valid, w, t)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = prefix_select_rows(key, bits, valid, w, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in range(3):
        _, _, _, w2, t2 = _case(16, torch.bfloat16, seed % 2 == 0, seed=seed)
        w.copy_(torch.where(valid, w2, 0))
        t.copy_(t2.roll(seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, prefix_select(key, bits, valid, w, t)), seed


def test_probs_batch_topp_kernel_switch(monkeypatch) -> None:
    """probs_batch with its row kernels uses the top-k / top-p kernels on CUDA by default
    (HYSPEC_TOPP_KERNEL=0 turns them off), in the interpreter only with HYSPEC_TOPP_KERNEL=1."""
    import hyspec.gpu.sampling as dsamp
    from hyspec.sampling import SamplingParams

    dev = kernel_device()
    calls = []
    real = dsamp.prefix_select_rows
    monkeypatch.setattr(dsamp, "prefix_select_rows", lambda *a: calls.append(1) or real(*a))
    x = _logits(2, torch.bfloat16, seed=9).to(dev)
    table = dsamp.SamplingTable(2, dev)
    table.set_all([SamplingParams(temperature=0.8, top_p=0.9, top_k=40), SamplingParams(temperature=1.0, top_k=5)])
    monkeypatch.delenv("HYSPEC_TOPP_KERNEL", raising=False)
    default = dsamp.probs_batch(x, table, kernel=True)
    assert len(calls) == (2 if x.is_cuda else 0)
    calls.clear()
    monkeypatch.setenv("HYSPEC_TOPP_KERNEL", "0")
    off = dsamp.probs_batch(x, table, kernel=True)
    assert not calls
    monkeypatch.setenv("HYSPEC_TOPP_KERNEL", "1")
    on = dsamp.probs_batch(x, table, kernel=True)
    assert len(calls) == 2 and torch.equal(on, off) and torch.equal(default, off)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_top_p_from_the_values_bits(dtype) -> None:
    """Top-p alone through the kernels (a top-p-only regime): they form order_key's key
    and the valid mask (not -inf) from the logits' bits as they load them. The keep masks
    equal the search over order_key's key tensor (-0.0 and +0.0 rank equal, -inf tokens are
    never kept), and probs_batch equals its torch search, bitwise."""
    from hyspec.gpu.sampling import SampledGraphKey, SamplingTable, fixed_mass, order_key, prefix_select, probs_batch
    from hyspec.kernels.probs.topp import prefix_select_rows
    from hyspec.sampling import SamplingParams

    B = 8
    dev = kernel_device()
    x = _logits(B, dtype, seed=9)
    x[0, 7::97] = -0.0  # signed zeros beside +0.0 (ties: the lower id first)
    x[0, 8::97] = 0.0
    x[4, ::2], x[4, 1::2] = -0.0, 0.0  # a row of zeros: the top token is token 0 (-0.0), lowest id
    x = x.to(dev)
    key, bits = order_key(x)
    valid = x > -math.inf
    weight = torch.where(valid, fixed_mass(torch.softmax(x.double(), 1)), 0)
    total = weight.sum(1, keepdim=True)
    thr = torch.cat([total[:4] // 2, torch.ones_like(total[:2]), total[6:] + 1])
    want = prefix_select(key, bits, valid, weight, thr)
    assert torch.equal(prefix_select_rows(key, bits, valid, weight, thr), want)
    assert torch.equal(prefix_select_rows(x, bits, None, weight, thr), want)  # from the values
    assert not bool(want[1::4][~valid[1::4]].any())
    params = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=0.7, top_p=0.5), None,
              SamplingParams(temperature=1.3, top_p=0.999), SamplingParams(temperature=0.9), None,
              SamplingParams(temperature=0.5, top_p=0.2, min_p=0.1), SamplingParams(temperature=1.0, top_p=0.9)]
    table = SamplingTable(B, dev)
    table.set_all(params)
    regime = SampledGraphKey.of(params)
    assert regime.top_p and not regime.top_k
    kernel = dev.type == "cuda" or interpreting()
    got = probs_batch(x, table, regime=regime, kernel=kernel, topp_kernel=True)
    assert torch.equal(got, probs_batch(x, table, regime=regime, kernel=kernel, topp_kernel=False))



def _by_sort(key, valid, weight, thr):
    """The definition: valid tokens whose weight ranked ahead of them (decreasing key, ties
    by id) is below the threshold."""
    order = torch.sort(key.to(torch.int64), dim=1, descending=True, stable=True).indices
    ranked = weight.gather(1, order)
    ahead = torch.empty_like(ranked).scatter_(1, order, ranked.cumsum(1) - ranked)
    return valid & (ahead < thr)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_p_from_the_values_bits_signed_zeros_share_a_digit(dtype) -> None:
    """From the values' bits, -0.0 and +0.0 are one key in every pass (the histogram's
    as the ties'): rows of interleaved signed zeros (and a few larger values) cut in the
    middle of the zeros (past the weight of the +0.0 ones) keep the lowest ids first."""
    from hyspec.gpu.sampling import order_key
    from hyspec.kernels.probs.topp import prefix_select_rows

    dev = kernel_device()
    x = torch.zeros(3, V, dtype=torch.float64)
    x[:, ::2] = -0.0
    x[1, 100:110] = 1.0  # ahead of the zeros
    x[2, ::3] = -math.inf
    x = x.to(dtype)
    key, bits = order_key(x)
    valid = x > -math.inf
    weight = valid.to(torch.int64) * 3
    thr = torch.tensor([[3 * 1500 + 1], [3 * 1800], [3 * 5]])  # beyond the +0.0 tokens' weight alone
    want = _by_sort(key, valid, weight, thr)
    assert want.sum(1).tolist() == [1501, 1800, 5]
    got = prefix_select_rows(x.to(dev), bits, None, weight.to(dev), thr.to(dev))
    assert torch.equal(got.cpu(), want)


def test_prefix_select_kernel_zero_weight_tokens_below_an_exact_cut() -> None:
    """The threshold met exactly by the weight of the top keys, then valid tokens of zero
    weight (top-p masses that round to 0) a block of keys lower (rows 0, 1) or lower in
    the same block of SCAN_BLOCK digits (rows 2, 3: the cut found bin by bin), then more
    weight: the zero-weight tokens have the whole threshold ahead of them and are dropped."""
    from hyspec.kernels.probs.topp import prefix_select_rows

    dev = kernel_device()
    key = torch.zeros(4, V, dtype=torch.int64)
    weight = torch.zeros(4, V, dtype=torch.int64)
    key[:, 10:20], weight[:, 10:20] = 30000, 5  # 50 in the top block of first-pass digits
    key[:2, 1500:1520] = 25000  # valid, no weight, one block of digits lower
    key[2:, 1500:1520] = 29500  # ... in the same block
    key[:, 2200:2300], weight[:, 2200:2300] = 0, 1
    key[1::2] = key[1::2] * 65536 + 123  # as 32-bit keys
    valid = torch.ones(4, V, dtype=torch.bool)
    thr = torch.full((4, 1), 50)
    for b, dtype in ((0, torch.int16), (1, torch.int32), (2, torch.int16), (3, torch.int32)):
        want = _by_sort(key[b:b + 1], valid[b:b + 1], weight[b:b + 1], thr[b:b + 1])
        assert int(want.sum()) == 10 and bool(want[0, 10:20].all())
        got = prefix_select_rows(key[b:b + 1].to(dtype).to(dev), 8 * dtype.itemsize, valid[b:b + 1].to(dev),
                                 weight[b:b + 1].to(dev), thr[b:b + 1].to(dev))
        assert torch.equal(got.cpu(), want), dtype
