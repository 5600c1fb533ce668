"""Batch invariance of the engine core: a sequence's tokens, telemetry and stop reason are
bitwise the same whether it runs alone or in a continuously refilled batch — whatever
else is in the batch (mixed K, sampling modes, penalties, rollback strategies), whichever
slot it sits in, whenever it joins, and whoever leaves or is cancelled beside it."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS
from hyspec.core import Request, Scheduler
from hyspec.core.slots import Slot, slot_bytes
from hyspec.sampling import SamplingParams
from hyspec.speculative.loop import SpecOptions

G = SamplingParams(temperature=0.0)

# (draft K, sampling, other drafter options, max_new_tokens)
MIX = [
    (0, G, None, 14),
    (3, G, None, 25),
    (2, SamplingParams(temperature=0.9, top_p=0.9, seed=5), None, 18),
    (1, SamplingParams(temperature=1.0, seed=7, repetition_penalty=1.3, presence_penalty=0.2), None, 9),
    (3, SamplingParams(temperature=0.8, seed=3, mode="coupled"), SpecOptions(rollback="rescan"), 22),
    (0, SamplingParams(temperature=1.0, seed=11, frequency_penalty=0.3, top_k=20), None, 16),
    (4, G, SpecOptions(rollback="replay", adaptive=True), 20),
    (2, SamplingParams(temperature=1.2, min_p=0.05, seed=2), SpecOptions(p_min=0.05), 12),
    (3, SamplingParams(temperature=0.0, repetition_penalty=1.5), SpecOptions(prime_pending=False), 15),
]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (8, 3, 13, 1, 21, 5, 9, 2, 11)]


def make(prompt, k, params, spec, n) -> Request:
    return Request(prompt_ids=prompt, max_new_tokens=n, params=params, draft=k, spec=spec, stop_ids={0})


def fingerprint(r: Request):
    """Tokens, stop reason, telemetry, and the final state bytes of the sequence's cache
    (linear-layer conv + SSM state, the KV rows it wrote, the draft KV rows)."""
    return (tuple(r.tokens), r.stop_reason, r.stats.get("spec"), r.stats.get("direct_tokens"), r.final_state)


class StateRecordingScheduler(Scheduler):
    """Keeps each finished sequence's cache contents (as bytes) on its request."""

    def _finish(self, s, reason, exc=None):
        c = s.cache
        parts = [t.contiguous().numpy().tobytes() for t in
                 [x for st in c.linear_states for x in (st.conv, st.ssm)]
                 + [b.k[:, : c.pos] for b in c.kv_buffers] + [b.v[:, : c.pos] for b in c.kv_buffers]]
        if s.speculative:  # plain sequences never write the draft KV
            # draft rows below the next refill are final (later rows are the chain's scratch)
            parts.append(s.slot.draft_kv.k[:, : s.fill_start].contiguous().numpy().tobytes())
        s.req.final_state = (c.pos, hash(b"".join(parts)))
        super()._finish(s, reason, exc)


def run_alone(model, reqs, **kw):
    out = []
    for r in reqs:
        s = StateRecordingScheduler(model, max_batch=1, **kw)
        s.submit(r)
        s.run()
        out.append(fingerprint(r))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_equals_alone_with_staggered_joins_and_slot_reuse(zoo, arch):
    m = zoo.model("tiny", arch, "float32", "coop")
    ps = prompts(m.cfg.vocab_size)
    alone = run_alone(m, [make(p, *mx) for p, mx in zip(ps, MIX)])
    assert len({a[0] for a in alone}) == len(alone)  # the requests really differ

    sched = StateRecordingScheduler(m, max_batch=3)
    allocs = []
    orig_alloc = sched.pool.alloc

    def alloc(length):
        slot = orig_alloc(length)
        allocs.append(slot.index)
        return slot

    sched.pool.alloc = alloc
    reqs = [make(p, *mx) for p, mx in zip(ps, MIX)]
    pending = list(reqs)
    step = 0
    while pending or sched.has_work():
        if pending and step % 3 == 0:  # staggered arrivals: one every third step
            sched.submit(pending.pop(0))
        sched.step()
        step += 1
        assert sched.running <= 3
    assert [fingerprint(r) for r in reqs] == alone
    assert len(allocs) == len(reqs) and len(set(allocs)) < len(allocs)  # freed slots were reused


def test_reversed_order_and_bigger_batch(zoo):
    """Other neighbours, other slots: all nine at once, submitted in reverse order."""
    m = zoo.model("tiny", "qwen3_5_moe", "float32", "coop")
    ps = prompts(m.cfg.vocab_size)
    alone = run_alone(m, [make(p, *mx) for p, mx in zip(ps, MIX)])
    reqs = [make(p, *mx) for p, mx in zip(ps, MIX)]
    sched = StateRecordingScheduler(m, max_batch=9)
    for r in reversed(reqs):
        sched.submit(r)
    sched.run()
    assert [fingerprint(r) for r in reqs] == alone


def test_cancel_leaves_the_others_untouched(zoo):
    m = zoo.model("tiny", "qwen3_next", "float32", "coop")
    ps = prompts(m.cfg.vocab_size)[:4]
    alone = run_alone(m, [make(p, *mx) for p, mx in zip(ps, MIX)])
    reqs = [make(p, *mx) for p, mx in zip(ps, MIX)]
    sched = StateRecordingScheduler(m, max_batch=4)
    for r in reqs:
        sched.submit(r)
    for _ in range(3):
        sched.step()
    sched.cancel(reqs[1])
    sched.run()
    assert reqs[1].stop_reason == "cancelled" and reqs[1].done
    assert 0 < len(reqs[1].tokens) < MIX[1][3]
    for i in (0, 2, 3):
        assert fingerprint(reqs[i]) == alone[i]
    assert not sched.pool.used  # every slot came back


def test_bad_request_is_refused_and_others_run(zoo):
    m = zoo.model("tiny", "qwen3_5", "float32")
    sched = Scheduler(m, max_batch=2)
    good = sched.submit(make([1, 2, 3], 2, G, None, 6))
    for bad, msg in (([1, m.cfg.vocab_size], "out of range"), ([], "empty")):
        with pytest.raises(ValueError, match=msg):
            sched.submit(make(bad, 2, G, None, 6))
    with pytest.raises(ValueError, match="draft"):
        sched.submit(make([1], -1, G, None, 6))
    for stop in (m.cfg.vocab_size, -1):  # (the first id past the vocabulary too)
        with pytest.raises(ValueError, match=r"stop id\(s\) \[-?\d+\] out of range"):
            sched.submit(Request(prompt_ids=[1], max_new_tokens=6, params=G, stop_ids={stop}))
    sched.run()
    assert good.done and len(good.tokens) == 6 and good.stop_reason in ("length", "eos")


def test_a_failing_round_ends_its_batch_not_the_scheduler(zoo, monkeypatch):
    m = zoo.model("tiny", "qwen3_5", "float32")
    sched = Scheduler(m, max_batch=2)
    a = sched.submit(make([1, 2, 3], 2, G, None, 8))
    sched.step()
    sched.step()
    orig = sched.backend.verify
    monkeypatch.setattr(sched.backend, "verify", lambda items: (_ for _ in ()).throw(RuntimeError("boom")))
    sched.step()
    assert a.done and a.stop_reason == "error" and "boom" in a.error
    monkeypatch.setattr(sched.backend, "verify", orig)
    b = sched.submit(make([1, 2, 3], 2, G, None, 8))
    sched.run()
    assert b.done and b.stop_reason in ("length", "eos") and not sched.pool.used


@pytest.mark.parametrize("arch", ARCHS)
def test_slot_bytes_match_the_allocated_buffers(zoo, arch):
    m = zoo.model("tiny", arch, "float32")
    for length in (1, 7, 64):
        assert Slot(0, m, length).nbytes() == slot_bytes(m.cfg, m.dtype, length, m.has_mtp)["total"]
    sched = Scheduler(m, max_batch=2)
    per = sched.pool.bytes_per_slot(1000)["total"]
    assert sched.pool.slots_that_fit(10 * per + per // 2, 1000) == 10


def test_slot_bytes_and_the_pool_budget_refuse_impossible_values(zoo):
    """slot_bytes of a negative length gave negative KV bytes (a fractional one fractional
    bytes) with no error; a SlotPool took a negative, NaN or string budget_bytes in silence
    (then refused every slot, or raised a TypeError at the first alloc), and slots_that_fit
    of a negative budget was -1. Now they are ValueErrors (0 tokens: the fixed state alone)."""
    from hyspec.core.slots import SlotPool

    m = zoo.model("tiny", "qwen3_5", "float32")
    assert slot_bytes(m.cfg, m.dtype, 0)["kv"] == 0 < slot_bytes(m.cfg, m.dtype, 0)["total"]
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="length must be an integer >= 0"):
            slot_bytes(m.cfg, m.dtype, bad)
    for bad in (-5, float("nan"), float("inf"), "1000", True):
        with pytest.raises(ValueError, match="budget_bytes must be None or a number of bytes >= 0"):
            SlotPool(m, budget_bytes=bad)
    per = slot_bytes(m.cfg, m.dtype, 50, m.has_mtp)["total"]
    pool = SlotPool(m, budget_bytes=float(2 * per))  # (a float counts, as 8e9)
    assert pool.budget_bytes == 2 * per and pool.slots_that_fit(-1, 50) == 0
    a, b = pool.alloc(50), pool.alloc(50)
    with pytest.raises(MemoryError, match="a slot of 50 tokens needs"):
        pool.alloc(50)
    assert pool.held_bytes == 2 * per == a.nbytes() + b.nbytes()


def test_a_batch_wide_stop_id_out_of_range_is_not_blamed_on_a_prompt():
    """generate_batch's stop_ids hold for every prompt: one out of the vocabulary was refused as
    "prompt 0: stop id(s) ..." (generate says it without a prompt)."""
    from hyspec.engine import Engine

    eng = Engine.load()
    with pytest.raises(ValueError, match=r"^stop id\(s\) \[999999\] out of range"):
        eng.generate_batch(["a", "b"], max_new_tokens=2, stop_ids=[999999])


def test_a_bad_prompt_is_named_in_a_batch_only(zoo):
    """A prompt the scheduler refuses (an id outside the vocabulary) is "prompt i: ..." in
    generate_batch, and said without a prompt number by generate (one prompt)."""
    from hyspec.engine import Engine

    eng = Engine(zoo.model("tiny", "qwen3_5", "float32"))
    with pytest.raises(ValueError, match="1000000") as e:
        eng.generate([1, 10**6], max_new_tokens=2)
    assert str(e.value).startswith("prompt token id"), str(e.value)
    with pytest.raises(ValueError, match=r"^prompt 1: .*1000000"):
        eng.generate_batch([[1, 2], [1, 10**6]], max_new_tokens=2)


def test_an_engine_error_is_raised_by_generate_batch(zoo, monkeypatch):
    """generate_batch returns a prompt's own decoding error (its constraint cannot go on, its
    logits overflow) in that prompt's Output; any other error (a failed forward, out of
    memory) is the engine's and is raised, not returned as stop_reason "error"."""
    from hyspec.core.backend import ReferenceBackend
    from hyspec.engine import Engine

    eng = Engine(zoo.model("tiny", "qwen3_5", "float32"))
    monkeypatch.setattr(ReferenceBackend, "verify", lambda self, items: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        eng.generate_batch([[1, 2, 3], [4, 5]], max_new_tokens=4, draft=2)


def test_the_pool_holds_at_most_max_batch_slots_when_prompts_grow(zoo):
    """A long-lived scheduler (the server's) whose requests each need a longer slot than any
    freed one (a chat's growing history) kept every freed slot: one more per request, never
    let go of (40 slots, 114 MB on the default model after 40 requests at max_batch 4).
    Now the shortest free slot goes when a new one is made: at most max_batch are held."""
    m = zoo.model("tiny", "qwen3_5_moe", "float32")
    sched = Scheduler(m, max_batch=2)
    g = torch.Generator().manual_seed(0)
    for n in range(1, 40, 3):
        r = Request(prompt_ids=torch.randint(0, m.cfg.vocab_size, (n,), generator=g).tolist(), max_new_tokens=2,
                    params=G, draft=1)
        sched.submit(r)
        sched.run()
        assert r.done and r.stop_reason == "length"
        st = sched.pool.stats()
        assert st["slots_in_use"] == 0 and st["slots_free"] <= 2, st
    assert sched.pool.held_bytes == sum(s.nbytes() for s in sched.pool.free)


def test_the_pool_holds_at_most_max_slots_with_one_in_use(zoo):
    """While a slot is in use and none of the free ones fits a new request, the shortest free
    ones go so that the slots held, free and in use, stay at most max_slots (one extra free
    slot was kept per in-use one); release(keep=False) lets the slot go, a kept one is
    reused (reset) by a request that fits it, and max_free caps the free ones."""
    from hyspec.core.slots import SlotPool

    m = zoo.model("tiny", "qwen3_5", "float32")
    pool = SlotPool(m, max_slots=2)
    a = pool.alloc(10)
    pool.release(a)
    b = pool.alloc(20)  # (a does not fit: kept free, 2 held)
    assert pool.free == [a] and pool.used == {b.index: b}
    c = pool.alloc(30)  # (b in use: a goes, or 3 would be held)
    assert pool.free == [] and len(pool.used) == 2
    with pytest.raises(RuntimeError, match="all 2 slots are in use"):
        pool.alloc(5)
    pool.release(c, keep=False)
    assert pool.free == [] and list(pool.used) == [b.index]
    pool.release(b)
    b.cache.pos = 7
    assert pool.alloc(15) is b and b.cache.pos == 0  # (the free one that fits: reused, reset)
    few = SlotPool(m, max_slots=4, max_free=1)
    s = [few.alloc(n) for n in (5, 9, 7)]
    for x in s:
        few.release(x)
    assert few.free == [s[1]]  # (the longest kept)
    plain = slot_bytes(m.cfg, m.dtype, 50, with_mtp=False)  # (a checkpoint without an MTP head: no draft KV)
    assert plain["draft_kv"] == 0 and plain["total"] == plain["kv"] + plain["linear"]
    assert slot_bytes(m.cfg, m.dtype, 50)["draft_kv"] > 0


def test_a_first_token_that_ends_the_request_never_joins_a_round(zoo):
    """The first token (taken when the prefill ends) can end a request on its own: a stop id,
    or the max_new_tokens limit (1). The request ends there, with that token alone, plain
    or speculative; at max_new_tokens 0 it ends with none and its slot comes back."""
    m = zoo.model("tiny", "qwen3_5", "float32")
    p = prompts(m.cfg.vocab_size)[0]
    first = run_alone(m, [make(p, 0, G, None, 1)])[0][0][0]
    for k in (0, 2):
        for stops, n, want in (({first}, 9, ([first], "eos")), (set(), 1, ([first], "length")), (set(), 0, ([], "length"))):
            sched = Scheduler(m, max_batch=2)
            seen = []
            r = sched.submit(Request(prompt_ids=p, max_new_tokens=n, params=G, draft=k, stop_ids=stops,
                                     on_tokens=lambda req, toks, seen=seen: seen.extend(toks)))
            sched.run()
            assert (r.tokens, r.stop_reason) == want and seen == want[0] and r.done, (k, n)
            assert not sched.pool.used


def test_cancel_while_queued_or_between_prefill_chunks(zoo):
    """A long prompt's prefill runs one chunk per step while the batch's rounds go on;
    cancel() ends a request at the next step wherever it is: queued behind a full batch, or
    between two chunks of its prefill (no token, its slot back). The sequence decoding beside
    them is untouched, and a speculative one whose prompt ran in several chunks decodes as
    alone in the same chunks (its tokens and telemetry as with one chunk)."""
    m = zoo.model("tiny", "qwen3_next", "float32", "coop")
    ps = prompts(m.cfg.vocab_size)
    spec = (3, SamplingParams(temperature=0.9, seed=3), None, 12)
    alone = run_alone(m, [make(ps[1], 2, G, None, 20), make(ps[4], *spec)], prefill_chunk=4)
    assert [x[:4] for x in alone] == [x[:4] for x in run_alone(m, [make(ps[1], 2, G, None, 20), make(ps[4], *spec)])]
    sched = StateRecordingScheduler(m, max_batch=2, prefill_chunk=4)
    streamed = []
    a = sched.submit(make(ps[1], 2, G, None, 20))  # 3 prompt tokens: one chunk
    sched.step()
    assert a.sequence is None and len(sched.active) == 1 and a.tokens
    b, c = make(ps[2], 0, G, None, 9), make(ps[0], 0, G, None, 9)  # 13 prompt tokens: 4 chunks
    for r in (b, c):
        r.on_tokens = lambda req, toks: streamed.append(req)
        sched.submit(r)
    n = [len(a.tokens)]
    for _ in range(2):
        sched.step()  # b: chunks 1 and 2; c waits (the batch is full)
        n.append(len(a.tokens))
    assert n[0] < n[1] < n[2] and len(sched.prefilling) == 1 and not b.tokens and list(sched.waiting) == [c]
    sched.cancel(c)
    sched.step()  # c leaves the queue; b: chunk 3
    assert c.done and c.stop_reason == "cancelled" and not c.tokens and not b.done and len(a.tokens) > n[2]
    sched.cancel(b)
    sched.step()  # b ends before its last chunk
    assert b.done and b.stop_reason == "cancelled" and not b.tokens and not streamed
    d = sched.submit(make(ps[4], *spec))  # 21 prompt tokens: 6 chunks, the drafter seeded from all of them
    sched.run()
    assert [fingerprint(a), fingerprint(d)] == alone and not sched.pool.used


def test_the_pool_reuses_the_shortest_free_slot_that_fits_and_frees_a_slot_once(zoo):
    """A free slot of exactly the length asked for is reused, and of the free ones that fit
    the shortest is taken (the longer ones stay for longer requests: no new slot is made);
    a slot released twice (abandon after its finish) is free once, so two requests never
    share it; max_free 0 keeps none free; grow takes its headroom only where the budget has
    it without dropping a free slot (else exactly what is needed, the free slot kept)."""
    from hyspec.core.slots import SlotPool

    m = zoo.model("tiny", "qwen3_5", "float32")
    pool = SlotPool(m, max_slots=4)
    a, b = pool.alloc(10), pool.alloc(30)
    pool.release(a)
    pool.release(b)
    assert pool.alloc(10) is a
    pool.release(a)
    assert pool.alloc(5) is a and pool.alloc(25) is b and not pool.free and pool._next == 2
    pool.release(a)
    pool.release(a)
    assert pool.free == [a] and list(pool.used) == [b.index]
    x, y = pool.alloc(10), pool.alloc(10)
    assert x is a and y is not a
    none = SlotPool(m, max_free=0)
    s = none.alloc(10)
    none.release(s)
    assert none.max_free == 0 and none.free == [] and not none.used
    per = lambda n: slot_bytes(m.cfg, m.dtype, n, m.has_mtp)["total"]
    tight = SlotPool(m, budget_bytes=per(50) + per(20))
    s, f = tight.alloc(40), tight.alloc(20)
    tight.release(f)
    tight.grow(s, 45)  # (1.5x, 60 rows, fits only if the free slot goes: exactly 45, the free slot kept)
    assert s.length == 45 and tight.free == [f]


def test_the_pool_keeps_its_free_slots_to_max_free_bytes(zoo):
    """max_free capped how many free slots a pool keeps, not their bytes: 16 long free slots
    held many GB with nothing to cap them. max_free_bytes caps the free slots' bytes: a
    released slot beyond it lets the shortest free ones go (the longest fit the most
    requests; a slot longer than the cap is not kept), a lower cap set later trims at once,
    the one kept is reused (reset), stats report both, and a bad cap is refused as
    budget_bytes is (a float counts)."""
    from hyspec.core.slots import SlotPool

    m = zoo.model("tiny", "qwen3_5", "float32")
    per = lambda n: slot_bytes(m.cfg, m.dtype, n, m.has_mtp)["total"]
    pool = SlotPool(m, max_slots=8, max_free_bytes=per(40) + per(20))
    a, b, c, d = (pool.alloc(n) for n in (10, 30, 20, 40))
    pool.release(a)
    pool.release(b)
    assert pool.free == [a, b]  # (10 + 30 fit)
    pool.release(c)
    assert pool.free == [b, c]  # (10 + 30 + 20 do not: the 10 goes)
    pool.release(d)
    assert pool.free == [d]  # (30 + 20 + 40 do not: the 20 goes, then the 30, though 40 + 20 would fit)
    st = pool.stats()
    assert st["free_bytes"] == pool.free_bytes == d.nbytes() == per(40) and st["max_free_bytes"] == per(40) + per(20)
    assert st["slots_free"] == 1 and st["held_bytes"] == per(40)
    d.cache.pos = 9
    assert pool.alloc(35) is d and d.cache.pos == 0 and pool._next == 4  # (reused, reset: no new slot)
    pool.release(d)
    e = pool.alloc(50)
    pool.max_free_bytes = per(40) - 1  # (a lower cap: the free 40 goes at once)
    assert pool.free == [] and pool.stats()["max_free_bytes"] == per(40) - 1
    pool.release(e)
    assert pool.free == [] and not pool.used  # (longer than the cap: not kept)
    few = SlotPool(m, max_slots=8, max_free=1, max_free_bytes=None)  # (no byte cap: max_free alone, as before)
    s = [few.alloc(n) for n in (5, 9, 7)]
    for x in s:
        few.release(x)
    assert few.free == [s[1]] and few.max_free_bytes is None and few.stats()["max_free_bytes"] is None
    assert SlotPool(m).max_free_bytes is None
    for bad in (-5, float("nan"), float("inf"), "1000", True):
        with pytest.raises(ValueError, match="max_free_bytes must be None or a number of bytes >= 0"):
            SlotPool(m, max_free_bytes=bad)
        with pytest.raises(ValueError, match="max_free_bytes must be None or a number of bytes >= 0"):
            few.max_free_bytes = bad
        assert few.max_free_bytes is None  # (refused: the cap as before)
    exact = SlotPool(m, max_free_bytes=float(per(10)))  # (a float counts, as 8e9; a slot of exactly the cap is kept)
    assert exact.max_free_bytes == per(10) and isinstance(exact.max_free_bytes, int)
    x = exact.alloc(10)
    exact.release(x)
    assert exact.free == [x]
    zero = SlotPool(m, max_free_bytes=0)
    zero.release(zero.alloc(1))
    assert zero.free == [] and zero.stats()["free_bytes"] == 0


def test_a_resumed_request_needs_a_token_to_make(zoo):
    """A request continuing a kept Sequence (a session's next turn) is refused up front at
    max_new_tokens 0 (it would end unprefilled, its new tokens in the transcript but not in
    the state, and the kept Sequence marked continued); the kept Sequence is untouched and
    continues as before."""
    m = zoo.model("tiny", "qwen3_5", "float32")
    sched = Scheduler(m, max_batch=2)
    first = sched.submit(Request(prompt_ids=[1, 2, 3], max_new_tokens=3, params=G, keep=True, stop_ids=set()))
    sched.run()
    kept = first.sequence
    assert kept is not None and kept.pending is not None
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        sched.submit(Request(prompt_ids=[4], max_new_tokens=0, params=G, keep=True, resume=kept))
    assert not getattr(kept, "continued", False) and not sched.has_work()
    nxt = sched.submit(Request(prompt_ids=[4], max_new_tokens=3, params=G, keep=True, resume=kept))
    sched.run()
    assert nxt.stop_reason == "length" and len(nxt.tokens) == 3 and kept.continued
    sched.pool.release(nxt.sequence.slot)
    assert not sched.pool.used
