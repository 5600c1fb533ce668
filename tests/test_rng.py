"""Counter-based RNG: Python == torch, determinism, uniformity, Gumbel noise."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from hyspec.rng import (
    _philox4x32_tensor,
    Stream,
    gumbel_noise,
    gumbel_noise_batch,
    philox4x32,
    u01,
    u01_tensor,
)

ALPHA = 1e-3  # significance level of every goodness-of-fit test below (fixed seeds)


def test_philox_known_answer() -> None:
    # Random123 known-answer vectors for Philox-4x32-10.
    assert philox4x32(0, 0, 0, 0, 0, 0) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32(
        0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0
    ) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)
    m = 0xFFFFFFFF
    assert philox4x32(m, m, m, m, m, m) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    # the int64 tensor version on the same vectors
    words = torch.tensor([[0, 0, 0, 0], [m, m, m, m]], dtype=torch.int64)
    out = _philox4x32_tensor(*words.T, 0, 0)
    assert [int(w[0]) for w in out] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    out = _philox4x32_tensor(*words.T, m, m)
    assert [int(w[1]) for w in out] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_python_equals_torch() -> None:
    counters = torch.cat(
        [
            torch.arange(0, 300, dtype=torch.int64),
            torch.tensor([2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**62 + 11, 2**63 - 1]),
            torch.randint(0, 2**62, (200,), generator=torch.Generator().manual_seed(1)),
        ]
    )
    for seed in (0, 1, 12345, 2**32 + 5, 2**64 - 1, -3):
        for stream in (Stream.DRAFT, Stream.COUPLED, 0, 2**32 - 1):
            t = u01_tensor(seed, stream, counters)
            assert t.dtype == torch.float64 and t.shape == counters.shape
            py = torch.tensor([u01(seed, stream, int(c)) for c in counters], dtype=torch.float64)
            assert torch.equal(t, py), (seed, stream)


def test_tensor_shape_preserved() -> None:
    c = torch.arange(24).reshape(2, 3, 4)
    u = u01_tensor(7, Stream.PLAIN, c)
    assert u.shape == (2, 3, 4)
    assert u[1, 2, 3].item() == u01(7, Stream.PLAIN, 23)


def test_determinism_and_independence_of_keys() -> None:
    assert u01(42, Stream.ACCEPT, 10) == u01(42, Stream.ACCEPT, 10)
    base = u01(42, Stream.ACCEPT, 10)
    assert u01(43, Stream.ACCEPT, 10) != base
    assert u01(42, Stream.RESIDUAL, 10) != base
    assert u01(42, Stream.ACCEPT, 11) != base
    # streams must not be shifted copies of each other
    a = u01_tensor(5, Stream.DRAFT, torch.arange(1000))
    b = u01_tensor(5, Stream.ACCEPT, torch.arange(1000))
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.15
    assert not torch.equal(a[1:], b[:-1])


def test_open_interval_and_resolution() -> None:
    u = u01_tensor(3, Stream.PLAIN, torch.arange(50_000))
    assert bool((u > 0).all()) and bool((u < 1).all())
    # values sit on the 53-bit grid
    m = u * 2.0**53
    assert torch.equal(m, torch.round(m))
    # more than 32 bits of resolution are actually used
    assert bool(((m % 2**21) != 0).any())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        u01(0, 1, -1)
    with pytest.raises(ValueError):
        u01(0, 1, 2**64)
    with pytest.raises(ValueError):
        u01(0, 2**32, 0)
    with pytest.raises(ValueError):
        u01_tensor(0, 1, torch.tensor([-5]))
    with pytest.raises(TypeError):
        u01_tensor(0, 1, torch.tensor([0.5]))


def test_uniformity_chi_square() -> None:
    n, bins = 200_000, 100
    u = u01_tensor(2024, Stream.PLAIN, torch.arange(n))
    obs = torch.bincount((u * bins).long(), minlength=bins).numpy()
    res = stats.chisquare(obs)
    assert res.pvalue > ALPHA, res


def test_uniformity_pairs_chi_square() -> None:
    # Consecutive counters: the 2-D histogram of (u_i, u_{i+1}) is uniform too.
    n, side = 200_000, 10
    u = u01_tensor(99, Stream.DRAFT, torch.arange(2 * n)).reshape(n, 2)
    cell = (u[:, 0] * side).long() * side + (u[:, 1] * side).long()
    obs = torch.bincount(cell, minlength=side * side).numpy()
    res = stats.chisquare(obs)
    assert res.pvalue > ALPHA, res


def test_kolmogorov_smirnov_across_seeds() -> None:
    # Same counter, many seeds: also uniform.
    u = torch.tensor([u01(s, Stream.BONUS, 0) for s in range(5000)])
    res = stats.kstest(u.numpy(), "uniform")
    assert res.pvalue > ALPHA, res


def test_gumbel_noise_matches_u01() -> None:
    seed, pos, V = 11, 37, 50
    g = gumbel_noise(seed, Stream.COUPLED, pos, V)
    assert g.shape == (V,) and g.dtype == torch.float64
    for i in (0, 1, 17, 49):
        u = u01(seed, Stream.COUPLED, pos * 2**32 + i)
        assert g[i].item() == -math.log(-math.log(u))
    # noise of token i does not depend on the vocabulary size
    assert torch.equal(gumbel_noise(seed, Stream.COUPLED, pos, 20), g[:20])
    batch = gumbel_noise_batch(seed, Stream.COUPLED, torch.tensor([pos, 0, 5]), V)
    assert torch.equal(batch[0], g)
    assert torch.equal(batch[2], gumbel_noise(seed, Stream.COUPLED, 5, V))
    with pytest.raises(ValueError):
        gumbel_noise(seed, Stream.COUPLED, 2**31, V)


def test_gumbel_distribution() -> None:
    g = gumbel_noise_batch(1, Stream.COUPLED, torch.arange(2000), 50).reshape(-1)  # 100k
    assert torch.isfinite(g).all()
    res = stats.kstest(g.numpy(), stats.gumbel_r.cdf)
    assert res.pvalue > ALPHA, res
    assert abs(g.mean().item() - 0.5772156649) < 0.02
