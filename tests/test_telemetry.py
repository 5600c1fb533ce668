"""SpecTelemetry: depth histogram, tau, saturating deltas, merges, reporting."""

from __future__ import annotations

import json

import pytest

from hyspec.speculative.telemetry import MAX_DEPTH, SpecTelemetry


def _from_masks(masks: list[list[bool]]) -> SpecTelemetry:
    t = SpecTelemetry()
    for mask in masks:
        accepted = 0
        while accepted < len(mask) and mask[accepted]:
            accepted += 1
        t.record_round(len(mask), accepted)
    return t


def test_accept_masks_give_tau_and_depth_histogram() -> None:
    t = _from_masks(
        [[True, True, True], [True, True, False], [True, False, False], [False, False, False]]
    )
    assert (t.rounds, t.drafted, t.accepted) == (4, 12, 6)
    assert t.drafted_at == [4, 4, 4]
    assert t.accepted_at == [3, 2, 1]
    assert t.tau == 1.5
    assert t.acceptance_length == 2.5
    assert t.acceptance_rate == 0.5
    assert t.per_depth_rate() == [0.75, 0.5, 0.25]


def test_empty_telemetry() -> None:
    t = SpecTelemetry()
    assert t.tau == 0.0 and t.acceptance_rate == 0.0 and t.acceptance_length == 0.0
    assert t.per_depth_rate() == []
    assert t == SpecTelemetry(drafted_at=[0, 0], accepted_at=[0])


def test_histogram_grows_with_depth_and_caps() -> None:
    t = SpecTelemetry()
    t.record_round(2, 1)
    t.record_round(5, 5)
    t.record_round(0, 0)  # a round that drafted nothing (e.g. drafter stopped at once)
    assert t.drafted_at == [2, 2, 1, 1, 1]
    assert t.accepted_at == [2, 1, 1, 1, 1]
    assert t.per_depth_rate() == [1.0, 0.5, 1.0, 1.0, 1.0]
    assert (t.rounds, t.drafted, t.accepted) == (3, 7, 6)
    t.record_round(MAX_DEPTH + 4, 2)
    assert len(t.drafted_at) == MAX_DEPTH  # deeper drafts count only in totals
    assert t.drafted == 7 + MAX_DEPTH + 4


def test_record_round_rejects_bad_counts() -> None:
    t = SpecTelemetry()
    with pytest.raises(ValueError):
        t.record_round(2, 3)
    with pytest.raises(ValueError):
        t.record_round(2, -1)
    assert t == SpecTelemetry()


def test_delta_isolates_a_burst() -> None:
    t = SpecTelemetry()
    t.record_round(3, 3)
    t.record_round(3, 1)
    before = t.copy()
    t.record_round(3, 2)
    d = t.delta(before)
    assert (d.rounds, d.drafted, d.accepted) == (1, 3, 2)
    assert d.drafted_at == [1, 1, 1]
    assert d.accepted_at == [1, 1]
    assert d == SpecTelemetry(1, 3, 2, [1, 1, 1], [1, 1, 0])
    # the snapshot was not touched by later recording
    assert (before.rounds, before.drafted_at) == (2, [2, 2, 2])
    assert before + d == t


def test_delta_saturates_never_negative() -> None:
    small = SpecTelemetry(rounds=1, drafted=2, accepted=1, drafted_at=[1, 1], accepted_at=[1])
    big = SpecTelemetry(
        rounds=5, drafted=15, accepted=9, drafted_at=[5, 5, 5], accepted_at=[4, 3, 2]
    )
    d = small.delta(big)
    assert (d.rounds, d.drafted, d.accepted) == (0, 0, 0)
    assert all(x == 0 for x in d.drafted_at + d.accepted_at)
    # mixed: per field and per depth independently
    a = SpecTelemetry(rounds=3, drafted=1, accepted=0, drafted_at=[0, 4], accepted_at=[2])
    b = SpecTelemetry(rounds=1, drafted=5, accepted=0, drafted_at=[3, 1, 7], accepted_at=[])
    d = a.delta(b)
    assert (d.rounds, d.drafted, d.accepted) == (2, 0, 0)
    assert d.drafted_at == [0, 3] and d.accepted_at == [2]


def test_merge_accumulates_fieldwise() -> None:
    agg = SpecTelemetry()
    d1 = SpecTelemetry(rounds=2, drafted=6, accepted=4, drafted_at=[2], accepted_at=[2])
    d2 = SpecTelemetry(rounds=1, drafted=3, accepted=1, drafted_at=[1, 1], accepted_at=[1])
    assert agg.merge(d1) is agg
    agg += d2
    assert (agg.rounds, agg.drafted, agg.accepted) == (3, 9, 5)
    assert agg.drafted_at == [3, 1]
    assert agg.accepted_at == [3, 0]
    # __add__ leaves its operands alone
    s = d1 + d2
    assert s == agg and d1.drafted_at == [2] and d2.rounds == 1


def test_merge_of_deltas_equals_total() -> None:
    t = SpecTelemetry()
    snaps = [t.copy()]
    for drafted, accepted in [(4, 1), (4, 4), (2, 0), (3, 2), (4, 3), (1, 1)]:
        t.record_round(drafted, accepted)
        snaps.append(t.copy())
    bursts = [snaps[i + 1].delta(snaps[i]) for i in range(len(snaps) - 1)]
    total = SpecTelemetry()
    for b in bursts:
        total.merge(b)
    assert total == t


def test_to_dict_is_json_and_round_trips() -> None:
    t = _from_masks([[True, False], [True, True, True], [False]])
    d = t.to_dict()
    json.dumps(d)  # JSON-able
    assert d["rounds"] == 3 and d["drafted"] == 6 and d["accepted"] == 4
    assert d["drafted_at"] == [3, 2, 1] and d["accepted_at"] == [2, 1, 1]
    assert d["per_depth_rate"] == pytest.approx([2 / 3, 0.5, 1.0])
    assert d["tau"] == pytest.approx(4 / 3)
    assert d["acceptance_length"] == pytest.approx(7 / 3)
    assert d["acceptance_rate"] == pytest.approx(4 / 6)
    assert SpecTelemetry.from_dict(json.loads(json.dumps(d))) == t


def test_summary_line() -> None:
    t = _from_masks([[True, True, True], [True, False, False]])
    line = t.summary_line()
    assert "\n" not in line
    assert line.startswith("spec: rounds=2 drafted=6 accepted=4 ")
    assert "tau=2.000" in line and "accept_len=3.000" in line
    assert "per-depth=[1.00 0.50 0.50]" in line


def test_record_totals_adds_counts_without_depths() -> None:
    t = _from_masks([[True, False]])
    t.record_totals(2, 5, 3)
    assert (t.rounds, t.drafted, t.accepted) == (3, 7, 4)
    assert t.drafted_at == [1, 1] and t.accepted_at == [1]  # no depth information added
    for bad in [(1, 2, 3), (-1, 2, 1), (1, -2, 0), (1, 2, -1)]:
        with pytest.raises(ValueError, match="record_totals"):
            t.record_totals(*bad)
    assert (t.rounds, t.drafted, t.accepted) == (3, 7, 4)


def test_equality_compares_every_field() -> None:
    base = SpecTelemetry(2, 4, 2, [2, 2], [1, 1])
    assert base == SpecTelemetry(2, 4, 2, [2, 2, 0], [1, 1, 0])
    for other in [SpecTelemetry(3, 4, 2, [2, 2], [1, 1]), SpecTelemetry(2, 5, 2, [2, 2], [1, 1]),
                  SpecTelemetry(2, 4, 3, [2, 2], [1, 1]), SpecTelemetry(2, 4, 2, [2, 1], [1, 1]),
                  SpecTelemetry(2, 4, 2, [2, 2], [2, 0])]:
        assert base != other, other


def test_iadd_updates_in_place() -> None:
    agg = SpecTelemetry(1, 2, 1, [1, 1], [1])
    alias = agg
    agg += SpecTelemetry(1, 3, 0, [1, 1, 1], [])
    assert agg is alias and alias == SpecTelemetry(2, 5, 1, [2, 2, 1], [1])


def test_summary_line_rate_is_a_percentage() -> None:
    t = _from_masks([[True, True, False], [False, False, False]])
    assert "rate=33.3%" in t.summary_line()
