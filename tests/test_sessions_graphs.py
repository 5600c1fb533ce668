"""Session turns on the CUDA-graph lanes: on the CPU through the Triton interpreter (fp32),
on a GPU with HYSPEC_TEST_DEVICE=cuda (bench/gpu_tests.sh; fp32 models on the device).

Where the lanes run, a session turn runs on them (hyspec.session.Session._graph_turn): the
lane loads the session's state, prefills [pending] + the message, decodes and hands its end
state back (Request.end_state). Promises: speculative == plain (tokens and target state,
greedy and coupled); rewind / fork / save-load; a stop among accepted drafts leaves the
stop token pending; a lane that could not hand its state over gets it rebuilt by a prefill;
a conversation outgrows the decoder. On the CPU also: the engine-core session's tokens
(fp32, where the graph path equals the core), turn by turn and with turns alternating
between the core and the lanes."""

from __future__ import annotations


import pytest

from conftest import ARCHS
from hyspec.gpu.batch_loop import BatchRunner
from hyspec.sampling import SamplingParams
from hyspec.session import Session
from session_helpers import DEVICE, skip_unless_lanes_run, assert_same, engine, messages, target_part

pytest.importorskip("triton")

ON_CPU = DEVICE == "cpu"  # the interpreter's fp32 lanes equal the engine core; a GPU's do not (other kernels)
NEW = 5  # tokens per reply (the interpreter runs ~1 s per decode step)
COUPLED = SamplingParams(temperature=0.9, seed=7, mode="coupled")
SAMPLED = SamplingParams(temperature=0.8, seed=3)


@pytest.fixture(autouse=True)
def _lanes_run_here():
    skip_unless_lanes_run()


def graph_engine(zoo, arch):
    eng = engine(zoo, arch, dtype="float32")
    eng.batch_graphs = eng.session_graphs = True
    return eng


def core_engine(zoo, arch):
    return engine(zoo, arch, dtype="float32")  # (session_graphs off)


def replies(sess, msgs):
    return [sess.send(m).tokens for m in msgs]


# (CI's time: on the CPU the MoE family only; qwen3_next's lanes export and load states in
# tests/test_graph_store.py, qwen3_5's run every other test here; all three families on the GPU)
@pytest.mark.parametrize("arch", ["qwen3_5_moe"] if ON_CPU else ARCHS)
def test_graph_session_turns_resume_and_grow(zoo, arch):
    """Plain and K=2 turns run on the lanes, each resuming the state (only [pending] + the
    message prefilled); the decoder is rebuilt as the transcript outgrows it (on the CPU,
    where a decoder is sized to its need); on the CPU the tokens are the core session's."""
    graphs = graph_engine(zoo, arch)
    msgs = messages(graphs.model.cfg.vocab_size, 3, seed=2)
    lens = []
    for draft, n in ((0, 3), (2, 2)):  # (CI's time: the K=2 session resumes once, in the decoder the plain one grew)
        s = graphs.session(draft=draft, max_new_tokens=NEW)
        outs = []
        for m in msgs[:n]:
            before = len(s.tokens)
            out = s.send(m)
            assert out.stats["path"] == "batch-graphs"
            assert out.stats["cached_tokens"] == max(before - 1, 0)
            outs.append(out.tokens)
            lens.append(graphs._batch_dec.max_len)
        assert len(s.tokens) == sum(map(len, msgs[:n])) + n * NEW
        if ON_CPU:
            assert outs == replies(core_engine(zoo, arch).session(draft=draft, max_new_tokens=NEW), msgs[:n]), draft
    if ON_CPU:
        assert lens[-1] >= 2 * lens[0]


def test_sampled_and_coupled_graph_sessions(zoo):
    """Coupled speculative == coupled plain, tokens and the states' target parts bitwise;
    on the CPU seeded sampling gives the core session's tokens."""
    graphs = graph_engine(zoo, "qwen3_5")
    msgs = messages(graphs.model.cfg.vocab_size, 2, seed=5)
    if ON_CPU:
        a = replies(graphs.session(params=SAMPLED, max_new_tokens=NEW), msgs)
        assert a == replies(core_engine(zoo, "qwen3_5").session(params=SAMPLED, max_new_tokens=NEW), msgs)
    plain = graphs.session(params=COUPLED, max_new_tokens=NEW, use_store=False)
    spec = graphs.session(draft=3, params=COUPLED, max_new_tokens=NEW, use_store=False)
    for i, m in enumerate(msgs):
        assert plain.send(m).tokens == spec.send(m).tokens, i
        assert_same(target_part(plain.state()), target_part(spec.state()), f"turn {i}")


def test_rewind_fork_save_and_core_turns_on_the_lanes(zoo, tmp_path):
    """rewind() + the same send == the original turn (state bitwise); a fork and a saved
    and loaded copy continue like the original; turns alternate between the engine core and
    the lanes (on the CPU: the all-core tokens)."""
    graphs = graph_engine(zoo, "qwen3_5")
    msgs = messages(graphs.model.cfg.vocab_size, 5, seed=3)
    s = graphs.session(draft=2, max_new_tokens=NEW, use_store=False)

    def send(sess, msg, lanes):  # a turn on the lanes or on the engine core
        graphs.session_graphs = lanes
        before = len(sess.tokens)
        out = sess.send(msg)
        assert (out.stats.get("path") == "batch-graphs") == lanes
        assert len(sess.tokens) == before + len(msg) + NEW
        return out.tokens

    # (CI's time: one session has both hand-overs: the core for turns 1 and 5, the lanes for 2-4)
    outs = [send(s, msgs[0], False)] + [send(s, m, True) for m in msgs[1:3]]  # core -> lanes
    assert not graphs.session_scheduler().pool.used  # (the core turn's slot went back at the hand-over)
    after = s.state()
    s.rewind()
    assert send(s, msgs[2], True) == outs[2]
    assert_same(s.state(), after, "rewound turn")
    f = s.fork()
    s.save(tmp_path / "s.pt")
    loaded = Session.load(graphs, tmp_path / "s.pt")
    outs.append(send(s, msgs[3], True))
    assert send(f, msgs[3], True) == outs[3] and send(loaded, msgs[3], True) == outs[3]
    outs.append(send(s, msgs[4], False))  # lanes -> core
    if ON_CPU:
        assert outs == replies(core_engine(zoo, "qwen3_5").session(draft=2, max_new_tokens=NEW, use_store=False),
                               msgs)


def test_stop_among_accepted_drafts_and_a_state_not_handed_over(zoo, monkeypatch):
    """A turn ending on a stop token leaves it pending (the lane's commit cut the round
    there); a lane whose end state was not exported gets it rebuilt by a prefill of the
    transcript, and the conversation goes on with the same tokens."""
    graphs = graph_engine(zoo, "qwen3_5")
    msgs = messages(graphs.model.cfg.vocab_size, 3, seed=1)
    stop = graphs.session(max_new_tokens=NEW, use_store=False).send(msgs[0]).tokens[2]
    plain = graphs.session(max_new_tokens=NEW, stop_ids=[stop], use_store=False)
    spec = graphs.session(draft=3, max_new_tokens=NEW, stop_ids=[stop], use_store=False)
    first = plain.send(msgs[0]).tokens
    assert first[-1] == stop and spec.send(msgs[0]).tokens == first
    for s in (plain, spec):
        st = s.state()
        assert st.pending == stop and st.pos == len(st.tokens) - 1
    monkeypatch.setattr(BatchRunner, "_keep_state", lambda self, lane, r: None)
    rebuilt = [spec.send(m, max_new_tokens=3).tokens for m in msgs[1:]]  # (CI's time: short turns)
    monkeypatch.undo()
    assert rebuilt == [plain.send(m, max_new_tokens=3).tokens for m in msgs[1:]]
    st = spec.state()
    assert st.pending == st.tokens[-1] and st.pos == len(st.tokens) - 1



def test_continue_turns_sample_as_the_engine_core(zoo):
    """`send([])` (go on with the reply) in a speculative session with seeded rejection
    sampling: the lane prefills the pending token and draws the next from that row, as the
    engine core's resume does, so its rounds start where the core's do and the draws that
    make each token are the core's (going on from the state mid-rounds sampled other tokens
    and ran other rounds: a different, equally distributed sample). On the CPU: the core
    session's tokens and per-turn telemetry."""
    def turns(eng):
        s = eng.session(draft=3, params=SamplingParams(temperature=0.9, seed=4), max_new_tokens=NEW,
                        ignore_eos=True, use_store=False)
        m0, m1 = messages(eng.model.cfg.vocab_size, 2, seed=2)
        outs = [s.send(m) for m in (m0, [], m1)]
        return [(o.tokens, o.stats["spec"]["drafted_at"], o.stats["spec"]["accepted_at"]) for o in outs], \
            [o.stats.get("path") for o in outs]

    got, paths = turns(graph_engine(zoo, "qwen3_5"))
    assert paths == ["batch-graphs"] * 3
    if ON_CPU:
        assert got == turns(core_engine(zoo, "qwen3_5"))[0]


@pytest.mark.parametrize("lanes", [False, True], ids=["core", "lanes"])
def test_a_cancelled_turn_is_kept_as_a_turn_that_ended_there(zoo, lanes):
    """Session.send(cancel=fn): the reply ends after the round where fn() turned True
    (stop_reason "cancelled") and the turn is kept as it stands: its tokens are the ones
    streamed, the target's state and the next turn's tokens equal a session whose turn
    ended there by max_new_tokens (engine core and lanes); cancel must be callable."""
    from hyspec.sampling import ParamError

    eng = graph_engine(zoo, "qwen3_5") if lanes else core_engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 2, seed=9)
    # (ignore_eos: no stop id, so only the session-turn rule keeps the lanes from queueing a round ahead of the
    # cancel, which would leave the lane's state a round past the transcript)
    s = eng.session(draft=2, max_new_tokens=8, use_store=False, ignore_eos=True)
    seen = []
    out = s.send(msgs[0], on_tokens=seen.extend, cancel=lambda: len(seen) >= 2)
    assert out.samples[0].stop_reason == "cancelled" and 2 <= len(out.tokens) < 8 and out.tokens == seen
    assert (out.stats.get("path") == "batch-graphs") == lanes
    ref = eng.session(draft=2, max_new_tokens=8, use_store=False, ignore_eos=True)
    assert ref.send(msgs[0], max_new_tokens=len(out.tokens)).tokens == out.tokens
    assert s.tokens == ref.tokens
    assert_same(target_part(s.state()), target_part(ref.state()), "after the cancelled turn")
    assert s.send(msgs[1], max_new_tokens=4).tokens == ref.send(msgs[1], max_new_tokens=4).tokens
    assert_same(target_part(s.state()), target_part(ref.state()), "the next turn")
    with pytest.raises(ParamError, match="cancel"):
        s.send(msgs[1], cancel=True)
