"""Stop strings in the Python API and the CLI (the server has its own tests): a sample ends
at the token that completes a stop string, its tokens are the run without stop strings up to
that token, its text ends before the stop string; on the engine core and on the CUDA-graph
lanes (Triton interpreter on the CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from hyspec.engine import Engine
from hyspec.sampling import SamplingParams


def expected(eng, tokens, stops):
    """(tokens, text) of an uncut run cut at its first stop string: the first prefix whose
    text (special tokens left out, as the server shows it) holds one ends the tokens; the
    text ends before the earliest match (an oracle independent of the matcher: every prefix
    decoded whole)."""
    for j in range(1, len(tokens) + 1):
        text = eng.tokenizer.decode(tokens[:j], skip_special_tokens=True)
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return tokens[:j], text[:min(found)]
    return tokens, None


def a_stop_inside(eng, tokens, at=0.5):
    """A 3-character stop string from the middle of the run's text (across tokens when it can)."""
    text = eng.tokenizer.decode(tokens, skip_special_tokens=True)
    i = int(len(text) * at)
    return text[i:i + 3]


@pytest.fixture(scope="module")
def eng():
    return Engine.load(dtype="float64")


@pytest.mark.parametrize("draft,params", [(0, None), (3, None), (3, SamplingParams(temperature=0.9, seed=4)),
                                          (2, SamplingParams(temperature=0.8, seed=2, mode="coupled"))])
def test_a_stop_string_cuts_the_run_where_it_completes(eng, draft, params):
    prompt = "def read_file(path):\n"
    full = eng.generate(prompt, max_new_tokens=40, draft=draft, params=params, ignore_eos=True)
    stop = a_stop_inside(eng, full.tokens)
    want_tokens, want_text = expected(eng, full.tokens, [stop, "never here"])
    assert want_text is not None and len(want_tokens) < len(full.tokens)
    seen = []
    out = eng.generate(prompt, max_new_tokens=40, draft=draft, params=params, ignore_eos=True, logprobs=2,
                       stop=[stop, "never here"], on_tokens=lambda i, t: seen.extend(t))
    s = out.samples[0]
    assert (s.tokens, s.text, s.stop_reason) == (want_tokens, want_text, "stop")
    assert seen == want_tokens and len(out.logprobs[0]) == len(want_tokens)
    # a stop string that never comes changes nothing
    same = eng.generate(prompt, max_new_tokens=40, draft=draft, params=params, ignore_eos=True, stop="never here")
    assert (same.tokens, same.text, same.samples[0].stop_reason) == (full.tokens, full.text, "length")


def test_the_eos_text_never_completes_a_stop_string(eng):
    """EOS ends a sample as "eos" even when a stop string matches its text (as on the
    server: stop ids are not part of the text searched)."""
    params = SamplingParams(temperature=1.0, seed=2)
    full = eng.generate("\n\n\n", max_new_tokens=60, params=params)
    assert full.samples[0].stop_reason == "eos" and full.text.endswith("<|endoftext|>")
    for stop in ("<", "endoftext", "<|endoftext|>"):
        out = eng.generate("\n\n\n", max_new_tokens=60, params=params, stop=stop)
        assert (out.tokens, out.text, out.samples[0].stop_reason) == (full.tokens, full.text, "eos"), stop
    with pytest.raises(ValueError, match="stop"):
        eng.generate("x", stop={"a": 1})
    with pytest.raises(ValueError, match="stop='a\\\\udc80'.*lone surrogate"):  # (never in decoded text)
        eng.generate("x", stop=["b", "a\udc80"])


def test_the_first_bytes_of_a_character_never_complete_a_stop_string(eng):
    """A character of several byte tokens decodes as U+FFFD until its last byte: a stop
    string "\ufffd" matched there (it cut '中文' to nothing, stop_reason "stop")."""
    c = eng.constraint("regex", "中文")
    full = eng.generate("s = ", max_new_tokens=10, constraint=c)
    cut = eng.generate("s = ", max_new_tokens=10, constraint=c, stop="\ufffd")
    assert "中文" in full.text and (cut.tokens, cut.text) == (full.tokens, full.text)


def test_samples_batches_and_chat(eng):
    params = SamplingParams(temperature=1.0, seed=9)
    full = eng.generate("import os\n", max_new_tokens=30, draft=3, params=params, num_samples=2, ignore_eos=True)
    stops = [a_stop_inside(eng, full.samples[1].tokens, 0.3)]
    cut = eng.generate("import os\n", max_new_tokens=30, draft=3, params=params, num_samples=2, ignore_eos=True,
                       stop=stops)
    for f, c in zip(full.samples, cut.samples):
        assert (c.tokens, c.text) == (expected(eng, f.tokens, stops)[0], expected(eng, f.tokens, stops)[1] or f.text)
    # generate_batch: one stop list for all, or one entry per prompt
    prompts = ["def f(x):\n", "class A:\n"]
    alone = [eng.generate(p, max_new_tokens=24, draft=3, ignore_eos=True) for p in prompts]
    per = [a_stop_inside(eng, alone[0].tokens), None]
    outs = eng.generate_batch(prompts, max_new_tokens=24, draft=3, ignore_eos=True, stop=per, max_batch=2)
    assert outs[0].tokens == expected(eng, alone[0].tokens, [per[0]])[0] and outs[0].samples[0].stop_reason == "stop"
    assert outs[1].tokens == alone[1].tokens
    with pytest.raises(ValueError, match="stop has 1 entries for 2 prompts"):
        eng.generate_batch(prompts, stop=[None])
    with pytest.raises(ValueError, match="stop"):
        eng.generate("x", stop=[3])
    # Engine.chat: the message ends before the stop string too
    msgs = [{"role": "user", "content": "def g(y):\n"}]
    whole = eng.chat(msgs, max_new_tokens=24, ignore_eos=True)
    stop = whole.message["content"][5:8]
    out = eng.chat(msgs, max_new_tokens=24, ignore_eos=True, stop=stop)
    assert out.message["content"] == whole.message["content"][:whole.message["content"].find(stop)]



def test_a_chat_reply_ends_before_the_earliest_of_its_stop_strings(eng):
    """Engine.chat's message with several stop strings ends before the one found first in
    the text (not the last), a stop string at the reply's very start leaves it empty, and
    an empty stop string in the list is dropped (it matched at 0 and emptied every reply)."""
    msgs = [{"role": "user", "content": "def g(y):\n"}]
    full = eng.chat(msgs, max_new_tokens=24, ignore_eos=True)
    whole, tokens = full.message["content"], full.tokens
    early, late = whole[3:6], whole[12:15]
    assert whole.find(early) < whole.find(late)
    turn = eng.prepare_chat(msgs)
    assert turn.message(tokens, stop_strings=[late, early])["content"] == whole[:whole.find(early)]
    assert turn.message(tokens, stop_strings=[late, whole[:3]])["content"] == ""
    out = eng.chat(msgs, max_new_tokens=24, ignore_eos=True, stop=["", early])
    assert out.stop_reason == "stop" and out.message["content"] == whole[:whole.find(early)]


@pytest.mark.parametrize("draft,params", [(0, None), (3, None), (3, SamplingParams(temperature=0.9, seed=4))])
def test_a_session_turn_ends_at_a_stop_string(eng, draft, params):
    """Session.send(stop=...): the turn ends with the token that completes the stop string,
    with the one-shot's tokens and text; the transcript ends there (tokens past it would be
    in it), and the next turn is the one-shot run on it. (The state itself at a stop among
    accepted drafts: tests/test_sessions.py::test_a_stop_string_among_accepted_drafts_ends_the_round_there.)"""
    s = eng.session(draft=draft, params=params, max_new_tokens=40, ignore_eos=True, use_store=False)
    prompt = "def read_file(path):\n"
    full = s.send(prompt)
    s.rewind()
    stop = a_stop_inside(eng, full.tokens)
    seen = []
    cut = s.send(prompt, stop=[stop, "never here"], on_tokens=seen.extend)
    one = eng.generate(prompt, max_new_tokens=40, draft=draft, params=params, ignore_eos=True, stop=stop)
    want_tokens, want_text = expected(eng, full.tokens, [stop])
    assert (cut.tokens, cut.text, cut.samples[0].stop_reason) == (want_tokens, want_text, "stop")
    assert (one.tokens, one.text) == (want_tokens, want_text) and seen == want_tokens
    assert s.tokens == eng.encode(prompt) + want_tokens
    nxt = s.send("\n# next\n", max_new_tokens=12)
    ref = eng.generate(s.tokens[:-len(nxt.tokens)], max_new_tokens=12, draft=draft, params=params, ignore_eos=True)
    assert nxt.tokens == ref.tokens


def test_a_stop_string_across_a_cut_reply_and_its_continuation(eng, tmp_path):
    """A reply cut by max_new_tokens inside a stop string, then continued (send([])): the
    continuation's matcher starts from the reply so far, so it ends where the uncut turn
    ends (it ran on: each turn matched only its own text); also after save / load and in a
    fork, and a stop string wholly inside the earlier part does not end the continuation."""
    from hyspec.session import Session

    prompt = "def read_file(path):\n"
    full = eng.generate(prompt, max_new_tokens=40, draft=3, ignore_eos=True)
    # a stop string whose match begins in the first k tokens' text and ends after them
    for k in range(2, 30):
        head = eng.tokenizer.decode(full.tokens[:k], skip_special_tokens=True)
        stop = eng.tokenizer.decode(full.tokens, skip_special_tokens=True)[len(head) - 2: len(head) + 2]
        want_tokens, want_text = expected(eng, full.tokens, [stop])
        if len(stop) == 4 and len(want_tokens) > k and want_text == head[:-2]:
            break
    else:
        pytest.fail("no stop string straddles a cut in this run")
    s = eng.session(draft=3, max_new_tokens=40, ignore_eos=True, use_store=False)
    a = s.send(prompt, max_new_tokens=k, stop=stop)
    assert a.tokens == full.tokens[:k] and a.samples[0].stop_reason == "length"
    s.save(tmp_path / "cut.pt")
    forked = s.fork()  # (a fork carries the reply so far too)
    for sess in (s, Session.load(eng, tmp_path / "cut.pt"), forked):
        b = sess.send([], stop=stop)
        assert a.tokens + b.tokens == want_tokens and b.samples[0].stop_reason == "stop" and b.text == ""
        sess.rewind()  # the continuation undone: the reply so far is the first part again (a rewind point's)
        again = sess.send([], stop=stop)
        assert (again.tokens, again.text, again.samples[0].stop_reason) == (b.tokens, "", "stop")
    s.save(tmp_path / "on.pt")  # saved after the continuation: its rewind point keeps the reply before it
    back = Session.load(eng, tmp_path / "on.pt")
    back.rewind()
    assert back.send([], stop=stop).tokens == b.tokens
    # a stop string found only in the earlier part: the continuation runs on to its limit
    s.rewind()
    early = eng.tokenizer.decode(full.tokens[:k], skip_special_tokens=True)[:3]
    c = s.send([], stop=early, max_new_tokens=5)
    assert c.samples[0].stop_reason == "length" and a.tokens + c.tokens == full.tokens[:k + 5]


def test_a_continuation_matches_stop_strings_from_its_own_reply_only(eng):
    """The reply a "go on" continues is the last message's reply: a stop string that begins
    in the reply to an earlier message does not end it (the reply so far ran on across
    messages: that earlier reply's text was matched too)."""
    s = eng.session(draft=0, max_new_tokens=6, ignore_eos=True, use_store=False)
    r1 = s.send("def read_file(path):\n").tokens
    r2 = s.send("\n# next", max_new_tokens=1).tokens
    free = s.fork().send([], max_new_tokens=8)  # the continuation without a stop string
    text = lambda t: eng.tokenizer.decode(t, skip_special_tokens=True)
    stop = text(r1)[-1:] + text(r2) + text(free.tokens)[:1]
    assert len(stop) >= 3 and stop not in text(r2 + free.tokens)
    out = s.send([], max_new_tokens=8, stop=stop)
    assert out.tokens == free.tokens and out.samples[0].stop_reason == "length"


def test_a_new_messages_reply_is_matched_on_its_own(eng):
    """A turn with a message starts a new reply: a stop string that begins in the reply
    before does not end it (only a "go on" continues the reply before)."""
    text = lambda t: eng.tokenizer.decode(t, skip_special_tokens=True)
    s = eng.session(draft=0, max_new_tokens=6, ignore_eos=True, use_store=False)
    r1 = s.send("def read_file(path):\n").tokens
    free = s.fork().send("\n# next", max_new_tokens=8)
    stop = text(r1)[-2:] + text(free.tokens)[:1]
    assert len(stop) == 3 and stop not in text(free.tokens)
    out = s.send("\n# next", max_new_tokens=8, stop=stop)
    assert out.tokens == free.tokens and out.samples[0].stop_reason == "length"


def test_the_cli_stop_flag_and_prompts_file_lines(eng, tmp_path):
    from cli_helpers import cli_each

    full = eng.generate("def add(a, b):", max_new_tokens=30, draft=3)
    stop = a_stop_inside(eng, full.tokens)
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"prompt": "def add(a, b):", "max_new_tokens": 30, "draft": 3, "stop": stop}) + "\n"
                 + json.dumps({"prompt": "def add(a, b):", "max_new_tokens": 30, "draft": 3}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "stop": 5}) + "\n")
    (c1, o1), (c2, o2), (c3, _) = cli_each([
        ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "30", "--draft", "3", "--stop", stop, "--json"],
        ["generate", "--prompts-file", str(f)], ["generate", "--prompts-file", str(bad)]])
    assert c1 == 0 and c2 == 0 and c3 == 2
    one = json.loads(o1)
    want_tokens, want_text = expected(eng, full.tokens, [stop])
    assert (one["tokens"], one["text"], one["stop_reason"]) == (want_tokens, want_text, "stop")
    rows = [json.loads(x) for x in o2.strip().splitlines()]
    assert rows[0]["tokens"] == want_tokens and rows[0]["stop_reason"] == "stop" and rows[1]["tokens"] == full.tokens


@pytest.mark.usefixtures("triton_interpreter")
def test_a_stop_string_on_the_graph_lanes(tmp_path):
    """The lanes stop at the same token as the engine core (inside a round, as at a stop id),
    one-shot and in a session turn; a kept turn stopped among accepted drafts (forced
    acceptance) has its end state rebuilt at the stop (it fails when the lane emits past it)."""
    pytest.importorskip("triton")
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "tiny", seed=3, layers=4, hidden=32, vocab_size=320, std=0.2)
    core = Engine.load(d)
    full = core.generate([5, 17, 99, 3], max_new_tokens=10, draft=2, ignore_eos=True)
    stop = a_stop_inside(core, full.tokens, 0.2)  # (CI's time: it completes at the fifth token of ten)
    want = core.generate([5, 17, 99, 3], max_new_tokens=10, draft=2, ignore_eos=True, stop=stop)
    assert want.samples[0].stop_reason == "stop" and len(want.tokens) < len(full.tokens)
    lanes = Engine.load(d)
    lanes.batch_graphs = True
    got = lanes.generate([5, 17, 99, 3], max_new_tokens=10, draft=2, ignore_eos=True, stop=stop)
    s = got.samples[0]
    assert s.stats["path"] == "batch-graphs"
    assert (s.tokens, s.text, s.stop_reason) == (want.tokens, want.text, "stop")
    # it stopped early: the lane ran the core's rounds up to the stop (its tokens are the core's, fp32), fewer
    # than the uncut run's (a lane that decoded on and cut its output afterwards ran those)
    forwards = [r.samples[0].stats["target_forwards"] for r in (want, full)]
    assert s.stats["target_forwards"] == forwards[0] < forwards[1]
    # a session turn on the lanes: the same tokens, and its kept state (rebuilt when the device
    # committed past the stop) continues as the engine core's session does
    turns = []
    for e in (core, lanes):
        sess = e.session(draft=2, max_new_tokens=10, ignore_eos=True, use_store=False)
        a = sess.send([5, 17, 99, 3], stop=stop)
        b = sess.send([7, 8], max_new_tokens=3)
        turns.append((a.tokens, a.samples[0].stop_reason, b.tokens, a.stats.get("path")))
    assert turns[0][:3] == turns[1][:3] == (want.tokens, "stop", turns[0][2]) and turns[1][3] == "batch-graphs"
    # a kept turn whose stop string completes among accepted drafts (forced acceptance): the lane
    # stops there, its device state is past the transcript, and the end state is rebuilt: the
    # plain engine-core session's state at the same stop
    import hyspec.gpu.batch_loop as batch_loop
    from hyspec.core.request import Request
    from hyspec.engine import StopStrings
    from hyspec.speculative.loop import SpecOptions
    from session_helpers import target_part

    prompt, stops = [5, 17, 99, 3], lanes._stops(None, True)
    ref = core.generate(prompt, max_new_tokens=14, ignore_eos=True).tokens
    # a stop string that first completes at token i, a draft of a forced K=3 round (token 0:
    # the prefill's; then rounds of three drafts and a bonus)
    def completes_at(i):
        before, now = (core.tokenizer.decode(ref[:j], skip_special_tokens=True) for j in (i, i + 1))
        cand = now[max(0, len(before) - 1):]
        return cand if len(cand) > 1 and len(expected(core, ref, [cand])[0]) == i + 1 else None

    stop = next(c for i in (5, 6, 7, 3, 2, 1) for c in [completes_at(i)] if c)
    plain = core.session(max_new_tokens=10, ignore_eos=True, use_store=False)
    a = plain.send(prompt, stop=stop)
    assert len(a.tokens) < 10
    req = Request(prompt_ids=prompt, max_new_tokens=10, draft=3, spec=SpecOptions(k=3, forced_rates=(1.0,)),
                  reference=ref, stop_ids=stops, stop_text=StopStrings(lanes, [stop], stops), keep=True)
    rebuilt = []
    real = batch_loop.state_of
    try:
        batch_loop.state_of = lambda *x, **kw: rebuilt.append(1) or real(*x, **kw)
        batch_loop.run_requests(lanes._graph_batch([req], 1), [req], 1)
    finally:
        batch_loop.state_of = real
    assert (req.tokens, req.stop_reason) == (a.tokens, "stop") and rebuilt == [1], (req.tokens, a.tokens, rebuilt)
    assert req.stats["spec"]["accepted"] > 0
    # (rebuilt by a prefill of the transcript: the decoded state's values up to rounding)
    got, want_st = target_part(req.end_state), target_part(plain.state())
    assert (got.tokens, got.pos, got.pending) == (want_st.tokens, want_st.pos, want_st.pending)
    for name, t in want_st.tensors().items():
        assert torch.allclose(got.tensors()[name], t, rtol=1e-4, atol=1e-5), name


def test_a_character_cut_in_its_bytes_completes_in_the_continuation(eng):
    """A reply cut inside a character's bytes (an emoji of four byte-tokens, cut after two),
    then continued (send([])): a stop string ending on that character was skipped as "wholly
    in the earlier part" (the run went on to EOS while one uncut run stops there), and the
    continuation's text began with U+FFFD U+FFFD for the character's last bytes (or, cut by
    a later stop string, lost it). The character is now the continuation's, as in the whole
    reply's text."""
    c = eng.constraint("regex", "ab😀cd中文ef é gh")
    whole = eng.generate("s = '", max_new_tokens=40, constraint=c, draft=0)
    assert eng.decode(whole.tokens).startswith("ab😀cd中文ef é gh")
    for stop, want_text, want_reason in ((["😀"], "", "stop"), (["b😀"], "", "stop"), (None, None, None),
                                         (["ef"], "😀cd中文", "stop")):
        for draft in (0, 3):
            s = eng.session(draft=draft, max_new_tokens=3, use_store=False)
            first = s.send("s = '", constraint=c)
            assert first.tokens == whole.tokens[:3] and first.text.endswith("\ufffd")  # cut in 😀's bytes
            go_on = s.send([], max_new_tokens=30, stop=stop)
            one_shot = eng.generate("s = '", max_new_tokens=33, constraint=c, stop=stop, draft=draft)
            assert first.tokens + go_on.tokens == one_shot.tokens, (stop, draft)
            if stop is None:
                assert go_on.text == eng.decode(whole.tokens)[2:len(eng.decode(one_shot.tokens))], draft
                assert "\ufffd" not in go_on.text
            else:
                assert (go_on.text, go_on.samples[0].stop_reason) == (want_text, want_reason), (stop, draft)
            s.close()


def test_a_real_replacement_character_that_ends_a_turn_is_not_repeated(eng):
    """A reply may end in a real U+FFFD (its bytes EF BF BD), not a cut character: the
    continuation's text then repeated it (the cut-character rule took it for the start of
    one), also with a stop string."""
    c = eng.constraint("regex", "ab\ufffdcd ef")
    whole = eng.generate("s = '", max_new_tokens=30, constraint=c).tokens
    k = next(k for k in range(1, len(whole)) if eng.decode(whole[:k]) == "ab\ufffd")  # its last byte's token
    for stop, want in ((None, "cd ef"), (["ef"], "cd ")):
        s = eng.session(draft=0, max_new_tokens=k, use_store=False)
        first = s.send("s = '", constraint=c)
        assert first.text == "ab\ufffd"
        go_on = s.send([], max_new_tokens=30, stop=stop)
        assert go_on.text.startswith(want), (stop, go_on.text)
        s.close()


@pytest.mark.parametrize("draft", [0, 3])
@pytest.mark.parametrize("stop", [None, ["中文"], ["zzz"]])
def test_a_text_stream_gives_output_text_without_replacement_characters(eng, draft, stop):
    """The README's streaming recipe decoded each round's ids alone: every character split
    over tokens or rounds printed as U+FFFD. Engine.text_stream gives final text only, and
    its pieces joined are Output.text (with stop strings: cut before the first)."""
    c = eng.constraint("regex", "ab😀cd中文ef é gh")
    stream, pieces = eng.text_stream(stop=stop), []
    out = eng.generate("s = '", max_new_tokens=30, constraint=c, draft=draft, stop=stop,
                       on_tokens=lambda i, ids: pieces.append(stream.feed(ids)))
    pieces.append(stream.finish())
    assert "".join(pieces) == out.text and not any("\ufffd" in p for p in pieces), pieces
    # (["zzz"]: no stop string met, the run ends on EOS: Output.text keeps its text, so does the stream)
    assert out.text.startswith("ab😀cd") and ("中" in out.text) == (stop != ["中文"])


def test_a_text_stream_takes_the_requests_stop_ids():
    """A stop id whose token would also complete a stop string ends the output with its text
    (the stop id is checked first, as in the round driver); the stream, which knew only the
    stop strings, cut it there instead: its pieces were not Output.text."""
    from hyspec import Engine, SamplingParams

    eng = Engine.load()
    sp = SamplingParams(temperature=0, repetition_penalty=1.2)
    full = eng.generate("def read_file(path):", max_new_tokens=30, params=sp)
    sid = next(t for t in full.tokens[1:] if "file" in eng.decode([t]))
    for ignore_eos in (False, True):
        stream, pieces = eng.text_stream(stop=["file"], stop_ids=[sid], ignore_eos=ignore_eos), []
        out = eng.generate("def read_file(path):", max_new_tokens=30, params=sp, stop=["file"], stop_ids=[sid],
                           ignore_eos=ignore_eos, on_tokens=lambda i, ids: pieces.append(stream.feed(ids)))
        pieces.append(stream.finish())
        assert out.samples[0].stop_reason == "eos" and out.text.endswith("file")
        assert "".join(pieces) == out.text, (pieces, out.text)
