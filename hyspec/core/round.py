"""One speculative round for a batch of sequences — the only place a round is written.
(Kept as one module of ~490 lines on purpose: draft, accept and commit share the
per-sequence round state and read top to bottom as one round.)

Words (docs/speculative.md): *pending* = the last emitted token, not yet run through the
target; *draft* = the MTP head's guesses d1..dk for the positions after it; *verify* = one
target forward over [pending, d1..dk] of every sequence at once (Σ(k_i + 1) rows);
*accept* = the longest prefix of drafts the target agrees with (greedy: argmax match;
sampled: rejection test or coupled noise), n of k; *bonus* = the target's own token after
the accepted prefix; *commit* = the cache keeps pending + n accepted rows (the rollback
strategy rewinds the Gated-DeltaNet state past them); *refresh* = the next round's drafter
refill rows get the target's true hiddens. Every round emits n + 1 tokens per sequence
and leaves the bonus pending. A sequence with k = 0 is plain decoding: its round verifies
[pending] and takes the row's own token.

Sequence state (one per active request, on top of its slot):
    pending        int | None   the token to verify first (None only in the no-pending form)
    h_last         [1, H]       target hidden at cache.pos - 1 (seeds the drafter)
    fill_*         the drafter rows the next round's first MTP call writes: tokens [m],
                   hiddens [m, H], starting draft-KV row
    last_logits    [1, V]       the target row predicting position cache.pos
RNG: counter-based, keyed by (seed, stream, absolute position) — nothing to carry.
"""

from __future__ import annotations

import time

import torch

from hyspec.core.request import Request
from hyspec.rng import Stream, u01
from hyspec.sampling import (NonFiniteLogits, apply_penalties, coupled_speculative, coupled_token, draft_token,
                             greedy_token, plain_token, row_probs, sample_index, speculative_sample, top_ids)
from hyspec.speculative.drafter import FORCED_STREAM
from hyspec.speculative.telemetry import SpecTelemetry



def forced_token(reference: list[int], rates, seed: int, vocab: int, depth: int, position: int) -> int:
    """The forced-acceptance drafter's proposal at (depth, absolute position): the reference
    run's token with probability rates[depth], else a wrong one. Greedy acceptance at depth d,
    given the earlier drafts were accepted, is then rates[d]."""
    if position >= len(reference):
        return 0
    ref = reference[position]
    rate = rates[min(depth, len(rates) - 1)]
    return ref if u01(seed, FORCED_STREAM, position * 64 + depth) < rate else (ref + 1) % vocab


def choose_token(logits: torch.Tensor, history: list[int], params, position: int) -> int:
    """The token plain decoding emits at absolute `position` given the row's logits [V]."""
    if params.greedy:
        return greedy_token(apply_penalties(logits, history, params) if params.adjusts_logits else logits)
    return plain_token(row_probs(logits, history, params), params, position)


def commit_constraint(constraint, tokens) -> bool:
    """Commit emitted tokens to a sequence's constraint (the engine core's rounds and the
    CUDA-graph lanes); a failure is that sequence's, not the batch's: it is recorded
    (Constraint.fail) and the sequence ends in error. Returns whether this commit failed:
    the caller then takes the tokens back out of the output (the grammar did not take
    them, and they were never streamed), so a failed sequence's output is what its stream
    showed. (A failure marked earlier, with this commit taken, returns False: the tokens
    are output, and the sequence ends in error after them.)"""
    try:
        constraint.commit(tokens)
    except (ValueError, RuntimeError) as e:
        if not hasattr(constraint, "fail"):  # (a constraint object without the failure protocol)
            raise
        constraint.fail(str(e))
        return True
    return False


def masked(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return logits if mask is None else logits.masked_fill(~mask.to(logits.device), float("-inf"))


class Sequence:
    """A request being decoded: its slot plus the loop variables of the round."""

    def __init__(self, model, req: Request, slot, opts, rollback, stops: set[int]) -> None:
        self.model, self.req, self.slot = model, req, slot
        vocab = model.cfg.vocab_size
        self.prompt = list(req.prompt_ids)
        self.params = req.params
        self.opts = opts  # SpecOptions or None (plain decoding)
        self.rollback = rollback
        self.stops = stops
        self.vocab = vocab
        self.out: list[int] = req.tokens
        self.feed: list[int] = self.prompt  # tokens the prefill runs (a resumed turn: only the new ones)
        self.carry = None  # a resumed turn: the drafter rows still queued (hyspec.core.state.Carry)
        self.pending: int | None = None
        self.h_last = self.fill_h = self.last_logits = None
        self.fill_tokens: list[int] = []
        self.fill_start = 0
        self.k_next = opts.k if opts else 0
        self.tel = req.telemetry if req.telemetry is not None else SpecTelemetry()
        self.mtp_forwards = 0
        self.direct = 0  # tokens taken from an already-known target row, without a verify
        self.extra_bytes = 0
        self.reason: str | None = None
        self.failure: Exception | None = None  # its own error in a round (NonFiniteLogits): it alone ends
        self.prefilled = 0  # prompt tokens run so far
        self.hidden_parts: list[torch.Tensor] = []  # prompt hiddens that seed the drafter
        self.forced_ref = (list(req.prompt_ids) + list(req.reference)) if opts and opts.forced_rates else None
        self.t_start = time.perf_counter()
        self.t_first = None
        self.round = None

    @property
    def cache(self):
        return self.slot.cache

    @property
    def speculative(self) -> bool:
        return self.opts is not None

    @property
    def history(self) -> list[int]:
        return self.prompt + self.out

    def mask(self, prefix: list[int]) -> torch.Tensor | None:
        c = self.req.constraint
        return None if c is None else c.allowed(prefix)

    def emit(self, tokens: list[int], rows: list[torch.Tensor] | None = None) -> list[int]:
        """Append a round's tokens, stopping at a stop id, the token completing a stop string
        (req.stop_text) or the token limit; returns what was kept."""
        kept = []
        for i, tok in enumerate(tokens):
            self.out.append(tok)
            kept.append(tok)
            if rows is not None and self.req.logprobs is not None:
                self.req.token_logprobs.append(_logprob(rows[i], tok, self.req.logprobs))
            if tok in self.stops:
                self.reason = "eos"
                break
            if self.req.stop_text is not None and self.req.stop_text.check(tok):
                self.reason = "stop"
                break
            if len(self.out) >= self.req.max_new_tokens:
                self.reason = "length"
                break
        if self.req.constraint is not None and kept and commit_constraint(self.req.constraint, kept):
            # the grammar refused the round's tokens: they leave the output (never streamed; the
            # sequence ends in error at the round's end, Scheduler.step)
            del self.out[len(self.out) - len(kept):]
            if rows is not None and self.req.logprobs is not None:
                del self.req.token_logprobs[len(self.req.token_logprobs) - len(kept):]
            return []
        if self.t_first is None and kept:
            self.t_first = time.perf_counter()
        return kept


def _logprob(row: torch.Tensor, tok: int, top: int):
    lp = torch.log_softmax(row.double(), -1)
    alts = []
    if top:  # (ties by ascending id: the greedy token first among its equals)
        i = top_ids(row, top)
        alts = list(zip(i.tolist(), lp[i].tolist()))
    return float(lp[tok]), alts


class _Round:
    """Round-local values of one sequence."""

    def __init__(self, seq: Sequence, k: int) -> None:
        self.k = k
        self.base = seq.cache.pos  # absolute position of the first verify token
        self.first_draft_pos = self.base + (1 if seq.pending is not None else 0)
        self.drafts: list[int] = []
        self.q_rows: list[torch.Tensor] = []
        self.masks: dict[int, torch.Tensor | None] = {}
        self.h = None  # the MTP hidden that predicts the next draft
        self.row = 0  # next draft-KV row
        self.prefix: list[int] = []  # tokens between the history and the drafts (a guessed round: next_round_guess)

    @classmethod
    def scratch(cls, k: int, first_draft_pos: int, prefix: list[int]) -> "_Round":
        """A round that exists only to draft a guess (next_round_guess): no cache position."""
        rd = cls.__new__(cls)
        rd.k, rd.base, rd.first_draft_pos, rd.prefix = k, first_draft_pos - 1, first_draft_pos, list(prefix)
        rd.drafts, rd.q_rows, rd.masks, rd.h, rd.row = [], [], {}, None, 0
        return rd

    def mask(self, seq: Sequence, j: int):
        if j not in self.masks:
            self.masks[j] = seq.mask(self.drafts[:j])
        return self.masks[j]


# ---------------------------------------------------------------------------------------
# draft
# ---------------------------------------------------------------------------------------
def _draft_one(seq: Sequence, rd: _Round, logits: torch.Tensor, j: int) -> bool:
    """Choose draft j from the drafter's row (the same transformation as the target's row).
    Returns False when drafting stops here (p_min, or the constraint allows nothing)."""
    p, opts = seq.params, seq.opts
    position = rd.first_draft_pos + j
    mask = rd.mask(seq, j)
    if mask is not None and not bool(mask.any()):
        return False
    logits = masked(logits, mask)
    if mask is not None and not bool(torch.isfinite(logits).any()):
        return False  # a reduced draft vocabulary (mtp.d2t) scores none of the allowed tokens
    hist = seq.history + rd.prefix + rd.drafts
    q = None
    try:
        if p.greedy:
            lg = apply_penalties(logits, hist, p) if p.adjusts_logits else logits
            tok = greedy_token(lg)
            prob = float(torch.softmax(lg.double(), -1)[tok]) if opts.p_min > 0.0 else 1.0
        else:
            q = row_probs(logits, hist, p)
            tok = coupled_token(q, p.seed, position) if p.mode == "coupled" else draft_token(q, p.seed, position)
            prob = float(q[tok])
    except NonFiniteLogits:  # the drafter's row overflowed: no draft here; the target's choices are
        return False  # untouched (any proposal keeps the output exact, none is one)
    if seq.forced_ref is not None:  # the real choice above keeps the cost; the token is forced
        tok = forced_token(seq.forced_ref, opts.forced_rates, opts.forced_seed, seq.vocab, j, position)
        if mask is not None and not bool(mask[tok]):
            tok = greedy_token(logits)
        if q is not None:  # the proposal is deterministic: q is one-hot at tok
            q = torch.zeros_like(q)
            q[tok] = 1.0
        prob = 1.0
    elif opts.p_min > 0.0:
        if prob < opts.p_min:
            return False
        if q is not None:
            # a kept draft is distributed as q restricted to {q >= p_min}: acceptance must
            # test against that distribution, or sampling stops being lossless
            q = q * (q >= opts.p_min)
            q = q / q.sum()
    rd.drafts.append(tok)
    if q is not None:
        rd.q_rows.append(q)
    return True


def draft(backend, seqs: list[Sequence]) -> None:
    """Chain each sequence's MTP head up to its k; one batched MTP forward per depth."""
    active = [s for s in seqs if s.round.k > 0]
    if not active:
        return
    hs = backend.mtp([(s.slot.draft_kv, s.fill_tokens, s.fill_h, s.fill_start) for s in active])
    for s, h in zip(active, hs):
        s.mtp_forwards += 1
        s.round.h = h[-1:]
        s.round.row = s.fill_start + len(s.fill_tokens)
    j = 0
    while active:
        logits = backend.draft_logits(torch.cat([s.round.h for s in active]))
        chain = [s for s, row in zip(active, logits) if _draft_one(s, s.round, row, j) and j + 1 < s.round.k]
        if chain:
            hs = backend.mtp([(s.slot.draft_kv, [s.round.drafts[-1]], s.round.h, s.round.row) for s in chain])
            for s, h in zip(chain, hs):
                s.mtp_forwards += 1
                s.round.h = h
                s.round.row += 1
        active = chain
        j += 1


# ---------------------------------------------------------------------------------------
# the optimistic fork's guess of the next round (hyspec/parallel/fork.py)
# ---------------------------------------------------------------------------------------
LOOKUP_WINDOW = 2048  # plain sequences: how far back prompt lookup searches


def prompt_lookup(history: list[int]) -> int:
    """The token that followed the latest earlier occurrence of the last 3, 2 or 1 tokens
    (the last token itself when none recurs)."""
    h = history[-LOOKUP_WINDOW:]
    L = len(h)
    for n in (3, 2, 1):
        if L <= n:
            continue
        key = h[L - n:]
        for i in range(L - n - 1, -1, -1):
            if h[i: i + n] == key:
                return h[i + n]
    return h[-1]


def _guess_bonus(seq: Sequence, logits: torch.Tensor, hist: list[int], depth: int, position: int) -> int:
    """The bonus the target would take at `position` after a full accept if its row were
    the drafter's: the same transformation and the same random draw (BONUS uniform,
    coupled noise), or the forced drafter's token at that depth."""
    p = seq.params
    if seq.forced_ref is not None:
        o = seq.opts
        return forced_token(seq.forced_ref, o.forced_rates, o.forced_seed, seq.vocab, depth, position)
    if p.greedy:
        return greedy_token(apply_penalties(logits, hist, p) if p.adjusts_logits else logits)
    q = row_probs(logits, hist, p)
    if p.mode == "coupled":
        return coupled_token(q, p.seed, position)
    return sample_index(q, u01(p.seed, Stream.BONUS, position))


class _Guess:
    def __init__(self, s: Sequence, n: int, P: int, k2: int) -> None:
        self.s, self.n, self.P, self.k2 = s, n, P, k2
        self.h, self.row = s.round.h, s.round.row
        self.bonus: int | None = None
        self.rd: _Round | None = None


def _mtp_step(backend, items: list[_Guess], tokens: list[int]) -> None:
    """One batched MTP chain step: each guess feeds its token at its next draft-KV row."""
    hs = backend.mtp([(g.s.slot.draft_kv, [t], g.h, g.row) for g, t in zip(items, tokens)])
    for g, h in zip(items, hs):
        g.h, g.row = h, g.row + 1


def next_round_guess(backend, seqs: list[Sequence]) -> list[list[int]] | None:
    """The verify tokens each of `seqs` (this round's verifying sequences, after drafting)
    would send next round if every draft of this round is accepted: [bonus guess] + the
    next round's drafts, drawn by _draft_one as the next round would draw them (for a
    plain sequence: [prompt-lookup guess], or the request's reference token when it has
    one: the forced-acceptance drafter's testing hook). None when there is no next round to guess for
    some sequence (it could finish this round: token limit, a stop id or a stop
    string's completing token among the drafts, or a stop id as the guessed bonus; a
    guessed bonus that completes a stop string only makes the fork miss) or the guess cannot be made (a constraint, whose
    state advances with the emitted tokens; a round that did not run the drafter).
    Side effects: MTP steps write draft-KV rows past the drafts (scratch rows: the next
    round's refill rewrites them before they are read); the sequences' counters are untouched."""
    plain: dict[int, list[int]] = {}
    spec: list[_Guess] = []
    for i, s in enumerate(seqs):
        rd = s.round
        if s.req.constraint is not None or any(t in s.stops for t in rd.drafts) or \
                (s.req.stop_text is not None and s.req.stop_text.peek(rd.drafts) is not None):
            return None
        n = len(rd.drafts)
        left = s.req.max_new_tokens - len(s.out) - n - 1  # tokens still to come after a full accept
        if left <= 0:
            return None
        P = rd.first_draft_pos + n  # position of the bonus (the next round's first verify token)
        if not s.speculative:
            ref = s.prompt + list(s.req.reference or ())  # a reference (testing hook) is the guess
            g = ref[P] if P < len(ref) else prompt_lookup(s.history)
            if g in s.stops:
                return None
            plain[i] = [g]
            continue
        if rd.h is None or s.slot.draft_kv is None:
            return None
        kn = max(s.opts.adaptive_floor, min(n + 1, s.opts.k)) if s.opts.adaptive else s.k_next
        k2 = min(kn, left - 1)
        if P + k2 + 1 > s.slot.draft_kv.capacity:
            return None
        spec.append(_Guess(s, n, P, k2))
    if spec:
        # the hidden predicting the bonus: the drafter stopped before k (p_min) -> it already
        # has it; else one more chain step on the last draft
        full = [g for g in spec if g.n == g.s.round.k]
        if full:
            _mtp_step(backend, full, [g.s.round.drafts[-1] for g in full])
        rows = backend.draft_logits(torch.cat([g.h for g in spec]))
        for g, row in zip(spec, rows):
            s = g.s
            try:
                g.bonus = _guess_bonus(s, row, s.history + s.round.drafts, g.n, g.P)
            except NonFiniteLogits:  # the drafter's row overflowed: no guess
                return None
            if g.bonus in s.stops:
                return None
            g.rd = _Round.scratch(g.k2, g.P + 1, s.round.drafts + [g.bonus])
        active = [g for g in spec if g.k2 > 0]
        if active:
            _mtp_step(backend, active, [g.bonus for g in active])
        j = 0
        while active:
            rows = backend.draft_logits(torch.cat([g.h for g in active]))
            chain = [g for g, row in zip(active, rows) if _draft_one(g.s, g.rd, row, j) and j + 1 < g.k2]
            if chain:
                _mtp_step(backend, chain, [g.rd.drafts[-1] for g in chain])
            active = chain
            j += 1
    by_seq = {id(g.s): [g.bonus] + g.rd.drafts for g in spec}
    return [plain[i] if i in plain else by_seq[id(s)] for i, s in enumerate(seqs)]


# ---------------------------------------------------------------------------------------
# accept
# ---------------------------------------------------------------------------------------
def accept(seq: Sequence, rd: _Round, rows: torch.Tensor) -> tuple[int, int | None] | None:
    """rows [k+1, V] target logits for positions first_draft_pos.. -> (accepted n, bonus).
    Under a constraint every row is masked by the constraint's state after the drafts before
    it. When the constraint allows nothing after all k drafts, the result is (k, None) if
    every draft is accepted (no bonus exists), and None if k = 0 (no token at all)."""
    params, drafts = seq.params, rd.drafts
    k = len(drafts)
    dead_end = False
    if seq.req.constraint is not None:
        ms = [rd.mask(seq, j) for j in range(k + 1)]
        dead_end = ms[k] is not None and not bool(ms[k].any())
        if dead_end:
            if k == 0:
                return None
            # a stand-in last row (a copy of row k-1): it only decides a bonus that is discarded
            ms[k], rows = ms[k - 1], torch.cat([rows[:k], rows[k - 1: k]])
        rows = torch.stack([masked(rows[j], ms[j]) for j in range(k + 1)])
    hist = seq.history
    # a row after a stop draft (a stop id, the token completing a stop string) is never needed:
    # with the drafts up to it accepted the round ends there (stop_cut), as plain decoding does
    # without running that row; one that overflows changes nothing
    stop = stop_cut(drafts, k, None, seq.stops, seq.req.stop_text)[0] if seq.speculative else k
    if not seq.speculative:
        n, tok = 0, choose_token(rows[0], hist, params, rd.first_draft_pos)
    elif params.greedy:
        n, tok = k, None
        for j in range(k + 1):
            lg = apply_penalties(rows[j], hist + drafts[:j], params) if params.adjusts_logits else rows[j]
            try:
                t = greedy_token(lg)
            except NonFiniteLogits:
                if j <= stop:
                    raise
                n, tok = j, None  # (stop_cut makes the stop draft the bonus)
                break
            if j == k or t != drafts[j]:
                n, tok = j, t
                break
    else:
        n, tok = sampled_accept(rows, drafts, rd.q_rows, hist, params, rd.first_draft_pos, stop)
    if dead_end and n == k:
        return k, None
    return n, tok


def sampled_accept(rows: torch.Tensor, drafts: list[int], q_rows: list, hist: list[int], params,
                   position: int, stop: int | None = None) -> tuple[int, int]:
    """A sampled round's (accepted count, next token) from its k + 1 verify rows (rejection
    or coupled mode). Row j follows drafts[:j]: a row that overflows (NonFiniteLogits) past
    row 0 matters only if those drafts are all accepted, so the round is decided over the
    drafts before it and the error raised only when it is reached (plain decoding, which
    never feeds a rejected draft, would not have seen that row). stop: the index of the first
    stop draft (stop_cut): a row past it is not needed either (the round ends at the stop)."""
    k = len(drafts)
    p_list, bad = [], None
    for j in range(k + 1):
        try:
            p_list.append(row_probs(rows[j], hist + drafts[:j], params))
        except NonFiniteLogits as e:
            if j == 0:
                raise
            bad = e
            p_list.append(p_list[-1])  # a stand-in row j: it only decides a bonus that is not taken
            break
    k = len(p_list) - 1
    p_rows = torch.stack(p_list)
    if params.mode == "coupled":
        n, tok = coupled_speculative(p_rows, drafts[:k], params.seed, position)
    else:
        q = torch.stack(list(q_rows[:k])) if k else p_rows[:0]
        n, tok = speculative_sample(p_rows, q, drafts[:k], params.seed, position)
    if bad is not None and n == k and (stop is None or k <= stop):  # the drafts before the overflowing
        raise bad  # row all accepted, none of them a stop: it is needed
    return n, tok


# ---------------------------------------------------------------------------------------
# the round
# ---------------------------------------------------------------------------------------
def run_round(backend, seqs: list[Sequence], may_fork: bool = True) -> dict[Sequence, list[int]]:
    """One round for every sequence in `seqs` (each unfinished, prefilled). Returns the
    tokens each sequence emitted; finished sequences have .reason set.

    may_fork: the caller expects the same batch next round (no prefill in between); then a
    backend that forks (the pipeline with --optimistic) gets a guess of the next round's
    verify with this round's (next_round_guess)."""
    emitted: dict[Sequence, list[int]] = {}
    for s in seqs:
        remaining = s.req.max_new_tokens - len(s.out)
        s.round = _Round(s, min(s.k_next, remaining - 1) if s.speculative else 0)

    draft(backend, seqs)

    # a sequence with no pending token and no drafts takes the known row's token directly
    verifying = []
    for s in seqs:
        rd = s.round
        if s.pending is None and not rd.drafts:
            m = rd.mask(s, 0)
            if m is not None and not bool(m.any()):
                s.reason = "constraint"
                emitted[s] = []
                continue
            try:
                tok = choose_token(masked(s.last_logits[0], m), s.history, s.params, rd.base)
            except NonFiniteLogits as e:  # this sequence's own error: it alone ends (Scheduler.step)
                s.failure, emitted[s] = e, []
                continue
            s.pending = tok
            s.direct += 1
            if s.speculative and rd.k == 0:  # the drafter did not run: its queued rows stay queued
                s.fill_tokens, s.fill_h = s.fill_tokens + [tok], torch.cat([s.fill_h, s.h_last])
            elif s.speculative:
                s.fill_tokens, s.fill_h, s.fill_start = [tok], s.h_last, rd.base - 1
            emitted[s] = s.emit([tok], [s.last_logits[0]])
        else:
            rd.verify_tokens = ([s.pending] if s.pending is not None else []) + rd.drafts
            rd.snap = s.cache.snapshot() if s.speculative else None
            verifying.append(s)
    if not verifying:
        return emitted

    items = [(s.cache, s.round.verify_tokens, s.rollback.record if s.speculative else "none") for s in verifying]
    if may_fork and len(verifying) == len(seqs) and getattr(backend, "forking", False):
        results = backend.verify(items, guess=lambda: next_round_guess(backend, verifying))
    else:
        results = backend.verify(items)
    for s, (vpre, vpost, vlogits) in zip(verifying, results):
        rd = s.round
        rows = vlogits if s.pending is not None else torch.cat([s.last_logits, vlogits])
        if s.speculative:
            s.extra_bytes = max(s.extra_bytes, s.cache.record_nbytes() + rd.snap.nbytes())
        try:
            res = accept(s, rd, rows)
        except NonFiniteLogits as e:  # the target's row overflowed: this sequence's error, not the batch's
            s.failure, emitted[s] = e, []
            continue
        if res is None:  # the constraint allows no token at all here
            _commit(s, rd, 0, vpre, vpost, rows, None)
            emitted[s], s.reason = [], "constraint"
            continue
        n, bonus = res
        if s.speculative:
            s.tel.record_round(len(rd.drafts), n)
        n, bonus = stop_cut(rd.drafts, n, bonus, s.stops, s.req.stop_text)
        _commit(s, rd, n, vpre, vpost, rows, bonus)
        emitted[s] = s.emit(rd.drafts[:n] + ([bonus] if bonus is not None else []), list(rows[: n + 1]))
        if bonus is None:
            s.reason = s.reason or "constraint"
        if s.speculative and s.opts.adaptive:
            s.k_next = max(s.opts.adaptive_floor, min(n + 1, s.opts.k))
    return emitted


def stop_cut(drafts: list[int], n: int, bonus, stops, stop_text) -> tuple[int, int | None]:
    """(n, bonus) of a round whose n accepted drafts and bonus may hold a stop: a stop id, or
    the token completing a stop string (stop_text.peek), among the accepted drafts ends the
    round there: that draft becomes the bonus, and only what is emitted is committed (the
    cache then matches the history). The engine core's rounds and the lanes' adaptive K."""
    cut = next((i for i, t in enumerate(drafts[:n]) if t in stops), n)
    if stop_text is not None:
        i = stop_text.peek(list(drafts[:cut]))
        if i is not None:
            cut = i
    return (cut, drafts[cut]) if cut < n else (n, bonus)


def _commit(s: Sequence, rd: _Round, n: int, vpre, vpost, rows, bonus) -> None:
    """Keep pending + the n accepted drafts in the cache; set up the next round."""
    j = n + (1 if s.pending is not None else 0)  # verify rows to keep
    if s.speculative:
        if j == len(rd.verify_tokens):
            s.cache.clear_records()  # full accept: the cache is already right
        elif j == 0:
            s.cache.restore(rd.snap)  # no pending and nothing accepted: fold the round away
        else:
            s.rollback.keep(s.model, s.cache, rd.snap, j, rd.verify_tokens)
        vseed = vpost if s.opts.hidden == "post" else vpre
        # draft rows for the committed tokens get the target's true hiddens, then the new pending
        toks = rd.verify_tokens[:j] + ([bonus] if bonus is not None else [])
        hs = torch.cat([s.h_last, vseed[:j]])
        if rd.k == 0 and s.fill_tokens:  # the drafter did not run: its queued rows (the last one
            # is this round's (pending, h_last) pair again) stay queued
            s.fill_tokens, s.fill_h = s.fill_tokens[:-1] + toks, torch.cat([s.fill_h[:-1], hs])
        else:
            s.fill_tokens, s.fill_h, s.fill_start = toks, hs, rd.base - 1
        if j > 0:
            s.h_last = vseed[j - 1: j]
        s.last_logits = rows[n: n + 1]
    s.pending = bonus
