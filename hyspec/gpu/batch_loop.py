"""Continuous batching on the BatchDecoder: sequences join after their prefill, leave on
a stop id, their token limit or a cancel, and every round runs the active lanes in one
captured graph set.  The host reads one small tensor per round (accepted count, bonus,
drafts per lane) and does the bookkeeping: emit, stop, compaction of the lanes.

BatchRunner is the loop as an open queue (the server submits and cancels while it runs);
run_batch runs a closed list of requests on one.  Greedy and sampled requests (plain
k = 0, or speculative k >= 1, mixed freely in one batch; with or without penalties),
constrained or not: a request's tokens equal those of the same request decoded alone,
bitwise, whenever it joined and whoever else was in the batch, and the engine core's.
Each round runs the graphs of its lanes' sampling regime (hyspec.gpu.sampling.
SampledGraphKey: the stages and draws some lane needs).

Constrained requests (a hyspec.constraints.Constraint each): a round with a constrained
lane is a *masked* round (BatchRunner._run_masked; docs/constraints.md, "On the CUDA-graph
path"). The drafter runs depth by depth (a graph per step); between two steps the host
reads the drafted tokens and computes the next depth's mask with llguidance while the
device runs the next drafter step, and the last depth's mask while the device runs the
verify forward; the masks are applied inside the graphs. Masked rounds are not pipelined
(the next round's first mask needs this round's tokens).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hyspec.config import no_mtp_error
from hyspec.core.round import commit_constraint, stop_cut
from hyspec.rng import u01_tensor
from hyspec.sampling import NonFiniteLogits, check_logit_bias, top_ids
from hyspec.speculative.drafter import FORCED_STREAM
from hyspec.speculative.telemetry import SpecTelemetry
from hyspec.gpu.batch import BatchDecoder, drafter_cut, padded_size
from hyspec.gpu.sampling import SampledGraphKey


KEPT_ENDS = ("eos", "length")  # the ends whose state is kept (the engine core's rule; not cancelled, constraint)


class _OwnError(Exception):
    """A request's own ValueError while it is admitted (args[0]): it alone ends in error."""


@dataclass(eq=False)
class LaneRequest:
    prompt: list[int]
    max_new_tokens: int
    k: int = 0  # drafts per round; 0 = plain decoding
    stop_ids: frozenset = frozenset()
    stop_text: Any = None  # stop strings (hyspec.engine.StopStrings): the token completing one ends it ("stop")
    reference: list[int] | None = None  # continuation the forced-acceptance drafter proposes from
    arrival: int = 0  # the first round at which this request may join (staggered arrivals in benches)
    on_tokens: Callable[[list[int]], None] | None = None  # streaming: the tokens each round emits
    on_finish: Callable[["LaneRequest"], None] | None = None  # once it has left (reason set, lane freed)
    telemetry: SpecTelemetry = field(default_factory=SpecTelemetry)  # its speculative rounds
    params: Any = None  # SamplingParams (None: greedy)
    constraint: Any = None  # hyspec.constraints.Constraint (advanced in place by the emitted tokens)
    resume: Any = None  # a stored SeqState the prompt extends: the lane loads it and prefills only the rest
    carry_k: bool = False  # adaptive K: start at the resumed state's k_next (a session's own turn, not a store hit)
    on_state: Callable[[Any], None] | None = None  # takes its end state (a SeqState) at an exact eos / length end
    keep: bool = False  # a session turn: on_state takes the end state at every end but an error
    adaptive_floor: int | None = None  # adaptive K: next round's k = clamp(accepted + 1, floor, k); None: fixed k
    p_min: float = 0.0  # SpecOptions.p_min: drafting stops at a draft the drafter gives less probability than this
    logprobs: int | None = None  # N: each emitted token's log-probability (raw target logits) and top-N
    token_logprobs: list = field(default_factory=list)  # per emitted token: (logprob, [(id, logprob), ...])
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None  # "eos" | "stop" | "length" | "cancelled" | "constraint" | "error"
    error: str | None = None  # why, with reason "error" (its constraint could not go on: Constraint.fail)
    exception: Exception | None = None  # its own error (at admission or in a round), reason "error" (NonFiniteLogits)
    k_now: int = -1  # the k its lane drafts in the current round (k_lane on the device)
    k_next: int = -1  # adaptive K: the k it asks for next round (before the token-limit cap)
    rounds: int = 0  # target forwards (plain steps and speculative rounds)
    t_admit: float | None = None  # perf_counter when its prefill started
    t_first: float | None = None  # ... when its first token was chosen
    t_done: float | None = None  # ... when it left
    cached: int = 0  # prompt tokens not prefilled (resumed from `resume`)

    def emit(self, toks: list[int], logprobs: list | None = None) -> None:
        """Append a round's tokens up to a stop id, the token completing a stop string or the
        token limit (logprobs: one entry per token of toks, kept alongside). (The device
        commits a round up to a stop id only: after a stop string inside the accepted drafts
        the lane's state is past the transcript, and a kept end state is rebuilt.)"""
        n0 = len(self.tokens)
        for i, t in enumerate(toks):
            self.tokens.append(t)
            if logprobs is not None:
                self.token_logprobs.append(logprobs[i])
            if t in self.stop_ids:
                self.reason = "eos"
                break
            if self.stop_text is not None and self.stop_text.check(t):
                self.reason = "stop"
                break
            if len(self.tokens) >= self.max_new_tokens:
                self.reason = "length"
                break
        if self.constraint is not None and len(self.tokens) > n0:
            if commit_constraint(self.constraint, self.tokens[n0:]):  # this lane's failure, not the batch's:
                # the grammar refused the round's tokens, which leave the output unstreamed (as on the
                # engine core; a session turn's end state is then rebuilt from the tokens kept)
                if logprobs is not None:
                    del self.token_logprobs[len(self.token_logprobs) - (len(self.tokens) - n0):]
                del self.tokens[n0:]
                self.reason, self.error = "error", self.constraint.failure
                return
        if self.on_tokens is not None and len(self.tokens) > n0:
            self.on_tokens(self.tokens[n0:])


class BatchRunner:
    """The batched round over an open queue of LaneRequests.

        runner = BatchRunner(dec, max_batch=16)
        runner.submit(LaneRequest(prompt=[...], max_new_tokens=64, k=3, on_tokens=print))
        while runner.has_work():
            runner.step()        # admit (prefill) between rounds, one round, leave

    One thread steps a runner: it owns the decoder's lanes.  submit() and cancel() may be
    called from any thread: they only hand the request over (under a lock), and it takes
    effect at the next round boundary (a cancelled request's lane is freed within one
    round: the last lane moves into the hole).  Tokens reach on_tokens as each round
    commits them; on_finish runs once the request has left.

    pipeline: queue the next round before reading the current one's result when no lane
    can finish by its token limit, nothing waits to join and nothing is cancelled."""

    def __init__(self, dec: BatchDecoder, *, max_batch: int | None = None, forced_rates=None, forced_seed: int = 0,
                 pipeline: bool = True) -> None:
        self.dec = dec
        self.cap = min(max_batch or dec.slots, dec.slots)
        self.forced_rates, self.forced_seed = forced_rates, forced_seed
        self.forced = forced_rates is not None
        self.pipeline = pipeline
        self.waiting: deque[LaneRequest] = deque()  # submitted, not in a lane yet (stepping thread)
        self.active: list[LaneRequest] = []  # active[i] sits in lane i
        self.round = 0  # rounds launched (and idle rounds waiting for a later arrival)
        self.prefill_s = self.rounds_s = 0.0
        self._round_t0 = None  # perf_counter at the start of the round in progress (stats() counts it)
        self.wait_s = 0.0  # of rounds_s: the host waiting for a round's result (the rest is host work)
        self.tokens = 0  # tokens the rounds emitted (the prefills' first tokens not counted)
        self.constraint_s = 0.0  # host seconds in the constraints (masks and commits; the first tokens' included)
        self.masked_rounds = 0  # rounds with a constrained lane
        self.states_kept = self.states_not_kept = 0  # end states handed to on_state / not exact (export)
        self.store_s = 0.0  # seconds exporting end states (_keep_state; inside prefill_s or rounds_s)
        # the decoder's captures so far: stats() reports this runner's own (inside its rounds_s)
        self._captures0 = (dec.step_graphs.captures, dec.step_graphs.capture_s)
        self._lock = threading.Lock()
        self._submitted: list[LaneRequest] = []  # handed over, not yet seen by step()
        self._cancelled: list[LaneRequest] = []
        self._inflight = None  # a launched round not read yet (pipelining)
        self._raw_rows = None  # a masked round's verify logits before its commit masked them (logprobs)
        self._cuda = dec.dev.type == "cuda"
        self._sync = torch.cuda.synchronize if self._cuda else (lambda: None)
        # results of a launched round: copied to pinned host memory behind an event, so the
        # next round can be queued before the host reads this one (two buffers)
        if self._cuda:
            self._host = [torch.empty(dec.result.shape, dtype=torch.long, pin_memory=True) for _ in range(2)]
            # the drafts each lane kept (dec.k_round) of a round with p_min or masks
            self._khost = [torch.empty(dec.slots, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]
            # a masked round's drafts so far (the whole [lanes, t_max] block: one contiguous copy)
            self._tok_host = torch.empty(dec.slots, dec.t_max, dtype=torch.long, pin_memory=True)
            self._tok_event = torch.cuda.Event()
        self._buf = 0  # the next host buffer
        for lane in range(dec.slots):  # a runner starts from idle lanes
            dec.free(lane)

    # -- any thread --------------------------------------------------------------------
    def check(self, r: LaneRequest) -> None:
        """ValueError when r cannot run on this decoder."""
        dec = self.dec
        if r.k > dec.k_max:
            raise ValueError(f"a request drafts k={r.k} > the decoder's k_max {dec.k_max}")
        if not 0.0 <= r.p_min < 1.0:
            raise ValueError(f"a request's p_min must be in [0, 1), got {r.p_min}")
        if len(r.prompt) + r.max_new_tokens + r.k + 2 > dec.max_len:
            raise ValueError(f"a request needs {len(r.prompt) + r.max_new_tokens + r.k + 2} positions > "
                             f"the decoder's max_len {dec.max_len}")
        if self.forced and r.k > 0 and r.reference is None:
            raise ValueError("the forced-acceptance drafter needs each speculative request's reference")
        if r.params is not None:  # (its ids: the scheduler's check, for callers of the lanes alone)
            check_logit_bias(r.params, dec.cfg.vocab_size)
        if r.constraint is not None and (not hasattr(r.constraint, "allowed_words")
                                         or getattr(r.constraint, "vocab_size", None) != dec.cfg.vocab_size):
            raise ValueError(f"a request's constraint has no packed masks (allowed_words) over this model's "
                             f"vocabulary of {dec.cfg.vocab_size} tokens")
        st = r.resume
        if st is not None:
            n = len(st.tokens)
            if tuple(r.prompt[:n]) != tuple(st.tokens) or (n == len(r.prompt) and st.pending is None):
                raise ValueError("a resumed request's prompt must extend the state's tokens (with something to run)")
            if r.k > 0 and st.drafter != dec.hidden:
                raise ValueError(f"a drafting request needs a state with drafter rows of hidden={dec.hidden!r}")

    def submit(self, r: LaneRequest) -> LaneRequest:
        self.check(r)
        with self._lock:
            self._submitted.append(r)
        return r

    def cancel(self, r: LaneRequest) -> None:
        """Stop r at the next round boundary (reason "cancelled"; a finished r is left as it is)."""
        with self._lock:
            self._cancelled.append(r)

    def has_work(self) -> bool:
        with self._lock:
            handed = bool(self._submitted or self._cancelled)
        return handed or bool(self.waiting or self.active or self._inflight)

    def run(self) -> None:
        while self.has_work():
            self.step()

    def stats(self) -> dict:
        """Timing so far: prefill and rounds apart."""
        g = self.dec.step_graphs
        t0 = self._round_t0  # (a lane that leaves inside a round: its tokens are counted, so is its time so far)
        rounds_s = self.rounds_s + (time.perf_counter() - t0 if t0 is not None else 0.0)
        return {"prefill_s": self.prefill_s, "rounds_s": rounds_s, "wait_s": self.wait_s, "rounds": self.round,
                "round_tokens": self.tokens, "round_tok_s": self.tokens / rounds_s if rounds_s > 0 else None,
                "constraint_s": self.constraint_s, "masked_rounds": self.masked_rounds, "store_s": self.store_s,
                "graph_captures": g.captures - self._captures0[0], "graph_capture_s": g.capture_s - self._captures0[1]}

    # -- the stepping thread -----------------------------------------------------------
    def step(self) -> bool:
        """Take what was handed over, admit waiting requests (between rounds), run one
        round over the active lanes and let finished ones leave. Returns whether anything ran."""
        self._take_handed()
        if self._inflight is None:
            self._leave()  # cancelled lanes go before the round (and before anyone joins)
            self._admit()
            if not self.active:
                if self.waiting:  # nobody due yet: an idle round
                    self.round += 1
                    return True
                return False
        t0 = self._round_t0 = time.perf_counter()
        if self._inflight is None:
            self._inflight = self._launch()
        nxt = self._launch() if self._may_queue_next(self._inflight[2]) else None
        self._take(*self._read(self._inflight))
        self._inflight = None
        if nxt is not None:
            if any(r.reason is not None for r in self.active):
                self._take(*self._read(nxt))  # drain: the lanes still going keep the queued round's tokens
            else:
                self._inflight = nxt
        if self._inflight is None:
            self._leave()
        self.rounds_s += time.perf_counter() - t0
        self._round_t0 = None
        return True

    def _take_handed(self) -> None:
        with self._lock:
            submitted, cancelled = self._submitted, self._cancelled
            self._submitted, self._cancelled = [], []
        self.waiting.extend(submitted)
        for r in cancelled:
            if r.reason is not None:
                continue  # it finished already
            if r in self.waiting:
                r.reason = "cancelled"
                self.waiting.remove(r)
                self._finished(r)
            elif r in self.active:
                r.reason = "cancelled"  # it leaves at the round boundary (_leave)

    def _finished(self, r: LaneRequest) -> None:
        if r.reason == "constraint":  # nothing allowed after its tokens: an EOS ended the grammar,
            from hyspec.core.scheduler import dead_end  # or it is a dead end (an error)

            dead_end(r)
        failure = getattr(r.constraint, "failure", None)
        if failure is not None and r.reason != "cancelled":  # its grammar could not go on: an error
            r.reason, r.error = "error", failure
        r.t_done = time.perf_counter()
        if r.on_finish is not None:
            r.on_finish(r)

    def _due(self) -> bool:
        """Someone waits to join and a lane is free for it."""
        return bool(self.waiting) and len(self.active) < self.cap and self.waiting[0].arrival <= self.round

    def _admit(self) -> None:
        dec = self.dec
        t0 = time.perf_counter()
        while self._due():
            r = self.waiting.popleft()
            r.t_admit = time.perf_counter()
            r.k_next = r.k
            if r.adaptive_floor is not None and r.carry_k and r.resume is not None and r.resume.k_next:
                # a session turn goes on with the k its state's last round chose (the core's _resume); a
                # store hit starts as the request would alone (the output must not depend on the store)
                r.k_next = max(r.adaptive_floor, min(r.resume.k_next, r.k))
            if r.max_new_tokens == 0:
                r.reason = "length"
                self._finished(r)
                continue
            lane = len(self.active)
            try:
                self._admit_one(r, lane)
            except _OwnError as e:  # r's own error, not the batch's: it alone ends (as on the engine
                dec.free(lane)      # core); the lanes running go on
                r.reason, r.exception = "error", e.args[0]
                self._finished(r)
        self._sync()
        self.prefill_s += time.perf_counter() - t0

    def _admit_one(self, r: LaneRequest, lane: int) -> None:
        """Prefill r into the free lane and choose its first token (joins the round, or ends).
        A ValueError of r's own on the way (its first row's logits overflowed: NonFiniteLogits;
        a parameter the device tables refuse) is raised as _OwnError; a callback's goes as it is."""
        from hyspec.core.round import _logprob, choose_token, masked
        from hyspec.core.state import carry_of
        from hyspec.sampling import greedy_token

        dec = self.dec
        try:
            dec.set_stops(lane, r.stop_ids)
            st, carry = r.resume, None
            if st is not None:  # the stored state, then [its pending token] + the prompt's new tokens
                dec.load(lane, st, drafter=r.k > 0)
                feed = ([st.pending] if st.pending is not None else []) + list(r.prompt[len(st.tokens):])
                r.cached = len(r.prompt) - len(feed)
                if feed == [st.pending] and r.k == 0:  # nothing new: a plain lane goes on from the state itself
                    # (a drafting lane prefills its pending token and draws the next one from that
                    # row, as the engine core's resume does: its rounds, hence which draws make a
                    # sampled token, start there; going on mid-rounds would give other samples)
                    dec.set_params(lane, r.params)
                    dec.resume(lane, st)
                    r.t_first = time.perf_counter()
                    self._join(r, lane)
                    return
                pre, post, logits = dec.prefill(lane, feed, start=st.pos)
                carry = carry_of(st) if r.k > 0 else None
            else:
                pre, post, logits = dec.prefill(lane, r.prompt)
            row, first = logits[0], None
            if r.constraint is not None:  # the first token under the constraint's state now
                t_c = time.perf_counter()
                mask = r.constraint.allowed()
                self.constraint_s += time.perf_counter() - t_c
                row = masked(row, mask) if bool(mask.any()) else None
            if row is not None:
                if r.params is None:  # (greedy_token: a row with NaN / +inf is an error, as on the engine core)
                    first = greedy_token(row)
                else:  # the token at position P, as the engine core chooses it (penalised greedy too)
                    first = choose_token(row, r.prompt, r.params, len(r.prompt))
                dec.set_params(lane, r.params)
        except ValueError as e:
            raise _OwnError(e) from e
        if first is None:  # its constraint allows nothing
            r.reason = "constraint"
            dec.free(lane)
            self._finished(r)
            return
        r.t_first = time.perf_counter()
        self._emit(r, [first], None if r.logprobs is None else [_logprob(logits[0], first, r.logprobs)])
        if r.reason is not None:
            if self._keeps(r):  # its drafter rows belong to the state
                dec.start(lane, r.prompt, pre, post, first, r.k, carry)
                self._keep_state(lane, r)
            dec.free(lane)
            self._finished(r)
            return
        dec.start(lane, r.prompt, pre, post, first, r.k, carry)
        self._join(r, lane)

    def _join(self, r: LaneRequest, lane: int) -> None:
        dec = self.dec
        r.k_now = r.k  # (the lane's k_lane as started; _launch moves it to k_next)
        if r.k > 0 and r.p_min > 0:
            dec.set_p_min(lane, r.p_min)
        if self.forced and r.k > 0:
            dec.set_forced(lane, forced_table(list(r.prompt) + list(r.reference), list(self.forced_rates),
                                              self.forced_seed, dec.capacity, dec.k_max, dec.cfg.vocab_size))
        self.active.append(r)

    @staticmethod
    def _keeps(r: LaneRequest) -> bool:
        """Whether r's end state goes to r.on_state (store: eos / length; a session turn:
        every end without an error, a cancel too: Session.send(cancel=) keeps the turn as it
        stands; export hands over only a state that is exactly the transcript's)."""
        return r.on_state is not None and (r.reason in KEPT_ENDS or (r.keep and r.exception is None))

    def _keep_state(self, lane: int, r: LaneRequest) -> None:
        """Hand lane's end state to r.on_state (when it is exactly r's transcript's)."""
        t0 = time.perf_counter()
        st = self.dec.export(lane, list(r.prompt) + r.tokens, r.k_next if r.adaptive_floor is not None else r.k)
        if st is None:
            self.states_not_kept += 1
        else:
            self.states_kept += 1
            r.on_state(st)
        self.store_s += time.perf_counter() - t0

    def _launch(self):
        dec, active = self.dec, self.active
        # a lane drafts at most remaining - 1 (the engine core's rule: a round never decides
        # positions past the limit, which keeps sampled output equal to the core's)
        for i, r in enumerate(active):
            k_eff = max(0, min(r.k_next, r.max_new_tokens - len(r.tokens) - 1))
            if k_eff != r.k_now:  # (fill_: a kernel with the value as argument; item assignment
                dec.k_lane[i].fill_(k_eff)  # copied a host scalar through pageable memory, a sync)
                r.k_now = k_eff
        nb = padded_size(len(active), dec.sizes)
        k = max(r.k for r in active)
        if any(r.adaptive_floor is not None for r in active):  # the round's graphs draft as deep as some lane asks
            k = max(r.k_now for r in active) or k
        regime = SampledGraphKey.of([r.params for r in active])  # None: the argmax graphs
        plain = any(r.k == 0 for r in active)
        # (the forced drafter's proposals are certain: p_min never stops them, as on the core)
        pmin = k > 0 and not self.forced and any(r.p_min > 0 and r.k_now > 0 for r in active)
        masked = any(r.constraint is not None for r in active)
        # the drafts each lane kept (dec.k_round): p_min, a dead mask row or a bad drafter row
        # (a sampled round: hyspec.gpu.batch.drafter_cut) ended them
        cut = k > 0 and (pmin or masked or drafter_cut(regime))
        if masked:
            self._run_masked(nb, k, regime, plain, pmin)
        elif k == 0:
            dec.decode(nb, regime)
        else:
            dec.round(nb, k, self.forced, regime, plain, pmin)
        self.round += 1
        buf = self._buf
        self._buf ^= 1
        n = len(active)
        asking = [i for i, r in enumerate(active) if r.logprobs is not None]
        lp = None
        if asking:
            lp = self._logprob_pack(asking, k, min(max(active[i].logprobs for i in asking), dec.cfg.vocab_size))
        if self._cuda:
            # whole rows: a column slice is not contiguous, and torch copies a non-contiguous
            # tensor to the host through an unpinned temporary, which blocks until the GPU is
            # done (plain rounds of 2+ lanes then ran unpipelined: 8 % of a batch-16 step)
            self._host[buf][:n].copy_(dec.result[:n], non_blocking=True)
            kr = None
            if cut:  # the drafts each lane kept (telemetry)
                kr = self._khost[buf]
                kr[:n].copy_(dec.k_round[:n], non_blocking=True)
            if lp is not None:  # the pack to pinned memory (the caching host allocator); top and lanes kept
                pack = lp[0]
                lp = (torch.empty(pack.shape, dtype=pack.dtype, pin_memory=True).copy_(pack, non_blocking=True),
                      *lp[1:])
            self._events[buf].record()
            return buf, n, k, None, lp, kr
        kr = dec.k_round[:n].clone() if cut else None
        return buf, n, k, dec.result[:n].clone(), lp, kr  # CPU: the call was synchronous

    def _logprob_pack(self, lanes: list[int], k: int, top: int):
        """For a round just launched whose lanes `lanes` ask for logprobs: each of their
        verify rows' logsumexp, the logit of the token that row emits if it emits one (row j
        of a lane: draft j + 1 while j < its accepted n, else the bonus) and the top-`top`
        logits and ids (lane i's rows i*t .. i*t + k; a plain step's row i), computed
        on the device behind the round, before any later round overwrites the runner's
        logits buffer, and read back with the round's result (so the rounds still pipeline).
        A masked round's rows are the copy _run_masked took before its commit masked them
        (the raw logits, as the engine core reports them under a constraint too). -> (one
        packed fp32 tensor, top, lanes)."""
        dec = self.dec
        t = k + 1
        raw, self._raw_rows = self._raw_rows, None  # a masked round's rows as the verify left them

        def rows_of(a: torch.Tensor, per: int) -> torch.Tensor:  # the lanes' rows: slices (no index upload)
            if lanes[-1] - lanes[0] == len(lanes) - 1:
                return a[lanes[0] * per: (lanes[-1] + 1) * per]
            return torch.cat([a[i * per: (i + 1) * per] for i in lanes])

        x = rows_of(dec.runner.bufs.logits if raw is None else raw, t).float()  # [len(lanes) * t, V]
        res = rows_of(dec.result, 1)
        n = len(lanes)
        bonus = res[:, 1:2].clamp(min=0)  # (-1: a masked round's dead end; nothing emitted there)
        j = torch.arange(t, device=x.device)[None, :]
        tok = torch.where(j < res[:, :1], torch.cat([res[:, 2: 2 + k], bonus], 1), bonus)  # [n, t]
        chosen = x.view(n, t, -1).gather(2, tok[..., None]).view(-1)
        ids = top_ids(x, top)  # (ties by ascending id, as the engine core's lists)
        vals = x.gather(1, ids)
        return torch.cat([torch.logsumexp(x, -1), chosen, vals.flatten(), ids.flatten().float()]), top, lanes

    def _run_masked(self, nb: int, k: int, regime, plain: bool, pmin: bool = False) -> None:
        """One round with masks: the drafter depth by depth, the host writing mask row j
        (each constrained lane's state after its drafts d1..dj) while the device runs the
        drafter step (or, for the last row, the verify forward) that does not need it."""
        dec, active = self.dec, self.active
        self.masked_rounds += 1
        n = len(active)
        mask_np = dec.mask_host.numpy()  # [t_max, S, W] (on the CPU: the device's own buffer)
        cons = [(i, r) for i, r in enumerate(active) if r.constraint is not None]
        for i in range(nb):  # unconstrained and padding lanes: all-ones rows
            if (i >= n or active[i].constraint is None) and not dec.mask_host_ones[i]:
                mask_np[:, i] = -1
                dec.mask_host_ones[i] = True
        for i, _ in cons:
            dec.mask_host_ones[i] = False
        drafts = {i: [] for i, _ in cons}
        dead = set()  # lanes whose mask emptied this round (every later row is empty too)

        def rows(j: int) -> None:
            t0 = time.perf_counter()
            for i, r in cons:
                if j > r.k_now:  # a row past the lane's drafts: never read
                    continue
                if i in dead:
                    mask_np[j, i] = 0
                    continue
                words = r.constraint.allowed_words(drafts[i][:j])
                mask_np[j, i] = words
                if not words.any():
                    dead.add(i)
            self.constraint_s += time.perf_counter() - t0
            dec.upload_mask(nb, j)

        if k == 0:
            dec.masked_decode_forward(nb)
            rows(0)  # overlaps the target forward
            dec.masked_decode_pick(nb, regime)
            return
        dec.masked_draft_fill(nb)
        rows(0)  # overlaps the drafter's fill rows
        for i in range(k):
            dec.masked_draft_pick(nb, i, self.forced, regime, pmin)
            if self._cuda:
                self._tok_host[:n].copy_(dec.verify_tokens[:n], non_blocking=True)
                self._tok_event.record()
            else:
                toks = dec.verify_tokens[:n, 1 + i].tolist()
            if i + 1 < k:
                dec.masked_draft_advance(nb, i)
            else:
                dec.verify(nb, k + 1)
            if self._cuda:
                self._tok_event.synchronize()
                toks = self._tok_host[:n, 1 + i].tolist()
            for lane, _ in cons:
                drafts[lane].append(toks[lane])
            rows(i + 1)  # overlaps the next drafter step / the verify forward
        if any(r.logprobs is not None for r in active):  # the raw rows, before the commit masks them in place
            self._raw_rows = dec.runner.bufs.logits[: n * (k + 1)].clone()
        dec.masked_commit(nb, k + 1, regime, plain)

    def _emit(self, r: LaneRequest, toks: list[int], logprobs: list | None = None) -> None:
        t0 = time.perf_counter()
        r.emit(toks, logprobs)  # (commits them to r's constraint)
        if r.constraint is not None:
            self.constraint_s += time.perf_counter() - t0

    def _read(self, launched):
        """-> (rows (accepted n, bonus, d1..dk, bad row) per lane, k, the logprob pack or
        None, the drafts each lane kept or None)."""
        buf, n, k, copy, lp, kr = launched
        if self._cuda:
            t0 = time.perf_counter()
            self._events[buf].synchronize()
            self.wait_s += time.perf_counter() - t0
            kept = None if kr is None else kr[:n].tolist()
            rows = self._host[buf][:n].tolist()
        else:
            rows, kept = copy.tolist(), None if kr is None else kr.tolist()
        return [row[: 2 + k] + row[-1:] for row in rows], k, lp, kept

    def _take(self, rows, k: int, lp=None, kept=None) -> None:
        """Emit a read round's tokens to the lanes still going (a finished or cancelled
        lane's row is dropped); k: the round's drafts (its verify ran k + 1 rows a lane);
        lp: the round's logprob pack (_logprob_pack) when a lane asked; kept: the drafts
        each lane kept (a round with p_min, masks or a sampled lane: a draft below p_min, a
        dead mask row or a bad drafter row ended them), else each lane's k_now."""
        lps = self._round_logprobs(rows, k + 1, lp) if lp is not None else {}
        for i, (r, row) in enumerate(zip(self.active, rows)):  # row: (accepted n, bonus, d1..dk, bad row)
            if r.reason is not None:
                continue
            n, bonus = row[0], row[1]
            bad = row[-1]
            if bad <= n and stop_cut(row[2: 2 + bad], bad, None, r.stop_ids, r.stop_text)[0] == bad:
                # a row the round used held NaN / +inf: as on the engine core (hyspec.core.round:
                # NonFiniteLogits), this lane alone ends in error and the round emits nothing for it
                # (rows past a rejected draft or past an accepted stop are not read there either)
                r.reason, r.exception = "error", NonFiniteLogits()
                continue
            drafted = r.k_now if kept is None else kept[i]
            r.rounds += 1
            # a constraint that allowed no token at all (no drafts, a dead bonus row): the engine
            # core's accept gives no result there, so it records no round and keeps its k
            dead = bonus < 0 and drafted == 0
            if r.k > 0 and not dead:
                r.telemetry.record_round(drafted, n)
            if r.adaptive_floor is not None and not dead:  # the core's rule (hyspec.core.round.run_round),
                cut = stop_cut(row[2: 2 + n], n, None, r.stop_ids, r.stop_text)[0]  # after its stop cut
                r.k_next = max(r.adaptive_floor, min(cut + 1, r.k))
            before = len(r.tokens)
            if bonus < 0:  # a masked round: the constraint allows nothing after the accepted drafts
                self._emit(r, row[2: 2 + n], lps.get(i))
                r.reason = r.reason or "constraint"
            else:
                self._emit(r, row[2: 2 + n] + [bonus], lps.get(i))
            self.tokens += len(r.tokens) - before

    def _round_logprobs(self, rows, t: int, lp) -> dict:
        """{lane: [(logprob, [(id, logprob), ...top-N]) per token the round emits]} for the
        lanes that ask, from the round's logprob pack: logprob = logit - logsumexp (the raw
        logits' log-softmax, as the engine core reports it: hyspec.core.round._logprob; in
        fp32), the top-N by the raw logits (the same order)."""
        pack, top, lanes = lp
        vals = pack.tolist()
        m = len(lanes) * t
        lse, chosen, tv, ti = vals[:m], vals[m: 2 * m], vals[2 * m: 2 * m + m * top], vals[2 * m + m * top:]
        out = {}
        for p, i in enumerate(lanes):  # the p-th asking lane sits in lane i: its rows p*t ..
            r = self.active[i]
            if r.reason is not None:
                continue
            n, bonus = rows[i][0], rows[i][1]
            out[i] = [(chosen[a] - lse[a], [(int(ti[a * top + q]), tv[a * top + q] - lse[a])
                                            for q in range(min(r.logprobs, top))])
                      for a in range(p * t, p * t + n + (1 if bonus >= 0 else 0))]
        return out

    def _may_queue_next(self, k) -> bool:
        """Queue the next round before reading this one: only when no lane can reach its
        token limit in this round, nothing waits to join and nothing is cancelled (a stop
        id may still end a lane: its extra round is then dropped)."""
        if not self.pipeline or any(r.reason is not None or r.constraint is not None or r.adaptive_floor is not None
                                    for r in self.active):
            return False  # (a masked round needs this round's tokens for its first mask; adaptive K, its n)
        if any(r.on_state is not None and (r.keep or r.stop_ids or r.stop_text is not None) for r in self.active):
            return False  # a stop token ending this round (or a session turn's cancel, Session.send(cancel=)) would
            # leave the lane a round past its end state
        with self._lock:
            if self._cancelled or (self._submitted and len(self.active) < self.cap):
                return False
        if self._due():
            return False
        # (with >= 2k + 2 left before this round, every lane still drafts its full k in the next)
        return all(r.max_new_tokens - len(r.tokens) >= 2 * (k + 1) for r in self.active)

    def _leave(self) -> None:
        """Free the lanes of finished requests: the last lane moves into each hole."""
        dec, active = self.dec, self.active
        for i in reversed(range(len(active))):
            r = active[i]
            if r.reason is None:
                continue
            if self._keeps(r):
                self._keep_state(i, r)
            last = len(active) - 1
            if i != last:
                dec.move(last, i)
                active[i] = active[last]
            else:
                dec.free(i)
            active.pop()
            self._finished(r)


def run_batch(dec: BatchDecoder, requests: list[LaneRequest], *, max_batch: int | None = None,
              forced_rates=None, forced_seed: int = 0, pipeline: bool = True) -> dict:
    """Decode every request to its end (joining by its arrival round); returns timing
    stats (prefill and rounds apart)."""
    runner = BatchRunner(dec, max_batch=max_batch, forced_rates=forced_rates, forced_seed=forced_seed,
                         pipeline=pipeline)
    for r in requests:
        runner.check(r)
    for r in sorted(requests, key=lambda r: r.arrival):
        runner.submit(r)
    runner.run()
    return runner.stats()


def forced_table(reference: list[int], rates, seed: int, capacity: int, k_max: int, vocab: int) -> torch.Tensor:
    """[capacity, k_max] tokens the forced drafter proposes at (position, depth): exactly
    hyspec.core.round.forced_token, vectorised."""
    K = max(k_max, 1)
    pos = torch.arange(capacity, dtype=torch.long)[:, None]
    depth = torch.arange(K, dtype=torch.long)[None, :]
    ref = torch.tensor(list(reference) + [0] * max(0, capacity - len(reference)), dtype=torch.long)[:capacity]
    rate = torch.tensor([rates[min(d, len(rates) - 1)] for d in range(K)], dtype=torch.float64)[None, :]
    u = u01_tensor(seed, FORCED_STREAM, pos * 64 + depth)
    r = ref[:, None].expand(capacity, K)
    tok = torch.where(u < rate, r, (r + 1) % vocab)
    tok[pos[:, 0] >= len(reference)] = 0
    return tok


@torch.no_grad()
def decode_one(dec: BatchDecoder, prompt: list[int], max_new_tokens: int, *, k: int = 0, forced_rates=None,
               forced_seed: int = 0, reference: list[int] | None = None, stop_ids=(), params=None):
    """One sequence decoded alone on dec (one lane): plain (k = 0) or speculative with k
    drafts per round, the real MTP drafter or, with forced_rates, the forced-acceptance one
    (it proposes from reference). The round graphs it needs are captured first, outside
    the timing. -> hyspec.decode.GenerationResult: tokens, stop_reason, stats (the engine's
    lane stats; decode_tok_s = the tokens the rounds emitted per second of rounds, prefill
    and set-up excluded; "spec": the telemetry of a speculative run; "runner": the
    BatchRunner's stats)."""
    from hyspec.decode import GenerationResult

    forced = forced_rates is not None and k > 0
    r = LaneRequest(prompt=list(prompt), max_new_tokens=max_new_tokens, k=k, stop_ids=frozenset(stop_ids),
                    reference=list(reference) if reference is not None else None, params=params)
    if k > 0 and not dec.has_mtp:
        raise no_mtp_error()
    runner = BatchRunner(dec, max_batch=1, forced_rates=tuple(forced_rates) if forced else None,
                         forced_seed=forced_seed)
    runner.check(r)  # before any capture: a bad request is an error, not a failed graph
    regime = SampledGraphKey.of([params])
    if dec.graphs and not (regime is not None and (regime.penalties or regime.bias)):  # (penalised or biased:
        # captured on first use, once the lane has its penalty window / bias row)
        dec.capture([padded_size(1, dec.sizes)], [k], forced=(forced,), sampled=(regime or False,),
                    plain=(k == 0,))
    runner.submit(r)
    runner.run()
    st = runner.stats()
    stats = lane_stats(r, dec)
    stats["decode_tok_s"] = st["round_tok_s"]
    stats["runner"] = st
    return GenerationResult(list(r.tokens), r.reason or "length", stats)


# ---------------------------------------------------------------------------------------
# the engine's entry: hyspec.core.request.Request objects on the graph path
# ---------------------------------------------------------------------------------------
def graph_eligible(reqs) -> str | None:
    """None when every request can run on the BatchDecoder (greedy or sampled, penalties
    included, constrained or not, with logprobs or not, fixed or adaptive k, with or without p_min, with the
    post-norm hidden, one
    forced profile; a session turn when it resumes from a SeqState, not from a live
    engine-core slot, and has no more stop ids than the device's commit knows); else the
    reason it cannot (the engine core serves it). The prefix store is no reason: a lane
    resumes from a stored state and leaves its end state there (store_state)."""
    from hyspec.core.state import SeqState
    from hyspec.gpu.batch import STOP_SLOTS

    forced = {(tuple(r.spec.forced_rates), r.spec.forced_seed) if r.spec and r.spec.forced_rates else None
              for r in reqs if r.draft > 0}
    if len(forced) > 1:
        return "requests with different forced-drafter profiles"
    for r in reqs:
        if r.constraint is not None and not hasattr(r.constraint, "allowed_words"):
            return "a constraint without packed masks (allowed_words)"
        if r.resume is not None and not isinstance(r.resume, SeqState):
            return "session state in an engine-core slot"
        if r.keep and len(set(r.stop_ids or ())) > STOP_SLOTS:
            return f"a session turn with more than {STOP_SLOTS} stop ids (its end state would not be exact)"
        o = r.spec
        if r.draft > 0 and o is not None and (o.hidden != "post" or not o.prime_pending):
            return "speculative options the graph round does not have (hidden=pre, no priming)"
    return None


def lane_of(r, on_finish=None, store=None) -> LaneRequest:
    """The LaneRequest of a hyspec.core Request (its stream and telemetry passed through).
    store: the prefix store: the lane resumes from the longest stored state its prompt
    extends (r.use_store; a lookup, counted as a hit or a miss) and leaves its end state
    there (r.store_state)."""
    cb = None if r.on_tokens is None else (lambda toks: r.on_tokens(r, toks))
    if r.draft > 0 and r.telemetry is None:
        r.telemetry = SpecTelemetry()
    if r.resume is not None:  # a session turn: the state's transcript, then the new tokens
        prompt, resume = list(r.resume.tokens) + list(r.prompt_ids), r.resume
    else:
        prompt = list(r.prompt_ids)
        resume = stored_state(store, prompt, r.draft) if store is not None and r.use_store else None
    on_state = store.put if store is not None and r.store_state else None
    if r.keep:  # the end state goes to the request (r.end_state), and into the store when asked
        def on_state(st, put=on_state):
            r.end_state = st
            if put is not None:
                put(st)
    return LaneRequest(prompt=prompt, max_new_tokens=r.max_new_tokens, k=r.draft,
                       stop_ids=frozenset(r.stop_ids or ()), stop_text=r.stop_text, reference=r.reference, on_tokens=cb,
                       on_finish=on_finish,
                       telemetry=r.telemetry if r.draft > 0 else SpecTelemetry(), params=r.params,
                       constraint=r.constraint, resume=resume, carry_k=r.resume is not None, on_state=on_state,
                       keep=r.keep,
                       logprobs=r.logprobs, token_logprobs=r.token_logprobs,
                       adaptive_floor=r.spec.adaptive_floor if r.draft > 0 and r.spec is not None and r.spec.adaptive
                       else None,
                       p_min=r.spec.p_min if r.draft > 0 and r.spec is not None else 0.0)


def lane_prompt_len(r) -> int:
    """Positions a hyspec.core Request's lane prefills or resumes (a session turn's state
    included)."""
    return len(r.prompt_ids) + (len(r.resume.tokens) if r.resume is not None else 0)


def stored_state(store, prompt: list[int], k: int):
    """The prefix store's state for a lane of this prompt (the longest stored prefix; a
    drafting lane takes only states with drafter rows of the graph round's post-norm
    hidden), or None. Counts a hit or a miss."""
    return store.lookup(prompt, drafter="post" if k > 0 else None)


@torch.no_grad()
def state_of(dec: BatchDecoder, tokens: list[int], k: int):
    """The SeqState of a transcript whose last token is pending (None when it has fewer
    than two tokens), built on lane 0 of an idle decoder: a prefill of all but the last
    token, the last one started as pending (k > 0: with the drafter's rows), exported, the
    lane freed. For a session turn whose lane could not hand over its end state."""
    if len(tokens) < 2:
        return None
    dec.prefill_start(0, list(tokens[:-1]), k, pending=tokens[-1])
    st = dec.export(0, list(tokens), k)
    dec.free(0)
    return st


def lane_stats(lr: LaneRequest, dec: BatchDecoder) -> dict:
    """A finished lane's stats, with the engine core's keys (sequence_stats)."""
    n = len(lr.tokens)
    t_done = lr.t_done if lr.t_done is not None else time.perf_counter()
    first = lr.t_first if lr.t_first is not None else t_done
    prefill = first - lr.t_admit if lr.t_admit is not None else 0.0
    decode = t_done - first
    stats = {"prompt_tokens": len(lr.prompt), "generated_tokens": n, "path": "batch-graphs",
             "graphs": dec.step_graphs.active, "exact": dec.exact, "cached_tokens": lr.cached,
             "prefill_s": prefill, "decode_s": decode, "decode_tok_s": (n - 1) / decode if n > 1 and decode > 0 else None,
             "time_to_first_token_s": prefill if lr.t_first is not None and lr.t_admit is not None else None,
             "target_forwards": lr.rounds}
    if lr.k > 0:
        # a lane's only token off a known row is the prefill's (every round verifies [pending, drafts])
        stats.update({"k": lr.k, "direct_tokens": min(n, 1), "spec": lr.telemetry.to_dict()})
    if lr.error is not None:  # (the engine core's req.error form: the server answers it with a 400)
        stats["error"] = f"ConstraintFailure: {lr.error}"
    elif lr.exception is not None:  # (the server: a 500 for this request alone)
        stats["error"] = f"{type(lr.exception).__name__}: {lr.exception}"
    return stats


def run_requests(dec: BatchDecoder, reqs, max_batch: int, store=None) -> None:
    """Run hyspec.core Requests to their end on the BatchDecoder; fills tokens, stop_reason,
    stats and calls on_tokens / on_finish like the engine core's scheduler does (on_finish
    as each request ends, not once the whole batch has: a session turn's, whose end state
    may have to be rebuilt on the idle decoder, after the run). store: the prefix store the
    requests resume from (use_store) and leave their end states in (store_state), as on the
    engine core."""
    forced = next((r.spec for r in reqs if r.draft > 0 and r.spec is not None and r.spec.forced_rates), None)
    runner = BatchRunner(dec, max_batch=max_batch, forced_rates=forced.forced_rates if forced else None,
                         forced_seed=forced.forced_seed if forced else 0)
    lanes = [lane_of(r, store=store) for r in reqs]
    t0 = 0.0  # (set as the requests are submitted)
    ended = set()  # the requests whose finish ran

    def batch_stats() -> dict:
        stats = runner.stats()
        return {"batch_wall_s": time.perf_counter() - t0, "batch_round_tok_s": stats["round_tok_s"],
                "batch_runner": stats}

    def finish(r, lr) -> None:  # r's outputs from its lane, then its on_finish (once)
        ended.add(id(r))
        r.tokens[:] = lr.tokens
        r.stop_reason = lr.reason or "length"
        if lr.error is not None:
            from hyspec.core.scheduler import ConstraintFailure

            r.exception = ConstraintFailure(lr.error)
            r.error = f"ConstraintFailure: {lr.error}"
        elif lr.exception is not None:  # its own error (NonFiniteLogits), as the engine core's
            r.exception = lr.exception
            r.error = f"{type(lr.exception).__name__}: {lr.exception}"
        if r.keep and r.end_state is None and (lr.exception is None or lr.tokens):  # not exported (no token
            # emitted, not exact, or its own error in a round: the lane's state holds that round; the engine
            # core keeps the rounds before it): rebuilt (not after an error at admission: the turn is undone)
            r.end_state = state_of(dec, lr.prompt + lr.tokens, lr.k)
            if r.end_state is not None and lr.adaptive_floor is not None:
                r.end_state.k_next = lr.k_next
        r.done = True
        r.stats = {**lane_stats(lr, dec), **batch_stats()}
        if r.on_finish is not None:
            r.on_finish(r)

    asked: set[int] = set()  # the lanes handed to runner.cancel

    def cancel_asked() -> None:  # every request asked to stop, running or still waiting for a lane
        for q, lq in zip(reqs, lanes):
            if q.cancel_requested and id(lq) not in asked:
                asked.add(id(lq))
                runner.cancel(lq)

    for r, lr in zip(reqs, lanes):
        runner.check(lr)
        if lr.on_tokens is not None:  # a callback may ask to stop (Request.cancel_requested), this
            def on_tokens(toks, inner=lr.on_tokens, r=r):  # request or (generate's cancel) others too
                inner(toks)
                if r.cancel_requested:
                    cancel_asked()
            lr.on_tokens = on_tokens
        if not r.keep:  # as it leaves its lane (state_of, for a session turn, needs the decoder idle)
            lr.on_finish = lambda lr, r=r: finish(r, lr)
    t0 = time.perf_counter()
    for lr in lanes:
        runner.submit(lr)
    runner.run()
    final = batch_stats()
    for r, lr in zip(reqs, lanes):
        if id(r) in ended:  # (its on_finish has run) the batch's figures as of its end: now the whole batch's
            r.stats = {**r.stats, **final}
        else:
            finish(r, lr)
