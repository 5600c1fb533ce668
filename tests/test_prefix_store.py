"""The prefix store: longest stored prefix, token-tuple identity, drafter compatibility,
digest check, byte budget with LRU demotion to host and eviction, stats."""

from __future__ import annotations

import pytest

from hyspec.prefix_store import PrefixStore
from session_helpers import MAX_NEW, engine, messages


@pytest.fixture(scope="module")
def states(zoo):
    """Boundary states of a 4-turn speculative session and of a plain one."""
    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 4, seed=20)
    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    spec = []
    for m in msgs:
        s.send(m)
        spec.append(s.state())
    p = eng.session(draft=0, max_new_tokens=MAX_NEW, use_store=False)
    p.send(msgs[0])
    return spec, p.state(), msgs


def test_longest_prefix_and_identity(states):
    spec, plain, msgs = states
    st = PrefixStore()
    for x in spec[:3]:
        st.put(x)
    toks = list(spec[2].tokens) + [5, 6]
    assert st.extends(toks) and not st.extends([t + 1 for t in toks])  # a peek: no hit or miss counted
    alone = PrefixStore()
    alone.put(spec[2])
    assert alone.extends(list(spec[2].tokens))  # equal to an entry with a pending token: it extends it
    assert st.lookup(toks, drafter="post") is spec[2]
    assert st.lookup(list(spec[1].tokens) + [9], drafter="post") is spec[1]
    bad = list(spec[2].tokens)
    bad[3] = (bad[3] + 1) % 50  # differs at one position: only a shorter entry could match (none does)
    assert st.lookup(bad + [1]) is None
    assert st.lookup(list(spec[2].tokens), drafter="post") is spec[2]  # equal to an entry with a pending token
    assert st.lookup(toks, drafter="pre") is None  # drafter rows built from another hidden
    s = st.stats()
    assert (s["hits"], s["misses"], s["entries"]) == (3, 2, 3) and s["hit_rate"] == 3 / 5
    assert s["tokens_saved"] == spec[2].pos + spec[1].pos + spec[2].pos


def test_plain_entries_serve_plain_requests_only(states):
    spec, plain, msgs = states
    st = PrefixStore()
    st.put(plain)
    assert st.lookup(list(plain.tokens) + [3]) is plain
    assert st.lookup(list(plain.tokens) + [3], drafter="post") is None
    st.put(spec[1])  # a plain request takes any entry (docs/sessions.md), a speculative one's too
    assert st.lookup(list(spec[1].tokens) + [3]) is spec[1]


def test_an_entry_with_drafter_rows_is_not_replaced_by_one_without(states):
    """A plain and a speculative session with the same first turn (greedy: the same tokens)
    put states under one key: the speculative one stays, whichever came first, so a
    speculative request extending the transcript still resumes (and a plain one too)."""
    spec, plain, msgs = states
    assert plain.tokens == spec[0].tokens and plain.drafter is None and spec[0].drafter == "post"
    toks = list(spec[0].tokens) + [3]
    for order in ((spec[0], plain), (plain, spec[0])):
        st = PrefixStore()
        for x in order:
            st.put(x)
        assert len(st) == 1
        assert st.lookup(toks, drafter="post") is spec[0], order
        assert st.lookup(toks) is spec[0]


def test_digest_check_drops_a_corrupted_entry(states):
    spec, plain, msgs = states
    st = PrefixStore()
    st.put(spec[0])
    st.put(spec[1])
    corrupt = spec[1].to("cpu")
    corrupt.ssm[0].view(-1)[0] += 1.0
    st._entries[tuple(spec[1].tokens)].state = corrupt  # the state no longer matches its digest
    got = st.lookup(list(spec[1].tokens) + [4], drafter="post")
    assert got is spec[0]  # the corrupted entry is dropped; the next-longest serves
    assert st.identity_failures == 1 and tuple(spec[1].tokens) not in st


def test_budget_demotes_lru_then_evicts(states):
    spec, plain, msgs = states
    sizes = [x.nbytes() for x in spec]
    st = PrefixStore(budget_bytes=sizes[2] + sizes[3], host_budget_bytes=sizes[2])
    assert sizes[0] + sizes[1] > sizes[2]  # the recurrent state (the same size at every length) dominates
    for x in spec:
        st.put(x)
    # device holds the two most recent; spec[1] was demoted to host; spec[0] demoted then evicted
    assert [st.tier_of(x.tokens) for x in spec] == [None, "host", "device", "device"]
    s = st.stats()
    assert s["bytes_device"] == sizes[2] + sizes[3] and s["bytes_host"] == sizes[1]
    assert s["demotions"] == 2 and s["evictions"] == 1
    got = st.lookup(list(spec[1].tokens) + [7], drafter="post")  # promoted back; the LRU device entry goes to host
    assert got is not spec[1] and got.digest() == spec[1].digest()
    assert st.tier_of(spec[1].tokens) == "device" and st.promotions == 1
    assert st.tier_of(spec[2].tokens) == "host"
    assert st.tier_of(spec[3].tokens) == "device"


def test_a_budget_smaller_than_one_state_keeps_none_on_the_device(states):
    """budget_bytes below one state (0: no device tier) demotes even the entry just put or
    looked up (was: the most recent entry always stayed on the device); the state a lookup
    hands out stays usable."""
    spec, plain, msgs = states
    st = PrefixStore(budget_bytes=0, host_budget_bytes=1 << 40)
    for x in spec:
        st.put(x)
    assert st.stats()["bytes_device"] == 0 and all(st.tier_of(x.tokens) == "host" for x in spec)
    got = st.lookup(list(spec[1].tokens) + [7], drafter="post")
    assert got.digest() == spec[1].digest() and got.device == spec[1].device
    assert st.stats()["bytes_device"] == 0 and st.tier_of(spec[1].tokens) == "host"


def test_a_put_again_entry_is_the_most_recent(states):
    """Putting a state under a key already stored (a turn repeated after a rewind, or another
    session with the same transcript) makes it the most recently used: the budget demotes
    the entries not touched since, not the one just put."""
    spec, plain, msgs = states
    sizes = [x.nbytes() for x in spec]
    st = PrefixStore(budget_bytes=sizes[0] + sizes[2], host_budget_bytes=1 << 40)  # room for two
    st.put(spec[0])
    st.put(spec[1])
    st.put(spec[0])  # again: now the most recent
    st.put(spec[2])  # over the budget: the least recently used (spec[1]) goes to host
    assert [st.tier_of(x.tokens) for x in spec[:3]] == ["device", "host", "device"]
    # the same when the state put again has no drafter rows (the entry with them is kept, and used)
    assert plain.tokens == spec[0].tokens and plain.drafter is None
    st = PrefixStore(budget_bytes=sizes[0] + sizes[2], host_budget_bytes=1 << 40)
    st.put(spec[0])
    st.put(spec[1])
    st.put(plain)
    st.put(spec[2])
    assert [st.tier_of(x.tokens) for x in spec[:3]] == ["device", "host", "device"]


def test_the_host_budget_evicts_host_entries_only(states):
    """Over the host budget, the least recently used *host* entries go: an older entry still on
    the device stays (the host tier's bytes are the host entries')."""
    spec, plain, msgs = states
    st = PrefixStore(budget_bytes=1 << 40, host_budget_bytes=0)
    st.put(spec[0])
    st.put(spec[1])
    st.demote(spec[1].tokens)  # (demote alone enforces nothing: the host tier is over its budget)
    st.demote(spec[1].tokens)  # already on the host: nothing to do
    assert st.tier_of(spec[1].tokens) == "host" and st.demotions == 1
    st.put(spec[2])
    assert [st.tier_of(x.tokens) for x in spec[:3]] == ["device", None, "device"]
    assert st.evictions == 1 and st.stats()["bytes_host"] == 0


def test_token_sequences_as_tensors_are_keys_too(states):
    """`in`, tier_of and remove take a token tensor as lookup does (its elements are 0-d
    tensors, hashed by identity: never equal to a stored key)."""
    import torch

    spec, plain, msgs = states
    st = PrefixStore()
    st.put(spec[0])
    t = torch.tensor(spec[0].tokens)
    assert t in st and st.tier_of(t) == "device"
    st.remove(t)
    assert len(st) == 0 and tuple(spec[0].tokens) not in st


def test_stats_report_budgets_and_hit_rate():
    st = PrefixStore(budget_bytes=8e9, host_budget_bytes=3 << 30)
    s = st.stats()
    assert s["hit_rate"] == 0.0 and (s["hits"], s["misses"], s["entries"]) == (0, 0, 0)
    assert (s["budget_bytes"], s["host_budget_bytes"]) == (8_000_000_000, 3 << 30)
    assert type(s["budget_bytes"]) is int  # (a JSON number without ".0" in /health)


def test_an_eviction_keeps_the_other_entries_of_its_length(states):
    """Two conversations whose transcripts have the same length: evicting one (host budget)
    leaves the other one found (the store indexes entries by length: one removal of a length
    must not hide the others of that length)."""
    import dataclasses

    spec, plain, msgs = states
    a = spec[1]
    b = dataclasses.replace(a, tokens=(a.tokens[0] % 50 + 1,) + tuple(a.tokens[1:]))
    assert len(b.tokens) == len(a.tokens) and b.tokens != a.tokens
    st = PrefixStore(budget_bytes=0, host_budget_bytes=b.nbytes())
    st.put(a)
    st.put(b)  # a is evicted
    assert a.tokens not in st and st.tier_of(b.tokens) == "host" and st.evictions == 1
    got = st.lookup(list(b.tokens) + [4], drafter="post")
    assert got is not None and got.digest() == b.digest()
    st.remove(b.tokens)
    st.put(a)
    assert st.lookup(list(a.tokens) + [4], drafter="post") is not None


def test_verify_promote_checks_an_entry_coming_back_from_host(states):
    """verify="promote": an entry whose host copy no longer matches its digest is dropped when
    a lookup would promote it (identity_failures), and the next-longest entry serves."""
    spec, plain, msgs = states
    st = PrefixStore(verify="promote")
    st.put(spec[0])
    st.put(spec[1])
    st.demote(spec[1].tokens)
    st._entries[tuple(spec[1].tokens)].state.ssm[0].view(-1)[0] += 1.0  # the host copy, damaged
    got = st.lookup(list(spec[1].tokens) + [4], drafter="post")
    assert got is spec[0] and st.identity_failures == 1 and tuple(spec[1].tokens) not in st
    # verify="never": no check at all, not even coming back from host
    st = PrefixStore(verify="never")
    st.put(spec[1])
    st.demote(spec[1].tokens)
    st._entries[tuple(spec[1].tokens)].state.ssm[0].view(-1)[0] += 1.0
    got = st.lookup(list(spec[1].tokens) + [4], drafter="post")
    assert got is not None and st.identity_failures == 0 and st.promotions == 1


def test_an_entry_equal_to_the_prompt_serves_only_with_a_pending_token(zoo):
    """A state without a pending token (a speculative prefill with prime_pending=False leaves
    none) that equals the whole prompt leaves nothing to prefill: lookup and extends skip it
    (the scheduler ran an empty prefill: RuntimeError in the scan), a longer prompt takes it."""
    import dataclasses

    from hyspec.core import Request, Scheduler
    from hyspec.core.state import capture
    from hyspec.speculative.loop import SpecOptions

    eng = engine(zoo, "qwen3_5")
    msg = messages(eng.model.cfg.vocab_size, 1, seed=21)[0]
    opts = SpecOptions(k=2, prime_pending=False)
    sched = Scheduler(eng.model)
    got, start = [], sched._start
    sched._start = lambda s, post: (start(s, post), got.append(capture(s)))  # the state right after prefill
    sched.submit(Request(prompt_ids=msg, max_new_tokens=MAX_NEW, draft=2, spec=opts, keep=True))
    sched.step()
    st = got[0]
    assert st.pending is None and st.tokens == tuple(msg) and st.pos == len(msg)
    store = PrefixStore()
    store.put(st)
    other = dataclasses.replace(st, tokens=tuple(msg) + (4,), pending=4)  # (a longer entry, another transcript)
    store.put(other)
    assert not store.extends(msg) and store.extends(msg + [3])
    assert store.lookup(msg, drafter="post") is None and store.misses == 1
    assert store.lookup(msg + [3], drafter="post") is st
    want = eng.generate(msg, max_new_tokens=MAX_NEW, draft=2, spec=opts, use_store=False).tokens
    eng.store = store
    out = eng.generate(msg, max_new_tokens=MAX_NEW, draft=2, spec=opts)
    assert out.tokens == want and out.stats["cached_tokens"] == 0


def test_bad_options():
    with pytest.raises(ValueError, match="verify"):
        PrefixStore(verify="sometimes")


def test_one_shot_final_state_serves_a_later_request(zoo):
    """Request(store_state=True) stores a one-shot's end state; a request extending its
    transcript resumes from it and equals the second turn of a session with the same first turn."""
    from hyspec.core import Request, Scheduler

    eng = engine(zoo, "qwen3_next")
    msgs = messages(eng.model.cfg.vocab_size, 2, seed=21)
    sched = Scheduler(eng.model, store=eng.store)
    req = Request(prompt_ids=msgs[0], max_new_tokens=MAX_NEW, draft=2, store_state=True)
    sched.submit(req)
    sched.run()
    assert len(eng.store) == 1 and sched.pool.stats()["slots_in_use"] == 0
    one = eng.generate(msgs[0] + req.tokens + msgs[1], max_new_tokens=MAX_NEW, draft=2)
    assert one.stats["cached_tokens"] == len(msgs[0]) + len(req.tokens) - 1
    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    assert s.send(msgs[0]).tokens == req.tokens
    assert s.send(msgs[1]).tokens == one.tokens


def test_bytes_checksum_sees_any_one_word_and_moved_rows():
    """The digest's tensor part (hyspec.core.state.bytes_checksum, reductions where the
    tensors live): equal bytes -> equal checksums; any one 16-bit word changed, or two rows
    swapped, changes it; byte-equal views of other dtypes agree; 1-byte dtypes are read too."""
    import torch

    from hyspec.core.state import bytes_checksum

    g = torch.Generator().manual_seed(0)
    a = torch.randn(48, 40, generator=g)
    base = bytes_checksum([a])
    assert bytes_checksum([a.clone()]) == base and bytes_checksum([a.view(torch.int32)]) == base
    for i in torch.randint(0, a.numel() * 2, (20,), generator=g).tolist():
        b = a.clone()
        b.view(torch.int16).view(-1)[i] ^= 1 << int(torch.randint(0, 16, (1,), generator=g))
        assert bytes_checksum([b]) != base, i
    swapped = a.clone()
    swapped[[3, 29]] = swapped[[29, 3]]
    assert bytes_checksum([swapped]) != base
    assert bytes_checksum([a[:24], a[24:]]) != bytes_checksum([a[24:], a[:24]])  # tensors in order
    if torch.cuda.is_available():  # wherever they live, on one device or several
        assert bytes_checksum([a.cuda()]) == base
        assert bytes_checksum([a[:24].cuda(), a[24:]]) == bytes_checksum([a[:24], a[24:]])
    # chunks: a tensor longer than a chunk; two of its chunks swapped show
    import hyspec.core.state as state_mod
    long = torch.randn(3 * 1024, generator=g)
    whole = bytes_checksum([long])
    old = state_mod.CHECKSUM_CHUNK
    try:
        state_mod.CHECKSUM_CHUNK = 1024  # 16-bit words: 512 floats a chunk
        state_mod._WEIGHTS.clear()
        small = bytes_checksum([long])
        swapped_chunks = torch.cat([long[512:1024], long[:512], long[1024:]])
        assert bytes_checksum([swapped_chunks]) != small and small != whole
    finally:
        state_mod.CHECKSUM_CHUNK = old
        state_mod._WEIGHTS.clear()
    # a 1-byte tensor's slice at an odd offset (no 16-bit view of it exists)
    u = torch.arange(9, dtype=torch.uint8)
    assert bytes_checksum([u[1:5]]) == bytes_checksum([u[1:5].clone()]) != bytes_checksum([u[2:6]])
    f8 = torch.zeros(7, dtype=torch.uint8)
    f8b = f8.clone()
    f8b[6] = 1
    assert bytes_checksum([f8.view(torch.float8_e4m3fn)]) != bytes_checksum([f8b.view(torch.float8_e4m3fn)])


def test_adaptive_k_from_the_store_starts_as_alone():
    """A one-shot request that hits the store starts adaptive K at opts.k, as it would alone
    (was: at the stored state's k_next, so seeded rejection sampling gave other tokens
    depending on what the store held); a session's own next turn still goes on from it."""
    import torch

    from hyspec import Engine
    from hyspec.sampling import SamplingParams
    from hyspec.speculative.loop import SpecOptions

    torch.set_num_threads(1)
    eng = Engine.load(dtype="float64")
    adaptive = SpecOptions(adaptive=True)
    s = eng.session(draft=4, spec=adaptive, params=SamplingParams(temperature=1.0, seed=1), max_new_tokens=32)
    s.send("def read_file(path):\n")
    assert s.state().k_next not in (0, 4)  # the stored state asks for another k than a fresh start
    prompt = s.tokens + eng.encode("\ndef main():\n")
    for seed in range(8):  # (16 tokens: the old rule gives other tokens for the same seeds as with 48)
        p = SamplingParams(temperature=1.0, seed=seed)
        a = eng.generate(prompt, max_new_tokens=16, draft=4, spec=adaptive, params=p)
        b = eng.generate(prompt, max_new_tokens=16, draft=4, spec=adaptive, params=p, use_store=False)
        assert a.stats["cached_tokens"] > 0 and a.tokens == b.tokens, seed


def test_lanes_carry_adaptive_k_only_for_a_session_turn():
    """The CUDA-graph lanes follow the same rule: lane_of marks carry_k for a session turn's
    resume, not for a prefix-store hit (BatchRunner._admit starts at k unless carry_k)."""
    import inspect

    from hyspec.core.request import Request
    from hyspec.gpu import batch_loop
    from hyspec.speculative.loop import SpecOptions

    class Store:
        def __init__(self, state):
            self.state = state

        def lookup(self, prompt, drafter=None):
            return self.state

        def put(self, st):
            pass

    state = type("State", (), {"tokens": [1, 2], "k_next": 1, "pending": 3})()
    spec = SpecOptions(k=3, adaptive=True)
    hit = batch_loop.lane_of(Request(prompt_ids=[1, 2, 5], max_new_tokens=4, draft=3, spec=spec), store=Store(state))
    turn = batch_loop.lane_of(Request(prompt_ids=[5], max_new_tokens=4, draft=3, spec=spec, resume=state))
    assert hit.resume is state and not hit.carry_k
    assert turn.resume is state and turn.carry_k and turn.prompt == [1, 2, 5]
    assert "r.carry_k" in inspect.getsource(batch_loop.BatchRunner._admit)


def test_a_kept_sequence_resumes_once():
    """A kept Sequence's slot holds the state of whoever continued it: a second request that
    resumes the same Sequence ends with an error naming the cause (was: wrong tokens, no
    error); a captured SeqState resumes any number of times, equal to the first resume."""
    from hyspec import Engine
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler
    from hyspec.core.state import capture

    eng = Engine.load(dtype="float64")
    sched = Scheduler(eng.model)
    r1 = Request(prompt_ids=eng.encode("def f(x):\n"), max_new_tokens=5, keep=True, stop_ids=())
    sched.submit(r1)
    sched.run()
    seq, snap = r1.sequence, capture(r1.sequence)
    msg = eng.encode("    return")
    outs = []
    for res in (seq, seq, snap, snap):
        r = Request(prompt_ids=msg, max_new_tokens=5, resume=res, stop_ids=())
        sched.submit(r)
        sched.run()
        outs.append(r)
    assert outs[0].stop_reason == "length" and outs[1].stop_reason == "error"
    assert "already continued" in str(outs[1].error)
    assert outs[2].tokens == outs[3].tokens == outs[0].tokens


def test_budget_arguments_are_checked():
    from hyspec import Engine
    from hyspec.sampling import ParamError

    for bad in (None, -1, "1000", float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="budget_bytes must be a number of bytes"):
            PrefixStore(budget_bytes=bad)
    assert PrefixStore(budget_bytes=8e9).budget_bytes == 8_000_000_000
    eng = Engine.load()
    for bad in (-5, "1000000"):
        with pytest.raises(ParamError, match="budget_bytes"):
            eng.memory(10, bad)
    assert eng.memory(10, 1e9)["slots_that_fit"] == eng.memory(10, 10**9)["slots_that_fit"] > 0


def test_sessions_and_one_shot_requests_share_the_store_after_it_is_dropped():
    """eng.store = None, then a session: the store the session makes is the one later
    one-shot requests resume from (was: the session scheduler kept None while the engine
    made a new store, so the two never met)."""
    from hyspec import Engine

    eng = Engine.load(dtype="float64")
    eng.session(max_new_tokens=4).send("x = 1\n")  # the session scheduler exists
    eng.store = None
    s = eng.session(max_new_tokens=4)
    s.send("def f(x):\n")
    assert eng.session_scheduler().store is eng.store and len(eng.store._entries) > 0
    out = eng.generate(s.tokens + eng.encode("    return"), max_new_tokens=2)
    assert out.stats["cached_tokens"] > 0


def test_stats_read_from_another_thread_while_the_engine_thread_puts_and_looks_up():
    """The server reads the store's stats on its event loop (/health) while its engine thread
    puts and looks up entries: the stats iterated the entries' OrderedDict while the other
    thread moved one ("OrderedDict mutated during iteration", /health answered 500)."""
    import sys
    import threading

    import torch

    from hyspec.core.state import SeqState
    from hyspec.prefix_store import PrefixStore

    def state(i):
        toks = (1, i, 7)
        return SeqState(toks, 2, [torch.zeros(2, 4)], [torch.zeros(1, 2, 2)], [torch.zeros(1, 2, 2)],
                        [torch.zeros(1, 2, 2)], 7)

    store = PrefixStore(verify="never")
    states = [state(i) for i in range(2000)]
    for st in states:
        store.put(st)
    errors, done = [], threading.Event()

    def engine_thread():
        i = 0
        while not done.is_set():
            store.put(states[i % len(states)])
            store.lookup([1, (i * 7) % 2000, 7, 9])
            i += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    t = threading.Thread(target=engine_thread)
    t.start()
    try:
        for _ in range(1500):
            try:
                store.stats()
            except RuntimeError as e:
                errors.append(repr(e))
    finally:
        done.set()
        t.join()
        sys.setswitchinterval(old)
    assert not errors, errors[:1]


def test_a_store_serves_one_engine(zoo):
    """A PrefixStore given to a second engine (here another state dtype: the Gated DeltaNet
    state rounded to bfloat16 after every token) was taken: its entries are keyed by tokens
    alone, so the second engine resumed from the first model's states (restore_into put a
    float64 state into its slot: the first model's computation, not its own). Now the store
    is refused while the first engine holds it, and free again once it lets it go."""
    import gc

    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.prefix_store import PrefixStore

    path = zoo.path("tiny", "qwen3_5")
    a = Engine(load_model(path, dtype="float64"))
    b = Engine(load_model(path, dtype="float64", ssm_dtype="bfloat16"))
    store = PrefixStore()
    a.store = store
    s = a.session(max_new_tokens=12)
    s.send([5, 6, 7, 8, 9, 10, 11] * 4)
    with pytest.raises(ValueError, match="this PrefixStore already serves another Engine"):
        b.store = store
    with pytest.raises(ValueError, match="already serves another Engine"):
        b.store = a.store
    assert b._store is None and a.store is store  # (neither changed)
    prompt = s.tokens + [3, 4]
    assert b.generate(prompt, max_new_tokens=2).stats["cached_tokens"] == 0  # b's own store
    a.store = a.store  # (the same engine again: fine)
    a.store = None  # let go: b may take it
    b.store = store
    assert b.store is store
    c = Engine(load_model(path, dtype="float64"))
    store2 = PrefixStore()
    c.store = store2
    del c
    gc.collect()
    b.store = store2  # (its engine is gone)


def test_a_store_another_engine_let_go_or_left_behind_starts_empty(zoo, tmp_path):
    """`a.store = None` (or `a` garbage collected) let another engine take a's store with a's
    entries in it: keyed by tokens alone, so the other engine (other weights here) resumed
    from a's states as its own, and its output was a's model's, not its own."""
    import gc

    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.prefix_store import PrefixStore
    from hyspec.tiny import make_tiny

    other = make_tiny("qwen3_5", tmp_path / "other", seed=4)  # (the same shapes, other weights)
    for let_go in ("release", "gc"):
        a = Engine(load_model(zoo.path("tiny", "qwen3_5"), dtype="float32"))
        b = Engine(load_model(other, dtype="float32"))
        store = PrefixStore()
        a.store = store
        s = a.session(max_new_tokens=12)
        s.send([5, 6, 7, 8, 9, 10, 11] * 4)
        prompt = s.tokens + [3, 4]
        assert len(store) > 0
        want = b.generate(prompt, max_new_tokens=8, use_store=False).tokens
        if let_go == "release":
            a.store = None
            a.store = store  # (the same engine taking it back keeps its entries)
            assert len(store) > 0
            a.store = None
        else:
            del s, a
            gc.collect()
        b.store = store
        out = b.generate(prompt, max_new_tokens=8)
        assert out.stats["cached_tokens"] == 0 and out.tokens == want, let_go


def test_two_engines_taking_one_store_in_two_threads_one_gets_it(zoo, monkeypatch):
    """The owner check and the take were not atomic: each engine's setter holds only its own
    engine's lock, so two threads could both see the store free and both take it."""
    import threading

    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.prefix_store import PrefixStore

    path = zoo.path("tiny", "qwen3_5")
    engines = [Engine(load_model(path, dtype="float32")) for _ in range(2)]
    barrier = threading.Barrier(2, timeout=2)

    class SlowStore(PrefixStore):  # the owner read waits for the other thread's (the window, made wide)
        @property
        def _owner(self):
            ref = self.__dict__.get("_owner_ref")
            if getattr(self, "_racing", False) and ref is None:  # (read, then wait: the other thread reads too)
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:
                    pass
            return ref

        @_owner.setter
        def _owner(self, ref):
            self.__dict__["_owner_ref"] = ref

    store = SlowStore()
    store._racing = True
    results = []

    def take(eng):
        try:
            eng.store = store
            results.append("took")
        except ValueError:
            results.append("refused")

    threads = [threading.Thread(target=take, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["refused", "took"], results
