"""Sessions on all three tiny families: the kept state continues a conversation exactly.

Promises (docs/sessions.md): speculative session == plain session every turn (greedy and
coupled sampling), tokens and target state bitwise; rewind() + the same send == the
original turn; fork()ed sessions do not disturb each other; a one-shot request extending
a stored conversation == continuing the live session; a slot that fills grows without
losing state; the maximum context gives an error naming both numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ARCHS
from hyspec.sampling import SamplingParams
from hyspec.session import Session
from session_helpers import MAX_NEW, assert_same, engine, messages, target_part

COUPLED = SamplingParams(temperature=0.9, seed=7, mode="coupled")


def run(sess, msgs, **kw):
    outs = []
    for m in msgs:
        outs.append(sess.send(m, **kw).tokens)
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_session_equals_plain(zoo, arch):
    eng = engine(zoo, arch)
    msgs = messages(eng.model.cfg.vocab_size, 4)
    for params in (None, COUPLED):
        plain = eng.session(draft=0, params=params, max_new_tokens=MAX_NEW)
        spec = eng.session(draft=3, params=params, max_new_tokens=MAX_NEW, use_store=False)
        for i, m in enumerate(msgs):
            a, b = plain.send(m), spec.send(m)
            assert a.tokens == b.tokens, (arch, params, i)
            assert_same(target_part(plain.live_state()), target_part(spec.live_state()), f"turn {i}")
        assert spec.telemetry.rounds > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_stop_inside_accepted_drafts_keeps_state_consistent(zoo, arch):
    """A turn ending on a stop token (possibly among accepted drafts) leaves the stop token
    pending; the next turn runs it first; spec == plain on every later turn."""
    eng = engine(zoo, arch)
    msgs = messages(eng.model.cfg.vocab_size, 4, seed=1)
    ref = eng.session(max_new_tokens=MAX_NEW, use_store=False).send(msgs[0]).tokens
    stop = ref[4]
    plain = eng.session(draft=0, max_new_tokens=MAX_NEW, stop_ids=[stop], use_store=False)
    spec = eng.session(draft=4, max_new_tokens=MAX_NEW, stop_ids=[stop], use_store=False)
    for i, m in enumerate(msgs):
        a, b = plain.send(m), spec.send(m)
        assert a.tokens == b.tokens, i
        if i == 0:  # (the session's stop ids end its turns)
            assert a.tokens == ref[:ref.index(stop) + 1] and a.samples[0].stop_reason == "eos"
        assert_same(target_part(plain.live_state()), target_part(spec.live_state()), f"turn {i}")
        st = spec.state()
        assert st.pending == st.tokens[-1] and st.pos == len(st.tokens) - 1
    assert plain.tokens.count(stop) >= 1


class _TokenStop:
    """A stand-in for hyspec.engine.StopStrings (the zoo's models have no tokenizer) whose
    "stop string" is one token id: the same peek / check / apply protocol."""

    def __init__(self, engine, stops, stop_ids=(), skip_break=False) -> None:
        self.tok, self.stopped = int(stops[0]), False

    def peek(self, tokens):
        return next((i for i, t in enumerate(tokens) if t == self.tok), None)

    def check(self, token) -> bool:
        self.stopped = self.stopped or token == self.tok
        return self.stopped

    def apply(self, req):
        return None


def test_a_stop_string_among_accepted_drafts_ends_the_round_there(zoo, monkeypatch):
    """The round driver ends a sequence at the token completing a stop string as at a stop
    id: among accepted drafts it commits only what is emitted, so the speculative session's
    state is the plain one's at every stop position (a cut after the round kept the cache
    past the stop: a different state, a different next turn)."""
    import hyspec.engine

    monkeypatch.setattr(hyspec.engine, "StopStrings", _TokenStop)
    for arch in ("qwen3_next", "qwen3_5"):
        eng = engine(zoo, arch)
        msgs = messages(eng.model.cfg.vocab_size, 2, seed=1)
        ref = eng.session(max_new_tokens=MAX_NEW, use_store=False).send(msgs[0]).tokens
        for p, stop in enumerate(ref):
            if p == 0 or stop in ref[:p]:
                continue
            plain = eng.session(draft=0, max_new_tokens=MAX_NEW, use_store=False)
            spec = eng.session(draft=4, max_new_tokens=MAX_NEW, use_store=False)
            a, b = plain.send(msgs[0], stop=str(stop)), spec.send(msgs[0], stop=str(stop))
            assert a.tokens == b.tokens == ref[:p + 1] and b.samples[0].stop_reason == "stop", (arch, p)
            assert_same(target_part(plain.live_state()), target_part(spec.live_state()), f"{arch} stop at {p}")
            assert plain.send(msgs[1]).tokens == spec.send(msgs[1]).tokens, (arch, p)


@pytest.mark.parametrize("arch", ARCHS)
def test_rewind_then_same_send_is_the_original_turn(zoo, arch):
    eng = engine(zoo, arch)
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=2)
    for k, params in ((3, None), (2, SamplingParams(temperature=1.0, seed=3))):
        s = eng.session(draft=k, params=params, max_new_tokens=MAX_NEW)
        states = [None]
        outs = []
        for m in msgs:
            outs.append(s.send(m).tokens)
            states.append(s.state())
        s.rewind()
        assert_same(s.live_state(), states[2], "after rewind()")
        assert s.send(msgs[2]).tokens == outs[2]
        assert_same(s.live_state(), states[3], "resent turn")
        s.rewind(2)
        assert_same(s.live_state(), states[1], "after rewind(2)")
        assert run(s, msgs[1:]) == outs[1:]
        s.rewind(3)
        assert s.tokens == [] and s.live_state() is None
        assert run(s, msgs) == outs
        with pytest.raises(ValueError, match="cannot rewind 4"):
            s.rewind(4)


@pytest.mark.parametrize("arch", ARCHS)
def test_fork_is_independent(zoo, arch):
    eng = engine(zoo, arch)
    msgs = messages(eng.model.cfg.vocab_size, 4, seed=3)
    solo = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    base = run(solo, msgs[:2])
    a_ref = run(solo, msgs[2:])
    solo.rewind(2)
    b_ref = run(solo, [msgs[3], msgs[2]])

    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    assert run(s, msgs[:2]) == base
    f = s.fork()
    got_a, got_b = [], []
    got_a.append(s.send(msgs[2]).tokens)  # interleaved
    held = len(eng.session_scheduler().pool.used)
    s.park()  # its slot given back: the next turn resumes from the boundary, the same bits
    assert len(eng.session_scheduler().pool.used) == held - 1
    got_b.append(f.send(msgs[3]).tokens)
    got_a.append(s.send(msgs[3]).tokens)
    got_b.append(f.send(msgs[2]).tokens)
    assert got_a == a_ref and got_b == b_ref
    f.rewind(2)
    assert f.tokens == s.tokens[: len(f.tokens)]
    f.close()
    assert s.send(msgs[0]).tokens  # the original is untouched by closing the fork


@pytest.mark.parametrize("arch", ARCHS)
def test_one_shot_extending_a_stored_conversation(zoo, arch):
    eng = engine(zoo, arch)
    msgs = messages(eng.model.cfg.vocab_size, 4, seed=4)
    for k, params in ((3, None), (0, SamplingParams(temperature=0.8, seed=5)), (2, COUPLED)):
        s = eng.session(draft=k, params=params, max_new_tokens=MAX_NEW)
        run(s, msgs[:3])
        prompt = s.tokens + msgs[3]
        hits = eng.store.hits
        one = eng.generate(prompt, max_new_tokens=MAX_NEW, draft=k, params=params)
        assert eng.store.hits == hits + 1
        assert one.stats["cached_tokens"] == len(s.tokens) - 1
        assert one.tokens == s.send(msgs[3]).tokens
        cold = eng.generate(prompt, max_new_tokens=MAX_NEW, draft=k, params=params, use_store=False)
        assert cold.stats["cached_tokens"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_growth_keeps_state(zoo, arch):
    eng = engine(zoo, arch)
    msgs = messages(eng.model.cfg.vocab_size, 6, seed=5)
    s = eng.session(draft=3, max_new_tokens=MAX_NEW, use_store=False)
    s.send(msgs[0])
    grown = 0
    for m in msgs[1:]:
        before = s.state()
        length = s._seq.slot.length
        twin = Session.from_state(eng, before, draft=3, max_new_tokens=MAX_NEW, use_store=False)
        assert_same(s.live_state(), before)
        a = s.send(m).tokens
        grown += s._seq.slot.length > length
        assert twin.send(m).tokens == a  # a fresh exactly-sized slot, restored from the state
        assert_same(s.live_state(), twin.live_state())
        twin.close()
    assert grown >= 2


def test_max_context_error_names_both_numbers(zoo):
    eng = engine(zoo, "qwen3_5")
    cfg = eng.model.cfg
    old = cfg.max_position_embeddings
    object.__setattr__(cfg, "max_position_embeddings", 30)
    try:
        s = eng.session(max_new_tokens=10)
        s.send([5] * 12)  # 12 + 10 <= 30
        with pytest.raises(ValueError, match=r"would reach 42 tokens.*maximum context of 30"):
            s.send([6] * 10)
        assert len(s.tokens) == 22  # unchanged by the refused turn
        assert s.send([6] * 2, max_new_tokens=6).tokens
        # a full context: no max_new_tokens (>= 1) helps, so the error does not advise lowering it
        assert len(s.tokens) == 30
        for msg, advice in (([], r"no room is left for a reply \(30 tokens before it\): rewind or reset$"),
                            ([7], r"no room is left for a reply \(31 tokens.*or send a shorter message$")):
            with pytest.raises(ValueError, match=advice) as e:
                s.send(msg, max_new_tokens=1)
            assert "lower max_new_tokens" not in str(e.value)
        s.rewind()
        with pytest.raises(ValueError, match="lower max_new_tokens"):  # (where it would help, it says so)
            s.send([6] * 2, max_new_tokens=7)
    finally:
        object.__setattr__(cfg, "max_position_embeddings", old)


def test_bad_turn_and_session_arguments_are_named_up_front(zoo, tmp_path):
    """A turn's stop_ids are checked as generate's are (were: "12" became ids 1 and 2, 1.7
    became 1, 5 and "abc" failed deep inside); params must be SamplingParams when the session
    is made, not at its first send; saving into a missing folder says so. Nothing changes."""
    eng = engine(zoo, "qwen3_5")
    s = eng.session(max_new_tokens=2)
    s.send([3, 4])
    before = s.state().digest()
    for bad in ("12", [1.7], 5, "abc"):
        with pytest.raises(ValueError, match="stop_ids"):
            s.send([5], stop_ids=bad)
    with pytest.raises(ValueError, match="out of range"):
        s.send([5], stop_ids=[10 ** 6])
    with pytest.raises(ValueError, match="params"):
        s.send([5], params={"temperature": 0.7})
    with pytest.raises(ValueError, match="params"):
        eng.session(params={"temperature": 0.7})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        s.save(tmp_path / "no_such_folder" / "s.pt")
    # extra must be what Session.load can read back (a function was written, then the file failed to load)
    import numpy as np

    for bad in ({"f": lambda: 1}, {"f": np.float64(1.5)}):  # (np.float64 passed an isinstance check, then the
        with pytest.raises(ValueError, match=r"extra\['f'\] .* cannot be saved"):  # file did not load)
            s.save(tmp_path / "s.pt", extra=bad)
    with pytest.raises(ValueError, match="extra must be a dict"):
        s.save(tmp_path / "s.pt", extra="abc")
    assert not (tmp_path / "s.pt").exists()
    for bad in (0, -1, 1.5, "1"):  # (rewind(0) undid every turn)
        with pytest.raises(ValueError, match="rewind needs a number of turns >= 1"):
            s.rewind(bad)
    assert s.state().digest() == before and s.num_turns == 1
    assert s.send([5], stop_ids=[7]).tokens


def test_switching_plain_and_speculative_is_refused(zoo, tmp_path):
    eng = engine(zoo, "qwen3_next")
    s = eng.session(draft=0, max_new_tokens=4)
    s.send([3, 4, 5])
    with pytest.raises(ValueError, match="without drafts"):
        s.send([6], draft=2)
    t = eng.session(draft=2, max_new_tokens=4)
    t.send([3, 4, 5])
    # the other way the reason is another: a plain turn needs no drafter rows, it builds none for
    # the speculative turns after it (was: "draft=0 would need the drafter's rows")
    with pytest.raises(ValueError, match=r"with drafts since its first turn; a plain turn \(draft=0\) would not "
                                         r"build the drafter's rows that its later speculative turns need") as e:
        t.send([6], draft=0)
    assert "draft=0 would need" not in str(e.value)
    assert t.send([6], draft=4).tokens  # K may change between speculative turns
    # a session made with draft=2 whose first turn was plain stays plain by default (it refused every
    # send without draft=0); a wrong params type is named before the draft rule
    u = eng.session(draft=2, max_new_tokens=4)
    u.send([3, 4, 5], draft=0)
    with pytest.raises(ValueError, match="params"):
        u.send([6], params={"temperature": 1.0})
    assert u.send([6]).tokens == s.send([6]).tokens
    v = eng.session(draft=0, max_new_tokens=4)  # and a speculative one stays at its last K
    v.send([3, 4, 5], draft=2)
    assert v.send([6]).stats["k"] == 2
    # ... also after a rewind (the K before the undone turns; it kept theirs) and in a saved
    # and loaded session (it lost it): a seeded turn resent without draft= is the original one
    v.send([7], draft=4)
    v.rewind()
    assert v.turns == v.num_turns == 2 and v.send([7]).stats["k"] == 2
    v.save(tmp_path / "v.pt")
    w = Session.load(eng, tmp_path / "v.pt")
    f = v.fork()  # (a fork too, and it has the last turn's stats)
    assert f.last_stats == v.last_stats and f.last_stats["k"] == 2
    assert w.send([8]).stats["k"] == v.send([8]).stats["k"] == f.send([8]).stats["k"] == 2
    w.rewind(2)  # (a loaded session's rewind points keep their K)
    assert w.send([7]).stats["k"] == 2
    x = eng.session(draft=0, max_new_tokens=2)  # (each its own: the K before the last turn, not the last one)
    x.send([3, 4], draft=3)
    x.send([5], draft=1)
    x.save(tmp_path / "x.pt")
    y = Session.load(eng, tmp_path / "x.pt")
    y.rewind()
    assert y.send([5]).stats["k"] == 3


def test_a_session_rewound_to_its_start_is_empty_again(zoo):
    """rewind() back before the first turn leaves an empty session, as reset() does: its next
    first turn may be plain or speculative again (the first turn sets the mode); after reset()
    too, with no turns to rewind and no last turn's stats."""
    eng = engine(zoo, "qwen3_next")
    msgs = messages(eng.model.cfg.vocab_size, 2, seed=8)
    want = eng.generate(msgs[1], max_new_tokens=MAX_NEW, use_store=False).tokens
    s = eng.session(draft=0, max_new_tokens=MAX_NEW, use_store=False)
    s.send(msgs[0])
    s.rewind()
    assert s.tokens == [] and s.turns == 0
    assert s.send(msgs[1], draft=2).tokens == want  # (was refused: "decodes without drafts since its first turn")
    s.rewind()
    assert s.send(msgs[1], draft=0).tokens == want
    s.send(msgs[0], max_new_tokens=2)  # reset() too: no turns, no stats, and the next turn sets the mode
    s.reset()
    assert (s.tokens, s.turns, s.last_stats, s.matcher) == ([], 0, {}, None)
    assert s.send(msgs[1], draft=2).tokens == want and s.turns == 1
    with pytest.raises(ValueError, match="cannot rewind 2"):
        s.rewind(2)


def test_a_forks_turns_do_not_count_in_the_original_telemetry(zoo):
    """fork() gives the copy its own telemetry: a turn of one counts in its own
    s.telemetry and stats["session"]["spec"] only."""
    eng = engine(zoo, "qwen3_next")
    msgs = messages(eng.model.cfg.vocab_size, 2, seed=9)
    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    s.send(msgs[0])
    before = s.telemetry.copy()
    f = s.fork()
    out = f.send(msgs[1])
    assert f.telemetry.rounds > before.rounds and out.stats["session"]["spec"] == f.telemetry.to_dict()
    assert s.telemetry == before
    assert s.send(msgs[1]).stats["session"]["spec"] == f.telemetry.to_dict()  # the same turn, counted once


@pytest.mark.parametrize("arch", ARCHS)
def test_drafter_options_across_turns(zoo, arch):
    """The no-pending form, the other rollback strategies, adaptive K and p_min: a
    speculative session still equals the plain one on every turn."""
    from hyspec.speculative.loop import SpecOptions

    eng = engine(zoo, arch)
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=6)
    plain = eng.session(max_new_tokens=MAX_NEW, use_store=False)
    want = run(plain, msgs)
    for spec in (SpecOptions(prime_pending=False), SpecOptions(rollback="rescan", adaptive=True),
                 SpecOptions(rollback="replay", p_min=0.05)):
        s = eng.session(draft=3, spec=spec, max_new_tokens=MAX_NEW, use_store=False)
        assert run(s, msgs) == want, spec
        assert_same(target_part(s.live_state()), target_part(plain.live_state()))


def test_seeded_session_is_reproducible_as_a_whole(zoo):
    """RNG draws are keyed by absolute position: two sessions with one seed give the same
    transcript turn after turn; another seed gives another."""
    eng = engine(zoo, "qwen3_5_moe")
    msgs = messages(eng.model.cfg.vocab_size, 4, seed=7)
    p = SamplingParams(temperature=1.2, seed=21)
    a = run(eng.session(draft=2, params=p, max_new_tokens=MAX_NEW, use_store=False), msgs)
    b = run(eng.session(draft=2, params=p, max_new_tokens=MAX_NEW, use_store=False), msgs)
    c = run(eng.session(draft=2, params=SamplingParams(temperature=1.2, seed=22), max_new_tokens=MAX_NEW,
                        use_store=False), msgs)
    assert a == b and a != c


def test_one_shot_extending_a_stored_conversation_where_graphs_run(zoo, triton_interpreter):
    """Where the batched graphs run (CUDA; here engine.batch_graphs through the Triton
    interpreter), a sampled one-shot request that extends a stored conversation resumes from
    the prefix store on a graph lane (the lane loads the stored state and prefills only the
    new tokens) and equals the live session's turn. fp32: the graph path equals the engine
    core there (in fp64 its sampled draws can differ from the core's, resumed or not)."""
    pytest.importorskip("triton")
    eng = engine(zoo, "qwen3_5", dtype="float32")
    eng.batch_graphs = True
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=4)
    params = SamplingParams(temperature=0.8, seed=5)
    s = eng.session(draft=0, params=params, max_new_tokens=MAX_NEW)
    run(s, msgs[:2], max_new_tokens=3)  # (CI's time: two short stored turns; the one-shot extends the longer)
    hits = eng.store.hits
    one = eng.generate(s.tokens + msgs[2], max_new_tokens=MAX_NEW, draft=0, params=params)
    assert eng.store.hits == hits + 1 and one.stats["cached_tokens"] == len(s.tokens) - 1
    assert one.stats["path"] == "batch-graphs"
    assert one.tokens == s.send(msgs[2]).tokens


@pytest.mark.parametrize("where", ["generate", "session", "on_finish"])
def test_a_model_call_from_a_callback_on_the_lanes_is_refused(zoo, triton_interpreter, where):
    """A callback (on_tokens, on_finish) that starts another model call on its engine while
    its request runs on the CUDA-graph lanes (here batch_graphs through the Triton
    interpreter): the engine's lock is re-entrant, so the inner call ran, its BatchRunner
    freed every lane, and the outer request went on from a freed lane -- another output, no
    error. It is now refused (RuntimeError from the callback, reaching the caller; a session
    turn undone) and the engine's next calls equal a fresh engine's."""
    pytest.importorskip("triton")

    def lanes():
        eng = engine(zoo, "qwen3_5", dtype="float32")
        eng.batch_graphs = eng.session_graphs = True
        return eng

    prompts, inner = [[5, 6, 7], [8, 9, 10, 11]], [3, 4, 2]
    fresh = lanes()
    want = [fresh.generate(p, max_new_tokens=4).tokens for p in prompts]
    eng = lanes()
    nested = []

    def call_in(*_):
        if not nested:
            nested.append(eng.generate(inner, max_new_tokens=2).tokens)

    refused = pytest.raises(RuntimeError, match="started from a callback .* of a request running on its CUDA-graph")
    if where == "generate":
        with refused:
            eng.generate(prompts[0], max_new_tokens=4, on_tokens=call_in)
    elif where == "on_finish":
        with refused:
            eng.generate_batch(prompts, max_new_tokens=[2, 4], on_finish=call_in)  # (prompt 1 decodes on)
    else:
        s = eng.session(max_new_tokens=4)
        with refused:
            s.send(prompts[0], on_tokens=call_in)
        assert s.num_turns == 0 and s.tokens == []
        assert s.send(prompts[0]).tokens == want[0]
    assert not nested
    assert [o.tokens for o in eng.generate_batch(prompts, max_new_tokens=4)] == want


@pytest.mark.parametrize("when,exc", [(1, ValueError), (2, ValueError), (1, KeyboardInterrupt),
                                      (2, KeyboardInterrupt)])
def test_an_exception_escaping_a_turn_undoes_it_and_leaves_the_engine_clean(zoo, when, exc):
    """on_tokens raising (ValueError, or Ctrl-C as KeyboardInterrupt) on the turn's first
    token (from the prefill) or in a later round: the exception reaches the caller, the
    turn is undone (the session as before it, its slot state not trusted), the shared
    session scheduler keeps nothing of it, and every later turn -- of this session and of
    another -- equals the same turn of sessions that never saw it. (The aborted request
    once stayed active: it decoded inside other sessions' turns and re-fired its callback.)"""
    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=4)
    ref = eng.session(draft=3, max_new_tokens=MAX_NEW, use_store=False)
    want = [ref.send(m).tokens for m in msgs]
    ref.close()
    s = eng.session(draft=3, max_new_tokens=MAX_NEW, use_store=False)
    t = eng.session(draft=3, max_new_tokens=MAX_NEW, use_store=False)
    assert s.send(msgs[0]).tokens == want[0]
    calls = []

    def boom(ids):
        calls.append(ids)
        if len(calls) == when:
            raise exc("stop here")

    with pytest.raises(exc):
        s.send(msgs[1], on_tokens=boom)
    sched = eng.session_scheduler()
    assert not sched.active and not sched.prefilling and not sched.waiting
    assert s.num_turns == 1 and len(s.tokens) == len(msgs[0]) + len(want[0])
    n = len(calls)
    assert t.send(msgs[0]).tokens == want[0] and len(calls) == n  # the other session: its own tokens, no stray calls
    assert [s.send(m).tokens for m in msgs[1:]] == want[1:]
    s.close()
    t.close()
    assert not sched.pool.used  # no slot leaked


def _three_turns_and_a_session_after_one(zoo, seed):
    """(engine, 3 messages, the 3 replies of a session that runs them, a new session after
    the first of them)."""
    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=seed)
    ref = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    want = [ref.send(m).tokens for m in msgs]
    ref.close()
    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    assert s.send(msgs[0]).tokens == want[0]
    return eng, msgs, want, s


@pytest.mark.parametrize("method", ["rewind", "reset", "park", "close", "send"])
def test_a_turn_cannot_move_its_own_session(zoo, method):
    """rewind() / reset() / park() / close() from the session's own on_tokens were let in (the
    engine's lock is re-entrant): they handed back the slot the turn was still writing, the
    next session took it, and both went on wrong in silence. Now they are refused there with
    an error naming the call; the turn is undone, and the session and the others go on exact."""
    eng, msgs, want, s = _three_turns_and_a_session_after_one(zoo, seed=5)
    move = (lambda: s.send(msgs[2])) if method == "send" else getattr(s, method)
    with pytest.raises(RuntimeError, match=rf"Session.{method}\(\) was called during this session's own turn"):
        s.send(msgs[1], on_tokens=lambda ids: move())
    assert s.num_turns == 1 and not s.closed
    other = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)  # (it took the slot handed back)
    assert other.send(msgs[0]).tokens == want[0]
    assert [s.send(m).tokens for m in msgs[1:]] == want[1:]
    s.close()
    other.close()
    assert not eng.session_scheduler().pool.used


def test_a_ctrl_c_as_a_turn_ends_undoes_it(zoo, monkeypatch):
    """A KeyboardInterrupt after the turn's last round, while its end state is captured, left
    the session pointing at a Sequence already continued: every later send failed ("this
    kept Sequence was already continued by another request"). The turn is now undone, as
    one interrupted mid-round."""
    import hyspec.session as session_mod

    eng, msgs, want, s = _three_turns_and_a_session_after_one(zoo, seed=6)
    real = session_mod.capture

    def interrupted(seq):
        monkeypatch.setattr(session_mod, "capture", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(session_mod, "capture", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.send(msgs[1])
    assert s.num_turns == 1 and len(s.tokens) == len(msgs[0]) + len(want[0])
    assert [s.send(m).tokens for m in msgs[1:]] == want[1:]
    s.close()
    assert not eng.session_scheduler().pool.used


@pytest.mark.parametrize("where", ["store", "output"])
def test_a_ctrl_c_after_the_turn_is_recorded_undoes_it(zoo, monkeypatch, where):
    """A KeyboardInterrupt after the turn's record, while its end state went into the prefix
    store or its reply was being made, escaped with the turn kept (the chat then said "the
    reply is dropped" of a turn still in the session). The turn is now undone there too."""
    eng, msgs, want, s = _three_turns_and_a_session_after_one(zoo, seed=6)
    s.use_store = where == "store"
    target, name = (eng.store, "put") if where == "store" else (eng, "_output")
    real = getattr(target, name)

    def interrupted(*a, **kw):
        monkeypatch.setattr(target, name, real)
        raise KeyboardInterrupt

    monkeypatch.setattr(target, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.send(msgs[1])
    s.use_store = False
    assert s.num_turns == 1 and len(s.tokens) == len(msgs[0]) + len(want[0])
    assert [s.send(m).tokens for m in msgs[1:]] == want[1:]
    s.close()
    assert not eng.session_scheduler().pool.used


def test_a_growing_session_slot_keeps_to_the_pool_budget(zoo):
    """A turn that needs a longer slot grew it without looking at the pool's budget (held
    3.5x a budget of one slot, no error). Now growing past the budget is a MemoryError for
    that turn, the session stays as before it, and with room it goes on exactly."""
    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=7)
    ref = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    want = [ref.send(m).tokens for m in msgs]
    ref.close()
    pool = eng.session_scheduler().pool
    pool.free.clear()  # (no free slot of earlier sessions to reuse: the first turn's slot is its own size)
    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    assert s.send(msgs[0]).tokens == want[0]
    pool.budget_bytes = pool.held_bytes  # (that slot alone: no room to grow)
    try:
        with pytest.raises(MemoryError, match="growing a slot to .* tokens needs .* more bytes"):
            s.send(msgs[1])
        assert pool.held_bytes <= pool.budget_bytes and s.num_turns == 1
    finally:
        pool.budget_bytes = None
    assert [s.send(m).tokens for m in msgs[1:]] == want[1:]
    s.close()


def test_a_growing_slot_takes_no_headroom_past_the_context(zoo, monkeypatch):
    """A session's slot grew by 1.5x with no cap: near a model's context it held rows no turn
    can ever use (76 positions for a context of 64 + 5). The headroom now stops at the most
    a turn can need: the context plus the round's k + 2 rows."""
    from hyspec.core.slots import SlotPool

    eng = engine(zoo, "qwen3_5")
    pool = SlotPool(eng.model)
    slot = pool.alloc(40)
    pool.grow(slot, 45, most=50)
    assert slot.length == 50  # (1.5x would be 60)
    pool.grow(slot, 52, most=51)
    assert slot.length == 52  # (the need always wins)
    pool.grow(slot, 60)
    assert slot.length == 78  # (no cap given: 1.5x)
    pool.release(slot, keep=False)
    seen = []
    shared = eng.session_scheduler().pool
    grow = shared.grow
    monkeypatch.setattr(shared, "grow", lambda slot, need, most=None: (seen.append(most), grow(slot, need, most)))
    s = eng.session(draft=3, max_new_tokens=MAX_NEW, use_store=False)
    for m in messages(eng.model.cfg.vocab_size, 2, seed=5):
        s.send(m)
    s.close()
    assert seen and set(seen) == {eng.model.cfg.max_position_embeddings + 3 + 2}


def test_on_finish_is_called_once_even_when_it_raises(zoo):
    eng = engine(zoo, "qwen3_5")
    calls = []

    def fail(i, out):
        calls.append((i, out.samples[0].stop_reason))
        raise RuntimeError("caller's bug")

    with pytest.raises(RuntimeError, match="caller's bug"):
        eng.generate_batch([[5, 6, 7]], max_new_tokens=1, on_finish=fail)
    assert calls == [(0, "length")]


@pytest.mark.parametrize("when", [1, 2])
def test_a_raising_on_tokens_reaches_the_generate_batch_caller(zoo, when):
    """On the first token (from the prefill) as in a later round: the callback's exception
    reaches the caller (the first one was once swallowed into an "error" output while the
    other prompts ran on), and the engine serves the next call as before."""
    eng = engine(zoo, "qwen3_5")
    prompts = [[5, 6, 7], [8, 9]]
    want = [o.tokens for o in eng.generate_batch(prompts, max_new_tokens=6, draft=2)]
    calls = []

    def boom(i, ids):
        calls.append(i)
        if len(calls) == when:
            raise ValueError("caller's callback")

    with pytest.raises(ValueError, match="caller's callback"):
        eng.generate_batch(prompts, max_new_tokens=6, draft=2, on_tokens=boom)
    assert [o.tokens for o in eng.generate_batch(prompts, max_new_tokens=6, draft=2)] == want


def test_rewind_takes_the_undone_turns_out_of_the_telemetry(zoo, tmp_path):
    """rewind() restores the telemetry (the conversation's turns only) and last_stats (the
    turn that is now the last) with the state; a fork and a saved-and-loaded session too
    (were: the undone turns' rounds kept counting, last_stats emptied)."""
    from hyspec.speculative.telemetry import SpecTelemetry

    eng = engine(zoo, "qwen3_next")
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=5)
    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    tel, stats = [], []
    for m in msgs:
        stats.append(s.send(m).stats)
        tel.append(s.telemetry.copy())
    assert 0 < tel[0].rounds < tel[1].rounds < tel[2].rounds
    f = s.fork()
    s.save(tmp_path / "s.pt")
    loaded = Session.load(eng, tmp_path / "s.pt")
    for x in (s, f, loaded):
        x.rewind()
        assert x.telemetry == tel[1]
        assert x.last_stats == (stats[1] if x is not loaded else {})  # (a loaded session has no turn stats)
        x.rewind(2)
        assert x.telemetry == SpecTelemetry() and x.last_stats == {}
        out = x.send(msgs[0])  # the same turn again: counted once
        assert x.telemetry == tel[0] and out.stats["session"]["spec"] == tel[0].to_dict()
    s.reset()
    assert s.telemetry == SpecTelemetry()


def test_a_failed_save_leaves_the_older_file_whole(zoo, tmp_path, monkeypatch):
    """save() writes beside the file and moves it over: an interrupted save keeps the older
    file loadable and leaves no partial file; a directory is named, not torch's error."""
    import torch

    eng = engine(zoo, "qwen3_next")
    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    s.send(messages(eng.model.cfg.vocab_size, 1, seed=2)[0])
    f = tmp_path / "s.pt"
    s.save(f)
    before = f.read_bytes()
    real = torch.save

    def dies(obj, f):  # writes the file, then fails before it is moved over the older one
        real(obj, f)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        s.save(f)
    monkeypatch.setattr(torch, "save", real)
    assert f.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["s.pt"]
    assert Session.load(eng, f).tokens == s.tokens
    with pytest.raises(IsADirectoryError, match="is a directory"):
        s.save(tmp_path)
    # a link is written through (the link stays one); a device or pipe is refused, never replaced
    # (saving to /dev/null as root put a regular file in the device's place)
    import os

    link = tmp_path / "link.pt"
    os.symlink(tmp_path / "target.pt", link)
    s.save(link)
    assert link.is_symlink() and Session.load(eng, tmp_path / "target.pt").tokens == s.tokens
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        s.save(fifo)
    assert fifo.is_fifo()
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:  # (root writes anywhere)
        with pytest.raises(OSError, match="cannot save the session"):
            s.save(tmp_path / "ro" / "s.pt")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_save_that_cannot_write_names_the_file_and_why(zoo, tmp_path, monkeypatch):
    """A folder not writable was "[Errno 13] Permission denied: '.../.s.pt.1168.efb35b723bf2.tmp'"
    (the temporary file named, not the one given); a full disk was "[enforce fail at
    inline_container.cc:672] . unexpected pos 3648 vs 3542" (torch's writer swallows the
    write's error). Both now name the file and the reason, and leave nothing behind."""
    import os

    eng = engine(zoo, "qwen3_5")
    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    s.send(messages(eng.model.cfg.vocab_size, 1, seed=2)[0])
    f = tmp_path / "s.pt"
    real_open = os.open

    def denied(path, flags, mode=0o777, **kw):
        raise PermissionError(13, "Permission denied", str(path))

    def full(path, flags, mode=0o777, **kw):  # the temporary file made, its bytes going to a full disk
        os.close(real_open(path, flags, mode))
        return real_open("/dev/full", os.O_WRONLY)

    for fake, why in ((denied, "Permission denied"), (full, "No space left on device")):
        monkeypatch.setattr(os, "open", fake)
        with pytest.raises(OSError, match=rf"^cannot save the session to {re.escape(str(f))}: {why}$"):
            s.save(f)
        monkeypatch.setattr(os, "open", real_open)
        assert list(tmp_path.iterdir()) == []
    s.save(f)
    assert Session.load(eng, f).tokens == s.tokens


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc's fd links")
def test_a_save_to_a_pipe_behind_a_link_is_refused_as_one(zoo, tmp_path):
    """/dev/stdout into a pipe (or /proc/self/fd/N): the link was resolved to /proc/PID/fd/pipe:[N],
    which is no file, and the save failed with "No such file or directory"."""
    import os

    eng = engine(zoo, "qwen3_5")
    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    s.send(messages(eng.model.cfg.vocab_size, 1, seed=2)[0])
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match=rf"^cannot save the session to /proc/self/fd/{w}: it is not a regular file$"):
            s.save(f"/proc/self/fd/{w}")
    finally:
        os.close(r)
        os.close(w)


def test_sessions_and_requests_in_several_threads_take_turns(zoo):
    """Two sessions' turns and one-shot requests from three threads give what each gives
    alone (two sessions in two threads livelocked on the engine's shared session scheduler;
    the engine's calls now take turns)."""
    import threading

    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=9)
    want = {d: run(eng.session(draft=d, max_new_tokens=MAX_NEW, use_store=False), msgs) for d in (0, 3)}
    one_shot = eng.generate(msgs[0], max_new_tokens=MAX_NEW, draft=2).tokens
    got: dict = {}
    errors: list = []

    def turns(d):
        try:
            got[d] = run(eng.session(draft=d, max_new_tokens=MAX_NEW, use_store=False), msgs)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    def requests():
        try:
            got["one_shot"] = [eng.generate(msgs[0], max_new_tokens=MAX_NEW, draft=2).tokens for _ in range(3)]
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=turns, args=(d,), daemon=True) for d in (0, 3)]
    threads.append(threading.Thread(target=requests, daemon=True))  # (daemons: a livelock fails, never hangs)
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert got[0] == want[0] and got[3] == want[3] and got["one_shot"] == [one_shot] * 3


def test_a_session_collected_while_another_call_runs_gives_its_slot_back_later(zoo):
    """A session's finalizer never waits for the engine's lock (a finalizer that waits can
    deadlock): dropped while another thread's call holds it, its slot is given back when the
    next call starts."""
    import gc
    import threading

    eng = engine(zoo, "qwen3_5")
    s = eng.session(max_new_tokens=2, use_store=False)
    s.send([3, 4])
    pool = eng.session_scheduler().pool
    assert s._seq is not None and len(pool.used) == 1
    held, done = threading.Event(), threading.Event()

    def hold():
        with eng._lock:
            held.set()
            done.wait(30)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert held.wait(30)
    del s
    gc.collect()
    assert len(pool.used) == 1 and len(eng._orphans) == 1  # not given back yet, and nothing waited
    done.set()
    t.join(30)
    eng.generate([5, 6], max_new_tokens=1)
    assert len(pool.used) == 0 and not eng._orphans


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_a_turn_failing_as_its_state_is_restored_gives_its_slot_back(zoo, monkeypatch, exc):
    """A turn resuming from a kept state (after park, rewind, fork or a load) takes a slot and
    copies the state into it: a failure there (a device out of memory, a Ctrl-C) kept that
    slot for good (the session pool has no budget to reclaim it: one leaked slot per failed
    turn). The slot now goes back; the session stays usable and equal to an uninterrupted one."""
    import hyspec.core.scheduler as sched_mod

    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=21)
    s = eng.session(draft=2, max_new_tokens=MAX_NEW)
    s.send(msgs[0])
    pool = eng.session_scheduler().pool
    real = sched_mod.restore_into

    def failing(state, slot):
        raise exc("planted") if exc is RuntimeError else exc()

    for _ in range(2):
        s.park()
        monkeypatch.setattr(sched_mod, "restore_into", failing)
        with pytest.raises(exc):
            s.send(msgs[1])
        monkeypatch.setattr(sched_mod, "restore_into", real)
        assert pool.stats()["slots_in_use"] == 0, pool.stats()
    got = s.send(msgs[1]).tokens
    ref = eng.session(draft=2, max_new_tokens=MAX_NEW)
    ref.send(msgs[0])
    assert got == ref.send(msgs[1]).tokens
    s.close()
    ref.close()


def test_a_save_while_another_thread_runs_a_turn_is_whole(zoo, monkeypatch, tmp_path):
    """Session.save read the session's fields (its state, rewind points, turn count, telemetry)
    one by one without the engine's lock: a turn ending in another thread meanwhile wrote a
    torn file ("its rewind points and their digests differ in number", or worse, a state of
    one turn beside the points of the one before). The dict is now taken whole between turns."""
    import threading

    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 1, seed=22)
    s = eng.session(draft=0, max_new_tokens=2, ignore_eos=True)
    s.send(msgs[0])
    import hyspec.session as session_mod

    real_capture, in_turn, turn_may_end = session_mod.capture, threading.Event(), threading.Event()

    def slow_capture(seq):  # a turn whose end is held open until the save has started
        state = real_capture(seq)
        in_turn.set()
        turn_may_end.wait(5)
        return state

    monkeypatch.setattr(session_mod, "capture", slow_capture)
    t = threading.Thread(target=lambda: s.send([]))
    t.start()
    assert in_turn.wait(30)
    saver = threading.Thread(target=lambda: s.save(tmp_path / "s.pt"))
    saver.start()
    saver.join(0.5)
    held = saver.is_alive()  # the save waits for the turn (before: it read the fields meanwhile)
    turn_may_end.set()
    t.join(30)
    saver.join(30)
    monkeypatch.setattr(session_mod, "capture", real_capture)
    assert held
    loaded = Session.load(eng, tmp_path / "s.pt")
    assert loaded.num_turns == s.num_turns == 2 and loaded.tokens == s.tokens
    s.close()
    loaded.close()


def test_first_sessions_in_two_threads_share_one_prefix_store(zoo, monkeypatch):
    """Engine.store made its store on first use without the engine's lock: a thread whose
    first session() was still making the store while another thread's session ran a turn
    set its own empty store over the one that turn had been put in, and a one-shot request
    extending that conversation prefilled it all again (cached_tokens 0)."""
    import threading
    import time

    import hyspec.prefix_store as ps

    eng = engine(zoo, "qwen3_next")
    made = ps.PrefixStore.__init__

    def slow(self, *a, **k):  # widens the window between the engine's "no store yet" and its setting one
        if threading.current_thread().name == "slow":
            time.sleep(0.5)
        made(self, *a, **k)

    monkeypatch.setattr(ps.PrefixStore, "__init__", slow)
    msgs = messages(eng.model.cfg.vocab_size)
    sessions = []
    other = threading.Thread(target=lambda: sessions.append(eng.session(max_new_tokens=3)), name="slow")
    other.start()
    time.sleep(0.1)
    s = eng.session(max_new_tokens=3)
    s.send(msgs[0])
    other.join()
    assert s.tokens in eng.store
    g = eng.generate(s.tokens + msgs[1], max_new_tokens=2)
    assert g.stats["cached_tokens"] == len(s.tokens) - 1  # (the pending token is prefilled again)


def test_a_session_without_the_store_neither_reads_nor_fills_it(zoo):
    """use_store=False: the session's first turn does not resume from a stored conversation it
    extends (it prefills the whole message, as a cold request) and its turn ends are not put
    in the store; a session with the store does both."""
    eng = engine(zoo, "qwen3_next")
    msgs = messages(eng.model.cfg.vocab_size, 2, seed=23)
    s = eng.session(max_new_tokens=3)
    s.send(msgs[0])
    assert s.tokens in eng.store
    entries = eng.store.stats()["entries"]
    t = eng.session(max_new_tokens=3, use_store=False)
    out = t.send(s.tokens + msgs[1])
    assert out.stats["cached_tokens"] == 0 and t.tokens not in eng.store
    assert eng.store.stats()["entries"] == entries
    nxt = s.send(msgs[1]).stats
    assert (nxt["turn"], nxt["context_tokens"]) == (2, len(s.tokens)) and s.tokens in eng.store


def test_a_turns_own_params_apply_to_that_turn_only(zoo):
    """send(params=...) samples that turn with them (a session made with them gives the same
    reply); the next turn without params= is the session's own (greedy) again."""
    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 2, seed=24)
    hot = SamplingParams(temperature=1.5, seed=3)
    want = eng.session(params=hot, max_new_tokens=MAX_NEW, use_store=False).send(msgs[0]).tokens
    assert want != eng.session(max_new_tokens=MAX_NEW, use_store=False).send(msgs[0]).tokens
    s = eng.session(max_new_tokens=MAX_NEW, use_store=False)
    assert s.send(msgs[0], params=hot).tokens == want
    greedy = Session.from_state(eng, s.state(), max_new_tokens=MAX_NEW, use_store=False)
    assert s.send(msgs[1]).tokens == greedy.send(msgs[1]).tokens


def test_settings_carry_over_to_a_fork_a_copy_and_a_loaded_file(zoo, tmp_path):
    """fork(), empty_copy() and save / load keep every setting of the session (ignore_eos,
    use_store, stop ids, ...); a closed session refuses a turn; a plain session's stats have
    no speculative telemetry."""
    from hyspec.speculative.loop import SpecOptions

    eng = engine(zoo, "qwen3_5")
    p = SamplingParams(temperature=0.7, seed=5)
    s = eng.session(draft=2, params=p, spec=SpecOptions(k=2, rollback="replay"), max_new_tokens=3, stop_ids=[9, 4],
                    ignore_eos=True, use_store=False)
    s.send([3, 5, 7])
    s.save(tmp_path / "s.pt")
    settings = lambda x: (x.draft, x.params, x.spec, x.max_new_tokens, sorted(x.stop_ids), x.ignore_eos, x.use_store)
    for other in (s.fork(), s.empty_copy(), Session.load(eng, tmp_path / "s.pt")):
        assert settings(other) == settings(s)
        other.close()
        with pytest.raises(ValueError, match="this session is closed"):
            other.send([3])
    assert eng.session(max_new_tokens=2).send([3]).stats["session"]["spec"] is None


def test_closed_sessions_do_not_pile_up_free_slots(zoo):
    """Every closed session's slot stayed in the sessions' pool (its cap: 65,536 slots), one
    more for each session longer than the ones before (11 free slots, 13 MB after 11 closed
    sessions of the default model). Closed sessions' slots are now kept up to a turn batch's
    worth (16); the sessions still open keep theirs, and a session reusing a slot is exact."""
    eng = engine(zoo, "qwen3_5")
    pool = eng.session_scheduler().pool
    vocab = eng.model.cfg.vocab_size
    ref = eng.session(draft=2, max_new_tokens=3, use_store=False)
    want = ref.send(list(range(1, 9))).tokens
    ref.close()
    held = [eng.session(max_new_tokens=1, use_store=False) for _ in range(3)]
    for s in held:
        s.send([5, 6])
    for n in range(1, 25):
        s = eng.session(max_new_tokens=1, use_store=False)
        s.send([(7 * i + n) % vocab for i in range(4 * n)])
        s.close()
        assert len(pool.free) <= 16 and len(pool.used) == len(held), pool.stats()
    assert len(pool.free) == 16 and min(f.length for f in pool.free) >= 4 * 8, pool.stats()  # (the longest kept)
    s = eng.session(draft=2, max_new_tokens=3, use_store=False)
    assert s.send(list(range(1, 9))).tokens == want and len(pool.free) == 15
    for s2 in (s, *held):
        s2.close()


def test_closed_sessions_free_slots_keep_to_session_free_bytes(zoo):
    """The sessions' pool kept up to 16 closed sessions' slots with no byte cap (16 long ones:
    many GB once the sessions were gone). Engine.session_free_bytes caps their bytes: by
    default two slots at the model's full context (reported by Engine.memory), settable
    before or after the first session (a bad value refused, a lower one trims at once, None
    for no cap). Closed sessions' slots go shortest first past the cap, and a session that
    reuses a kept slot is exact."""
    from hyspec.core.slots import slot_bytes

    eng = engine(zoo, "qwen3_5")
    m = eng.model
    full = slot_bytes(m.cfg, m.dtype, eng.context_length, m.has_mtp)["total"]
    pool = eng.session_scheduler().pool
    assert eng.session_free_bytes == pool.max_free_bytes == 2 * full == eng.memory(16)["session_free_bytes"]
    vocab = m.cfg.vocab_size
    ref = eng.session(draft=2, max_new_tokens=3, use_store=False)
    want = ref.send(list(range(1, 9))).tokens
    ref.close()
    pool.free.clear()  # (from here the free slots are the closed sessions' below)

    def opened(n: int):
        s = eng.session(max_new_tokens=1, use_store=False)
        s.send([(7 * j + n) % vocab for j in range(n)])
        return s, s._seq.slot

    (s1, long), (s2, short), (s3, mid) = opened(36), opened(12), opened(24)  # (open together: a slot each)
    assert long.length > mid.length > short.length
    cap = long.nbytes() + mid.nbytes() + short.nbytes() - 1  # (not all three)
    eng.session_free_bytes = cap
    assert pool.max_free_bytes == cap and pool.stats()["max_free_bytes"] == cap
    for s in (s1, s2, s3):
        s.close()
    assert pool.free == [long, mid] and pool.stats()["free_bytes"] == long.nbytes() + mid.nbytes()  # (shortest out)
    s4, longest = opened(48)  # (none fits: a new slot)
    s4.close()
    assert pool.free == [long, longest] and pool.free_bytes <= cap  # (the mid goes: the two longest fit)
    made = pool._next
    s = eng.session(draft=2, max_new_tokens=3, use_store=False)
    assert s.send(list(range(1, 9))).tokens == want  # (on a kept slot, reset: exact)
    assert pool._next == made and s._seq.slot is long and pool.free == [longest]  # (the shortest that fits)
    s.close()
    for bad in (-1, float("nan"), "8", True):
        with pytest.raises(ValueError, match="session_free_bytes must be None or a number of bytes >= 0"):
            eng.session_free_bytes = bad
    assert eng.session_free_bytes == pool.max_free_bytes == cap
    eng.session_free_bytes = 0  # (keep none: the free slots go at once)
    assert pool.free == [] and pool.max_free_bytes == 0
    eng.session_free_bytes = None  # (no byte cap: 16 slots at most, as before)
    assert pool.max_free_bytes is None and eng.memory(16)["session_free_bytes"] is None
    early = engine(zoo, "qwen3_5")
    early.session_free_bytes = 1e6  # (before the sessions' pool exists; a float counts)
    assert early.session_scheduler().pool.max_free_bytes == 10**6 == early.session_free_bytes


def test_a_turn_with_a_smaller_draft_keeps_to_it_under_adaptive_k(zoo):
    """Adaptive K: a session's next turn goes on from the k its last round chose, but never
    past that turn's own draft (a turn sent with draft=1 after draft=4 turns drafts at most
    one token a round), and its tokens still equal the plain session's."""
    from hyspec.speculative.loop import SpecOptions

    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 2, seed=6)
    plain = eng.session(max_new_tokens=MAX_NEW, use_store=False)
    want = run(plain, msgs)
    s = eng.session(draft=4, spec=SpecOptions(adaptive=True, adaptive_floor=2), max_new_tokens=MAX_NEW,
                    use_store=False)
    first = s.send(msgs[0])
    assert s.live_state().k_next >= 2  # the state asks for more than the next turn's draft
    second = s.send(msgs[1], draft=1)
    assert [first.tokens, second.tokens] == want
    spec = second.samples[0].stats["spec"]
    assert spec["rounds"] > 0 and spec["drafted"] <= spec["rounds"], spec
    assert len(spec["drafted_at"]) <= 1, spec
