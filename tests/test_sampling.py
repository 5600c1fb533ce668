"""Sampling: parameters, penalties, filters, inverse CDF, and lossless speculative sampling.

Every statistical test uses fixed seeds (so it is deterministic) and the significance
level ALPHA.  The "biased rule" tests show that the same tests do detect a wrong rule:
their p-values must fall below BIASED_MAX_P.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from scipy import stats

from hyspec.rng import Stream, gumbel_noise_batch, u01, u01_tensor
from hyspec.sampling import (
    SamplingParams,
    accept_or_resample,
    apply_penalties,
    coupled_speculative,
    coupled_token,
    draft_token,
    filter_probs,
    greedy_token,
    plain_token,
    row_probs,
    sample_index,
    speculative_sample,
)

ALPHA = 1e-3
BIASED_MAX_P = 1e-6
F64 = torch.float64


# --------------------------------------------------------------------------------------
# Vectorised twins of the package's one-row rules, for drawing tens of thousands of
# samples per statistical test. Test-only (the package samples row by row); each is
# checked against its scalar rule below (test_sample_indices_distribution,
# test_batch_matches_scalar, test_coupled_token_distribution).
# --------------------------------------------------------------------------------------


def sample_indices(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Vectorised hyspec.sampling.sample_index (same rule, checked against it below).

    probs: [V] (shared by every draw) or [N, V], non-negative, need not be exactly
    normalised; u: [N] uniforms in (0, 1).  Returns LongTensor [N].

    The target ``u * total`` is located in the float64 cumulative sum with
    ``searchsorted(right=True)`` (first index whose cumulative mass exceeds it); such an
    index always has positive probability.  If rounding puts the target at or past the
    final cumulative value, the last token with positive probability is returned.
    """
    p = probs.to(torch.float64)
    u = u.to(device=p.device, dtype=torch.float64).reshape(-1)  # [N]
    N = u.shape[0]
    if p.dim() == 1:
        p = p.unsqueeze(0).expand(N, -1)  # [N, V]
    if p.dim() != 2 or p.shape[0] != N:
        raise ValueError(f"probs {tuple(probs.shape)} does not match u [{N}]")
    if bool((p < 0).any()):
        raise ValueError("probabilities must be non-negative")
    cdf = torch.cumsum(p, dim=-1)  # [N, V]
    total = cdf[:, -1]  # [N]
    if not bool((total > 0).all()):
        raise ValueError("a probability row has zero total mass")
    target = (u * total).unsqueeze(-1)  # [N, 1]
    idx = torch.searchsorted(cdf.contiguous(), target, right=True).squeeze(-1)  # [N]
    V = p.shape[1]
    last_pos = (V - 1) - torch.argmax(torch.flip(p > 0, dims=[-1]).to(torch.int8), dim=-1)
    return torch.where(idx >= V, last_pos, idx)


def accept_or_resample_batch(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    u_accept: torch.Tensor,
    u_resid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised :func:`accept_or_resample` over N independent steps.

    p, q: [V] (shared) or [N, V]; drafts, u_accept, u_resid: [N].
    Returns (accepted bool [N], token long [N]) where token is the residual draw for
    rejected rows and -1 for accepted rows.
    """
    N = drafts.shape[0]
    p64 = p.to(torch.float64)
    q64 = q.to(torch.float64)
    P = p64.unsqueeze(0).expand(N, -1) if p64.dim() == 1 else p64  # [N, V]
    Q = q64.unsqueeze(0).expand(N, -1) if q64.dim() == 1 else q64  # [N, V]
    d = drafts.to(torch.int64).unsqueeze(-1)  # [N, 1]
    pd = P.gather(-1, d).squeeze(-1)  # [N]
    qd = Q.gather(-1, d).squeeze(-1)  # [N]
    accepted = u_accept.to(torch.float64) * qd < pd  # [N]
    resid = torch.clamp(P - Q, min=0.0)  # [N, V]
    empty = ~(resid.sum(dim=-1) > 0)  # [N]
    resid = torch.where(empty.unsqueeze(-1), P, resid)
    drawn = sample_indices(resid, u_resid)  # [N]
    return accepted, torch.where(accepted, torch.full_like(drawn, -1), drawn)


def coupled_tokens(probs: torch.Tensor, seed: int, positions: torch.Tensor) -> torch.Tensor:
    """Vectorised :func:`coupled_token`: probs [V] or [N, V], positions [N] -> LongTensor [N]."""
    p = probs.to(torch.float64)
    pos = positions.reshape(-1)
    g = gumbel_noise_batch(seed, Stream.COUPLED, pos, p.shape[-1], device=p.device)  # [N, V]
    p = p.unsqueeze(0).expand_as(g) if p.dim() == 1 else p
    score = torch.where(p > 0, torch.log(p) + g, torch.full_like(g, -math.inf))
    return torch.argmax(score, dim=-1)


def _t(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def _chi2_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square goodness of fit of token counts to p (zero-probability tokens must not occur)."""
    V = p.shape[0]
    counts = torch.bincount(tokens, minlength=V).to(F64)
    support = p > 0
    assert counts[~support].sum().item() == 0, "a zero-probability token was emitted"
    obs = counts[support].numpy()
    exp = (p[support] / p[support].sum()).numpy() * obs.sum()
    return float(stats.chisquare(obs, exp).pvalue)


# --------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("top_k", -1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("penalty_last_n", -2),
        ("mode", "nucleus"),
    ],
)
def test_params_validation_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value) and repr(value) in str(e.value)


def test_params_defaults_and_greedy() -> None:
    p = SamplingParams()
    assert not p.greedy and p.mode == "rejection" and p.penalty_last_n == 64
    assert SamplingParams(temperature=0).greedy
    assert not p.has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert not SamplingParams(repetition_penalty=1.1, penalty_last_n=0).has_penalties
    with pytest.raises(AttributeError):
        p.temperature = 2.0  # type: ignore[misc]  # frozen


# --------------------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    before = logits.clone()
    out = apply_penalties(logits, [0, 1, 1, 4], SamplingParams(repetition_penalty=2.0))
    assert torch.equal(logits, before)  # input untouched
    assert torch.allclose(out, torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0]))


def test_frequency_and_presence_penalties() -> None:
    logits = torch.zeros(4)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [2, 2, 2, 0], params)
    assert torch.allclose(out, torch.tensor([-0.75, 0.0, -1.75, 0.0]))


def test_penalty_window() -> None:
    logits = torch.ones(5)
    hist = [3, 3, 0, 1]
    params = SamplingParams(presence_penalty=1.0, penalty_last_n=2)
    assert torch.equal(apply_penalties(logits, hist, params), torch.tensor([0.0, 0, 1, 1, 1]))
    params = SamplingParams(presence_penalty=1.0, penalty_last_n=-1)
    assert torch.equal(apply_penalties(logits, hist, params), torch.tensor([0.0, 0, 1, 0, 1]))
    params = SamplingParams(presence_penalty=1.0, penalty_last_n=0)
    assert torch.equal(apply_penalties(logits, hist, params), logits)
    # history as a tensor; ids outside the vocabulary are ignored
    params = SamplingParams(presence_penalty=1.0, penalty_last_n=3)
    out = apply_penalties(logits, torch.tensor([0, 7, 2]), params)
    assert torch.equal(out, torch.tensor([0.0, 1, 0, 1, 1]))
    # a history shorter than the window: all of it (len 3 < 4 <= 2 * len once sliced from the end)
    params = SamplingParams(presence_penalty=1.0, penalty_last_n=4)
    assert torch.equal(apply_penalties(logits, [0, 3, 1], params), torch.tensor([0.0, 0, 1, 0, 1]))


def test_penalties_keep_forbidden_tokens_forbidden() -> None:
    logits = torch.tensor([-math.inf, 1.0, 2.0])
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
    out = apply_penalties(logits, [0, 1], params)
    assert out[0] == -math.inf and out[1] < 1.0 and out[2] == 2.0


# --------------------------------------------------------------------------------------
# Filters
# --------------------------------------------------------------------------------------


def test_temperature_only_is_softmax() -> None:
    logits = torch.tensor([1.0, 2.0, -0.5, 0.0])
    probs = filter_probs(logits, SamplingParams(temperature=0.7))
    assert probs.dtype == F64
    assert torch.allclose(probs, torch.softmax(logits.double() / 0.7, -1), atol=1e-15)


def test_greedy_is_one_hot_lowest_id() -> None:
    probs = filter_probs(torch.tensor([1.0, 3.0, 3.0, 0.0]), SamplingParams(temperature=0))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert greedy_token(torch.tensor([1.0, 3.0, 3.0, 0.0])) == 1
    assert greedy_token(torch.tensor([5.0, 5.0])) == 0


def test_top_k_with_ties_keeps_lowest_ids() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0])
    probs = filter_probs(logits, SamplingParams(top_k=2))
    assert probs.tolist() == [0.0, 0.5, 0.5, 0.0, 0.0]
    # permuting equal logits changes which ids win, consistently by id
    probs = filter_probs(torch.tensor([3.0, 1.0, 3.0, 0.0, 3.0]), SamplingParams(top_k=2))
    assert probs.tolist() == [0.5, 0.0, 0.5, 0.0, 0.0]
    # top_k >= V is a no-op
    assert torch.allclose(
        filter_probs(logits, SamplingParams(top_k=9)), filter_probs(logits, SamplingParams())
    )


def _logits_of(p: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(x) if x > 0 else -math.inf for x in p], dtype=F64)


def test_top_k_one_below_the_vocabulary_drops_the_last_ranked_token() -> None:
    """top_k = V - 1 is a real cut (only top_k >= V is a no-op): the lowest-ranked token
    (among equal logits, the highest id) gets probability 0 and the rest renormalise."""
    logits = torch.tensor([0.5, 2.0, 0.5, 1.0, -1.0])
    probs = filter_probs(logits, SamplingParams(top_k=4))
    assert (probs > 0).tolist() == [True, True, True, True, False]
    assert torch.allclose(probs[:4], filter_probs(logits[:4], SamplingParams()), atol=1e-15)
    ties = filter_probs(torch.zeros(4), SamplingParams(top_k=3))
    assert ties.tolist() == [1 / 3, 1 / 3, 1 / 3, 0.0]


def test_positive_infinite_logits_are_non_finite_logits() -> None:
    """A +inf logit (an overflowed activation, without NaN) is NonFiniteLogits in every mode,
    as a NaN is: the engine ends only that sequence on it. Let through, a sampled row
    would be NaN probabilities (a plain ValueError from the draw, the whole batch's), and a
    greedy row a one-hot on the overflowed token."""
    from hyspec.sampling import NonFiniteLogits

    row = torch.tensor([0.0, math.inf, 1.0, -math.inf])
    for params in (SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=2, top_p=0.9),
                   SamplingParams(mode="coupled", min_p=0.1)):
        with pytest.raises(NonFiniteLogits):
            filter_probs(row, params)
        with pytest.raises(NonFiniteLogits):
            filter_probs(torch.stack([torch.zeros(4), row]), params)
    with pytest.raises(NonFiniteLogits):
        greedy_token(row)


def test_top_p() -> None:
    logits = _logits_of([0.15, 0.5, 0.05, 0.3])
    keep = lambda tp: (filter_probs(logits, SamplingParams(top_p=tp)) > 0).tolist()  # noqa: E731
    assert keep(0.4) == [False, True, False, False]  # top token always kept
    assert keep(0.75) == [False, True, False, True]  # 0.5 < 0.75 <= 0.8
    assert keep(0.81) == [True, True, False, True]
    assert keep(1.0) == [True, True, True, True]
    probs = filter_probs(logits, SamplingParams(top_p=0.75))
    assert torch.allclose(probs, _t([0, 0.625, 0, 0.375]), atol=1e-12)


def test_top_p_after_top_k_uses_renormalised_mass() -> None:
    logits = _logits_of([0.4, 0.3, 0.2, 0.1])
    # top_p alone keeps {0, 1}; after top_k=2 the kept mass is [4/7, 3/7] and 4/7 >= 0.5
    assert (filter_probs(logits, SamplingParams(top_p=0.5)) > 0).sum() == 2
    probs = filter_probs(logits, SamplingParams(top_k=2, top_p=0.5))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_p() -> None:
    logits = _logits_of([0.5, 0.3, 0.15, 0.05])
    probs = filter_probs(logits, SamplingParams(min_p=0.2))  # threshold 0.1
    assert torch.allclose(probs, _t([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=1e-12)
    probs = filter_probs(logits, SamplingParams(min_p=0.61))  # threshold 0.305
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_filters_batch_rows_match_single_rows_and_forbid_inf() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g)
    logits[:, 5] = -math.inf
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)
    batch = filter_probs(logits, params)
    assert batch.shape == (6, 40)
    for i in range(6):
        assert torch.equal(batch[i], filter_probs(logits[i], params))
    assert bool((batch[:, 5] == 0).all())
    assert torch.allclose(batch.sum(-1), torch.ones(6, dtype=F64), atol=1e-12)
    with pytest.raises(ValueError):
        filter_probs(torch.full((3,), -math.inf), params)


def test_row_probs_is_penalties_then_filters() -> None:
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert row_probs(logits, [0], params).tolist() == [0.0, 1.0, 0.0, 0.0]
    params = SamplingParams(temperature=0.9, top_k=3, presence_penalty=0.5)
    expected = filter_probs(apply_penalties(logits, [1, 2], params), params)
    assert torch.equal(row_probs(logits, [1, 2], params), expected)


# --------------------------------------------------------------------------------------
# Inverse-CDF sampling
# --------------------------------------------------------------------------------------


def test_sample_index_edges() -> None:
    p = _t([0.0, 0.5, 0.0, 0.5])
    assert sample_index(p, 2.0**-54) == 1
    assert sample_index(p, 0.5 - 2.0**-53) == 1
    assert sample_index(p, 0.5) == 3
    assert sample_index(p, 1 - 2.0**-53) == 3
    # trailing zeros are never returned, even when u * total rounds up to the total
    p = _t([0.3, 0.7, 0.0, 0.0])
    assert sample_index(p, 1 - 2.0**-53) == 1
    # unnormalised rows are scaled by their total
    assert sample_index(_t([0.0, 2.0, 2.0]), 0.49) == 1
    with pytest.raises(ValueError):
        sample_index(_t([0.0, 0.0]), 0.5)


def test_sample_index_subnormal_mass_never_returns_a_zero_token() -> None:
    """A row whose total mass is a few subnormal units (a residual max(0, p - q) whose only
    positive entries are differences of tiny probabilities): u * total rounds up to the total
    itself, the search falls off the end, and the draw must be the last token with positive
    probability, not the row's last id (a zero-probability token). With a normal total,
    u <= 1 - 2**-53 keeps u * total below it, so only such rows reach that branch."""
    unit = 5e-324  # the smallest subnormal double
    p = _t([0.0, 3 * unit, 0.0, 2 * unit, 0.0, 0.0])
    for u in (0.95, 0.999, 1 - 2.0**-53):
        assert sample_index(p, u) == 3, u
    assert sample_index(p, 2.0**-54) == 1


def test_sample_indices_overflow_guard() -> None:
    # A row whose float cumsum exceeds 1: u * total may land on the last cumulative value.
    p = torch.full((10,), 0.1, dtype=F64)
    p = torch.cat([p, torch.zeros(3, dtype=F64)])
    u = torch.tensor([1 - 2.0**-53] * 4, dtype=F64)
    assert sample_indices(p, u).tolist() == [9, 9, 9, 9]


def test_sample_indices_distribution() -> None:
    p = _t([0.1, 0.0, 0.25, 0.05, 0.3, 0.0, 0.3])
    u = u01_tensor(8, Stream.PLAIN, torch.arange(40_000))
    tokens = sample_indices(p, u)
    assert _chi2_pvalue(tokens, p) > ALPHA
    # scalar version agrees
    for i in range(50):
        assert sample_index(p, float(u[i])) == int(tokens[i])


# --------------------------------------------------------------------------------------
# Accept / residual: pure-function cases
# --------------------------------------------------------------------------------------

U_GRID = [2.0**-54, 1e-9, 0.1, 0.5, 0.9, 0.999999, 1 - 2.0**-53]


def test_accept_when_q_zero_and_p_positive() -> None:
    p, q = _t([0.5, 0.5, 0.0]), _t([0.0, 0.5, 0.5])
    for u in U_GRID:
        assert accept_or_resample(p, q, 0, u, 0.3) == (True, None)


def test_reject_when_p_zero_and_residual_from_p_minus_q() -> None:
    p, q = _t([0.5, 0.5, 0.0]), _t([0.0, 0.5, 0.5])
    for u in U_GRID:
        ok, tok = accept_or_resample(p, q, 2, u, u)
        assert not ok
        assert tok == 0  # residual max(0, p - q) = [0.5, 0, 0] -> only token 0


def test_identical_p_q_always_accepts() -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.rand(12, generator=g, dtype=F64)
    p[4] = 0.0
    p /= p.sum()
    for d in range(12):
        if p[d] == 0:
            continue
        for u in U_GRID:
            assert accept_or_resample(p, p.clone(), d, u, 0.5) == (True, None)
    # an invalid draft (q[d] = p[d] = 0) rejects; the empty residual falls back to p
    ok, tok = accept_or_resample(p, p.clone(), 4, 0.5, 0.5)
    assert not ok and tok == sample_index(p, 0.5)


def test_disjoint_supports_always_reject_and_residual_is_p() -> None:
    p = _t([0.2, 0.0, 0.5, 0.0, 0.3])
    q = _t([0.0, 0.6, 0.0, 0.4, 0.0])
    for d in (1, 3):
        for u in U_GRID:
            ok, tok = accept_or_resample(p, q, d, u, u)
            assert not ok
            assert tok == sample_index(p, u)
    # residual draws are distributed as p
    n = 20_000
    drafts = sample_indices(q, u01_tensor(1, Stream.DRAFT, torch.arange(n)))
    acc, tok = accept_or_resample_batch(
        p,
        q,
        drafts,
        u01_tensor(1, Stream.ACCEPT, torch.arange(n)),
        u01_tensor(1, Stream.RESIDUAL, torch.arange(n)),
    )
    assert not bool(acc.any())
    assert _chi2_pvalue(tok, p) > ALPHA


def test_batch_matches_scalar() -> None:
    g = torch.Generator().manual_seed(5)
    V, n = 9, 300
    P = torch.rand(n, V, generator=g, dtype=F64) * (torch.rand(n, V, generator=g) > 0.3)
    Q = torch.rand(n, V, generator=g, dtype=F64) * (torch.rand(n, V, generator=g) > 0.3)
    P[:, 0] += 0.01  # every row has mass
    Q[:, 0] += 0.01
    P /= P.sum(-1, keepdim=True)
    Q /= Q.sum(-1, keepdim=True)
    Q[:7] = P[:7]  # some rows with p == q
    ua = u01_tensor(2, Stream.ACCEPT, torch.arange(n))
    ur = u01_tensor(2, Stream.RESIDUAL, torch.arange(n))
    drafts = sample_indices(Q, u01_tensor(2, Stream.DRAFT, torch.arange(n)))
    acc, tok = accept_or_resample_batch(P, Q, drafts, ua, ur)
    for i in range(n):
        ok, t = accept_or_resample(P[i], Q[i], int(drafts[i]), float(ua[i]), float(ur[i]))
        assert ok == bool(acc[i])
        assert (t if t is not None else -1) == int(tok[i])


# --------------------------------------------------------------------------------------
# One speculative step is distributed as p; biased rules are caught
# --------------------------------------------------------------------------------------

P_TEST = _t([0.30, 0.05, 0.0, 0.20, 0.10, 0.25, 0.10, 0.0])
Q_TEST = _t([0.05, 0.30, 0.15, 0.20, 0.0, 0.10, 0.10, 0.10])
N_LARGE = 40_000


def _one_step(rule: str, seed: int = 17) -> torch.Tensor:
    """Draft from Q_TEST, then accept/resample against P_TEST for N_LARGE positions."""
    pos = torch.arange(N_LARGE)
    drafts = sample_indices(Q_TEST, u01_tensor(seed, Stream.DRAFT, pos))  # [N]
    ua = u01_tensor(seed, Stream.ACCEPT, pos)
    ur = u01_tensor(seed, Stream.RESIDUAL, pos)
    if rule == "correct":
        acc, tok = accept_or_resample_batch(P_TEST, Q_TEST, drafts, ua, ur)
        return torch.where(acc, drafts, tok)
    pd, qd = P_TEST[drafts], Q_TEST[drafts]
    if rule == "loose_accept":  # accept when u * q < 1.2 p
        acc = ua * qd < 1.2 * pd
        resid = torch.clamp(P_TEST - Q_TEST, min=0)
    elif rule == "residual_is_p":  # resample from p instead of max(0, p - q)
        acc = ua * qd < pd
        resid = P_TEST
    else:
        raise AssertionError(rule)
    return torch.where(acc, drafts, sample_indices(resid, ur))


def test_speculative_step_distribution_is_p() -> None:
    tokens = _one_step("correct")
    assert _chi2_pvalue(tokens, P_TEST) > ALPHA
    # also with another seed
    assert _chi2_pvalue(_one_step("correct", seed=18), P_TEST) > ALPHA


@pytest.mark.parametrize("rule", ["loose_accept", "residual_is_p"])
def test_biased_rules_fail_the_same_test(rule: str) -> None:
    tokens = _one_step(rule)
    counts = torch.bincount(tokens, minlength=8).to(F64)
    support = P_TEST > 0
    pvalue = _chi2_pvalue(tokens, P_TEST) if counts[~support].sum() == 0 else 0.0
    assert pvalue < BIASED_MAX_P, (rule, pvalue)


# --------------------------------------------------------------------------------------
# speculative_sample over k = 3 rows
# --------------------------------------------------------------------------------------

P_ROWS = torch.stack(
    [
        _t([0.40, 0.10, 0.0, 0.25, 0.25, 0.0]),
        _t([0.05, 0.45, 0.20, 0.0, 0.10, 0.20]),
        _t([0.20, 0.20, 0.20, 0.20, 0.10, 0.10]),
        _t([0.0, 0.0, 0.5, 0.5, 0.0, 0.0]),
    ]
)  # [k+1=4, V=6]
Q_ROWS = torch.stack(
    [
        _t([0.10, 0.40, 0.10, 0.20, 0.10, 0.10]),
        _t([0.20, 0.30, 0.30, 0.10, 0.10, 0.0]),
        _t([0.50, 0.10, 0.10, 0.10, 0.10, 0.10]),
    ]
)  # [k=3, V=6]


def _round(seed: int, pos: int) -> tuple[list[int], int, int]:
    drafts = [draft_token(Q_ROWS[j], seed, pos + j) for j in range(3)]
    n, nxt = speculative_sample(P_ROWS, Q_ROWS, drafts, seed, pos)
    return drafts, n, nxt


def test_speculative_sample_counter_scheme() -> None:
    seed = 77
    for pos in (0, 5, 1000, 2**40):
        drafts, n, nxt = _round(seed, pos)
        # recompute with the documented streams and counters
        for j in range(3):
            ok, tok = accept_or_resample(
                P_ROWS[j],
                Q_ROWS[j],
                drafts[j],
                u01(seed, Stream.ACCEPT, pos + j),
                u01(seed, Stream.RESIDUAL, pos + j),
            )
            if not ok:
                assert (n, nxt) == (j, tok)
                break
        else:
            assert (n, nxt) == (3, sample_index(P_ROWS[3], u01(seed, Stream.BONUS, pos + 3)))
        assert (n, nxt) == speculative_sample(P_ROWS, Q_ROWS, torch.tensor(drafts), seed, pos)


def test_speculative_sample_full_accept_and_k0() -> None:
    p_rows = P_ROWS.clone()
    p_rows[:3] = Q_ROWS  # p == q: every draft accepted, bonus from row 3
    drafts = [draft_token(Q_ROWS[j], 3, 10 + j) for j in range(3)]
    n, nxt = speculative_sample(p_rows, Q_ROWS, drafts, 3, 10)
    assert n == 3 and nxt == sample_index(P_ROWS[3], u01(3, Stream.BONUS, 13))
    n, nxt = speculative_sample(P_ROWS[:1], Q_ROWS[:0], [], 3, 10)
    assert n == 0 and nxt == sample_index(P_ROWS[0], u01(3, Stream.BONUS, 10))
    with pytest.raises(ValueError):
        speculative_sample(P_ROWS[:3], Q_ROWS, drafts, 3, 10)


def test_speculative_sample_emitted_tokens_follow_p_rows() -> None:
    seed, n_trials = 4242, 12_000
    first, second = [], []
    n_acc = np.zeros(4, dtype=np.int64)
    for i in range(n_trials):
        drafts, n, nxt = _round(seed, 4 * i)
        emitted = drafts[:n] + [nxt]
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append(emitted[1])
        n_acc[n] += 1
    assert _chi2_pvalue(torch.tensor(first), P_ROWS[0]) > ALPHA
    # in this synthetic set-up row 1 does not depend on token 0, so the second emitted
    # token (present when draft 0 was accepted) follows p_rows[1]
    assert _chi2_pvalue(torch.tensor(second), P_ROWS[1]) > ALPHA
    # P(draft 0 accepted) = sum(min(p0, q0))
    accept0 = torch.minimum(P_ROWS[0], Q_ROWS[0]).sum().item()
    res = stats.binomtest(int(n_acc[1:].sum()), n_trials, accept0)
    assert res.pvalue > ALPHA


# --------------------------------------------------------------------------------------
# Coupled (Gumbel-max) sampling
# --------------------------------------------------------------------------------------


def test_coupled_token_distribution() -> None:
    p = _t([0.05, 0.0, 0.35, 0.1, 0.2, 0.0, 0.3])
    tokens = coupled_tokens(p, 123, torch.arange(40_000))
    assert _chi2_pvalue(tokens, p) > ALPHA
    for pos in (0, 1, 7, 999, 2**31 - 1):
        assert coupled_token(p, 123, pos) == int(coupled_tokens(p, 123, torch.tensor([pos]))[0])


def test_coupled_token_is_deterministic_and_same_for_equal_rows() -> None:
    p = _t([0.25, 0.25, 0.5])
    assert coupled_token(p, 1, 50) == coupled_token(p.clone(), 1, 50)
    one_hot = _t([0.0, 1.0, 0.0])
    assert all(coupled_token(one_hot, 9, pos) == 1 for pos in range(20))


def test_coupled_speculative_equals_plain_for_any_round_structure() -> None:
    # Context-free synthetic model: position t has target p_t and drafter q_t.
    g = torch.Generator().manual_seed(11)
    T, V, seed = 60, 12, 5
    P = torch.softmax(torch.randn(T + 8, V, generator=g, dtype=F64) * 1.5, -1)
    Q = torch.softmax(torch.log(P) + 0.7 * torch.randn(T + 8, V, generator=g, dtype=F64), -1)
    params = SamplingParams(mode="coupled", seed=seed)
    plain = [plain_token(P[t], params, t) for t in range(T)]
    for k in (1, 2, 4):
        out: list[int] = []
        while len(out) < T:
            t0 = len(out)
            drafts = [coupled_token(Q[t0 + j], seed, t0 + j) for j in range(k)]
            n, nxt = coupled_speculative(P[t0 : t0 + k + 1], drafts, seed, t0)
            out += drafts[:n] + [nxt]
        assert out[:T] == plain, k


def test_plain_token_dispatch() -> None:
    p = _t([0.2, 0.5, 0.3])
    assert plain_token(p, SamplingParams(seed=4), 9) == sample_index(p, u01(4, Stream.PLAIN, 9))
    assert plain_token(p, SamplingParams(seed=4, mode="coupled"), 9) == coupled_token(p, 4, 9)
    one_hot = filter_probs(torch.tensor([0.0, 2.0, 1.0]), SamplingParams(temperature=0))
    assert plain_token(one_hot, SamplingParams(temperature=0), 9) == 1


@pytest.mark.parametrize("kw", [dict(temperature=5e-324), dict(temperature=1e-6), dict(repetition_penalty=1e-38),
                                dict(repetition_penalty=1e5), dict(frequency_penalty=-1e38),
                                dict(presence_penalty=2e4)])
def test_values_that_would_overflow_the_logits_are_refused(kw):
    """A denormal temperature or a huge penalty passed validation and then made the logits
    inf / NaN mid-generation (an engine error, a 500 on the server); now they are refused
    up front with the bounds in the message, and the bounds themselves decode."""
    from hyspec.sampling import ParamError

    with pytest.raises(ParamError, match="must be"):
        SamplingParams(**kw)
    logits = torch.tensor([30.0, -30.0, 5.0, 0.0])
    for edge in (dict(temperature=1e-5), dict(repetition_penalty=1e-4), dict(repetition_penalty=1e4),
                 dict(frequency_penalty=-1e4), dict(presence_penalty=1e4)):
        p = row_probs(logits, [0, 1, 0, 2], SamplingParams(**edge))
        assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-9


@pytest.mark.parametrize("value,why", [
    ({1: 100.5}, "biases must be numbers in [-100, 100]"),
    ({1: math.inf}, "biases must be numbers in [-100, 100]"),
    ({-1: 1.0}, "token ids must be ints >= 0"),
    ({"x": 1.0}, "token ids must be ints >= 0"),
    ({1.5: 1.0}, "token ids must be ints >= 0"),
    ({True: 1.0}, "token ids must be ints >= 0"),
    ([(1, 2.0), (1, 3.0)], "a token id given twice"),
    ([(1, 2.0, 3.0)], "must map token ids to biases"),
    (7, "must map token ids to biases"),
])
def test_logit_bias_is_checked_and_named(value, why) -> None:
    with pytest.raises(ValueError, match=re.escape(why)) as e:
        SamplingParams(logit_bias=value)
    assert "logit_bias" in str(e.value)


def test_logit_bias_forms_and_its_place_before_the_penalties() -> None:
    """{id: bias}, JSON's {"id": bias} and (id, bias) pairs are one sorted tuple; the bias
    is added to the logits first, then the penalties see the biased logits (a repetition
    penalty divides the biased, positive logit); ids past the row are ignored; the input
    row is untouched; greedy takes the argmax of the result (adjusts_logits)."""
    a = SamplingParams(logit_bias={3: -1.5, 0: 2.0})
    assert a.logit_bias == ((0, 2.0), (3, -1.5)) == SamplingParams(logit_bias={"3": -1.5, "0": 2}).logit_bias
    assert SamplingParams(logit_bias=[(3, -1.5), (0, 2.0)]) == a and hash(a) == hash(SamplingParams(logit_bias=a.logit_bias))
    assert SamplingParams(logit_bias=None).logit_bias == () and not SamplingParams().adjusts_logits
    assert a.adjusts_logits and not a.has_penalties
    row = torch.tensor([1.0, -1.0, 0.5, 3.0])
    assert torch.equal(apply_penalties(row, [], a), torch.tensor([3.0, -1.0, 0.5, 1.5]))
    assert torch.equal(row, torch.tensor([1.0, -1.0, 0.5, 3.0]))
    p = SamplingParams(logit_bias={0: 2.0, 9: 50.0}, repetition_penalty=2.0, penalty_last_n=-1)
    assert torch.equal(apply_penalties(row, [0, 1], p), torch.tensor([1.5, -2.0, 0.5, 3.0]))
    assert int(row_probs(row, [], SamplingParams(temperature=0.0, logit_bias={2: 3.0})).argmax()) == 2


def test_logit_bias_through_the_engine_plain_and_speculative(ref_engine) -> None:
    """On the engine core: a -100 bias on greedy's first token moves greedy off it (and it
    never appears), speculative greedy == plain greedy token for token; coupled sampling
    speculative == plain; +100 on one token makes every sampled token that token
    (rejection mode, speculative: the verify rows, residuals and bonus draws are the biased
    ones); an id past the vocabulary is a ValueError naming logit_bias."""
    eng, prompt = ref_engine, "def read_file(path):"
    first = eng.generate(prompt, max_new_tokens=1, ignore_eos=True).samples[0].tokens[0]
    g = SamplingParams(temperature=0.0, logit_bias={first: -100})
    plain, spec = (eng.generate(prompt, max_new_tokens=24, params=g, draft=d, ignore_eos=True).samples[0].tokens
                   for d in (0, 3))
    assert plain == spec and first not in plain
    c = SamplingParams(temperature=0.9, seed=5, mode="coupled", logit_bias={first: -100, 13: 3.0})
    plain, spec = (eng.generate(prompt, max_new_tokens=24, params=c, draft=d, ignore_eos=True).samples[0].tokens
                   for d in (0, 3))
    assert plain == spec and first not in plain
    forced = SamplingParams(temperature=1.0, seed=2, logit_bias={455: 100})
    for d in (0, 3):
        assert eng.generate(prompt, max_new_tokens=16, params=forced, draft=d, ignore_eos=True).samples[0].tokens \
            == [455] * 16
    with pytest.raises(ValueError, match=r"logit_bias: token id\(s\) \[4096\] out of range for vocabulary size 4096"):
        eng.generate(prompt, max_new_tokens=2, params=SamplingParams(logit_bias={4096: 1}))
