"""Session turns on the CUDA-graph lanes (here the Triton interpreter, fp32).

On a GPU a session turn runs on the batched decoder's lanes (hyspec.session.Session.
_graph_turn): the lane loads the session's state, prefills [pending] + the message, decodes
and hands its end state back (Request.end_state). Promises: the engine-core session's
tokens (fp32, where the graph path equals the core), speculative == plain (tokens and
target state, greedy and coupled), rewind / fork / save-load, a stop among accepted drafts,
turns alternating with the engine core, a conversation that outgrows the decoder, a lane
that could not hand its state over (rebuilt by a prefill)."""

from __future__ import annotations

import pytest

from conftest import ARCHS
from hyspec.gpu.batch_loop import BatchRunner
from hyspec.sampling import SamplingParams
from hyspec.session import Session
from session_helpers import assert_same, engine, messages, target_part

pytestmark = pytest.mark.usefixtures("triton_interpreter")

NEW = 5  # tokens per reply (the interpreter runs ~1 s per decode step)
COUPLED = SamplingParams(temperature=0.9, seed=7, mode="coupled")
SAMPLED = SamplingParams(temperature=0.8, seed=3)


def graph_engine(zoo, arch):
    eng = engine(zoo, arch, dtype="float32")
    eng.batch_graphs = True
    return eng


def replies(sess, msgs):
    return [sess.send(m).tokens for m in msgs]


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_session_equals_the_core_session_and_grows(zoo, arch):
    """Greedy plain and K=2 turns on the lanes give the core session's tokens; each turn
    says it ran on the graphs; the decoder was rebuilt (doubled) as the transcript grew."""
    core, graphs = engine(zoo, arch, dtype="float32"), graph_engine(zoo, arch)
    msgs = messages(core.model.cfg.vocab_size, 3, seed=2)
    lens = []
    for draft in (0, 2):
        s = graphs.session(draft=draft, max_new_tokens=NEW)
        outs = []
        for m in msgs:
            before = len(s.tokens)
            out = s.send(m)
            assert out.stats["path"] == "batch-graphs"
            assert out.stats["cached_tokens"] == max(before - 1, 0)  # resumed: [pending] + m prefilled
            outs.append(out.tokens)
            lens.append(graphs._batch_dec.max_len)
        assert outs == replies(core.session(draft=draft, max_new_tokens=NEW), msgs), (arch, draft)
        assert len(s.tokens) == sum(map(len, msgs)) + len(msgs) * NEW
    assert lens[-1] >= 2 * lens[0]  # (off CUDA a decoder is sized to its need: the transcript outgrew it)


def test_sampled_and_coupled_graph_sessions(zoo):
    """Seeded sampling equals the core session; coupled speculative == coupled plain, and
    the graph states' target parts are bitwise equal."""
    core, graphs = engine(zoo, "qwen3_5", dtype="float32"), graph_engine(zoo, "qwen3_5")
    msgs = messages(core.model.cfg.vocab_size, 2, seed=5)
    a = replies(graphs.session(params=SAMPLED, max_new_tokens=NEW), msgs)
    assert a == replies(core.session(params=SAMPLED, max_new_tokens=NEW), msgs)
    plain = graphs.session(params=COUPLED, max_new_tokens=NEW, use_store=False)
    spec = graphs.session(draft=3, params=COUPLED, max_new_tokens=NEW, use_store=False)
    for i, m in enumerate(msgs):
        assert plain.send(m).tokens == spec.send(m).tokens, i
        assert_same(target_part(plain.state()), target_part(spec.state()), f"turn {i}")


def test_rewind_fork_save_and_core_turns_on_the_lanes(zoo, tmp_path):
    """rewind() + the same send == the original turn (state bitwise); a fork and a saved
    and loaded copy continue like the original; turns alternating between the engine core
    and the lanes give the all-core tokens."""
    graphs = graph_engine(zoo, "qwen3_5")
    msgs = messages(graphs.model.cfg.vocab_size, 4, seed=3)
    s = graphs.session(draft=2, max_new_tokens=NEW, use_store=False)
    replies(s, msgs[:2])
    third = s.send(msgs[2]).tokens
    after = s.state()
    s.rewind()
    assert s.send(msgs[2]).tokens == third
    assert_same(s.state(), after, "rewound turn")
    f = s.fork()
    s.save(tmp_path / "s.pt")
    loaded = Session.load(graphs, tmp_path / "s.pt")
    last = s.send(msgs[3]).tokens
    assert f.send(msgs[3]).tokens == last and loaded.send(msgs[3]).tokens == last
    # the engine core for turns 1 and 3, the lanes for 2 and 4 == the core throughout
    core = engine(zoo, "qwen3_5", dtype="float32")
    mixed, ref = graph_engine(zoo, "qwen3_5"), core.session(draft=2, max_new_tokens=NEW, use_store=False)
    m = mixed.session(draft=2, max_new_tokens=NEW, use_store=False)
    for i, msg in enumerate(msgs):
        mixed.batch_graphs = bool(i % 2)
        out = m.send(msg)
        assert ("path" in out.stats) == bool(i % 2)
        assert out.tokens == ref.send(msg).tokens, i


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
    rebuilt = [spec.send(m).tokens for m in msgs[1:]]
    monkeypatch.undo()
    assert rebuilt == [plain.send(m).tokens for m in msgs[1:]]
    st = spec.state()
    assert st.pending == st.tokens[-1] and st.pos == len(st.tokens) - 1
