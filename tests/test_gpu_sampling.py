"""hyspec.gpu.sampling (batched, graph-capturable sampling) against the scalar reference
(hyspec.sampling / hyspec.core.round), lane by lane, on the CPU in float64: probabilities
bitwise, tokens identical. The CUDA-graph test runs only where CUDA is available."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hyspec.core.round import choose_token
from hyspec.gpu.penalties import PenaltyWindow, verify_probs, window_counts
from kernel_grid import mass_edge_rows
from hyspec.gpu.sampling import (
    SamplingTable,
    draft_tokens,
    fill_bias_row,
    gumbel_lanes,
    order_key,
    prefix_select,
    plain_tokens,
    probs_batch,
    sample_rows,
    speculative_accept,
    u01_lanes,
)
from hyspec.rng import Stream, gumbel_noise, u01, u01_tensor
from hyspec.sampling import (
    SamplingParams,
    apply_penalties,
    coupled_speculative,
    coupled_token,
    draft_token,
    greedy_token,
    row_probs,
    sample_index,
    speculative_sample,
)

V = 97


# --------------------------------------------------------------------------------------
# random cases
# --------------------------------------------------------------------------------------


def rand_params(rng: random.Random, kind: str | None = None, vocab: int = V) -> SamplingParams:
    kind = kind or rng.choice(["greedy", "rejection", "coupled"])
    pen = rng.random() < 0.6
    return SamplingParams(
        temperature=0.0 if kind == "greedy" else rng.choice([0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([0, 0, 1, 3, 20, vocab, vocab + 5]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 1e-3]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]) if pen else 1.0,
        frequency_penalty=rng.choice([0.0, 0.4, -0.2]) if pen else 0.0,
        presence_penalty=rng.choice([0.0, 0.7]) if pen else 0.0,
        penalty_last_n=rng.choice([-1, 0, 1, 4, 16, 64]),
        seed=rng.choice([0, 7, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, rng.getrandbits(64)]),
        mode="rejection" if kind != "coupled" else "coupled",
    )


def rand_row(gen: torch.Generator, shape: str, vocab: int = V) -> torch.Tensor:
    """One logits row [vocab] float64 of the named shape."""
    x = torch.randn(vocab, generator=gen, dtype=torch.float64) * 2.0
    if shape == "ties":
        x = torch.round(x)  # many equal logits
    elif shape == "peaked":
        x[torch.randint(vocab, (1,), generator=gen)] += 25.0
    elif shape == "flat":
        x = torch.zeros(vocab, dtype=torch.float64)
    elif shape == "masked":  # forbidden tokens
        x[torch.rand(vocab, generator=gen) < 0.6] = -math.inf
        x[torch.randint(vocab, (1,), generator=gen)] = 0.5
    elif shape == "single":
        x = torch.full((vocab,), -math.inf, dtype=torch.float64)
        x[torch.randint(vocab, (1,), generator=gen)] = 1.0
    return x


SHAPES = ["normal", "ties", "peaked", "flat", "masked", "single"]


def rand_history(rng: random.Random, vocab: int = V) -> list[int]:
    n = rng.choice([0, 1, 3, 10, 40, 120])
    hot = [rng.randrange(vocab) for _ in range(5)]  # repeats, so counts > 1 occur
    # ids outside [0, V) take a window place but are not counted
    return [rng.choice(hot) if rng.random() < 0.5 else rng.randrange(vocab + 3) for _ in range(n)]


def make_lanes(seed: int, B: int, vocab: int = V, kinds=None):
    rng = random.Random(seed)
    params = [rand_params(rng, kinds[b] if kinds else None, vocab) for b in range(B)]
    hists = [rand_history(rng, vocab) for _ in range(B)]
    table = SamplingTable(B)
    window = PenaltyWindow(B, vocab, capacity=64)
    for b in range(B):
        table.set(b, params[b])
        window.load(b, hists[b], params[b])
    return rng, params, hists, table, window


def rand_logits(gen: torch.Generator, B: int, vocab: int = V, rows: int | None = None) -> torch.Tensor:
    shapes = [SHAPES[i % len(SHAPES)] for i in range(B * (rows or 1))]
    x = torch.stack([rand_row(gen, s, vocab) for s in shapes])
    return x.view(B, vocab) if rows is None else x.view(B, rows, vocab)


# --------------------------------------------------------------------------------------
# Philox with per-lane keys
# --------------------------------------------------------------------------------------


def test_u01_lanes_bitwise_equals_u01() -> None:
    seeds = [0, 1, 0xFFFFFFFF, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 0x0123456789ABCDEF]
    table = SamplingTable(len(seeds))
    for b, s in enumerate(seeds):
        table.set(b, SamplingParams(seed=s))
    counters = torch.tensor([[0, 1, 5, (1 << 32) + 3, (1 << 40) + 11, (1 << 62) + 9]] * len(seeds))
    for stream in Stream:
        got = u01_lanes(table.seed, stream, counters)
        for b, s in enumerate(seeds):
            want = [u01(s, stream, int(c)) for c in counters[b]]
            assert got[b].tolist() == want
            assert torch.equal(got[b], u01_tensor(s, stream, counters[b]))


def test_gumbel_lanes_bitwise_equals_gumbel_noise() -> None:
    seeds = [3, (1 << 64) - 5, 1 << 63]
    table = SamplingTable(3)
    for b, s in enumerate(seeds):
        table.set(b, SamplingParams(seed=s))
    pos = torch.tensor([0, 17, (1 << 31) - 1])
    g = gumbel_lanes(table.seed, Stream.COUPLED, pos, 1000)
    for b, s in enumerate(seeds):
        assert torch.equal(g[b], gumbel_noise(s, Stream.COUPLED, int(pos[b]), 1000))


def test_philox_kernel_bitwise_equals_torch_reference() -> None:
    """hyspec.kernels.philox.u01_rows (Triton: the CPU interpreter here, the GPU where CUDA
    is available) == u01_lanes, the int64 torch port, bit for bit; and so Gumbel noise."""
    from hyspec.kernels.gemm import triton_available
    from hyspec.kernels.pdl import interpreting
    from hyspec.kernels.philox import u01_rows

    if not triton_available():
        pytest.skip("triton is not installed")
    dev = torch.device("cpu" if interpreting() else "cuda")
    seeds = [0, 1, 0xFFFFFFFF, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 0x0123456789ABCDEF]
    table = SamplingTable(len(seeds), dev)
    for b, s in enumerate(seeds):
        table.set(b, SamplingParams(seed=s))
    pos = torch.tensor([0, 1, 17, (1 << 31) - 1, 1 << 20, 999, 5], device=dev)
    vocab = 2500  # not a multiple of the block
    for stream in (Stream.COUPLED, Stream.PLAIN):
        got = u01_rows(table.seed, stream, pos, vocab)
        want = u01_lanes(table.seed, stream, (pos.unsqueeze(1) << 32) + torch.arange(vocab, device=dev))
        assert torch.equal(got, want)
        buf = torch.zeros(len(seeds), vocab, dtype=torch.float64, device=dev)
        assert u01_rows(table.seed, stream, pos, vocab, out=buf) is buf and torch.equal(buf, want)
    wide = torch.zeros(len(seeds), vocab + 3, dtype=torch.float64, device=dev)
    for bad in (wide[:, :vocab], buf.float(), buf[:-1]):  # strided, float32, a row short: refused (it
        with pytest.raises(ValueError, match="u01_rows: out must be"):  # wrote past or between the rows)
            u01_rows(table.seed, Stream.PLAIN, pos, vocab, out=bad)
    g = gumbel_lanes(table.seed, Stream.COUPLED, pos, vocab, kernel=True)
    assert torch.equal(g, gumbel_lanes(table.seed, Stream.COUPLED, pos, vocab, kernel=False))


def test_u01_at_kernel_bitwise_equals_torch_reference() -> None:
    """hyspec.kernels.rng.u01_at (Triton: the interpreter here, the GPU with CUDA), a round's
    few draws in one launch, == u01_lanes bit for bit: one counter per lane and a [B, k]
    block of them, seeds with the high bit set, counters past 2**32 and near 2**63, an empty
    call; and u01_draws takes it with kernel=True and the torch ops with kernel=False."""
    from hyspec.gpu.sampling import u01_draws
    from hyspec.kernels.gemm import triton_available
    from hyspec.kernels.pdl import interpreting
    from hyspec.kernels.rng import u01_at

    if not triton_available():
        pytest.skip("triton is not installed")
    dev = torch.device("cpu" if interpreting() else "cuda")
    seeds = torch.tensor([0, 1, 0xFFFFFFFF, (1 << 63) - 1, -(1 << 63), -1, 0x0123456789ABCDEF], device=dev)
    B = seeds.shape[0]
    pos = torch.tensor([0, 1, 17, (1 << 31) - 1, 1 << 33, (1 << 63) - 8, 5], device=dev)
    for stream in (Stream.ACCEPT, Stream.RESIDUAL, Stream.BONUS, Stream.DRAFT, Stream.PLAIN):
        assert torch.equal(u01_at(seeds, stream, pos), u01_lanes(seeds, stream, pos)), stream
        block = pos.unsqueeze(1) + torch.arange(3, device=dev)  # [B, 3]: a round's accept draws
        got = u01_at(seeds, stream, block)
        assert got.shape == (B, 3) and torch.equal(got, u01_lanes(seeds, stream, block)), stream
        assert torch.equal(u01_draws(seeds, stream, block, kernel=True), got)
        assert torch.equal(u01_draws(seeds, stream, block, kernel=False), got)
    import hyspec.gpu.sampling as dsamp_mod  # kernel=True takes the kernel, not the torch ops

    def no_torch(*a, **k):
        raise AssertionError("u01_lanes called")

    torch_ops, dsamp_mod.u01_lanes = dsamp_mod.u01_lanes, no_torch
    try:
        if dsamp_mod.U01_KERNEL:
            assert torch.equal(u01_draws(seeds, Stream.BONUS, pos, kernel=True), u01_at(seeds, Stream.BONUS, pos))
    finally:
        dsamp_mod.u01_lanes = torch_ops
    assert u01_at(seeds, Stream.ACCEPT, pos.unsqueeze(1)[:, :0]).shape == (B, 0)
    one = u01_at(seeds[3:4], Stream.DRAFT, pos[3:4])  # one lane, one draw
    assert one.shape == (1,) and float(one[0]) == u01(int(seeds[3]) % (1 << 64), Stream.DRAFT, int(pos[3]))
    # the counters' two words and the stream each reach the draw
    assert not torch.equal(u01_at(seeds, Stream.ACCEPT, pos), u01_at(seeds, Stream.BONUS, pos))
    assert not torch.equal(u01_at(seeds, Stream.ACCEPT, pos + (1 << 32)), u01_at(seeds, Stream.ACCEPT, pos))


def test_gumbel_argmax_kernel_equals_torch() -> None:
    """hyspec.kernels.rng.gumbel_argmax (Triton: the interpreter here, the GPU with CUDA)
    == the torch ops (u01_rows_ref, two logs, log p, argmax): rows with zeros, a row
    without mass (token 0), a strided row view, a vocabulary that is not a multiple of
    the 1024-token chunk."""
    from hyspec.kernels.gemm import triton_available
    from hyspec.kernels.pdl import interpreting
    from hyspec.kernels.rng import gumbel_argmax, gumbel_argmax_ref

    if not triton_available():
        pytest.skip("triton is not installed")
    dev = torch.device("cpu" if interpreting() else "cuda")
    gen = torch.Generator().manual_seed(7)
    B, Vg = 5, 2500
    p = torch.softmax(torch.randn(B, 2, Vg, generator=gen, dtype=torch.float64) * 2, -1)
    p[:, :, ::3] = 0.0
    p[1, :, 1000:] = 0.0  # the best in the first chunks
    p[3] = 0.0  # no mass: token 0
    p = p.to(dev)
    seeds = torch.tensor([0, 5, (1 << 63) - 1, -1, 12345], device=dev)
    pos = torch.tensor([0, 17, 1 << 20, 9, (1 << 31) - 2], device=dev)  # (+ r: positions < 2**31)
    for r in range(2):
        got = gumbel_argmax(p[:, r], seeds, Stream.COUPLED, pos + r)  # [B, 2, V][:, r]: strided rows
        assert torch.equal(got, gumbel_argmax_ref(p[:, r], seeds, Stream.COUPLED, pos + r)), r
    assert int(got[3]) == 0



def test_gumbel_argmax_kernel_reads_every_token() -> None:
    """gumbel_argmax sees the last token of a partial last chunk and of a full one (rows
    with all their mass there), and a row whose best chunk is a later one."""
    from hyspec.kernels.gemm import triton_available
    from hyspec.kernels.pdl import interpreting
    from hyspec.kernels.rng import gumbel_argmax, gumbel_argmax_ref

    if not triton_available():
        pytest.skip("triton is not installed")
    dev = torch.device("cpu" if interpreting() else "cuda")
    seeds = torch.tensor([3, 4, 5], device=dev)
    pos = torch.tensor([1, 2, 3], device=dev)
    for Vg in (2500, 2048):
        p = torch.zeros(3, Vg, dtype=torch.float64)
        p[0, Vg - 1] = 1.0  # the last token alone
        p[1, [0, Vg - 1]] = 0.5
        p[2, 1], p[2, Vg - 1] = 1e-300, 1.0  # the last token all but surely
        want = gumbel_argmax_ref(p, seeds.cpu(), Stream.COUPLED, pos.cpu())
        assert int(want[0]) == Vg - 1 and int(want[2]) == Vg - 1
        assert torch.equal(gumbel_argmax(p.to(dev), seeds, Stream.COUPLED, pos).cpu(), want), Vg


def test_penalty_window_kernel_strided_rows() -> None:
    """window_push on ring and counts whose rows are views of wider rows (the contract's
    strided views): each lane's row through its stride, the padding untouched; the same
    ring, counts and length as the torch pushes."""
    from hyspec.kernels.gemm import triton_available
    from hyspec.kernels.pdl import interpreting
    from hyspec.kernels.window import window_push

    if not triton_available():
        pytest.skip("triton is not installed")
    dev = torch.device("cpu" if interpreting() else "cuda")
    rng = random.Random(5)
    B, Vw, C = 4, 30, 6
    ref = PenaltyWindow(B, Vw, capacity=C, device=dev)
    for b, (n, length) in enumerate(zip([-1, 2, 5, 3], [4, 3, 9, 1])):
        ref.load(b, [rng.randrange(Vw) for _ in range(length)], n)
    ring_w = torch.full((B, C + 3), -9, dtype=torch.int64, device=dev)
    counts_w = torch.full((B, Vw + 7), -9, dtype=torch.int32, device=dev)
    ring_w[:, :C], counts_w[:, :Vw] = ref.ring, ref.counts
    last_n, length = ref.last_n.clone(), ref.length.clone()
    for step in range(6):
        toks = torch.tensor([[rng.randrange(Vw) for _ in range(3)] for _ in range(B)], device=dev)
        n_valid = torch.tensor([rng.randrange(4) for _ in range(B)], device=dev)
        window_push(last_n, length, ring_w[:, :C], counts_w[:, :Vw], toks, n_valid)
        for i in range(3):
            ref.push_ref(toks[:, i], n_valid > i)
        assert torch.equal(ring_w[:, :C], ref.ring) and torch.equal(counts_w[:, :Vw], ref.counts), step
        assert torch.equal(length, ref.length), step
    assert bool((ring_w[:, C:] == -9).all()) and bool((counts_w[:, Vw:] == -9).all())

# --------------------------------------------------------------------------------------
# penalty window
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_penalty_window_push_matches_reference_window(seed: int) -> None:
    rng, params, hists, _, window = make_lanes(seed, 10)
    for b in range(10):  # loaded counts == the reference window's
        n = params[b].penalty_last_n if params[b].has_penalties else 0
        assert torch.equal(window.counts[b], window_counts(hists[b], n, V))
    for step in range(30):
        m = rng.choice([1, 2, 4])
        toks = torch.tensor([[rng.randrange(V + 2) for _ in range(m)] for _ in range(10)])
        n_valid = torch.tensor([rng.randrange(m + 1) for _ in range(10)])
        window.push_many(toks, n_valid)
        for b in range(10):
            hists[b] += toks[b, : int(n_valid[b])].tolist()
            n = params[b].penalty_last_n if params[b].has_penalties else 0
            assert torch.equal(window.counts[b], window_counts(hists[b], n, V)), (step, b)
            assert int(window.length[b]) == len(hists[b])


def test_penalty_window_kernel_equals_torch_pushes() -> None:
    """hyspec.kernels.window.window_push (Triton: the interpreter here, the GPU with CUDA)
    leaves the ring, counts and length of the torch pushes (PenaltyWindow.push_ref) after
    every push and push_many: windows of N = -1, 0, 1 (the ring's slot read right after its
    write), 2, 5 and 64, full and filling, ids outside [0, V), inactive lanes, and a head()
    view of the first lanes."""
    from hyspec.kernels.gemm import triton_available
    from hyspec.kernels.pdl import interpreting
    from hyspec.kernels.window import window_push

    if not triton_available():
        pytest.skip("triton is not installed")
    dev = torch.device("cpu" if interpreting() else "cuda")
    rng = random.Random(3)
    B, Vw = 8, 50
    a = PenaltyWindow(B, Vw, capacity=64, device=dev)
    for b, (n, length) in enumerate(zip([-1, 0, 1, 2, 5, 64, 1, 5], [3, 0, 0, 1, 2, 70, 40, 9])):
        a.load(b, [rng.randrange(-1, Vw + 2) for _ in range(length)], n)  # filling and full windows
    ref = a.clone()

    def same() -> bool:
        return all(torch.equal(x, y) for x, y in ((a.ring, ref.ring), (a.counts, ref.counts),
                                                  (a.length, ref.length), (a.last_n, ref.last_n)))

    for step in range(12):
        m = rng.choice([1, 3, 4])
        toks = torch.tensor([[rng.randrange(-1, Vw + 2) for _ in range(m)] for _ in range(B)], device=dev)
        n_valid = torch.tensor([rng.randrange(m + 1) for _ in range(B)], device=dev)
        lanes = rng.choice([B, 5])
        window_push(a.head(lanes).last_n, a.head(lanes).length, a.head(lanes).ring, a.head(lanes).counts,
                    toks[:lanes], n_valid[:lanes])
        for i in range(m):
            ref.head(lanes).push_ref(toks[:lanes, i], n_valid[:lanes] > i)
        assert same(), step
        active = torch.tensor([rng.random() < 0.7 for _ in range(B)], device=dev)
        a.push(toks[:, 0], active)  # one token a lane (a decode step)
        ref.push_ref(toks[:, 0], active)
        assert same(), step
    a.push(toks[:, -1])  # every lane active
    ref.push_ref(toks[:, -1])
    assert same()


def test_penalty_window_capacity() -> None:
    w = PenaltyWindow(2, V, capacity=8)
    with pytest.raises(ValueError, match="capacity"):
        w.load(0, [1, 2, 3], SamplingParams(repetition_penalty=1.2, penalty_last_n=9))
    w.load(0, list(range(50)), SamplingParams(repetition_penalty=1.2, penalty_last_n=-1))  # unbounded: fine
    assert int(w.counts[0].sum()) == 50
    with pytest.raises(ValueError, match=">= -1"):  # an explicit window length below -1
        w.load(1, [1, 2, 3], -2)


def test_penalty_window_torch_pushes_and_copies(monkeypatch) -> None:
    """The torch ops of the window (HYSPEC_WINDOW_KERNEL=0, or no Triton): push_many pushes
    tokens[b, :n_valid[b]] and nothing past them, as the reference window has them; copy_
    takes the other window's ring too (a copy then evicts the other's oldest tokens)."""
    import hyspec.gpu.penalties as pen

    monkeypatch.setattr(pen, "WINDOW_KERNEL", False)
    rng = random.Random(5)
    B, Vw = 6, 30
    lasts = [-1, 0, 1, 2, 3, 5]
    hists = [[rng.randrange(Vw) for _ in range(rng.randrange(8))] for _ in range(B)]
    w = PenaltyWindow(B, Vw, capacity=8)
    for b in range(B):
        w.load(b, hists[b], lasts[b])
    for step in range(8):
        toks = torch.tensor([[rng.randrange(-1, Vw + 1) for _ in range(3)] for _ in range(B)])
        n_valid = torch.tensor([rng.randrange(4) for _ in range(B)])
        w.push_many(toks, n_valid)
        for b in range(B):
            hists[b] += toks[b, : int(n_valid[b])].tolist()
            assert torch.equal(w.counts[b], window_counts(hists[b], lasts[b], Vw)), (step, b)
            assert int(w.length[b]) == len(hists[b])
    other = PenaltyWindow(B, Vw, capacity=8)  # another history in every field, then copied over
    for b in range(B):
        other.load(b, [rng.randrange(Vw) for _ in range(7)], lasts[b])
    other.copy_(w)
    extra = torch.tensor([rng.randrange(Vw) for _ in range(B)])
    other.push(extra)
    for b in range(B):
        assert torch.equal(other.counts[b], window_counts(hists[b] + [int(extra[b])], lasts[b], Vw)), b


# --------------------------------------------------------------------------------------
# probabilities and plain decoding
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_probs_batch_equals_row_probs(seed: int, dtype: torch.dtype) -> None:
    B = 18
    _, params, hists, table, window = make_lanes(seed, B)
    gen = torch.Generator().manual_seed(seed)
    logits = rand_logits(gen, B).to(dtype)
    got = probs_batch(logits, table, window.counts)
    assert got.dtype == torch.float64 and got.shape == (B, V)
    for b in range(B):
        assert torch.equal(got[b], row_probs(logits[b], hists[b], params[b])), b


def test_probs_batch_filter_boundaries() -> None:
    """Rows whose masses land exactly on the top-k / top-p / min-p boundaries."""
    flat = torch.zeros(4, dtype=torch.float64)  # softmax = 1/4 each, exactly
    halves = torch.tensor([math.log(2.0), 0.0, 0.0, -math.inf], dtype=torch.float64)  # 1/2, 1/4, 1/4, 0
    cases = [
        (flat, SamplingParams(top_p=0.5)),  # mass before token 2 == top_p exactly
        (flat, SamplingParams(top_p=0.75)),
        (flat, SamplingParams(top_p=0.25)),
        (flat, SamplingParams(top_k=2)),  # ties across the top-k boundary: lowest ids win
        (halves, SamplingParams(min_p=0.5)),  # p == min_p * p_max exactly: kept
        (halves, SamplingParams(top_p=0.5)),
        (halves, SamplingParams(top_k=2, top_p=0.9, min_p=0.4)),
        (halves, SamplingParams(temperature=0.0)),
    ]
    table = SamplingTable(len(cases))
    for b, (_, prm) in enumerate(cases):
        table.set(b, prm)
    got = probs_batch(torch.stack([row for row, _ in cases]), table)
    for b, (row, prm) in enumerate(cases):
        assert torch.equal(got[b], row_probs(row, [], prm)), b
    assert (got[0] > 0).sum() == 2 and (got[3] > 0).tolist() == [True, True, False, False]
    # a top_p below the fixed-point unit (2**-62) still keeps the top token, as the reference does
    tiny = SamplingTable(1)
    tiny.set(0, SamplingParams(top_p=1e-30))
    assert torch.equal(probs_batch(halves.unsqueeze(0), tiny)[0], row_probs(halves, [], SamplingParams(top_p=1e-30)))


def test_probs_batch_each_penalty_alone() -> None:
    """Each penalty alone on a history with repeated tokens (counts > 1): frequency scales
    with the count, presence does not, repetition divides positive logits and multiplies
    negative ones; probabilities and greedy tokens == the reference's."""
    row = torch.tensor([1.5, -0.5, 0.8, 0.0, 2.0, -1.0, 0.3], dtype=torch.float64)
    hist = [0, 0, 0, 1, 1, 4, 5, 5, 5, 5]
    cases = [SamplingParams(temperature=1.0, presence_penalty=0.9), SamplingParams(temperature=1.0,
             frequency_penalty=0.4), SamplingParams(temperature=1.0, repetition_penalty=1.7),
             SamplingParams(temperature=0.0, presence_penalty=0.9), SamplingParams(temperature=0.0,
             repetition_penalty=3.0)]
    table = SamplingTable(len(cases))
    window = PenaltyWindow(len(cases), row.shape[0], capacity=64)
    for b, prm in enumerate(cases):
        table.set(b, prm)
        window.load(b, hist, prm)
    got = probs_batch(row.expand(len(cases), -1).clone(), table, window.counts)
    for b, prm in enumerate(cases):
        assert torch.equal(got[b], row_probs(row, hist, prm)), b
    assert int(got[3].argmax()) == 4 and int(got[4].argmax()) == 2  # presence leaves 4 on top; r = 3 does not


def test_probs_batch_with_logit_bias_equals_row_probs() -> None:
    """logit_bias rows (fill_bias_row: the lanes' buffer) added before the penalties, as
    the reference's apply_penalties adds them: a bias on a token in the window that the
    repetition penalty then divides (added after it, the greedy lane's pick would differ),
    a bias of 0 on a -0.0 logit (+0.0 after it, as in the reference), lanes without a bias
    beside biased ones, -0.0 logits left as they are (top-p ranks by the values' bits):
    probabilities == row_probs, greedy and sampled (the torch ops; the row kernels take the
    same biased values: test_batch_decoder's lanes); an id past the vocabulary is refused."""
    row = torch.tensor([1.5, -0.0, 0.8, -0.0, 2.0, -1.0, 0.0], dtype=torch.float32)
    hist = [4, 4]
    cases = [SamplingParams(temperature=0.0, repetition_penalty=3.0, logit_bias={4: 1.0}),
             SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.5, logit_bias={4: 1.0, 1: 0.0}),
             SamplingParams(temperature=0.9, top_p=0.95),
             SamplingParams(temperature=0.0, logit_bias={6: 100.0}),
             SamplingParams(temperature=0.7, top_k=3, frequency_penalty=0.5, logit_bias={5: -100.0, 3: 1e-3})]
    B = len(cases)
    table = SamplingTable(B)
    window = PenaltyWindow(B, row.shape[0], capacity=64)
    bias = torch.empty(B, row.shape[0])
    for b, prm in enumerate(cases):
        table.set(b, prm)
        window.load(b, hist, prm)
        fill_bias_row(bias[b], prm)
    assert torch.equal(bias[2], torch.full((7,), -0.0)) and bias[2].signbit().all()
    got = probs_batch(row.expand(B, -1).clone(), table, window.counts, kernel=False, bias=bias)
    for b, prm in enumerate(cases):
        assert torch.equal(got[b], row_probs(row, hist, prm)), b
    assert int(got[0].argmax()) == 0 and int(got[3].argmax()) == 6  # (bias then r = 3 leaves 4 below 0)
    with pytest.raises(ValueError, match="logit_bias: token id"):
        fill_bias_row(bias[0], SamplingParams(logit_bias={7: 1.0}))


def test_table_takes_a_top_k_past_int64() -> None:
    """SamplingParams (and the server's top_k) take any k >= 0; one past int64 keeps every
    token as any k >= V does, where writing it into the lane table overflowed (ValueError on
    admission: on a GPU every sequence of the lanes' round failed with it)."""
    row = torch.tensor([0.5, 2.0, -1.0, 0.0], dtype=torch.float64)
    cases = [SamplingParams(top_k=k, temperature=0.7) for k in (1 << 63, 1 << 70, (1 << 63) - 1, 4)]
    table = SamplingTable(len(cases))
    for b, prm in enumerate(cases):
        table.set(b, prm)
    got = probs_batch(row.expand(len(cases), -1).clone(), table)
    for b, prm in enumerate(cases):
        assert torch.equal(got[b], row_probs(row, [], prm)), b


@pytest.mark.parametrize("dtype,Vs", [(torch.bfloat16, 700), (torch.float32, 700), (torch.float64, 700),
                                      (torch.bfloat16, 1 << 17)])
def test_prefix_select_equals_a_sort(dtype: torch.dtype, Vs: int) -> None:
    """prefix_select (radix passes, no sort) == rank by (value desc, id asc) with a stable
    sort, then an exclusive cumulative sum of the weights: keep iff it is below the
    threshold. Rows full of ties (rounded values, +0.0 / -0.0), forbidden tokens, zero and
    huge weights, thresholds at 0, 1, mid-way, the total and past it; several passes per
    key (V = 700: 9-bit digits) and one (bf16 keys, V = 2**17: 16-bit digits)."""
    gen = torch.Generator().manual_seed(dtype.itemsize)
    B = 12
    vals = torch.randn(B, Vs, generator=gen, dtype=torch.float64) * 3
    vals[0::3] = torch.round(vals[0::3] * 2) / 2  # many equal values
    vals[1::4, ::7] = 0.0
    vals[1::4, 3::7] = -0.0
    vals[2, :] = 1.0  # one value only: ties everywhere
    vals = vals.to(dtype)
    valid = torch.rand(B, Vs, generator=gen) > 0.2
    valid[:, 0] = True
    w = torch.randint(0, 1 << 40, (B, Vs), generator=gen, dtype=torch.int64)
    w[::2] = torch.randint(0, 3, (B // 2, Vs), generator=gen, dtype=torch.int64)  # small, with zeros
    w[3] = 1  # counts (top-k)
    key, bits = order_key(vals)
    wv = torch.where(valid, w, torch.zeros_like(w))
    order = torch.sort(vals.to(torch.float64), dim=1, descending=True, stable=True).indices
    ranked = wv.gather(1, order)
    ahead = torch.empty_like(ranked).scatter_(1, order, ranked.cumsum(1) - ranked)  # [B, V] token order
    total = wv.sum(1, keepdim=True)
    for thr in (torch.zeros_like(total), torch.ones_like(total), total // 3, total // 2 + 1, total, total + 5,
                torch.full_like(total, 37)):
        got = prefix_select(key, bits, valid, wv, thr)
        assert torch.equal(got, valid & (ahead < thr)), thr.flatten().tolist()


def test_table_views_repeat_and_are_read_only() -> None:
    """A view() of a table (the fixed-block path's row selections) repeats per field like
    the table's storages do, and refuses set() with a clear error."""
    table = SamplingTable(4)
    table.set_all([SamplingParams(temperature=0.5 + i, top_p=0.9, seed=i) for i in range(4)])
    view = table.view(lambda t: t[1:3], 2)
    for a, b in zip(view.repeat(2, 3).fields(), table.view(lambda t: t[1:3], 2).view(
            lambda t: t.repeat_interleave(3), 6).fields()):
        assert torch.equal(a, b)
    assert torch.equal(table.repeat(3, 2).temperature, table.temperature[:3].repeat_interleave(2))
    with pytest.raises(TypeError, match="read-only"):
        view.set(0, None)
    # the first lanes of a view, each repeated; and of the table itself
    assert torch.equal(view.repeat(1, 3).seed, torch.tensor([1, 1, 1]))
    assert torch.equal(view.repeat(1).temperature, table.temperature[1:2])
    with pytest.raises(ValueError, match="expected 4 lanes"):
        table.set_all([SamplingParams()] * 3)


def test_blocked_rows_equal_one_call() -> None:
    """hyspec.gpu.batch_sampling.blocked (the draws without the row kernels: fixed
    SAMPLE_BLOCK-row calls, the last padded) gives each row what one call over all rows
    gives: tensors and SamplingTables as row arguments, tuple outputs, n below, at and
    past a block."""
    from hyspec.gpu.batch_sampling import SAMPLE_BLOCK, blocked

    gen = torch.Generator().manual_seed(8)
    for n in (1, SAMPLE_BLOCK, SAMPLE_BLOCK + 5, 2 * SAMPLE_BLOCK + 1):
        _, _, _, table, window = make_lanes(n, n)
        logits = rand_logits(gen, n)
        shapes = []

        def fn(lg, tb, c, shapes=shapes):
            shapes.append(lg.shape[0])
            return probs_batch(lg, tb, c), lg.argmax(1)

        p, am = blocked(fn, n, logits, table, window.counts)
        assert set(shapes) == {SAMPLE_BLOCK}, n
        assert p.shape == (n, V) and torch.equal(p, probs_batch(logits, table, window.counts)), n
        assert torch.equal(am, logits.argmax(1)), n
        assert torch.equal(blocked(lambda a: a.sum(-1), n, logits), logits.sum(-1)), n


def test_regimes_equal_all_stages() -> None:
    """A batch's regime (SampledGraphKey.of its params) leaves stages out; every lane's
    probabilities and tokens are bitwise those of the general functions."""
    from hyspec.gpu.sampling import ALL_STAGES, SampledGraphKey

    gen = torch.Generator().manual_seed(2)
    groups = [
        [SamplingParams(temperature=0.8, top_p=0.9, seed=1, mode="coupled"), SamplingParams(temperature=0.0)],
        [SamplingParams(temperature=0.7, seed=2), SamplingParams(temperature=1.1, min_p=0.1, seed=3)],
        [SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=0.0)],
        [SamplingParams(temperature=0.9, top_k=5, seed=4, presence_penalty=0.5),
         SamplingParams(temperature=0.5, top_p=0.5, seed=5, mode="coupled")],
    ]
    K = 2
    for params in groups:
        B = len(params)
        regime = SampledGraphKey.of(params)
        assert regime is not None and regime != ALL_STAGES
        table = SamplingTable(B)
        window = PenaltyWindow(B, V, capacity=64)
        for b, prm in enumerate(params):
            table.set(b, prm)
            window.load(b, [3, 5, 5, 9], prm)
        target = rand_logits(gen, B, rows=K + 1).to(torch.float32)
        counts = window.counts if regime.penalties else None
        for r in range(K + 1):
            a = probs_batch(target[:, r], table, window.counts, regime)
            assert torch.equal(a, probs_batch(target[:, r], table, window.counts)), (params, r)
        p = torch.stack([probs_batch(target[:, r], table, counts, regime) for r in range(K + 1)], 1)
        q = p[:, :K] * 0.5 + torch.softmax(torch.randn(B, K, V, generator=gen, dtype=torch.float64), -1) * 0.5
        pos = torch.tensor([11, 40])
        drafts = draft_tokens(q[:, 0], table, pos, regime).unsqueeze(1).expand(B, K)
        assert torch.equal(drafts[:, 0], draft_tokens(q[:, 0], table, pos))
        assert torch.equal(plain_tokens(p[:, 0], table, pos, regime), plain_tokens(p[:, 0], table, pos))
        for kl in range(K + 1):
            k_lane = torch.full((B,), kl)
            got = speculative_accept(p, q, drafts, table, pos, k_lane, regime)
            want = speculative_accept(p, q, drafts, table, pos, k_lane)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (params, kl)
    assert SampledGraphKey.of([None, SamplingParams(temperature=0.0)]) is None


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_plain_tokens_equal_reference(seed: int) -> None:
    B = 24
    rng, params, hists, table, window = make_lanes(seed, B)
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(3):
        logits = rand_logits(gen, B)
        positions = torch.tensor([rng.randrange(1 << 20) for _ in range(B)])
        probs = probs_batch(logits, table, window.counts)
        got = plain_tokens(probs, table, positions)
        for b in range(B):
            pos = int(positions[b])
            assert int(got[b]) == choose_token(logits[b], hists[b], params[b], pos), b


def test_sample_rows_edge_cases() -> None:
    # u close to 1: rounding can put u * total at or past the last cdf step -> last positive token
    rows = torch.tensor(
        [
            [0.1, 0.2, 0.7, 0.0, 0.0],
            [1 / 3, 1 / 3, 1 / 3, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 1.0],
            [0.5, 0.0, 0.5, 0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    for u in [2.0**-54, 0.1, 0.3, 0.5, 1 - 2.0**-53]:
        got = sample_rows(rows, torch.full((4,), u, dtype=torch.float64))
        assert got.tolist() == [sample_index(r, u) for r in rows]


def test_chunked_scans() -> None:
    """cumsum_rows (chunks as rows, then the chunk offsets) == cumsum, exactly, for integer
    rows shorter than, equal to and longer than a chunk (with padding); the two-level
    inverse CDF the GPU uses picks the sequential scan's token for random rows with zeros
    and zero chunks, never a zero-probability token, and the fallbacks (no mass: 0; u * total
    past the end: the last positive token)."""
    from hyspec.gpu.sampling import SCAN_CHUNK, cumsum_rows

    gen = torch.Generator().manual_seed(3)
    for n in (700, SCAN_CHUNK, 3 * SCAN_CHUNK, 5 * SCAN_CHUNK - 37):
        x = torch.randint(0, 1 << 50, (5, n), generator=gen, dtype=torch.int64)
        x[1, : n // 2] = 0
        assert torch.equal(cumsum_rows(x), x.cumsum(1)), n
    B, Vc = 6, 5 * SCAN_CHUNK - 37
    p = mass_edge_rows(Vc, SCAN_CHUNK, gen)  # [B = 6, Vc]
    for _ in range(300):
        u = torch.rand(B, generator=gen, dtype=torch.float64).clamp(min=2.0**-54)
        a = sample_rows(p, u, chunked=True)
        assert torch.equal(a, sample_rows(p, u, chunked=False)), u
        assert bool((p.gather(1, a[:, None])[:, 0] > 0)[[0, 1, 2, 4, 5]].all()) and int(a[3]) == 0
    u = torch.full((B,), 1 - 2.0**-53, dtype=torch.float64)
    assert torch.equal(sample_rows(p, u, chunked=True), sample_rows(p, u, chunked=False))
    # targets exactly on a step (dyadic masses in different chunks): the next token, as the scan's
    q = torch.zeros(1, Vc, dtype=torch.float64)
    q[0, [3, SCAN_CHUNK + 9, 2 * SCAN_CHUNK, Vc - 1]] = 0.25
    for uu in (0.25, 0.5, 0.75, 0.125):
        u = torch.tensor([uu], dtype=torch.float64)
        assert torch.equal(sample_rows(q, u, chunked=True), sample_rows(q, u, chunked=False)), uu


# --------------------------------------------------------------------------------------
# a whole speculative round: draft, verify, accept, push
# --------------------------------------------------------------------------------------


def reference_draft(params, hist, logits_j, position):
    """hyspec.core.round._draft_one without forced drafts / p_min / constraints."""
    if params.greedy:
        lg = apply_penalties(logits_j, hist, params) if params.has_penalties else logits_j
        return greedy_token(lg), None
    q = row_probs(logits_j, hist, params)
    tok = coupled_token(q, params.seed, position) if params.mode == "coupled" else draft_token(q, params.seed, position)
    return tok, q


def reference_accept(params, hist, rows, drafts, q_rows, position):
    """hyspec.core.round.accept (speculative lane, no constraint)."""
    k = len(drafts)
    if params.greedy:
        for j in range(k + 1):
            lg = apply_penalties(rows[j], hist + drafts[:j], params) if params.has_penalties else rows[j]
            t = greedy_token(lg)
            if j == k or t != drafts[j]:
                return j, t
    p_rows = torch.stack([row_probs(rows[j], hist + drafts[:j], params) for j in range(k + 1)])
    if params.mode == "coupled":
        return coupled_speculative(p_rows, drafts, params.seed, position)
    q = torch.stack(q_rows) if k else p_rows[:0]
    return speculative_sample(p_rows, q, drafts, params.seed, position)


@pytest.mark.parametrize("noise", [0.0, 0.3, 3.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_round_equals_reference(seed: int, noise: float) -> None:
    B, K = 16, 4
    rng, params, hists, table, window = make_lanes(seed, B)
    gen = torch.Generator().manual_seed(1000 + seed)
    n_seen = torch.zeros(K + 1, dtype=torch.int64)
    for rnd in range(4):
        k_lane = torch.tensor([rng.randrange(K + 1) for _ in range(B)])
        positions = torch.tensor([len(h) + rng.randrange(50) for h in hists])
        target = rand_logits(gen, B, rows=K + 1)  # [B, K+1, V]
        drafter = target[:, :K] + noise * torch.randn(B, K, V, generator=gen, dtype=torch.float64)

        # drafting: a scratch window advanced with each draft, exactly like the verify rows
        # in the last round some lanes' first draft is planted off-distribution (a draft
        # with p[d] = 0 or q[d] = 0 then happens)
        planted = torch.tensor([rnd == 3 and rng.random() < 0.5 for _ in range(B)])
        planted_tok = torch.tensor([rng.randrange(V) for _ in range(B)])
        scratch = window.clone()
        q = torch.zeros(B, K, V, dtype=torch.float64)
        drafts = torch.full((B, K), -1, dtype=torch.int64)  # -1: no draft
        for j in range(K):
            q[:, j] = probs_batch(drafter[:, j], table, scratch.counts)
            d = draft_tokens(q[:, j], table, positions + j)
            if j == 0:
                d = torch.where(planted, planted_tok, d)
            drafts[:, j] = torch.where(j < k_lane, d, drafts[:, j])
            scratch.push(drafts[:, j], j < k_lane)

        p, best = verify_probs(target, table, window, drafts, with_best=True)
        n, nxt = speculative_accept(p, q, drafts, table, positions, k_lane)
        # with probs_batch's best per row (no argmax over p; the coupled draws in one call):
        # the same decisions; a wrong best (the next token) changes some
        assert all(torch.equal(a, b) for a, b in zip(speculative_accept(p, q, drafts, table, positions, k_lane,
                                                                         best=best), (n, nxt)))
        if noise == 0.0 and rnd == 0:
            bad = speculative_accept(p, q, drafts, table, positions, k_lane, best=(best + 1) % V)
            assert not all(torch.equal(a, b) for a, b in zip(bad, (n, nxt)))

        emitted = torch.cat([drafts, torch.zeros(B, 1, dtype=torch.int64)], dim=1)
        for b in range(B):
            kb, pos, hist = int(k_lane[b]), int(positions[b]), hists[b]
            ds, q_rows = [], []
            for j in range(kb):
                tok, qj = reference_draft(params[b], hist + ds, drafter[b, j], pos + j)
                if not (j == 0 and planted[b]):
                    assert int(drafts[b, j]) == tok, (rnd, b, j)
                ds.append(int(drafts[b, j]))
                if qj is not None:
                    q_rows.append(qj)
                    assert torch.equal(q[b, j], qj)
            for j in range(kb + 1):
                assert torch.equal(p[b, j], row_probs(target[b, j], hist + ds[:j], params[b])), (b, j)
            want = reference_accept(params[b], hist, target[b, : kb + 1], ds, q_rows, pos)
            assert (int(n[b]), int(nxt[b])) == want, (rnd, b, params[b])
            n_seen[want[0]] += 1
            hist += ds[: want[0]] + [want[1]]
            emitted[b, int(n[b])] = nxt[b]
        window.push_many(emitted, n + 1)
        for b in range(B):
            pn = params[b].penalty_last_n if params[b].has_penalties else 0
            assert torch.equal(window.counts[b], window_counts(hists[b], pn, V))
    if noise == 0.0:
        assert n_seen[1:].sum() > 0  # some drafts were accepted
    assert n_seen[:K].sum() > 0  # some were rejected or the lane had fewer drafts


@pytest.mark.parametrize("kind", ["greedy", "rejection", "coupled"])
def test_speculative_accept_k_lane_truncation(kind: str) -> None:
    """k_lane[b] < k: the same as the scalar function called with k_lane drafts."""
    B, K = 6, 3
    _, params, _, table, _ = make_lanes(7, B, kinds=[kind] * B)
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=gen, dtype=torch.float64), -1)
    if kind == "greedy":  # greedy lanes' rows are one-hot
        p = torch.zeros_like(p).scatter_(2, p.argmax(2, keepdim=True), 1.0)
    q = p[:, :K].clone()
    drafts = torch.stack([p[:, j].argmax(1) for j in range(K)], dim=1)  # likely accepted
    positions = torch.arange(B) * 10
    for kl in range(K + 1):
        k_lane = torch.full((B,), kl)
        n, nxt = speculative_accept(p, q, drafts, table, positions, k_lane)
        for b in range(B):
            ds, pos, s = drafts[b, :kl].tolist(), int(positions[b]), params[b].seed
            if kind == "greedy":
                want = reference_accept(params[b], [], p[b, : kl + 1], ds, [], pos)
            elif kind == "coupled":
                want = coupled_speculative(p[b, : kl + 1], ds, s, pos)
            else:
                want = speculative_sample(p[b, : kl + 1], q[b, :kl], ds, s, pos)
            assert (int(n[b]), int(nxt[b])) == want


def test_k_zero() -> None:
    B = 5
    _, params, _, table, _ = make_lanes(3, B)
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(B, 1, V, generator=gen, dtype=torch.float64), -1)
    p = torch.where(table.greedy.view(B, 1, 1), torch.zeros_like(p).scatter_(2, p.argmax(2, keepdim=True), 1.0), p)
    positions = torch.arange(B)
    n, nxt = speculative_accept(p, p[:, :0], torch.zeros(B, 0, dtype=torch.int64), table, positions,
                                torch.zeros(B, dtype=torch.int64))
    assert n.tolist() == [0] * B
    for b in range(B):
        if params[b].greedy:
            want = (0, int(p[b, 0].argmax()))
        elif params[b].mode == "coupled":
            want = coupled_speculative(p[b], [], params[b].seed, b)
        else:
            want = speculative_sample(p[b], p[b, :0], [], params[b].seed, b)
        assert int(nxt[b]) == want[1]


def test_larger_vocab_bitwise() -> None:
    """A vocabulary larger than a vector chunk / parallel grain (tails in different places)."""
    B, Vb, K = 4, 40_000, 2
    kinds = ["rejection", "coupled", "rejection", "greedy"]
    _, params, hists, table, window = make_lanes(11, B, vocab=Vb, kinds=kinds)
    gen = torch.Generator().manual_seed(11)
    target = torch.randn(B, K + 1, Vb, generator=gen, dtype=torch.float64) * 3
    drafts = torch.stack([target[:, j].argmax(1) for j in range(K)], dim=1)
    positions = torch.tensor([5, 1 << 20, 77, 3])
    p = verify_probs(target, table, window, drafts)
    q = p[:, :K].clone()
    n, nxt = speculative_accept(p, q, drafts, table, positions, torch.full((B,), K))
    toks = plain_tokens(p[:, 0], table, positions)
    for b in range(B):
        ds = drafts[b].tolist()
        for j in range(K + 1):
            assert torch.equal(p[b, j], row_probs(target[b, j], hists[b] + ds[:j], params[b]))
        assert int(toks[b]) == choose_token(target[b, 0], hists[b], params[b], int(positions[b]))
        want = reference_accept(params[b], hists[b], target[b], ds, list(q[b]), int(positions[b]))
        assert (int(n[b]), int(nxt[b])) == want


# --------------------------------------------------------------------------------------
# no host synchronisation / CUDA graphs
# --------------------------------------------------------------------------------------


def _one_round(table, window, target, drafter, positions, k_lane):
    K = target.shape[1] - 1
    scratch = window.clone()
    qs, ds = [], []
    for j in range(K):
        qs.append(probs_batch(drafter[:, j], table, scratch.counts))
        ds.append(draft_tokens(qs[-1], table, positions + j))
        scratch.push(ds[-1], j < k_lane)
    q, drafts = torch.stack(qs, 1), torch.stack(ds, 1)
    p = verify_probs(target, table, window, drafts)
    n, nxt = speculative_accept(p, q, drafts, table, positions, k_lane)
    plain = plain_tokens(p[:, 0], table, positions)
    window.push_many(torch.cat([drafts, nxt.unsqueeze(1)], 1), n + 1)
    return drafts, n, nxt, plain


def test_no_host_sync(monkeypatch) -> None:
    """Every batched call runs with the tensor->host conversions made to raise."""
    B, K = 8, 3
    _, _, _, table, window = make_lanes(4, B)
    gen = torch.Generator().manual_seed(4)
    target = rand_logits(gen, B, rows=K + 1)
    drafter = target[:, :K] + 0.2 * torch.randn(B, K, V, generator=gen, dtype=torch.float64)
    positions = torch.arange(B) * 3
    k_lane = torch.tensor([0, 1, 2, 3, 3, 2, 1, 3])

    def boom(*a, **k):
        raise AssertionError("host sync inside a batched sampling call")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "nonzero", boom)
    _one_round(table, window, target, drafter, positions, k_lane)
    monkeypatch.undo()
    with pytest.raises(AssertionError):  # the trap works
        monkeypatch.setattr(torch.Tensor, "item", boom)
        torch.zeros(1).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_and_replay() -> None:
    """Capture one round (draft, verify, accept, plain, push) as a CUDA graph with sync
    debugging set to raise, then replay it with other params written into the same table
    tensors: drafts, n, next and plain tokens and the window counts equal the CPU batched
    path's (itself == the scalar reference). CPU and GPU floating-point reductions may
    round differently; with these rows no decision falls within that rounding."""
    dev = torch.device("cuda")
    B, K = 8, 3
    gen = torch.Generator().manual_seed(9)
    target = rand_logits(gen, B, rows=K + 1)
    drafter = target[:, :K] + 0.2 * torch.randn(B, K, V, generator=gen, dtype=torch.float64)
    positions = torch.arange(B) * 3 + 40
    k_lane = torch.tensor([0, 1, 2, 3, 3, 2, 1, 3])

    def setup(seed):
        _, params, hists, table_cpu, window_cpu = make_lanes(seed, B)
        table = SamplingTable(B, dev)
        window = PenaltyWindow(B, V, capacity=64, device=dev)
        for b in range(B):
            table.set(b, params[b])
            window.load(b, hists[b], params[b])
        return table_cpu, window_cpu, table, window, params, hists

    _, _, table, window, _, _ = setup(0)
    s_target, s_drafter = target.to(dev), drafter.to(dev)
    s_pos, s_kl = positions.to(dev), k_lane.to(dev)
    state0 = window.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up
            _one_round(table, window, s_target, s_drafter, s_pos, s_kl)
        torch.cuda.current_stream().wait_stream(side)
        window.copy_(state0)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = _one_round(table, window, s_target, s_drafter, s_pos, s_kl)
    finally:
        torch.cuda.set_sync_debug_mode(0)

    for seed in (0, 1, 2):  # new params in the same tensors, same graph
        table_cpu, window_cpu, t2, w2, _, _ = setup(seed)
        for name in vars(t2):
            if isinstance(getattr(t2, name), torch.Tensor):
                getattr(table, name).copy_(getattr(t2, name))
        window.copy_(w2)
        g.replay()
        torch.cuda.synchronize()
        ref = _one_round(table_cpu, window_cpu, target, drafter, positions, k_lane)
        for got, want in zip(outs, ref):
            assert torch.equal(got.cpu(), want), seed
        assert torch.equal(window.counts.cpu(), window_cpu.counts)


# --------------------------------------------------------------------------------------
# the distribution of speculative sampling on the device (a GPU run)
# --------------------------------------------------------------------------------------

ALPHA = 1e-3  # significance level of the distribution test (as tests/test_sampling.py)
BIASED_MAX_P = 1e-6  # a planted wrong rule must fall below this


def _first_tokens(dec, prompt, seeds, k, params, forced=None, reference=None):
    """The first 3 tokens of seeded requests decoded in dec's lanes with k drafts per round
    (5 new tokens: with k = 3 the first round after the prefill's token drafts 3), and the
    speculative telemetry (accepted, drafted, rounds that accepted all 3 drafts)."""
    import dataclasses

    from hyspec.gpu.batch_loop import LaneRequest, run_batch

    reqs = [LaneRequest(prompt=list(prompt), max_new_tokens=5, k=k, reference=reference,
                        params=dataclasses.replace(params, seed=s)) for s in seeds]
    run_batch(dec, reqs, forced_rates=forced)
    tel = [r.telemetry.to_dict() for r in reqs]
    acc = (sum(t["accepted"] for t in tel), sum(t["drafted"] for t in tel),
           sum((t["accepted_at"] or [0, 0, 0])[-1] if len(t["accepted_at"] or []) == 3 else 0 for t in tel))
    return [tuple(r.tokens[:3]) for r in reqs], acc


def _two_sample_pvalue(a, b, min_cell=20):
    """Chi-square test that two samples of outcomes come from one distribution: the 2 x C
    table of counts, outcomes seen fewer than min_cell times in both together pooled."""
    import collections

    import numpy as np
    from scipy import stats

    ca, cb = collections.Counter(a), collections.Counter(b)
    cells = [c for c in set(ca) | set(cb) if ca[c] + cb[c] >= min_cell]
    rest = [c for c in set(ca) | set(cb) if ca[c] + cb[c] < min_cell]
    table = [[ca[c] for c in cells] + [sum(ca[c] for c in rest)], [cb[c] for c in cells] + [sum(cb[c] for c in rest)]]
    table = np.array([row for row in np.array(table).T if row.sum() > 0]).T
    return float(stats.chi2_contingency(table)[1])


def run_distribution_check(device, n=1200, layers=2, graphs=None):
    """(p-values) of the first 3 tokens, seeded sampling in the BatchDecoder: k = 3 with the
    MTP drafter vs plain decoding, k = 3 with the forced drafter (a one-hot proposal
    accepted most of the time: accept, residual and bonus all happen) vs plain, and the
    forced arm again with a planted rule that accepts every draft the target allows."""
    import tempfile
    from pathlib import Path

    from hyspec.gpu import sampling as dsamp
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_next", Path(tempfile.mkdtemp()) / "m", seed=3, layers=layers, hidden=64, vocab_size=32,
                  std=0.5)
    model = load_model(d, dtype=torch.float32, device=device)
    prompt = [5, 17, 9, 3]
    params = SamplingParams(temperature=1.0, top_k=4)

    def decoder():
        return BatchDecoder(model, 16, 3, slots=64, graphs=graphs)

    from hyspec.gpu.batch_loop import LaneRequest, run_batch

    dec = decoder()
    greedy = LaneRequest(prompt=list(prompt), max_new_tokens=8)
    run_batch(dec, [greedy])
    reference = greedy.tokens  # the greedy continuation: the forced drafter's proposals
    arms = [range(i * n, (i + 1) * n) for i in range(4)]  # disjoint seeds: independent samples
    plain, _ = _first_tokens(dec, prompt, arms[0], 0, params)
    mtp, acc_mtp = _first_tokens(dec, prompt, arms[1], 3, params)
    rates = (0.9, 0.8, 0.7)
    forced, acc_forced = _first_tokens(dec, prompt, arms[2], 3, params, forced=rates, reference=reference)
    exact = dsamp.speculative_accept

    def accept_all(p, q, *rest):  # u * p[d] < p[d]: every draft the target allows is accepted
        return exact(p, p[:, : q.shape[1]], *rest)

    dsamp.speculative_accept = accept_all
    try:
        biased, _ = _first_tokens(decoder(), prompt, arms[3], 3, params, forced=rates, reference=reference)
    finally:
        dsamp.speculative_accept = exact
    return {"mtp": _two_sample_pvalue(mtp, plain), "forced": _two_sample_pvalue(forced, plain),
            "biased": _two_sample_pvalue(biased, plain), "accepted_mtp": acc_mtp, "accepted_forced": acc_forced}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_speculative_sampling_keeps_the_distribution() -> None:
    """Seeded rejection sampling (T = 1, top-k 4) in the BatchDecoder's graphs on the GPU:
    the joint distribution of the first 3 tokens with k = 3 drafts per round equals plain
    decoding's (two-sample chi-square, 1200 seeds per arm, ALPHA), with the MTP drafter and
    with the forced drafter; a planted rule that accepts every allowed draft fails the same
    test (p < BIASED_MAX_P)."""
    res = run_distribution_check(torch.device("cuda"))
    accepted, drafted, full = res["accepted_forced"]
    assert drafted // 5 < accepted < drafted and full > 0, res  # accepts, rejections (residual) and bonus draws
    assert res["mtp"] > ALPHA and res["forced"] > ALPHA, res
    assert res["biased"] < BIASED_MAX_P, res
