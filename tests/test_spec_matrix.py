"""Greedy speculative decoding equals plain decoding, token for token, over 200 new tokens,
across the whole option space -- covered pairwise to keep it fast.

Factors: checkpoint source (make_tiny / transformers save_pretrained + mtp.*), family,
dtype (float64 / float32), K in {1, 2, 3, 5}, rollback strategy, options (none / adaptive
K / p_min / both), drafter (the checkpoint's random MTP head, a cooperative MTP head that
agrees with the target part of the time, the forced drafter at rates 1.0, 0.7, 0.0) and
how the loop starts (the prefill's token pending, or the no-pending first round).
The runs are a greedy covering array: every pair of values of any two factors occurs in
some run, and every (source, family, dtype) checkpoint runs at least once
(test_design_covers_all_pairs checks it); ties go to the cheaper run.
"""

from __future__ import annotations

import itertools

import pytest

from conftest import ARCHS, DTYPES, PROMPT, SOURCES
from hyspec.speculative.loop import SpecOptions, generate_speculative

N_NEW = 200
KS = (1, 2, 3, 5)
ROLLBACKS = ("checkpoint", "rescan", "replay")
MODES = ("none", "adaptive", "p_min", "adaptive+p_min")
DRAFTERS = ("mtp", "coop", "forced1.0", "forced0.7", "forced0.0")
P_MIN = 0.0031  # about the median top probability of the tiny models' MTP rows: cuts about half the drafts

STARTS = ("pending", "no_pending")  # SpecOptions.prime_pending True / False

FACTORS = ("source", "arch", "dtype", "k", "rollback", "mode", "drafter", "start")


def _cost(row: dict) -> float:
    """Rough relative run time: rounds x (verify rows + MTP steps) x family weight; used
    only to prefer cheap runs among those covering the same new pairs."""
    acc = {"mtp": 0.0, "forced0.0": 0.0, "coop": 0.4, "forced0.7": 0.7, "forced1.0": 1.0}[row["drafter"]]
    k = row["k"]
    if "p_min" in row["mode"] and row["drafter"] in ("mtp", "coop"):
        k = 1
    if row["mode"].startswith("adaptive") and acc == 0.0:
        k = min(2, k) if row["mode"] == "adaptive+p_min" else 1
    rounds = N_NEW / (1 + sum(acc ** (d + 1) for d in range(k)))
    family = {"qwen3_5": 1.0, "qwen3_next": 1.5, "qwen3_5_moe": 1.6}[row["arch"]]
    return rounds * (1 + 0.6 * k) * family


def _requirements(row: dict) -> set:
    reqs = {(f1, row[f1], f2, row[f2]) for f1, f2 in itertools.combinations(FACTORS, 2)}
    reqs.add(("model", row["source"], row["arch"], row["dtype"]))  # every checkpoint/dtype runs
    return reqs


def _design() -> list[dict]:
    """Greedy covering array: repeatedly add the run that covers the most uncovered
    requirements (all value pairs of two factors, and every (source, family, dtype)),
    the cheapest such run on ties."""
    levels = {"source": SOURCES, "arch": ARCHS, "dtype": DTYPES, "k": KS, "rollback": ROLLBACKS,
              "mode": MODES, "drafter": DRAFTERS, "start": STARTS}
    candidates = [dict(zip(FACTORS, vals)) for vals in itertools.product(*(levels[f] for f in FACTORS))]
    uncovered = set().union(*(_requirements(c) for c in candidates))
    rows = []
    while uncovered:
        best = max(candidates, key=lambda c: (len(_requirements(c) & uncovered), -_cost(c)))
        uncovered -= _requirements(best)
        rows.append(best)
    return rows


DESIGN = _design()


def _id(row: dict) -> str:
    return "-".join(str(row[f]) for f in FACTORS)


def test_design_covers_all_pairs():
    all_levels = {"source": SOURCES, "arch": ARCHS, "dtype": DTYPES, "k": KS, "rollback": ROLLBACKS,
                  "mode": MODES, "drafter": DRAFTERS, "start": STARTS}
    for f1, f2 in itertools.combinations(FACTORS, 2):
        seen = {(r[f1], r[f2]) for r in DESIGN}
        missing = set(itertools.product(all_levels[f1], all_levels[f2])) - seen
        assert not missing, (f1, f2, missing)


from spec_helpers import RoundLog  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("case", DESIGN, ids=_id)
def test_speculative_equals_plain(zoo, case):
    k, mode, drafter = case["k"], case["mode"], case["drafter"]
    adaptive = mode.startswith("adaptive")
    floor = min(2, k) if mode == "adaptive+p_min" else 1
    forced = tuple([float(drafter[len("forced"):])]) if drafter.startswith("forced") else None
    prime = case["start"] == "pending"
    opts = SpecOptions(k=k, rollback=case["rollback"], adaptive=adaptive, adaptive_floor=floor,
                       p_min=P_MIN if "p_min" in mode else 0.0, forced_rates=forced, forced_seed=k,
                       prime_pending=prime)
    variant = "coop" if drafter == "coop" else "plain"
    m = zoo.model(case["source"], case["arch"], case["dtype"], variant)
    ref = zoo.plain(case["source"], case["arch"], case["dtype"], N_NEW)
    tel = RoundLog()
    res = generate_speculative(m, PROMPT, max_new_tokens=N_NEW, opts=opts, reference=ref, telemetry=tel)

    assert res.tokens == ref  # the invariant
    assert res.stop_reason == "length"
    # telemetry totals: every round emits accepted + 1; with a pending start the prefill
    # emitted the first token. (No pending: a first step with no draft to verify takes the
    # prefill row's token outside any round.)
    assert tel.accepted <= tel.drafted
    assert res.stats["generated_tokens"] == N_NEW
    extra = N_NEW - tel.accepted - tel.rounds
    assert extra == 1 if prime else extra in (0, 1)
    assert res.stats["spec"] == tel.to_dict()
    assert res.stats["target_forwards"] == tel.rounds
    assert all(0 <= a <= d <= k for d, a in tel.log)
    # round structure: k_r = min(k_next, remaining - 1), k_next adapted from the last round
    # (the no-pending first round verifies no pending token: k_r = min(k, remaining))
    emitted, k_next = (1 if prime else extra), k
    for r, (d, a) in enumerate(tel.log):
        cap = min(k_next, N_NEW - emitted - 1) if (prime or r > 0 or extra) else min(k_next, N_NEW)
        if "p_min" in mode and forced is None:
            assert d <= cap  # p_min may stop a draft early
        else:
            assert d == cap
        emitted += a + 1
        if adaptive:
            k_next = max(floor, min(a + 1, k))
    if forced == (1.0,):
        assert tel.accepted == tel.drafted
    if forced == (0.0,) or drafter == "mtp":
        assert tel.accepted <= 0.05 * tel.drafted  # the random head: (almost) never right
    if drafter == "coop" and "p_min" not in mode:
        assert 0 < tel.accepted < tel.drafted
