"""Speculative-decoding telemetry: rounds, drafted/accepted totals, acceptance by depth.

Depth d is the 0-based position of a draft inside its round.  ``drafted_at[d]`` counts
rounds that drafted at least d+1 tokens and ``accepted_at[d]`` rounds that accepted at
least d+1 tokens (acceptance is always a prefix), so ``accepted_at[d] / drafted_at[d]``
is the fraction of rounds reaching depth d that kept the draft there.

Snapshots are plain values: take one with :meth:`SpecTelemetry.copy`, isolate a burst
with :meth:`SpecTelemetry.delta` (saturating, never negative) and sum bursts with
:meth:`SpecTelemetry.merge` or ``+``.  Not thread-safe; guard with a lock if shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_DEPTH", "SpecTelemetry"]

MAX_DEPTH = 16
"""Depth histogram size; drafts deeper than this count in the totals only."""


def _at(xs: list[int], d: int) -> int:
    return xs[d] if d < len(xs) else 0


def _trim(xs: list[int]) -> list[int]:
    n = len(xs)
    while n and xs[n - 1] == 0:
        n -= 1
    return xs[:n]


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


@dataclass(eq=False)
class SpecTelemetry:
    """Counters of speculative rounds (one session, one burst, or an aggregate)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # [<= MAX_DEPTH]
    accepted_at: list[int] = field(default_factory=list)  # [<= MAX_DEPTH]

    # ---- recording ------------------------------------------------------------------

    def record_round(self, drafted: int, accepted: int) -> None:
        """One round that drafted ``drafted`` tokens and accepted the first ``accepted``."""
        if not 0 <= accepted <= drafted:
            raise ValueError(
                f"record_round: need 0 <= accepted <= drafted, got drafted={drafted} "
                f"accepted={accepted}"
            )
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self._bump(self.drafted_at, drafted)
        self._bump(self.accepted_at, accepted)

    def record_totals(self, rounds: int, drafted: int, accepted: int) -> None:
        """Add totals without depth information (e.g. from a path that lacks it)."""
        if min(rounds, drafted, accepted) < 0 or accepted > drafted:
            raise ValueError(
                f"record_totals: bad counts rounds={rounds} drafted={drafted} "
                f"accepted={accepted}"
            )
        self.rounds += rounds
        self.drafted += drafted
        self.accepted += accepted

    @staticmethod
    def _bump(hist: list[int], n: int) -> None:
        n = min(n, MAX_DEPTH)
        if len(hist) < n:
            hist.extend([0] * (n - len(hist)))
        for d in range(n):
            hist[d] += 1

    # ---- derived quantities ---------------------------------------------------------

    @property
    def tau(self) -> float:
        """Mean accepted drafts per round (0 with no rounds)."""
        return _ratio(self.accepted, self.rounds)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per round: tau + 1 (0 with no rounds)."""
        return self.tau + 1.0 if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 with nothing drafted)."""
        return _ratio(self.accepted, self.drafted)

    @property
    def depth(self) -> int:
        """Number of depth buckets in use."""
        return max(len(self.drafted_at), len(self.accepted_at))

    def per_depth_rate(self) -> list[float]:
        """accepted_at[d] / drafted_at[d] for each depth (0.0 where nothing was drafted)."""
        return [
            _ratio(_at(self.accepted_at, d), _at(self.drafted_at, d)) for d in range(self.depth)
        ]

    # ---- snapshots, deltas, merges --------------------------------------------------

    def copy(self) -> SpecTelemetry:
        return SpecTelemetry(
            self.rounds, self.drafted, self.accepted, list(self.drafted_at), list(self.accepted_at)
        )

    def delta(self, since: SpecTelemetry) -> SpecTelemetry:
        """self - since, field by field and depth by depth, saturating at 0."""
        n = max(self.depth, since.depth)
        return SpecTelemetry(
            rounds=max(0, self.rounds - since.rounds),
            drafted=max(0, self.drafted - since.drafted),
            accepted=max(0, self.accepted - since.accepted),
            drafted_at=_trim(
                [max(0, _at(self.drafted_at, d) - _at(since.drafted_at, d)) for d in range(n)]
            ),
            accepted_at=_trim(
                [max(0, _at(self.accepted_at, d) - _at(since.accepted_at, d)) for d in range(n)]
            ),
        )

    def merge(self, other: SpecTelemetry) -> SpecTelemetry:
        """Add ``other`` into self (in place); returns self."""
        n = max(self.depth, other.depth)
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.drafted_at = [_at(self.drafted_at, d) + _at(other.drafted_at, d) for d in range(n)]
        self.accepted_at = [
            _at(self.accepted_at, d) + _at(other.accepted_at, d) for d in range(n)
        ]
        return self

    def __add__(self, other: SpecTelemetry) -> SpecTelemetry:
        if not isinstance(other, SpecTelemetry):
            return NotImplemented
        return self.copy().merge(other)

    def __iadd__(self, other: SpecTelemetry) -> SpecTelemetry:
        if not isinstance(other, SpecTelemetry):
            return NotImplemented
        return self.merge(other)

    def __eq__(self, other: object) -> bool:
        """Equal counts; trailing zero depth buckets do not matter."""
        if not isinstance(other, SpecTelemetry):
            return NotImplemented
        return (
            (self.rounds, self.drafted, self.accepted)
            == (other.rounds, other.drafted, other.accepted)
            and _trim(self.drafted_at) == _trim(other.drafted_at)
            and _trim(self.accepted_at) == _trim(other.accepted_at)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

    # ---- reporting ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: counts, depth arrays (padded to a common length) and rates."""
        n = self.depth
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tau": self.tau,
            "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "drafted_at": [_at(self.drafted_at, d) for d in range(n)],
            "accepted_at": [_at(self.accepted_at, d) for d in range(n)],
            "per_depth_rate": self.per_depth_rate(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecTelemetry:
        """Inverse of :meth:`to_dict` (derived fields are ignored)."""
        return cls(
            rounds=int(d.get("rounds", 0)),
            drafted=int(d.get("drafted", 0)),
            accepted=int(d.get("accepted", 0)),
            drafted_at=[int(x) for x in d.get("drafted_at", [])],
            accepted_at=[int(x) for x in d.get("accepted_at", [])],
        )

    def summary_line(self) -> str:
        rates = " ".join(f"{r:.2f}" for r in self.per_depth_rate())
        return (
            f"spec: rounds={self.rounds} drafted={self.drafted} accepted={self.accepted} "
            f"tau={self.tau:.3f} accept_len={self.acceptance_length:.3f} "
            f"rate={100.0 * self.acceptance_rate:.1f}% per-depth=[{rates}]"
        )
