"""Optimistic fork (`--optimistic`): the early stages start the next round's verify
before the last stage has resolved the current one.

What can be forked, exactly. Round r+1's verify rows are [bonus_r, d'_1..d'_k]: the
bonus is the target's own token after round r's last row, known only once the last
stage has produced round r's logits, and the drafts d' are drawn after it. No row of
round r+1 can be computed without its token, so the fork runs on a *guess* of the whole
row list, made by the driver while stage 0 works on round r (hyspec/core/round.py,
next_round_guess):

- it assumes every draft of round r is accepted (the next verify then starts right
  after round r's rows, on exactly the state stage 0 holds after running them);
- a speculative sequence continues its MTP chain one step past its last draft and takes
  the token the target would take there if the drafter's row were the target's
  (greedy: argmax; rejection sampling: the same BONUS uniform; coupled: the same
  Gumbel noise; the forced-acceptance drafter: its forced token); from that guess it
  drafts the next round's k tokens with the round's own draft code;
- a plain (non-speculative) sequence guesses the next token by prompt lookup (the token
  that followed the latest earlier occurrence of the last 3, 2 or 1 tokens), or takes it
  from the request's reference continuation when it has one (the forced-acceptance
  testing hook).

Nothing of round r+1 is known exactly at fork time (not even its first row's token), so
"exact" here means: a fork's rows are used only when they are exactly the rows the
unforked run computes, and otherwise leave no trace. A fork that guessed all but the
last rows right is a miss as a whole: reusing its first rows and recomputing the rest
would need stitching two forwards' rollback records, and on a GPU a verify's cost hardly
depends on its row count, so the saving would be small.

The fork's result is used only when the next forward the driver actually issues is the
forked one, row for row (same sequences, caches, start positions, token ids, flags) and
the forked caches saw no cache operation between but `clear` (round r's full accept) and
`snap` (round r+1's checkpoint): a *hit*. Stage 0's rows then are bitwise the rows it
would have computed (exact mode: the same rows on the same state), so the output never
depends on forking. Anything else is a *miss*: every forked stage puts back the state it
had before the fork (conv window, SSM state, verify record and length of each forked
cache; the KV rows the fork wrote lie past the committed length and are rewritten before
they are read) and then runs the real command.

The driver's draft work is never replaced by the guess: the real drafts are still drawn
after round r resolves, so telemetry (drafted / accepted) and sampled outputs are those
of a run without forking.

Controller (ForkController): forking pauses while it keeps missing.
- A miss adds one to the count of consecutive misses; a hit sets it to 0.
- After a miss that brings the count to 3 or more, forking pauses for `cool` rounds
  (rounds that would have forked are skipped: no guess, no stage-0 work).
  `cool` starts at 4, doubles with each pause up to 64, and returns to 4 after a hit.
- After the pause, the next round forks again (a probe): a hit resumes forking every
  round, a miss (the count is still >= 3) pauses again, twice as long.
So three misses in a row stop forking; it resumes after 4, 8, 16, ... 64 rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MISS_LIMIT = 3  # consecutive misses that pause forking
COOL_START = 4  # rounds of the first pause
COOL_MAX = 64
TRACE_MAX = 4096  # events kept in the trace


@dataclass
class ForkTelemetry:
    """Counters of the driver's forks. forks = hits + misses + dropped (+ 1 while one is
    in flight). Rows are verify rows (tokens) of forked forwards."""

    forks: int = 0  # forks issued (stage 0.. ran the guessed rows)
    hits: int = 0  # forks whose rows were used
    misses: int = 0  # forks discarded because the next forward differed
    dropped: int = 0  # forks discarded because the run ended (Driver.settle) or a mark (not fed to the controller)
    paused: int = 0  # rounds that would have forked but the controller paused forking
    no_guess: int = 0  # rounds with no guess (a sequence could finish, a constraint, ...)
    trips: int = 0  # pauses started
    forked_rows: int = 0
    hit_rows: int = 0
    wasted_rows: int = 0  # rows of missed and dropped forks (stage work thrown away)
    guess_s: float = 0.0  # driver time spent making guesses (MTP steps), hits and misses alike
    # events in order: h / m a fork resolved as hit / miss (logged when the next command is
    # sent), d a fork dropped at the end of a run, p a round paused by the controller, . a
    # round with no guess; a round that forks logs nothing until its fork resolves
    trace: list[str] = field(default_factory=list)

    def event(self, c: str) -> None:
        if len(self.trace) < TRACE_MAX:
            self.trace.append(c)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("forks", "hits", "misses", "dropped", "paused", "no_guess", "trips",
                                           "forked_rows", "hit_rows", "wasted_rows")}
        d["guess_s"] = round(self.guess_s, 6)
        d["hit_rate"] = self.hits / self.forks if self.forks else 0.0
        d["trace"] = "".join(self.trace)
        return d

    def summary_line(self) -> str:
        return (f"[optimistic fork: {self.forks} forks, {self.hits} hits ({self.to_dict()['hit_rate']:.0%}), "
                f"{self.misses} misses, {self.paused} rounds paused ({self.trips} pauses), "
                f"{self.wasted_rows} of {self.forked_rows} forked rows wasted]")


class ForkController:
    """The rule in the module docstring. allow() is asked once per round that could fork;
    resolve(hit) once per issued fork."""

    def __init__(self) -> None:
        self.streak = 0  # consecutive misses
        self.cool = COOL_START  # length of the next pause
        self.left = 0  # rounds of the current pause still to skip

    def allow(self) -> bool:
        if self.left > 0:
            self.left -= 1
            return False
        return True

    def resolve(self, hit: bool) -> bool:
        """Returns whether this miss started a pause."""
        if hit:
            self.streak, self.cool = 0, COOL_START
            return False
        self.streak += 1
        if self.streak >= MISS_LIMIT:
            self.left = self.cool
            self.cool = min(2 * self.cool, COOL_MAX)
            return True
        return False


@dataclass
class PendingFork:
    """A fork in flight on the driver: the forward command the stages ran on the guess."""

    fwd: dict
    rows: int
    t: float = field(default_factory=time.perf_counter)

    @property
    def uids(self) -> set:
        return {s[0] for s in self.fwd["seqs"]}


def fork_fwd(fwd: dict, guesses: list[list[int]]) -> dict | None:
    """The forward command of the next round if every draft of `fwd` (this round's verify
    command) is accepted: each sequence's cache continues right after this round's rows,
    with the same flags. None when a guess does not fit its cache."""
    seqs, ids, sizes = [], [], []
    for (uid, max_len, start, exact, record, chunked), n, g in zip(fwd["seqs"], fwd["sizes"], guesses):
        if uid is None or not g or start + n + len(g) > max_len:
            return None
        seqs.append((uid, max_len, start + n, exact, record, chunked))
        ids.extend(int(t) for t in g)
        sizes.append(len(g))
    return {"ids": ids, "sizes": sizes, "seqs": seqs}


def is_hit(fork: PendingFork, fwd: dict, ops: list[tuple]) -> bool:
    """The next forward is the forked one and the forked caches only saw a full accept
    (`clear`) and the next round's checkpoint (`snap`) since."""
    if fwd != fork.fwd:
        return False
    uids = fork.uids
    return all(op[0] in ("clear", "snap") for op in ops if op[1] in uids)


# ---------------------------------------------------------------------------------------
# the worker side: a forked stage's state before the fork
# ---------------------------------------------------------------------------------------
def capture(cache) -> tuple:
    """What a forward changes in a stage's cache, by reference: the length and each linear
    layer's (conv, ssm, record). A forward assigns new tensors to these (it never writes
    them in place), so the references keep the values; the KV rows it writes lie past
    the length."""
    return cache.pos, [(s.conv, s.ssm, s.record) for s in cache.linear_states]


def install(cache, state: tuple) -> None:
    pos, lin = state
    cache.pos = pos
    for s, (conv, ssm, record) in zip(cache.linear_states, lin):
        s.conv, s.ssm, s.record = conv, ssm, record


def same_state(cache, state: tuple) -> bool:
    """The cache still holds exactly `state` (the same tensors, by identity; records aside)."""
    pos, lin = state
    return cache.pos == pos and all(s.conv is conv and s.ssm is ssm
                                    for s, (conv, ssm, _) in zip(cache.linear_states, lin))
