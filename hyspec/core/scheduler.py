"""Continuous batching: requests join between rounds (after their prefill) and leave when
they finish; every step runs one round over all active sequences.

    sched = Scheduler(model, max_batch=16)
    sched.submit(Request(prompt_ids=[...], max_new_tokens=64, draft=3))
    while sched.has_work():
        sched.step()

Not thread-safe: one thread owns a scheduler (the server runs it in an engine thread).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from hyspec.config import no_mtp_error
from hyspec.core.backend import PREFILL_CHUNK, ReferenceBackend
from hyspec.core.request import Request
from hyspec.core.round import Sequence, choose_token, masked, run_round
from hyspec.core.slots import SlotPool
from hyspec.core.state import Carry, RoundTxn, SeqState, capture, carry_of, drafter_of, restore_into
from hyspec.sampling import SamplingParams, check_logit_bias, int_in

MAX_DRAFT = 16


def check_prompt(prompt: list[int], vocab: int) -> None:
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"prompt token id(s) {bad[:5]} out of range for vocabulary size {vocab}")


class ConstraintFailure(ValueError):
    """A request's constraint could not go on (hyspec.constraints.Constraint.fail): that
    request ends with stop_reason "error"; the others in its batch are not touched."""


def constraint_failure(req) -> ConstraintFailure | None:
    c = getattr(req, "constraint", None)
    why = getattr(c, "failure", None) if c is not None else None
    return None if why is None else ConstraintFailure(why)


def dead_end(req) -> bool:
    """Whether a request that stopped because its constraint allowed nothing stopped at a
    dead end (Constraint.dead_end: no EOS ended the grammar; the failure is then recorded)."""
    check = getattr(getattr(req, "constraint", None), "dead_end", None)
    return bool(check()) if check is not None else False


def check_stop(stop_ids, vocab: int) -> set[int]:
    s = set(int(t) for t in stop_ids)
    bad = [t for t in s if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop id(s) {sorted(bad)[:5]} out of range for vocabulary size {vocab}")
    return s


def spec_options(req: Request):
    """The request's SpecOptions (k = req.draft), or None for plain decoding."""
    from hyspec.speculative.loop import SpecOptions

    draft = int_in(req.draft, 0)
    if draft is None:
        raise ValueError(f"draft must be an integer >= 0 (0 = plain decoding), got {req.draft!r}")
    req.draft = draft  # (a numpy integer is kept as a Python int)
    if req.draft == 0:
        return None
    return (req.spec or SpecOptions()).with_k(req.draft)


class Scheduler:
    def __init__(self, model, *, max_batch: int = 16, backend=None, pool: SlotPool | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, store=None) -> None:
        self.max_batch = int_in(max_batch, 1)
        if self.max_batch is None:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.model = model
        self.backend = backend if backend is not None else ReferenceBackend(model)
        self.pool = pool if pool is not None else SlotPool(model, max_slots=self.max_batch)
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.rounds = 0
        self.store = store  # a hyspec.prefix_store.PrefixStore: prompts resume from its longest stored prefix

    # -- requests ----------------------------------------------------------------------
    def validate(self, req: Request):
        """Check a request before it is queued; returns (SpecOptions or None, stop set)."""
        cfg = self.model.cfg
        if req.resume is None:
            check_prompt(req.prompt_ids, cfg.vocab_size)
        elif req.prompt_ids:
            check_prompt(req.prompt_ids, cfg.vocab_size)
        elif req.resume.pending is None:
            raise ValueError("nothing to send: the conversation has no pending token, give at least one token")
        limit = int_in(req.max_new_tokens, 0)
        if limit is None:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {req.max_new_tokens!r}")
        if req.resume is not None and limit == 0:
            raise ValueError("a resumed request needs max_new_tokens >= 1")
        req.max_new_tokens = limit
        if not isinstance(req.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(req.params).__name__}")
        check_logit_bias(req.params, cfg.vocab_size)
        opts = spec_options(req)
        if opts is not None and not self.model.has_mtp:
            raise no_mtp_error()
        if opts is not None and opts.forced_rates is not None and req.reference is None:
            raise ValueError("SpecOptions.forced_rates: the forced-acceptance drafter needs a reference continuation "
                             "(the plain greedy output it accepts from), which Engine.generate makes itself; "
                             "generate_batch and sessions take no forced_rates")
        if req.reference is not None:
            bad = [t for t in req.reference if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ValueError(f"reference: token id(s) {bad[:5]} out of range for vocabulary size {cfg.vocab_size}")
        if req.logprobs is not None:
            top = int_in(req.logprobs, 0)
            if top is None:
                raise ValueError(f"logprobs must be None or an integer >= 0, got {req.logprobs!r}")
            req.logprobs = top
        return opts, check_stop(req.stop_ids, cfg.vocab_size)

    def submit(self, req: Request) -> Request:
        self.validate(req)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request before the next round (its slot is freed then)."""
        req.cancel_requested = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.active)

    @property
    def running(self) -> int:
        return len(self.active) + len(self.prefilling)

    def run(self) -> None:
        while self.has_work():
            self.step()

    # -- one scheduling step -----------------------------------------------------------
    def step(self) -> bool:
        """Admit waiting requests, advance one prefill chunk, run one round over the active
        batch. Returns whether anything ran."""
        worked = self._drop_cancelled()
        while self.waiting and self.running < self.max_batch:
            self._admit(self.waiting.popleft())
            worked = True
        if self.prefilling:
            self._prefill_step(self.prefilling[0])
            worked = True
        if self.active:
            batch = list(self.active)
            txn = {s: RoundTxn(s) for s in batch if s.req.keep}  # kept sequences: the round is a transaction
            try:
                # the optimistic fork (pipeline --optimistic) guesses the next round of this same
                # batch: not worth it while a prefill or an admission comes first
                may_fork = not self.prefilling and not (self.waiting and self.running < self.max_batch)
                emitted = run_round(self.backend, batch, may_fork=may_fork)
            except BaseException as e:  # a failed round ends its sequences, never the scheduler
                for s in batch:
                    if s in txn:
                        txn[s].restore(s)  # back to the last committed state, still usable
                    self._finish(s, "error", e)
                if not isinstance(e, Exception):  # Ctrl-C: the scheduler is clean, the caller gets it
                    raise
                return True
            self.rounds += 1
            for s in batch:
                failure = s.failure or constraint_failure(s.req)
                if failure is not None and s in txn:  # its grammar cannot go on, or its logits overflowed: it
                    txn[s].restore(s)  # alone ends, in error (a kept one at its state before the round)
                    self._finish(s, "error", failure)
                    continue
                toks = emitted.get(s, [])  # (a round whose tokens the grammar refused emitted none: Sequence.emit)
                if toks and s.req.on_tokens is not None:  # what is output is streamed, also before an error end
                    try:
                        s.req.on_tokens(s.req, toks)
                    except BaseException as e:  # the caller's callback: its exception goes to the caller,
                        self._finish(s, "error", e)  # and this sequence ends (its round is committed)
                        raise
                if failure is not None:
                    self._finish(s, "error", failure)
                    continue
                if s.reason == "constraint" and dead_end(s.req):  # nothing allowed after the committed tokens
                    self._finish(s, "error", constraint_failure(s.req))  # and no EOS ended them: a dead end
                    continue  # (found after drafts; at draft 0 the next round's mask finds it, same tokens)
                if s.reason is not None or len(s.out) >= s.req.max_new_tokens:
                    self._finish(s, s.reason or "length")
            if not self.has_work() and hasattr(self.backend, "settle"):
                self.backend.settle()  # the pipeline throws away a fork of the round that ended the work
            worked = True
        return worked

    def abandon(self, req: Request) -> None:
        """Take every trace of `req` out of the scheduler after an exception escaped a step
        with it in flight (a callback's, or a KeyboardInterrupt mid-round): it leaves the
        queues, its slot goes back to the pool (kept or not: its state is not trusted), and it
        ends with "error" without further callbacks. The other requests are untouched."""
        if req in self.waiting:
            self.waiting.remove(req)
        for s in [s for s in list(self.prefilling) + self.active if s.req is req]:
            if s in self.prefilling:
                self.prefilling.remove(s)
            if s in self.active:
                self.active.remove(s)
            self.pool.release(s.slot)
        if req.sequence is not None:
            self.pool.release(req.sequence.slot)
            req.sequence = None
        req.done = True
        req.stop_reason = req.stop_reason or "error"

    def _drop_cancelled(self) -> bool:
        dropped = False
        for req in [r for r in self.waiting if r.cancel_requested]:
            self.waiting.remove(req)
            self._finish_request(req, "cancelled")
            dropped = True
        for s in [s for s in list(self.prefilling) + self.active if s.req.cancel_requested]:
            self._finish(s, "cancelled")
            dropped = True
        return dropped

    def _admit(self, req: Request) -> None:
        t0 = time.perf_counter()  # the time to first token counts the store lookup and restore too
        allocated = None  # a slot this call took from the pool (not a kept Sequence's own)
        try:
            opts, stops = self.validate(req)
            if opts is not None:
                from hyspec.speculative.rollback import make_rollback

                rollback = make_rollback(opts.rollback)
                k = opts.k
            else:
                rollback, k = None, 0
            resume, new = req.resume, list(req.prompt_ids)
            if resume is None and self.store is not None and req.use_store:
                resume = self.store.lookup(new, drafter=opts.hidden if opts is not None else None)
                if resume is not None:
                    new = new[len(resume.tokens):]
            if resume is None:
                slot = allocated = self.pool.alloc(len(new) + req.max_new_tokens + k + 2)
            else:
                if opts is not None and (resume.drafter if isinstance(resume, SeqState) else drafter_of(resume)) \
                        != opts.hidden:
                    raise ValueError("this conversation state has no drafter rows for speculation "
                                     f"(hidden={opts.hidden!r}): it was decoded without drafts")
                pending = [resume.pending] if resume.pending is not None else []
                need = (resume.pos if isinstance(resume, SeqState) else resume.cache.pos) + len(pending) + len(new) \
                    + req.max_new_tokens + k + 2
                if isinstance(resume, SeqState):
                    slot = allocated = self.pool.alloc(need)
                    restore_into(resume, slot)
                else:
                    if getattr(resume, "continued", False):  # its slot holds a later state now
                        raise ValueError("this kept Sequence was already continued by another request: resume from "
                                         "that request's Sequence, or from a SeqState captured before "
                                         "(hyspec.core.state.capture), which can be resumed any number of times")
                    slot = resume.slot
                    # (keeping every row; within the pool's budget: else a MemoryError; no headroom past
                    # what a turn can need: the context, plus this round's k + 2 rows)
                    self.pool.grow(slot, need, most=self.model.cfg.max_position_embeddings + k + 2)
                    resume.continued = True  # for this request, and the kept Sequence is still the one to resume)
            seq = Sequence(self.model, req, slot, opts, rollback, stops)
            seq.t_start = t0
            if resume is not None:
                self._resume(seq, resume, new, carry_k=req.resume is not None)
        except BaseException as e:  # (the slot taken goes back: a failed restore, or a Ctrl-C in it, kept it
            if allocated is not None:  # for good, a session's pool has no budget to reclaim it)
                self.pool.release(allocated)
            if not isinstance(e, Exception):
                raise
            self._finish_request(req, "error", e)
            return
        if req.max_new_tokens == 0:
            self._finish(seq, "length")
            return
        self.prefilling.append(seq)

    def _prefill_step(self, s: Sequence) -> None:
        """Run the next chunk of s's prompt; when the prompt is done, take its first token
        and move it to the active batch."""
        try:
            part = s.feed[s.prefilled: s.prefilled + self.prefill_chunk]
            pre, post = self.backend.prefill(s.cache, part)
            s.prefilled += len(part)
            if s.speculative:
                s.hidden_parts.append(post if s.opts.hidden == "post" else pre)
            if s.prefilled < len(s.feed):
                return
            self.prefilling.popleft()
            self._start(s, post)
        except BaseException as e:
            if s.req.done:  # the request had finished and its on_finish raised: the caller's exception
                raise
            if s in self.prefilling:
                self.prefilling.remove(s)
            self._finish(s, "error", e)
            if not isinstance(e, Exception):  # Ctrl-C (or the first token's callback's): after the clean-up
                raise

    def _resume(self, s: Sequence, src, new: list[int], carry_k: bool = True) -> None:
        """Set a new turn's Sequence up to continue `src` (a kept Sequence or a SeqState):
        the history is the whole transcript, the prefill runs [pending] + the new tokens.
        carry_k: adaptive K goes on from the k the state's last round chose (a session's own
        next turn); a prefix-store hit starts at opts.k, as the request alone would, so its
        output never depends on what the store holds."""
        s.prompt = list(src.tokens if isinstance(src, SeqState) else src.history) + new
        s.feed = ([src.pending] if src.pending is not None else []) + new
        s.carry = carry_of(src) if s.speculative else None
        if carry_k and s.speculative and s.opts.adaptive and src.k_next:
            s.k_next = max(s.opts.adaptive_floor, min(src.k_next, s.opts.k))

    def _start(self, s: Sequence, post: torch.Tensor) -> None:
        P = s.cache.pos  # absolute position of the next token (= len(s.prompt))
        s.last_logits = self.backend.logits(post[-1:])  # [1, V] the row predicting position P
        s.t_prefilled = time.perf_counter()
        if s.speculative:
            seed_h = torch.cat(s.hidden_parts)  # [P, H] hiddens that seed the drafter
            s.hidden_parts = []
            s.h_last = seed_h[-1:]
        if not s.speculative or s.opts.prime_pending or P < 2:
            m = s.mask([])
            if m is not None and not bool(m.any()):  # nothing allowed at all: an ended grammar, or a dead end
                failure = constraint_failure(s.req) if dead_end(s.req) else None
                self._finish(s, "error" if failure else "constraint", failure)
                return
            s.pending = choose_token(masked(s.last_logits[0], m), s.prompt, s.params, P)
            s.direct += 1
            kept = s.emit([s.pending], [s.last_logits[0]])
            if kept and s.req.on_tokens is not None:
                try:
                    s.req.on_tokens(s.req, kept)
                except BaseException as e:  # the caller's callback: as in a round, the sequence ends
                    self._finish(s, "error", e)  # and the caller gets the exception
                    raise
        if s.speculative:
            # drafter pairs (token r+1, hidden r): the queued ones, then the fed tokens with their
            # hiddens, then the new pending token (the no-pending form keeps the last hidden back)
            c = s.carry if s.carry is not None else Carry([], seed_h[:0], 0, seed_h[:0], True)
            fill_tokens = c.tokens + (s.feed[1:] if c.first_queued else s.feed)
            fill_h = torch.cat([c.h] + ([] if c.first_queued else [c.h_last]) + [seed_h[:-1]])
            if s.pending is not None:
                fill_tokens, fill_h = fill_tokens + [s.pending], torch.cat([fill_h, seed_h[-1:]])
            # draft rows up to the last pair now (this sequence alone); the last pair is the first round's refill
            m = len(fill_tokens)
            if m > 1:
                self.backend.prefill_draft(s.slot.draft_kv, fill_tokens[:-1], fill_h[:-1], c.start)
            s.fill_tokens, s.fill_h, s.fill_start = fill_tokens[-1:], fill_h[-1:], c.start + m - 1
            s.carry = None
        s.started = True
        if s.reason is not None:
            self._finish(s, s.reason)
        else:
            self.active.append(s)

    # -- leaving -----------------------------------------------------------------------
    def _finish(self, s: Sequence, reason: str, exc: BaseException | None = None) -> None:
        if s.req.done:  # finished already (on_finish is called once)
            return
        if s in self.active:
            self.active.remove(s)
        if s in self.prefilling:
            self.prefilling.remove(s)
        if s.req.keep:
            s.req.sequence = s  # the slot stays held: a session continues from it
        else:
            self.pool.release(s.slot)
        s.req.stats = sequence_stats(s)
        if s.req.store_state and self.store is not None and exc is None and getattr(s, "started", False) \
                and reason in ("eos", "length", "constraint"):
            self.store.put(capture(s))
        self._finish_request(s.req, reason, exc)

    def _finish_request(self, req: Request, reason: str, exc: Exception | None = None) -> None:
        """End a request that holds no sequence (it waited, or failed at admission): its stats
        say so (no token, no time), with the same keys as an admitted one's first ones."""
        req.done = True
        req.stop_reason = reason
        if not req.stats:
            req.stats = {"prompt_tokens": len(req.prompt_ids or ()), "generated_tokens": 0, "prefill_s": 0.0,
                         "decode_s": 0.0, "decode_tok_s": None, "time_to_first_token_s": None, "cached_tokens": 0}
        if exc is not None:
            req.error = f"{type(exc).__name__}: {exc}"
            req.exception = exc
        if req.on_finish is not None:
            req.on_finish(req)


def sequence_stats(s: Sequence) -> dict:
    now = time.perf_counter()
    t_pre = getattr(s, "t_prefilled", now)
    n = len(s.out)
    dec = now - t_pre
    stats = {
        "prompt_tokens": len(s.prompt), "generated_tokens": n, "prefill_s": t_pre - s.t_start, "decode_s": dec,
        "decode_tok_s": (n - 1) / dec if n > 1 and dec > 0 else None,
        "time_to_first_token_s": (s.t_first - s.t_start) if s.t_first is not None else None,
        "cached_tokens": len(s.prompt) - len(s.feed),
    }
    if s.speculative:
        stats.update({
            "target_forwards": s.tel.rounds, "mtp_forwards": s.mtp_forwards, "k": s.opts.k,
            "direct_tokens": s.direct,  # generated = direct + accepted + rounds (unless EOS/limit cut a round)
            "rollback": s.opts.rollback, "rollback_extra_bytes_per_round": s.extra_bytes,
            "spec": s.tel.to_dict(),
        })
    else:
        stats["target_forwards"] = max(n - 1, 0)
    return stats
