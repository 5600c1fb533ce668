"""Constraints in sessions (hyspec/session.py): every reply under its own matcher, exact.

* Speculative == plain, every turn, greedy and coupled sampling, three tiny families.
* A reply cut by max_new_tokens continues under the same matcher with an empty message,
  and the pieces equal one uncut constrained generation.
* The matcher's state is part of the turn checkpoint: rewind, fork and save/load restore it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from conftest import ARCHS  # noqa: E402
from hyspec.constraints import make_constraint  # noqa: E402
from hyspec.engine import Engine  # noqa: E402
from hyspec.sampling import SamplingParams  # noqa: E402
from hyspec.session import Session  # noqa: E402
from session_helpers import messages  # noqa: E402

SCHEMA = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 12}, "y": {"type": "integer"}},
          "required": ["x", "y"], "additionalProperties": False}
COUPLED = SamplingParams(temperature=0.9, seed=7, mode="coupled")


def _engine(zoo, arch):
    return Engine(zoo.model("tiny", arch, "float64", "coop"), model_dir=str(zoo.path("tiny", arch)))


def _replies_valid(c, replies):
    for r in replies:
        d = c.clone()
        d.commit(r)  # raises on a token the schema does not allow


@pytest.mark.parametrize("arch", ARCHS)
def test_constrained_speculative_session_equals_plain(zoo, arch):
    eng = _engine(zoo, arch)
    c = eng.constraint("json_schema", SCHEMA)
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=2)
    for params in (None, COUPLED):
        outs = {}
        for k in (0, 3):
            s = eng.session(draft=k, params=params, max_new_tokens=24, constraint=c, use_store=False)
            outs[k] = [s.send(m).tokens for m in msgs]
            s.close()
        assert outs[3] == outs[0], (arch, params)
        _replies_valid(c, outs[0])
        free = eng.session(draft=0, params=params, max_new_tokens=24, use_store=False)
        assert [free.send(m).tokens for m in msgs] != outs[0]  # the mask bites


def test_a_cut_reply_continues_under_its_matcher(zoo):
    eng = _engine(zoo, "qwen3_5")
    c = eng.constraint("json_schema", SCHEMA)
    msg = messages(eng.model.cfg.vocab_size, 1, seed=3)[0]
    whole = eng.generate(msg, max_new_tokens=30, draft=3, constraint=c, use_store=False)
    s = eng.session(draft=3, max_new_tokens=5, constraint=c, use_store=False)
    pieces = s.send(msg).tokens
    assert len(pieces) == 5 and not s.matcher.finished
    while len(pieces) < len(whole.tokens):
        pieces += s.send([], max_new_tokens=min(5, len(whole.tokens) - len(pieces))).tokens
    assert pieces == whole.tokens
    assert s.matcher.tokens == pieces  # one matcher consumed the whole reply
    # a new message after a cut reply starts a fresh matcher; constraint=False frees a turn
    t = eng.session(draft=3, max_new_tokens=5, constraint=c, use_store=False)
    t.send(msg)
    t.send([7, 8])
    assert t.matcher.tokens == t.tokens[len(msg) + 5 + 2:]
    t.send([9], constraint=False)
    assert t.matcher is None
    # a turn's own constraint goes on too, in a session without one of its own
    u = eng.session(draft=3, max_new_tokens=5, use_store=False)
    pieces = u.send(msg, constraint=c).tokens
    while len(pieces) < len(whole.tokens):
        pieces += u.send([], max_new_tokens=min(5, len(whole.tokens) - len(pieces))).tokens
    assert pieces == whole.tokens and u.matcher.tokens == pieces


def test_rewind_fork_and_save_restore_the_matcher(zoo, tmp_path):
    eng = _engine(zoo, "qwen3_next")
    c = eng.constraint("json_schema", SCHEMA)
    msg = messages(eng.model.cfg.vocab_size, 1, seed=4)[0]
    s = eng.session(draft=2, max_new_tokens=4, constraint=c, use_store=False)
    s.send(msg)
    before = s.matcher.tokens
    second = s.send([]).tokens  # continues the cut reply
    f = s.fork()
    s.rewind()
    assert s.matcher.tokens == before
    assert s.send([]).tokens == second  # the same continuation from the restored matcher
    s.rewind()
    s.save(tmp_path / "s.pt")
    t = Session.load(eng, tmp_path / "s.pt")
    assert t.matcher.tokens == before and t.constraint is not None
    assert t.send([]).tokens == second
    assert f.matcher.tokens == before + second
    assert f.send([]).tokens == t.send([]).tokens  # the fork and the loaded copy go on alike


def test_the_matcher_a_session_hands_out_is_a_copy(zoo):
    """s.matcher is a copy: changing it (reset, commit) leaves the session's own, so a
    "go on" turn continues the cut reply where it stopped."""
    eng = _engine(zoo, "qwen3_5")
    c = eng.constraint("json_schema", SCHEMA)
    msg = messages(eng.model.cfg.vocab_size, 1, seed=3)[0]
    s, twin = (eng.session(draft=2, max_new_tokens=4, constraint=c, use_store=False) for _ in range(2))
    assert s.send(msg).tokens == twin.send(msg).tokens
    m = s.matcher
    before = list(m.tokens)
    m.reset()
    assert s.matcher.tokens == before
    assert s.send([]).tokens == twin.send([]).tokens


def test_session_constraint_for_another_vocabulary_is_refused(zoo):
    eng = _engine(zoo, "qwen3_5")
    other = make_constraint(zoo.path("tiny", "qwen3_5"), "regex", "[a-z]+", vocab_size=eng.model.cfg.vocab_size + 8)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.session(constraint=other)


def test_a_reply_cut_where_the_grammar_is_complete_goes_on_to_its_eos():
    """Cut by max_new_tokens exactly where the match is complete (the matcher finished: only
    EOS may follow), an empty turn continues that matcher -- its EOS -- instead of starting a
    new match (which gave '6464-01-016010-22')."""
    eng = Engine.load()
    c = eng.constraint("regex", "[0-9]{4}-[0-9]{2}-[0-9]{2}")
    uncut = eng.session(draft=3, max_new_tokens=16, constraint=c, use_store=False).send("date = ")
    assert uncut.samples[0].stop_reason == "eos" and uncut.tokens[-1] in eng.eos_ids
    s = eng.session(draft=3, max_new_tokens=len(uncut.tokens) - 1, constraint=c, use_store=False)
    first = s.send("date = ").tokens
    assert s.matcher.finished and not s.matcher.ended
    assert first + s.send([], max_new_tokens=6).tokens == uncut.tokens


def test_a_dead_end_stays_one_across_save_and_load(tmp_path):
    """A reply that ran into a dead end of its grammar marks the session's matcher failed: a
    "go on" is refused up front. Saved and loaded, the failure was lost (the matcher rebuilt
    from its tokens, finished False): the turn started and failed at its first mask instead,
    with another error."""
    from hyspec.core.scheduler import ConstraintFailure

    eng = Engine.load()
    dead = eng.constraint("grammar", 'start: "def" x\nx: x "a"')
    s = eng.session(draft=2, max_new_tokens=10, constraint=dead, use_store=False)
    with pytest.raises(ConstraintFailure):
        s.send("x = ")
    assert s.matcher.failure is not None
    with pytest.raises(ValueError) as before:
        s.send([])
    s.save(tmp_path / "d.pt")
    t = Session.load(eng, tmp_path / "d.pt")
    assert (t.matcher.failure, t.matcher.finished, t.matcher.tokens) == (s.matcher.failure, s.matcher.finished,
                                                                          s.matcher.tokens)
    with pytest.raises(ValueError) as after:
        t.send([])
    assert str(after.value) == str(before.value)
    s.close()
    t.close()
    # a message goes on after a dead end (only "go on" is refused): here free, the dead end was its turn's own
    u = eng.session(draft=2, max_new_tokens=3, use_store=False)
    with pytest.raises(ConstraintFailure):
        u.send("x = ", constraint=dead)
    assert u.send("\ny = ").tokens and u.matcher is None and u.num_turns == 2
    u.close()


def test_a_reply_cut_at_its_constraints_eos_is_not_restarted():
    """A reply cut by max_new_tokens exactly at the EOS that completes its constraint (under
    ignore_eos) is whole, as the uncut reply that ended there ("constraint"); a "go on" after
    it started the session's constraint afresh and wrote a second answer ("yes" then "no").
    It is refused now, and the session goes on with a message."""
    from hyspec.core.scheduler import ConstraintFailure

    eng = Engine.load()
    c = eng.constraint("choice", ["yes", "no"])
    for draft in (0, 2):
        whole = eng.session(constraint=c, ignore_eos=True, draft=draft, use_store=False).send("answer = ",
                                                                                          max_new_tokens=8)
        assert whole.samples[0].stop_reason == "constraint"
        s = eng.session(constraint=c, ignore_eos=True, draft=draft, use_store=False)
        cut = s.send("answer = ", max_new_tokens=len(whole.tokens))
        assert cut.tokens == whole.tokens
        with pytest.raises(ConstraintFailure, match="the last reply's constraint is complete"):
            s.send([], max_new_tokens=4)
        assert s.num_turns == 1 and s.tokens[-len(cut.tokens):] == cut.tokens
        assert eng.decode(s.send(" again: ", max_new_tokens=8).tokens).removesuffix("<|endoftext|>") in ("yes", "no")
        s.close()
