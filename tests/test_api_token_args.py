"""Token-id arguments of the public API: a 2-D tensor / array, a dict or a set is refused with
an error naming the argument (never flattened or read in hash order as a prompt)."""

import numpy as np
import pytest
import torch

from hyspec import Engine
from hyspec.sampling import ParamError


@pytest.fixture(scope="module")
def eng():
    return Engine.load()


IDS = [316, 288, 1465, 8, 78, 301]


def _refused(eng, bad, calls):
    """Each (method, field) of `calls` refuses `bad`, naming its own argument."""
    for call, field in calls:
        with pytest.raises(ParamError) as e:
            call(eng, bad)
        assert e.value.field == field, call


@pytest.mark.parametrize("bad", [torch.tensor(IDS)[:, None], torch.tensor([IDS]), np.array(IDS)[:, None],
                                 torch.tensor(IDS[0])])
def test_prompt_not_1d_refused(eng, bad):
    _refused(eng, bad, [(lambda e, b: e.generate(b, max_new_tokens=1), "prompt"), (Engine.encode, "prompt"),
                        (Engine.decode, "ids")])


@pytest.mark.parametrize("bad", [dict.fromkeys(IDS, 0), set(IDS), frozenset(IDS)])
def test_prompt_dict_or_set_refused(eng, bad):
    _refused(eng, bad, [(lambda e, b: e.generate(b, max_new_tokens=1), "prompt"), (Engine.score, "text"),
                        (Engine.decode, "ids")])


def test_token_ids_kept(eng):
    for good in (np.array(IDS), torch.tensor(IDS), torch.tensor(IDS, dtype=torch.int32), tuple(IDS), iter(IDS)):
        assert eng.encode(good) == IDS
    assert eng.decode(np.array(IDS)) == eng.decode(IDS)


def test_stop_ids_set_still_taken(eng):
    from hyspec.engine import _token_ids

    assert sorted(_token_ids("stop_ids", {5, 3}, ordered=False)) == [3, 5]
    eng.text_stream("x", stop_ids={5, 3})


def test_chat_stop_ids_generator_as_list(eng):
    msgs = [{"role": "user", "content": "hello there"}]
    first = eng.chat(msgs, max_new_tokens=6, ignore_eos=True).tokens
    stop = first[2]
    as_list = eng.chat(msgs, max_new_tokens=6, stop_ids=[stop])
    as_gen = eng.chat(msgs, max_new_tokens=6, stop_ids=iter([stop]))
    assert as_gen.tokens == as_list.tokens
    assert as_gen.message == as_list.message  # (the generator's stop token's text was kept in the content)


def test_a_chat_reply_leaves_its_stop_tokens_text_out(eng):
    """Engine.chat's message is the text before the stop id that ended the reply: the stop
    token's text is not part of the content (as the server answers it)."""
    msgs = [{"role": "user", "content": "hello there"}]
    first = eng.chat(msgs, max_new_tokens=6, ignore_eos=True).tokens
    stop = first[2]
    assert eng.tokenizer.decode([stop]).strip()
    out = eng.chat(msgs, max_new_tokens=6, stop_ids=[stop])
    assert out.tokens == first[:first.index(stop) + 1]
    assert out.message["content"] == eng.tokenizer.decode(out.tokens[:-1], skip_special_tokens=True)


def test_bool_flags_refuse_strings(eng):
    with pytest.raises(ParamError) as e:
        eng.text_stream(ignore_eos="no")
    assert e.value.field == "ignore_eos"
    s = eng.session(max_new_tokens=1)
    with pytest.raises(ParamError) as e:
        s.send("x", stop="z", stop_skips_opening_break="no")
    assert e.value.field == "stop_skips_opening_break"
    assert s.num_turns == 0


def test_prefix_store_numpy_budget_and_tensor_keys(eng):
    from hyspec import PrefixStore

    assert PrefixStore(budget_bytes=np.int64(1000), host_budget_bytes=np.uint32(7)).budget_bytes == 1000
    s = eng.session(max_new_tokens=2)
    s.send(IDS)
    toks = s.tokens
    store = eng.store
    assert toks in store
    for form in (torch.tensor(toks), np.array(toks)):
        assert form in store
        assert store.tier_of(form) == store.tier_of(toks) == "device"
    store.remove(torch.tensor(toks))
    assert toks not in store


def test_misuse_found_by_an_api_walk_is_refused_by_name(eng, tmp_path):
    """Each of these was taken or failed deep inside: a text stream's ids (-1 an OverflowError in
    the tokenizer, 99999 the empty text, a feed after finish() more text), its stop ids past the
    vocabulary, chat's reasoning="no" (taken as True), a constraint's commit of "12" (ids 1, 2)
    or 1.9 (id 1) and rollback(1.5), Session.load with no engine (blamed on the file), a path that
    is not one (pathlib's TypeError), a save under a file (said the folder does not exist), a
    rollback name in a list (unhashable), forced rates outside Engine.generate (asked for a
    reference no caller can give)."""
    from hyspec.session import Session
    from hyspec.speculative.loop import SpecOptions

    ts = eng.text_stream()
    for bad in ([-1], [99999], "abc", [[1, 2]]):
        with pytest.raises(ParamError) as e:
            ts.feed(bad)
        assert e.value.field == "ids"
    assert ts.feed([316, 288]) + ts.finish() == eng.decode([316, 288])
    with pytest.raises(ValueError, match="this text stream is finished"):
        ts.feed([316])
    with pytest.raises(ParamError) as e:
        eng.text_stream(stop=["x"], stop_ids=[99999])
    assert e.value.field == "stop_ids"
    with pytest.raises(ParamError) as e:
        eng.chat([{"role": "user", "content": "def f():"}], reasoning="no", max_new_tokens=2)
    assert e.value.field == "reasoning"
    c = eng.constraint("regex", "[\\s\\S]*")
    for bad in ("12", [1.9, 2.2], [True]):
        with pytest.raises(TypeError, match="integer token ids"):
            c.commit(bad)
    c.commit(np.array([5, 6]))
    assert c.tokens == [5, 6]
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="number of tokens"):
            c.rollback(bad)
    assert c.tokens == [5, 6]
    s = eng.session(max_new_tokens=2)
    s.send(IDS)
    good = tmp_path / "s.pt"
    s.save(good)
    with pytest.raises(ParamError) as e:
        Session.load(None, good)
    assert e.value.field == "engine"
    for call in (lambda: s.save(None), lambda: Session.load(eng, 3), lambda: eng.use_chat_template(5)):
        with pytest.raises(ParamError):
            call()
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        s.save(tmp_path / "f" / "a.pt")
    with pytest.raises(ValueError, match="unknown rollback strategy"):
        SpecOptions(rollback=["rescan"])
    with pytest.raises(ValueError, match="which Engine.generate makes itself"):
        eng.generate_batch([IDS], spec=SpecOptions(forced_rates=(0.5, 0.5, 0.5)), max_new_tokens=2)
    assert Session.load(eng, good).tokens == s.tokens


def test_on_finish_gets_its_own_output(eng):
    """generate_batch's on_finish Output and the returned one are apart: a callback that edits
    the tokens or stats it gets changes nothing the call returns (they shared the lists)."""
    def spoil(i, out):
        out.tokens.clear()
        out.stats.clear()

    want = eng.generate_batch([IDS], max_new_tokens=4)[0]
    got = eng.generate_batch([IDS], max_new_tokens=4, on_finish=spoil)[0]
    assert got.tokens == want.tokens and len(got.tokens) == 4 and got.stats.keys() == want.stats.keys()
