"""`hyspec serve` end to end: a real uvicorn server on 127.0.0.1 (free port), driven with the
official `openai` client and httpx, outputs checked against the offline Engine."""

from __future__ import annotations

import codecs
import concurrent.futures as cf
import json
import logging
import re
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hyspec.engine import Engine  # noqa: E402
from hyspec.sampling import SamplingParams  # noqa: E402
from hyspec.server.app import ServerConfig, create_app  # noqa: E402
from hyspec.server.thread import ServerThread  # noqa: E402

from conftest import SERVER_MODEL as MODEL  # noqa: E402  (server, client, ref_engine: conftest.py fixtures)
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def __init__(self):"]


def reference(eng, prompt, max_tokens, *, temperature=0.0, seed=0, n=1, draft=3, top_p=1.0, ignore_eos=False):
    params = SamplingParams(temperature=temperature, seed=seed, top_p=top_p)
    out = eng.generate(prompt, max_new_tokens=max_tokens, params=params, draft=draft, num_samples=n,
                       ignore_eos=ignore_eos)
    return [s.tokens for s in out.samples]


def text_of(eng, tokens):
    if tokens and tokens[-1] in eng.eos_ids:
        tokens = tokens[:-1]
    return eng.tokenizer.decode(tokens, skip_special_tokens=True)


def metric(server, name, labels=""):
    body = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


# ---- basics ------------------------------------------------------------------------------


def test_health_models_tokenize(server, client, ref_engine):
    assert httpx.get(server.url + "/health").status_code == 200
    head = httpx.head(server.url + "/health")  # (a 405 before: load balancers probe with HEAD)
    assert head.status_code == 200 and head.content == b""
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    ids = ref_engine.encode(PROMPTS[0])
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert r["tokens"] == ids and r["count"] == len(ids)
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPTS[0]
    msgs = [{"role": "user", "content": "def f(x):\n"}, {"role": "assistant", "content": "    return x"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    assert ref_engine.tokenizer.decode(r["tokens"]) == "def f(x):\n    return x"  # the documented plain fallback


def test_completions_equal_engine_greedy(client, ref_engine):
    for prompt, draft in ((PROMPTS[0], 3), (PROMPTS[1], 0)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"draft": draft, "return_token_ids": True})
        want = reference(ref_engine, prompt, 12, draft=draft)[0]
        c = r.choices[0]
        assert c.token_ids == want
        assert c.text == text_of(ref_engine, want)
        assert c.finish_reason == ("stop" if want[-1] in ref_engine.eos_ids else "length")
        assert r.usage.prompt_tokens == len(ref_engine.encode(prompt))
        assert r.usage.completion_tokens == len(want)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    # a batch of prompts, as strings and as token ids
    ids = [ref_engine.encode(p) for p in PROMPTS[:2]]
    r1 = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in r1.choices] == [c.text for c in r2.choices]
    assert [c.index for c in r1.choices] == [0, 1]
    assert r1.choices[1].text == text_of(ref_engine, reference(ref_engine, PROMPTS[1], 6)[0])


def test_logit_bias_is_the_engines(client, ref_engine):
    """OpenAI's logit_bias ({"token id": bias}; was refused with a 400): greedy and seeded
    samples equal the engine's with SamplingParams.logit_bias, on both endpoints; a -100
    bias keeps greedy's first token out of the whole reply."""
    prompt = PROMPTS[0]
    first = reference(ref_engine, prompt, 1)[0][0]
    bias = {str(first): -100, "13": 2.5}
    for temperature, n in ((0.0, 1), (0.9, 2)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=temperature, seed=7,
                                      n=n, logit_bias=bias, extra_body={"return_token_ids": True, "draft": 3})
        want = ref_engine.generate(prompt, max_new_tokens=12, draft=3, num_samples=n,
                                   params=SamplingParams(temperature=temperature, seed=7,
                                                         logit_bias={first: -100, 13: 2.5}))
        assert [c.token_ids for c in r.choices] == [s.tokens for s in want.samples]
        assert all(first not in c.token_ids for c in r.choices)
    msgs = [{"role": "user", "content": "Say hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"return_token_ids": True})
    avoid = plain.choices[0].token_ids[0]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                       logit_bias={str(avoid): -100}, extra_body={"return_token_ids": True})
    assert avoid not in r.choices[0].token_ids


def test_seeded_n_samples_reproducible(client, ref_engine):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, n=3,
              extra_body={"return_token_ids": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    want = reference(ref_engine, PROMPTS[2], 10, temperature=0.9, top_p=0.95, seed=1234, n=3)
    assert [c.token_ids for c in a.choices] == want
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({tuple(t) for t in want}) > 1  # the samples differ from one another
    assert a.usage.completion_tokens == sum(len(t) for t in want)


def test_chat_and_streaming(server, client, ref_engine):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    want = reference(ref_engine, ids, 14, ignore_eos=True)[0]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=14, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == ref_engine.tokenizer.decode(want, skip_special_tokens=True)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 14
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=14, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])
    # completions streaming, n = 2 seeded: each index reassembles to the non-streamed text
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0.8, seed=7, n=2)
    ns = client.completions.create(**kw)
    parts = {0: "", 1: ""}
    for ch in client.completions.create(**kw, stream=True):
        for c in ch.choices:
            parts[c.index] += c.text
    assert parts == {c.index: c.text for c in ns.choices}


def test_stop_strings(client, ref_engine):
    toks = reference(ref_engine, PROMPTS[0], 24, ignore_eos=True)[0]
    pieces = [ref_engine.tokenizer.decode([t]) for t in toks]
    full = "".join(pieces)
    # a stop string straddling the boundary between generated tokens 3 and 4
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
    at = sum(len(p) for p in pieces[:k]) + 1
    stop = full[at: at + len(pieces[k])]
    cut = full.find(stop)
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
              stop=["@@never@@", stop], extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(**kw, stream=True) if ch.choices)
    assert streamed == full[:cut]
    assert stop not in streamed
    # vLLM's include_stop_str_in_output: the text ends after the stop string (it was ignored)
    kw["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    assert client.completions.create(**kw).choices[0].text == full[:cut + len(stop)]
    # a stop token id ends the text before its own text, or (include_stop_str_in_output, as vLLM's) after it (it
    # was left out either way)
    j = next(i for i in range(2, len(toks)) if pieces[i].strip() and toks[i] not in toks[:i])
    for include, want in ((False, "".join(pieces[:j])), (True, "".join(pieces[:j + 1]))):
        body = {"ignore_eos": True, "stop_token_ids": [toks[j]], "include_stop_str_in_output": include}
        kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, extra_body=body)
        r = client.completions.create(**kw)
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (want, "stop", j + 1)
        assert "".join(ch.choices[0].text for ch in client.completions.create(**kw, stream=True) if ch.choices) == want


def test_logprobs(client, ref_engine):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    c = r.choices[0]
    ids = ref_engine.encode(PROMPTS[1])
    sc = ref_engine.score(ids + c.token_ids, top_logprobs=3)
    want = sc["logprobs"][len(ids) - 1:]
    assert c.logprobs.token_logprobs == pytest.approx(want, abs=1e-5)
    assert len(c.logprobs.tokens) == 6 and all(len(t) == 3 for t in c.logprobs.top_logprobs)
    for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert max(top.values()) == pytest.approx(lp, abs=1e-6)  # greedy picks the top token
    assert "".join(c.logprobs.tokens) == c.text
    # as OpenAI's completions: the chosen token is always in top_logprobs (logprobs=0 gave {})
    for n in (0, 1):
        s = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.5, seed=3,
                                      logprobs=n, extra_body={"ignore_eos": True}).choices[0].logprobs
        for tok, lp, top in zip(s.tokens, s.token_logprobs, s.top_logprobs):
            assert top[tok] == lp and n <= len(top) <= n + 1
        if n:
            assert any(len(top) == 2 for top in s.top_logprobs)  # (a sampled token outside the top 1)
    ch = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = "}], max_tokens=4,
                                        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = ch.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    assert "".join(e.token for e in content) == ch.choices[0].message.content
    # echo: the prompt comes back first, its first token without a logprob
    e = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True, logprobs=1)
    assert e.choices[0].text.startswith(PROMPTS[0])
    assert e.choices[0].logprobs.token_logprobs[0] is None
    assert len(e.choices[0].logprobs.tokens) == len(ref_engine.encode(PROMPTS[0])) + 3
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == e.choices[0].text
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(e.choices[0].logprobs.token_logprobs)
    assert streamed[1:] == pytest.approx(e.choices[0].logprobs.token_logprobs[1:], abs=1e-6)


def test_text_offsets_count_characters_and_agree_when_streamed(client, ref_engine):
    """Completions' text_offset: each token's offset is the number of complete characters
    of the returned text before it (a character split over byte tokens counts once), the
    first generated token sits at len(prompt) under echo, and a stream gives the same
    offsets as the whole response. (They once summed each token's lone decode, in which a
    byte of a split character is one U+FFFD: offsets past the text, and the stream's
    restarted at len(prompt).)"""
    prompt = "# é😀 世界\nx = "
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=1,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**kw).choices[0]
    ids = ref_engine.encode(prompt) + whole.token_ids
    tok = ref_engine.tokenizer
    # the characters before token i: its prefix's bytes decoded at once, an incomplete last
    # character held back, invalid bytes one U+FFFD each (as the returned text shows them)
    before = [codecs.getincrementaldecoder("utf-8")("replace").decode(b"".join(tok.token_bytes(t) for t in ids[:i]))
              for i in range(len(ids))]
    assert all(whole.text.startswith(b) for b in before)
    want = [len(b) for b in before]
    assert whole.logprobs.text_offset == want
    assert want[len(ref_engine.encode(prompt))] == len(prompt) and max(want) <= len(whole.text)
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [o for ch in chunks if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert streamed == want
    # a special token in the prompt is echoed as sent (it was left out of the echo, and of its offsets)
    special = tok.decode([0])
    assert tok.is_special(0) and special.startswith("<|")
    e = client.completions.create(**{**kw, "prompt": f"a{special}b", "max_tokens": 2}).choices[0]
    assert e.text.startswith(f"a{special}b")
    assert e.logprobs.tokens[:3] == ["a", special, "b"] and e.logprobs.text_offset[:4] == [0, 1, 1 + len(special),
                                                                                          2 + len(special)]
    # ... also after an unfinished character (its U+FFFD is in the text before the special token)
    lone = next(t for t in range(tok.vocab_size) if tok.token_bytes(t) == b"\xc3")
    ids = [ref_engine.encode("a")[0], lone, 0, ref_engine.encode("a")[0]]
    e = client.completions.create(**{**kw, "prompt": ids, "max_tokens": 1}).choices[0]
    assert e.text.startswith(f"a\ufffd{special}a")
    assert e.logprobs.text_offset[:4] == [0, 1, 2, 2 + len(special)]


BAD = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 5e-324}, "temperature"),  # accepted once, then overflowed into a 500
    ({"temperature": 2.5}, "temperature"),  # (OpenAI's range is [0, 2]: accepted, up to 1e308, before)
    ({"repetition_penalty": 1e-38}, "repetition_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"prompt": [[1, 2, 99999]]}, "prompt"),
    ({"prompt": [5] * 5000}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"temperature": "hot"}, "temperature"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ({"stop": 7}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"draft": 99}, "draft"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"logprobs": 99}, "logprobs"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999": -100}}, "logit_bias"),  # past the vocabulary
    ({"logit_bias": {"5": "hot"}}, "logit_bias"),
]


def _check_error(resp, status, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in resp.text
    if code:
        assert err["code"] == code
    return err


def test_errors(server, client):
    url = server.url + "/v1/completions"
    for patch, param in BAD:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, **patch}
        err = _check_error(httpx.post(url, json=body), 400)
        assert err["param"] == param, (patch, err)
    ok = httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 1, "response_format": {"type": "text"}})
    assert ok.status_code == 200
    _check_error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
    # a lone surrogate (a JSON \\ud800 escape; a stop string holding one could never match) is not valid JSON
    # text (RFC 8259: I-JSON): the parser's reason is named
    body = b'{"model": "%s", "prompt": "x", "max_tokens": 2, "stop": ["ok", "x\\ud800"]}' % MODEL.encode()
    err = _check_error(httpx.post(url, content=body, headers={"content-type": "application/json"}), 400,
                       "invalid_json")
    assert "hex escape at line 1" in err["message"], err
    # chat_template_kwargs may set the template's named variables too (once a 400: a repeated keyword)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                         "chat_template_kwargs": {"add_generation_prompt": False, "tools": []}})
    assert r.status_code == 200, r.text
    err = _check_error(httpx.post(url, json=[{"model": MODEL, "prompt": "x"}]), 400)
    assert err["message"] == "the request body must be a JSON object", err
    _check_error(httpx.post(server.url + "/v1/chat/completions",
                            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": -1}), 400)
    _check_error(httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
    err = _check_error(httpx.post(server.url + "/v1/chat/completions",  # OpenAI's roles only (was: a 200)
                                  json={"model": MODEL, "messages": [{"role": "bogus", "content": "x"}]}), 400)
    assert err["param"] == "messages" and "'bogus' is not one of system" in err["message"], err
    err = _check_error(httpx.post(server.url + "/tokenize",  # the chat route's tool checks (was: rendered)
                                  json={"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bad"}]}),
                       400)
    assert err["param"] == "tools", err
    _check_error(httpx.post(server.url + "/v1/chat/completions",
                            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}),
                 400)
    err = _check_error(httpx.post(url, json={"model": "gpt-4", "prompt": "x"}), 404, "model_not_found")
    assert err["type"] == "invalid_request_error"  # (OpenAI's type for it)
    _check_error(httpx.get(server.url + "/v1/nothing-here"), 404)
    _check_error(httpx.post(url, content=b"x" * (5 << 20)), 413)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
    assert ei.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=4)
    # the server still answers normally
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices


def test_vllm_fields_that_would_change_the_output_are_refused(server, client):
    """vLLM's extra fields that hyspec does not implement and that change the output
    (min_tokens, prompt_logprobs, skip_special_tokens: false, a per-request chat_template,
    continue_final_message, ...) are a 400 naming the field: they were silently ignored (a
    200 answered as if they had not been sent). Their "off" values and the fields that
    change nothing (user, metadata, service_tier, guided_decoding_backend, ...) still pass."""
    comp, chat = server.url + "/v1/completions", server.url + "/v1/chat/completions"
    base = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0}
    chat_base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "temperature": 0}
    refused = {"min_tokens": 4, "prompt_logprobs": 1, "use_beam_search": True, "truncate_prompt_tokens": 2,
               "skip_special_tokens": False, "return_tokens_as_token_ids": True, "bad_words": ["x"],
               "allowed_token_ids": [1, 2], "logits_processors": ["x"], "structured_outputs": {"regex": "a"},
               "guided_whitespace_pattern": " ", "extra_body": {"top_k": 1}, "best_of": 2}
    for field, value in refused.items():
        for url, body in ((comp, base), (chat, chat_base)):
            err = _check_error(httpx.post(url, json={**body, field: value}), 400)
            assert err["param"] == field and field in err["message"], (url, field, err)
    chat_refused = {"chat_template": "{{ messages[0].content }}!", "continue_final_message": True, "echo": True,
                    "documents": [{"title": "t", "text": "x"}]}
    for field, value in chat_refused.items():
        err = _check_error(httpx.post(chat, json={**chat_base, field: value}), 400)
        assert err["param"] == field, (field, err)
    with pytest.raises(openai.BadRequestError, match="min_tokens is not supported"):  # through extra_body
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"min_tokens": 2})
    passed = {"min_tokens": 0, "use_beam_search": False, "skip_special_tokens": True, "bad_words": [],
              "return_tokens_as_token_ids": False, "prompt_logprobs": None, "best_of": 1, "user": "u",
              "metadata": {"a": "b"}, "service_tier": "auto", "guided_decoding_backend": "xgrammar",
              "spaces_between_special_tokens": False, "length_penalty": 1.0, "priority": 0,
              "extra_body": {}}  # (an empty literal extra_body drops nothing)
    for url, body in ((comp, base), (chat, chat_base)):
        want = httpx.post(url, json=body).json()["choices"][0]
        r = httpx.post(url, json={**body, **passed})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0] == want
    r = httpx.post(chat, json={**chat_base, "continue_final_message": False, "echo": False})
    assert r.status_code == 200, r.text
    # /tokenize renders messages as chat does: the same two template fields refused there (they were
    # ignored: ids from the server's own template)
    msgs = {"model": MODEL, "messages": chat_base["messages"]}
    for field, value in (("chat_template", "{{ 'zzz' }}"), ("continue_final_message", True)):
        err = _check_error(httpx.post(server.url + "/tokenize", json={**msgs, field: value}), 400)
        assert err["param"] == field, (field, err)
    assert httpx.post(server.url + "/tokenize", json={**msgs, "continue_final_message": False}).status_code == 200


def test_echo_only_choices_count_as_finished(server, client):
    """An echo with max_tokens 0 answers finish_reason "length" without running: it was in no
    finish counter nor the latency histogram (its prompt tokens were counted)."""
    key = 'hyspec_requests_total{finish_reason="length"}'
    before = (metric(server, key), metric(server, "hyspec_e2e_request_latency_seconds_count"))
    r = client.completions.create(model=MODEL, prompt=["x = 1", "y = 2"], max_tokens=0, echo=True)
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    assert (metric(server, key), metric(server, "hyspec_e2e_request_latency_seconds_count")) == (
        before[0] + 2, before[1] + 2)


def test_an_echo_of_a_prompt_as_long_as_the_context_scores_it(client):
    """echo + max_tokens 0 generates nothing: a prompt of the whole context was refused ("at
    least one must be left to generate") although `hyspec score` takes it; one token more is
    still refused, and in a request of several prompts the error names which one."""
    ctx = 4096  # (the embedded model's)
    full = [1] * ctx
    r = client.completions.create(model=MODEL, prompt=full, max_tokens=0, echo=True)
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens == ctx
    with pytest.raises(openai.BadRequestError, match="as long as the model's context of 4096"):
        client.completions.create(model=MODEL, prompt=full, max_tokens=1, echo=True)
    with pytest.raises(openai.BadRequestError, match="longer than the model's context"):
        client.completions.create(model=MODEL, prompt=full + [1], max_tokens=0, echo=True)
    with pytest.raises(openai.BadRequestError, match="prompt 1: the prompt is 4097 tokens"):
        client.completions.create(model=MODEL, prompt=[[1, 2], full + [1]], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="prompt 1: max_tokens=3 is too large: the prompt has 4094"):
        client.completions.create(model=MODEL, prompt=[[1, 2], full[2:]], max_tokens=3)


def test_metrics_move(server, client):
    before = {k: metric(server, k) for k in ("hyspec_generation_tokens_total", "hyspec_prompt_tokens_total",
                                             "hyspec_spec_drafts_total", "hyspec_spec_draft_tokens_total",
                                             "hyspec_time_to_first_token_seconds_count",
                                             "hyspec_e2e_request_latency_seconds_count")}
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body={"draft": 3, "ignore_eos": True})
    after = {k: metric(server, k) for k in before}
    assert after["hyspec_generation_tokens_total"] - before["hyspec_generation_tokens_total"] == 8
    assert after["hyspec_prompt_tokens_total"] - before["hyspec_prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["hyspec_spec_drafts_total"] > before["hyspec_spec_drafts_total"]
    assert after["hyspec_spec_draft_tokens_total"] > before["hyspec_spec_draft_tokens_total"]
    assert after["hyspec_time_to_first_token_seconds_count"] == before["hyspec_time_to_first_token_seconds_count"] + 1
    assert after["hyspec_e2e_request_latency_seconds_count"] == before["hyspec_e2e_request_latency_seconds_count"] + 1
    body = httpx.get(server.url + "/metrics").text
    for name in ("hyspec_requests_running", "hyspec_requests_waiting", "hyspec_inter_token_latency_seconds_bucket",
                 "hyspec_prefix_cache_queries_total", "hyspec_prefix_cache_hits_total",
                 "hyspec_prefix_cache_cached_tokens_total", "hyspec_spec_accepted_tokens_total",
                 "hyspec_spec_mean_acceptance_length"):
        assert name in body, name
    # accepted tokens by draft position add up to the accepted total (a position appears once a
    # token was accepted there: none at all when this test runs first and nothing was accepted)
    per_pos = [float(v) for v in re.findall(r'^hyspec_spec_accepted_tokens_per_pos_total\{position="\d+"\} (\S+)$',
                                            body, re.M)]
    assert sum(per_pos) == metric(server, "hyspec_spec_accepted_tokens_total")
    assert 1.0 <= metric(server, "hyspec_spec_mean_acceptance_length") <= 4.0


def test_a_growing_conversation_does_not_pile_up_free_slots(server):
    """Each request whose prompt is longer than every earlier one (a chat sending its growing
    history) needed a slot longer than any freed one: the pool made a new one and kept the
    old free, never let go of (40 free slots, 114 MB after 40 such requests at --max-batch 4).
    The pool now holds at most --max-batch slots."""
    for n in range(1, 30, 2):  # one at a time: a slot per request, each longer than the last
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": list(range(100, 100 + 10 * n)), "max_tokens": 1})
        assert r.status_code == 200, r.text
    pool = server.server.config.app.state.hyspec.worker._sched.pool
    st = pool.stats()
    assert st["slots_in_use"] == 0 and st["slots_free"] <= pool.max_slots == 8, st


PREFIX_METRICS = ("hyspec_prefix_cache_queries_total", "hyspec_prefix_cache_hits_total",
                  "hyspec_prefix_cache_cached_tokens_total")


def test_second_chat_turn_resumes_from_the_prefix_store(server, client, ref_engine):
    """Turn 2 repeats turn 1's messages + its reply + a new user message: the rendered prompt
    (the plain template: contents concatenated) extends turn 1's prompt + generated tokens, so
    the request resumes from turn 1's stored end state. Its output equals Engine.generate on
    the same prompt from scratch (greedy), and the prefix-store metrics move."""
    first = [{"role": "user", "content": "def fibonacci(n):"}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=16, temperature=0,
                                        extra_body={"draft": 3, "ignore_eos": True})
    reply = r1.choices[0].message.content
    assert r1.choices[0].finish_reason == "length"
    p1 = ref_engine.encode(first[0]["content"])
    gen1 = reference(ref_engine, p1, 16, draft=3, ignore_eos=True)[0]
    assert reply == text_of(ref_engine, gen1)
    before = {k: metric(server, k) for k in PREFIX_METRICS}
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "\n\ndef factorial(n):"}]
    r2 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=12, temperature=0,
                                        extra_body={"draft": 3})
    after = {k: metric(server, k) for k in PREFIX_METRICS}
    p2 = ref_engine.encode("".join(m["content"] for m in second))
    # what makes the hit possible: re-encoding the text extends turn 1's token sequence here
    assert p2[: len(p1) + len(gen1)] == p1 + gen1
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached == len(p1) + len(gen1) - 1  # the stored state; its pending last token is fed again
    assert r2.usage.prompt_tokens == len(p2)
    want = reference(ref_engine, p2, 12, draft=3)[0]
    assert r2.choices[0].message.content == text_of(ref_engine, want)
    assert r2.usage.completion_tokens == len(want)
    assert after["hyspec_prefix_cache_queries_total"] == before["hyspec_prefix_cache_queries_total"] + 1
    assert after["hyspec_prefix_cache_hits_total"] == before["hyspec_prefix_cache_hits_total"] + 1
    assert after["hyspec_prefix_cache_cached_tokens_total"] == before["hyspec_prefix_cache_cached_tokens_total"] + cached
    assert httpx.get(server.url + "/health").json()["prefix_store"]["hits"] >= 1
    # n samples of one prompt: its reused tokens count once, as its prompt tokens do (were n times),
    # in usage and in the metrics (which counted each sample: cached tokens outgrew prompt tokens)
    before = {k: metric(server, k) for k in (*PREFIX_METRICS, "hyspec_prompt_tokens_total")}
    r3 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=4, temperature=0.7, seed=1, n=3)
    assert (r3.usage.prompt_tokens, r3.usage.prompt_tokens_details.cached_tokens) == (len(p2), cached)
    moved = {k: metric(server, k) - v for k, v in before.items()}
    assert moved == {"hyspec_prefix_cache_queries_total": 1, "hyspec_prefix_cache_hits_total": 1,
                     "hyspec_prefix_cache_cached_tokens_total": cached, "hyspec_prompt_tokens_total": len(p2)}


def test_serve_reads_the_checkpoints_recommended_sampling_unless_told_not_to(tmp_path, capsys):
    """`hyspec serve --model DIR` whose generation_config.json recommends sampling: the
    server's request defaults are that recommendation and it says so at start;
    `--generation-config none` keeps OpenAI's (temperature 1, top_p 1)."""
    import shutil

    from hyspec.engine import default_model_dir
    from hyspec.server import build_parser as serve_parser
    from hyspec.server import make_app

    d = tmp_path / "m"
    shutil.copytree(default_model_dir(), d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "do_sample": True, "temperature": 0.6,
                                                          "top_p": 0.95, "top_k": 20}))
    capsys.readouterr()
    st = make_app(serve_parser().parse_args(["--model", str(d)])).state.hyspec
    assert st.limits.sampling_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert "generation_config.json sampling: temperature 0.6, top_k 20, top_p 0.95" in capsys.readouterr().err
    st = make_app(serve_parser().parse_args(["--model", str(d), "--generation-config", "none"])).state.hyspec
    assert st.limits.sampling_defaults == {} and "generation_config" not in capsys.readouterr().err


def test_no_prefix_store_flag():
    from hyspec.server import build_parser as serve_parser
    from hyspec.server import make_app

    st = make_app(serve_parser().parse_args(["--prefix-store-bytes", "12345"])).state.hyspec
    assert st.worker.store is st.engine.store and st.engine.store.budget_bytes == 12345
    st = make_app(serve_parser().parse_args(["--no-prefix-store"])).state.hyspec
    assert st.worker.store is None and not st.metrics.prefix_store
    assert st.cfg.warm_up is None and not st.worker.warm_up  # warm-up: on a GPU only
    assert make_app(serve_parser().parse_args(["--no-warm-up"])).state.hyspec.cfg.warm_up is False
    with ServerThread(create_app(st.engine, st.cfg)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "def fibonacci(n):"}]
        r1 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "\n"}]
        r2 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens == 0
        assert all(metric(s, k) == 0 for k in PREFIX_METRICS)
        assert httpx.get(s.url + "/health").json()["prefix_store"] is None


def test_concurrent_outputs_equal_engine(server, client, ref_engine):
    """Mixed greedy / seeded, streamed / not, draft 0 / 3 requests at once: each equals the
    offline engine's output for its own parameters."""
    cases = []
    for i in range(8):
        cases.append(dict(prompt=PROMPTS[i % 3], max_tokens=8 + i % 3, temperature=0.0 if i % 2 else 0.7,
                          seed=100 + i, draft=3 if i % 3 else 0, stream=i % 4 == 0))

    def go(c):
        kw = dict(model=MODEL, prompt=c["prompt"], max_tokens=c["max_tokens"], temperature=c["temperature"],
                  seed=c["seed"], extra_body={"draft": c["draft"], "ignore_eos": True, "return_token_ids": True})
        if c["stream"]:
            return "".join(ch.choices[0].text for ch in client.completions.create(**kw, stream=True) if ch.choices)
        return client.completions.create(**kw).choices[0].token_ids

    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(go, cases))
    for c, g in zip(cases, got):
        want = reference(ref_engine, c["prompt"], c["max_tokens"], temperature=c["temperature"], seed=c["seed"],
                         draft=c["draft"], ignore_eos=True)[0]
        assert g == (ref_engine.tokenizer.decode(want, skip_special_tokens=True) if c["stream"] else want), c


def test_auth_queue_full_and_disconnect(ref_engine):
    eng = Engine.load()
    app = create_app(eng, ServerConfig(served_model_name=MODEL, draft=3, max_batch=1, max_queue=0, api_key="sekret",
                                       max_body_bytes=64 << 10))
    with ServerThread(app) as s:
        url = s.url + "/v1/completions"
        _check_error(httpx.post(url, json={"model": MODEL, "prompt": "x"}), 401)
        _check_error(httpx.post(url, json={"model": MODEL, "prompt": "x"}, headers={"authorization": "Bearer no"}), 401)
        _check_error(httpx.post(url, json={"model": MODEL, "prompt": "x"}, headers={"authorization": "Basic sekret"}),
                     401)
        ok = httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                        headers={"authorization": "bearer sekret"})  # the scheme's case does not matter
        assert ok.status_code == 200, ok.text
        assert httpx.get(s.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices
        _check_error(httpx.post(url, content=b"{" + b" " * (100 << 10) + b"}",
                                headers={"authorization": "Bearer sekret"}), 413)
        # capacity 1: while one sequence runs, another request is refused at once with 429
        hdr = {"authorization": "Bearer sekret"}
        with httpx.stream("POST", s.url + "/v1/chat/completions", headers=hdr, timeout=60,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 400,
                                "temperature": 0, "stream": True, "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[5:])["choices"][0]["delta"]["role"] == "assistant"
            t = time.perf_counter()
            r = httpx.post(url, headers=hdr, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert time.perf_counter() - t < 2.0
            _check_error(r, 429)
            assert r.headers["retry-after"] == "1"  # (clients that retry wait for it)
            # echo + logprobs: refused before its prompts are scored (it scored them on the engine
            # thread first, seconds of work that stalled the running stream, then answered 429)
            scored = []
            real_score = eng.score
            eng.score = lambda *a, **k: (scored.append(1), real_score(*a, **k))[1]
            try:
                r = httpx.post(url, headers=hdr, json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 1,
                                                       "echo": True, "logprobs": 1})
            finally:
                del eng.score
            _check_error(r, 429)
            assert not scored
        # the client went away: its sequence is cancelled and the slot frees up
        batched = app.state.hyspec.worker.batched
        t_end = time.monotonic() + (10 if batched else 60)
        while metric(s, "hyspec_requests_running") and time.monotonic() < t_end:
            time.sleep(0.05)
        if not batched:
            pytest.skip("Engine.generate fallback: a running sequence cannot be cancelled mid-generation")
        assert metric(s, "hyspec_requests_total", '{finish_reason="cancelled"}') == 1
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices
        # a non-streamed request whose client gives up is cancelled too, quietly: no
        # "Exception in ASGI application" traceback in the server's log
        errors: list[logging.LogRecord] = []
        catch = logging.Handler(logging.ERROR)
        catch.emit = errors.append
        logging.getLogger("uvicorn.error").addHandler(catch)
        try:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(url, headers=hdr, timeout=1.0, json={"model": MODEL, "prompt": "x", "max_tokens": 400,
                                                               "temperature": 0, "ignore_eos": True})
            t_end = time.monotonic() + 10
            while metric(s, "hyspec_requests_total", '{finish_reason="cancelled"}') < 2 and time.monotonic() < t_end:
                time.sleep(0.05)
            assert metric(s, "hyspec_requests_total", '{finish_reason="cancelled"}') == 2
            assert metric(s, "hyspec_requests_running") == 0
            time.sleep(0.2)  # the handler's return after the cancel
        finally:
            logging.getLogger("uvicorn.error").removeHandler(catch)
        assert not errors, [r.getMessage() for r in errors]


def test_engine_fault_is_contained(monkeypatch):
    """An exception inside the engine answers that request with a 500 in OpenAI's shape (no
    traceback) and the server goes on serving."""
    monkeypatch.setenv("HYSPEC_SERVE_SCHEDULER", "0")  # the sequential worker: the fault is easy to inject
    eng = Engine.load()
    real = eng.generate
    poison = eng.encode("poison")

    def generate(prompt, **kw):
        if list(prompt) == poison:
            raise RuntimeError("injected engine fault")
        return real(prompt, **kw)

    monkeypatch.setattr(eng, "generate", generate)
    with ServerThread(create_app(eng, ServerConfig(served_model_name=MODEL))) as s:
        url = s.url + "/v1/completions"
        err = _check_error(httpx.post(url, json={"model": MODEL, "prompt": "poison", "max_tokens": 3}), 500)
        assert "injected" not in err["message"]
        r = httpx.post(url, json={"model": MODEL, "prompt": "poison", "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and '"error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
        ok = httpx.post(url, json={"model": MODEL, "prompt": "x = ", "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_the_sequential_fallback_stops_a_cancelled_job(monkeypatch):
    """The sequential fallback (HYSPEC_SERVE_SCHEDULER=0) ran a job to its end whatever
    happened: a client that left after 0.5 s of a 4,000-token request held the engine for the
    whole of it (the next request waited a minute), a stop string matched early went on to
    max_tokens. A cancel now ends the job after the round (Engine.generate's cancel: it returns,
    the sample "cancelled"), and its tokens stream."""
    monkeypatch.setenv("HYSPEC_SERVE_SCHEDULER", "0")
    eng = Engine.load()
    real, runs = eng.generate, []

    def generate(prompt, **kw):
        run = {"tokens": 0, "ended": None}
        runs.append(run)
        inner = kw.get("on_tokens")

        def on_tokens(i, ids):
            run["tokens"] += len(ids)
            if inner is not None:
                inner(i, ids)

        try:
            out = real(prompt, **{**kw, "on_tokens": on_tokens})
        except BaseException as e:
            run["ended"] = type(e).__name__
            raise
        run["ended"] = out.samples[0].stop_reason
        return out

    monkeypatch.setattr(eng, "generate", generate)
    with ServerThread(create_app(eng, ServerConfig(served_model_name=MODEL))) as s:
        url = s.url + "/v1/completions"
        body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json=body, timeout=0.5)
        ok = httpx.post(url, json={**body, "max_tokens": 3}, timeout=120)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert runs[0]["ended"] == "cancelled" and runs[0]["tokens"] < 4000, runs
        # a stop string ends the job there: its text, and the engine stops after that round
        want = httpx.post(url, json={**body, "max_tokens": 40}).json()["choices"][0]["text"]
        stop = want[10:14]
        got = httpx.post(url, json={**body, "stop": [stop]}, timeout=120).json()
        assert got["choices"][0]["text"] == want[: want.index(stop)] and got["choices"][0]["finish_reason"] == "stop"
        assert runs[-1]["ended"] == "cancelled" and runs[-1]["tokens"] < 100, runs


def test_the_sequential_fallback_reports_a_stop_string_end_as_the_batched_path(monkeypatch, caplog):
    """A stop string ends a sequence through a cancel (the loop side matched it): the batched
    path reports that end ("cancelled" to the worker, finish_reason "stop" to the client) with
    the sequence's stats so far (timings, tokens, spec telemetry: the spec metrics and the
    request log line's accept_len come from them); the sequential fallback
    (HYSPEC_SERVE_SCHEDULER=0) reported it with no stats at all ({}: no spec counts, accept_len
    "-"). It now reports the same as the batched path."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "draft": 3}
    seen = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("HYSPEC_SERVE_SCHEDULER", mode)
        app = create_app(Engine.load(), ServerConfig(served_model_name=MODEL, draft=3))
        worker = app.state.hyspec.worker
        assert worker.batched == (mode == "1")
        finished = []

        def record(job, reason, stats, real=worker._finish, finished=finished):
            finished.append((reason, dict(stats)))
            real(job, reason, stats)

        monkeypatch.setattr(worker, "_finish", record)
        with ServerThread(app) as s:
            url = s.url + "/v1/completions"
            want = httpx.post(url, json=body, timeout=120).json()["choices"][0]["text"]
            stop = want[10:14]
            drafts = metric(s, "hyspec_spec_drafts_total")
            with caplog.at_level(logging.INFO, logger="hyspec.server"):
                got = httpx.post(url, json={**body, "stop": [stop]}, timeout=120).json()
            lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(got["id"])]
            reason, stats = finished[-1]
            seen[mode] = {"choice": got["choices"][0], "usage": got["usage"], "reason": reason, "keys": set(stats)}
            assert got["choices"][0]["text"] == want[: want.index(stop)], mode
            assert got["choices"][0]["finish_reason"] == "stop", mode
            assert stats and stats["prompt_tokens"] == got["usage"]["prompt_tokens"], (mode, stats)
            assert stats["generated_tokens"] >= got["usage"]["completion_tokens"] > 0, (mode, stats)
            assert stats["spec"]["rounds"] > 0, (mode, stats)
            assert metric(s, "hyspec_spec_drafts_total") - drafts == stats["spec"]["rounds"], mode
            assert len(lines) == 1 and re.search(r" accept_len=[0-9.]+ .* finish=stop$", lines[0]), (mode, lines)
    assert seen["0"] == seen["1"]
    assert seen["1"]["reason"] == "cancelled"


def test_rounds_stream_and_requests_join_the_batch(server, client):
    """With the batched engine: a stream gets tokens round by round, and a request that
    arrives while a long one runs joins the batch and finishes first."""
    st = server.server.config.app.state.hyspec if hasattr(server.server.config.app, "state") else None
    if st is None or not st.worker.batched:
        pytest.skip("the sequential Engine.generate fallback streams a request's tokens at its end")
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "draft": 3})
    it = iter(stream)
    first = next(it)
    assert first.choices[0].text
    t = time.perf_counter()
    short = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert short.choices[0].finish_reason in ("length", "stop") and time.perf_counter() - t < 5
    rest = [ch for ch in it if ch.choices and ch.choices[0].text]
    assert len(rest) >= 20  # ~200 tokens at an acceptance length of ~2: many rounds, many chunks
    stream.close()


def test_cli_wiring_and_request_log(server, client, caplog):
    """`hyspec serve` parses its flags into the app (defaults: the embedded model, K=3), and
    each request logs one line with its id, tokens in/out, acceptance length and latency."""
    import logging

    from hyspec.cli import build_parser
    from hyspec.server import build_parser as serve_parser
    from hyspec.server import make_app

    assert "serve" in build_parser().format_help()
    args = serve_parser().parse_args(["--port", "0", "--max-batch", "4", "--api-key", "k"])
    st = make_app(args).state.hyspec
    assert (st.cfg.served_model_name, st.cfg.draft, st.cfg.max_batch, st.cfg.api_key) == ("hyspec-default", 3, 4, "k")
    assert st.engine.model_dir.endswith("default_model")
    with caplog.at_level(logging.INFO, logger="hyspec.server"):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith(r.id)]
    assert len(lines) == 1
    assert re.fullmatch(rf"{r.id} in={r.usage.prompt_tokens} out=5 accept_len=[0-9.]+ latency=[0-9.]+s finish=length",
                        lines[0]), lines


def test_signed_seed_and_max_completion_tokens_on_completions(client, ref_engine):
    """A negative seed (OpenAI clients send signed 64-bit ints) is the unsigned seed with the
    same bits, not a 500; /v1/completions takes max_completion_tokens as chat does."""
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0.9, extra_body={"return_token_ids": True,
                                                                                       "ignore_eos": True})
    a = client.completions.create(seed=-1, **kw)
    b = client.completions.create(seed=(1 << 64) - 1, **kw)
    assert a.choices[0].token_ids == b.choices[0].token_ids
    assert a.choices[0].token_ids == reference(ref_engine, PROMPTS[1], 6, temperature=0.9, seed=(1 << 64) - 1,
                                               ignore_eos=True)[0]
    c = client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0,
                                  extra_body={"max_completion_tokens": 3, "ignore_eos": True})
    assert c.usage.completion_tokens == 3


def test_serve_option_checks():
    import socket

    from hyspec import server

    with socket.socket() as busy:  # a port in use: said before the model loads, not uvicorn's exit 3
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ValueError, match=r"cannot listen on 127\.0\.0\.1:\d+.*--port"):
            server.check_port("127.0.0.1", busy.getsockname()[1])
    with pytest.raises(ValueError, match="--host"):
        server.check_port("no-such-host.invalid", 8000)
    with socket.socket() as v4:  # an IPv4 listener does not make "::" (IPv6-only, as asyncio binds) busy
        v4.bind(("0.0.0.0", 0))
        v4.listen()
        if socket.has_ipv6:
            try:
                server.check_port("::", v4.getsockname()[1])
            except ValueError as e:
                assert "in use" not in str(e)
        with pytest.raises(ValueError, match="in use"):  # "": every interface, as uvicorn binds it
            server.check_port("", v4.getsockname()[1])
    with pytest.raises(ValueError, match="not an address of this machine"):  # (uvicorn said so after the load)
        server.check_port("192.0.2.1", 8000)  # (TEST-NET-1: documentation only, on no interface)
    server.check_port("127.0.0.1", 0)
    with pytest.raises(ValueError, match="--host"):  # (port 0 skipped the checks: uvicorn's "[Errno -2] Name or
        server.check_port("no-such-host.invalid", 0)  # service not known", exit 3, after the model loaded)
    with pytest.raises(ValueError, match="not an address of this machine"):
        server.check_port("192.0.2.1", 0)
    server.check_port("127.0.0.1", 99999)  # (out of range: check() names --port)

    for argv, needle in ((["--port", "99999"], "--port must be in 0..65535"), (["--port", "-1"], "--port"),
                         (["--max-batch", "0"], "--max-batch must be >= 1"),
                         (["--max-queue", "-1"], "--max-queue must be >= 0"),
                         # (0 removed the limit in silence, -1 refused every POST)
                         (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
                         (["--max-body-bytes", "-1"], "--max-body-bytes must be >= 1")):
        with pytest.raises(ValueError, match=needle):
            server.check(server.build_parser().parse_args(argv))


def test_prefix_queries_count_only_sequences_that_ran():
    """hyspec_prefix_cache_queries_total counts sequences that looked the store up: not one
    cancelled while queued or refused before it ran (it was every finished sequence)."""
    from hyspec.server.metrics import Metrics

    m = Metrics()
    m.prefix_store = True
    m.observe_prefix([{}])  # cancelled in the queue
    m.observe_prefix([{"error": "refused"}])
    m.observe_prefix([{"prompt_tokens": 5, "cached_tokens": 3}])
    assert m.prefix_queries._value.get() == 1 and m.prefix_hits._value.get() == 1


def test_a_stream_that_fails_unexpectedly_ends_with_an_error_event_then_done():
    """An unexpected exception mid-stream (not an APIError) ends the stream as any error
    does: a 500 error event, then [DONE] (it once stopped without [DONE]); the run is cancelled."""
    import asyncio
    import json
    from types import SimpleNamespace

    from hyspec.server.streaming import stream_events

    class Broken:
        def emittable(self, final):
            raise RuntimeError("planted")

    cancelled = []
    choice = SimpleNamespace(sent_final=False, finish_reason=None, error=None, matcher=Broken())
    run = SimpleNamespace(choices=[choice], done=False, cancel=lambda: cancelled.append(True), t0=0.0, id="x")
    counted = []
    metrics = SimpleNamespace(http_errors=SimpleNamespace(
        labels=lambda status: SimpleNamespace(inc=lambda: counted.append(status))))

    class Request:
        async def receive(self):
            await asyncio.sleep(3600)

    async def collect():
        return [e async for e in stream_events(SimpleNamespace(metrics=metrics), Request(), run, None, None, False,
                                               [{"header": 1}])]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    err = json.loads(events[-2][len("data: "):])
    assert err["error"]["code"] == "internal_error" and counted == ["500"] and cancelled == [True]


def test_prompts_are_rendered_and_encoded_off_the_event_loop():
    """Prompts were encoded (and chat templates rendered) on the event loop: a 4 MB prompt
    stood every other request and stream still for seconds, even one refused afterwards as
    too long. Each route now does that work in a thread; checked by where it runs."""
    import asyncio

    eng = Engine.load()
    app = create_app(eng, ServerConfig(served_model_name=MODEL))
    state = app.state.hyspec
    on_loop = []

    class Watched:
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def encode(self, *a, **k):
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:  # (no loop runs in this thread)
                on_loop.append(False)
            return self._tok.encode(*a, **k)

    state.tokenizer = Watched(state.tokenizer)
    # and a long text is encoded with the GIL let go (tokenizers' encode holds it: a thread
    # alone froze the loop just the same; encode_batch releases it), to the same ids
    from hyspec.tokenizer import LONG_TEXT

    inner, calls = eng.tokenizer._tok, []
    real_batch = inner.encode_batch

    class Spy:
        def __getattr__(self, name):
            return getattr(inner, name)

        def encode_batch(self, *a, **k):
            calls.append(len(a[0][0]))
            return real_batch(*a, **k)

    long_text = "def f(x):\n    return x\n" * (LONG_TEXT // 10)
    want = inner.encode(long_text, add_special_tokens=False).ids
    eng.tokenizer._tok = Spy()
    try:
        assert eng.tokenizer.encode(long_text) == want and calls == [len(long_text)]
        assert eng.tokenizer.encode("short") == inner.encode("short", add_special_tokens=False).ids
        assert calls == [len(long_text)]
    finally:
        eng.tokenizer._tok = inner
    with ServerThread(app) as s:
        for path, body in (("/v1/completions", {"prompt": "def f(x):", "max_tokens": 1}),
                           ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
                           ("/tokenize", {"prompt": "def f(x):"}),
                           ("/tokenize", {"messages": [{"role": "user", "content": "x"}]})):
            r = httpx.post(s.url + path, json={"model": MODEL, **body})
            assert r.status_code == 200, (path, r.text)
    assert on_loop and not any(on_loop), on_loop


def test_a_405_names_the_allowed_methods(server):
    # RFC 9110 15.5.6: a 405 carries Allow; the OpenAI-shaped error handler dropped Starlette's header
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers.get("allow") == "POST"
    r = httpx.post(server.url + "/health")
    assert r.status_code == 405 and set(r.headers.get("allow", "").replace(" ", "").split(",")) >= {"GET", "HEAD"}


def test_an_exit_signal_stops_running_requests_with_a_503():
    """On SIGINT / SIGTERM (uvicorn's handle_exit) plain uvicorn waited for every open request
    to run to its max_tokens (tens of seconds here, unbounded in general) before the server
    exited: now the running stream ends with a 503 error event and [DONE], a waiting
    non-streamed request gets a 503, and the server thread exits at once."""
    import signal
    import threading

    app = create_app(Engine.load(), ServerConfig(served_model_name=MODEL, draft=3, max_batch=4, warm_up=False))
    s = ServerThread(app, shutdown_timeout=20).start()
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 3000, "ignore_eos": True}
    plain = {}
    t = threading.Thread(target=lambda: plain.update(r=httpx.post(s.url + "/v1/completions", json=body, timeout=60)))
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"text"' in first
            t.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            s.server.handle_exit(signal.SIGTERM, None)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][len("data: "):])["error"]
        assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
        t.join(20)
        assert plain["r"].status_code == 503 and plain["r"].json()["error"]["code"] == "server_shutting_down"
        s.thread.join(20)
        assert not s.thread.is_alive() and time.monotonic() - t0 < 15
    finally:
        s.stop()


def test_an_unwritable_profile_file_is_refused_at_start(ref_engine, tmp_path, monkeypatch, capsys):
    """HYSPEC_PROFILE_ENGINE naming a file that cannot be written (a missing directory): the
    server ran, and when it stopped the engine thread died in a FileNotFoundError traceback,
    the run's profile lost. Now the server does not start: one line naming the variable."""
    from hyspec.cli.dispatch import main
    from hyspec.parallel import free_port

    bad = str(tmp_path / "no-such-dir" / "engine.prof")
    monkeypatch.setenv("HYSPEC_PROFILE_ENGINE", bad)
    with pytest.raises(ValueError, match="HYSPEC_PROFILE_ENGINE=.*cannot write the profile there"):
        create_app(ref_engine, ServerConfig())
    assert main(["serve", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "HYSPEC_PROFILE_ENGINE=" in err and "Traceback" not in err
    good = tmp_path / "engine.prof"  # a writable one is taken
    monkeypatch.setenv("HYSPEC_PROFILE_ENGINE", str(good))
    create_app(ref_engine, ServerConfig())


# ---- request fields and stream shapes that a mutation run found unchecked --------------------


def _sse_events(server, path, body):
    """The JSON events of a raw stream (without the closing [DONE])."""
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_stream_that_ends_on_length_sends_the_text_it_held_back(server, client):
    """The last characters of a reply that could still begin a stop string are held back while
    it runs; when it ends on max_tokens ("length") the stream's final text sends them, so the
    streamed text equals the whole response's."""
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    kw["stop"] = [whole[-1] + "@@never@@"]  # its first character ends the text: held back to the end
    r = client.completions.create(**kw).choices[0]
    assert (r.text, r.finish_reason) == (whole, "length")
    chunks = [ch for ch in client.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    ckw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**ckw).choices[0].message.content
    ckw["stop"] = [content[-1] + "@@never@@"]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**ckw, stream=True)
                       if ch.choices)
    assert streamed == content


def test_stream_usage_follows_include_usage(server, client):
    """stream_options.include_usage: true adds the usage chunk (choices []) and a "usage": null
    on every other chunk, as OpenAI's; include_usage: false (or no stream_options) sends
    neither (a client reading choices[0] of each chunk broke on the usage chunk)."""
    body = {"model": MODEL, "prompt": "x = ", "max_tokens": 3, "temperature": 0, "stream": True,
            "ignore_eos": True}
    on = _sse_events(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert on[-1]["choices"] == [] and on[-1]["usage"]["completion_tokens"] == 3
    assert all("usage" in ev and ev["usage"] is None for ev in on[:-1])
    for extra in ({"stream_options": {"include_usage": False}}, {}):
        off = _sse_events(server, "/v1/completions", {**body, **extra})
        assert all(ev["choices"] and "usage" not in ev for ev in off), extra
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                               temperature=0, stream=True, stream_options={"include_usage": False}))
    assert all(ch.choices and ch.usage is None for ch in chat)


def test_without_max_tokens_a_request_stops_at_the_context(server, client):
    """The default max_tokens (16 for completions, the rest of the context for chat) never runs
    past the context: a prompt 5 tokens short of it gets 5 tokens, "length"."""
    ctx = 4096  # (the embedded model's)
    r = client.completions.create(model=MODEL, prompt=[1] * (ctx - 5), temperature=0,
                                  extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 5)

    def chat_prompt(k):
        return [{"role": "user", "content": " a" * k}]

    base = httpx.post(server.url + "/tokenize", json={"messages": chat_prompt(100)}).json()["count"]
    msgs = chat_prompt(100 + ctx - 5 - base)  # (each " a" is one token)
    assert httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()["count"] == ctx - 5
    c = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, extra_body={"ignore_eos": True})
    assert (c.choices[0].finish_reason, c.usage.completion_tokens) == ("length", 5)


def test_penalties_reach_the_sampler_under_their_own_names(client, ref_engine):
    """presence_penalty, frequency_penalty and repetition_penalty go to the SamplingParams
    fields of the same names, and penalty_last_n defaults to 64 (docs/server.md): the output
    equals Engine.generate with those params (each pair of cases differs, so a swap shows)."""
    fib = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef"
    long = ('import os\nimport sys\n\n\ndef main():\n    print(os.path.join(sys.argv[1], "x"))\n# ' + "a " * 70
            + "\n\n\ndef")
    cases = [(fib, {"presence_penalty": 1.5}), (fib, {"frequency_penalty": 1.5}),
             (long, {"repetition_penalty": 2.0}), (long, {"repetition_penalty": 2.0, "penalty_last_n": -1})]
    wants = []
    for prompt, fields in cases:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True, **fields})
        params = SamplingParams(temperature=0.0, **{"penalty_last_n": 64, **fields})
        want = ref_engine.generate(prompt, max_new_tokens=10, params=params, ignore_eos=True).samples[0].tokens
        assert r.choices[0].token_ids == want, fields
        wants.append(want)
    assert wants[0] != wants[1] and wants[2] != wants[3]


def test_sampling_field_edges(server, client):
    """top_k -1 is "off" (as 0, vLLM's spelling); max_completion_tokens wins over max_tokens
    when both are sent; a stop list of 16 strings (the documented most) is taken."""
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0.9, seed=5,
              extra_body={"ignore_eos": True, "return_token_ids": True, "draft": 0})  # (plain decoding: a
    # shorter run's tokens are a prefix of a longer one's, docs/sampling.md)
    off = client.completions.create(**kw).choices[0].token_ids
    assert client.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "top_k": -1}}).choices[0].token_ids \
        == off
    r = client.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "max_completion_tokens": 3}})
    assert r.usage.completion_tokens == 3 and r.choices[0].token_ids == off[:3]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                         "stop": [f"@{i}@" for i in range(16)]})
    assert r.status_code == 200, r.text


# ---- what an OpenAI client sees, that a second mutation run found unchecked ------------------


def test_out_of_range_fields_are_400_naming_them(server):
    """Each documented range is enforced with a 400 naming the field (the mutation run widened
    or dropped them unseen): min_p in [0, 1), the OpenAI penalties in [-2, 2], penalty_last_n
    >= -1, logit_bias values in [-100, 100], stop ids and prompt ids >= 0, chat's top_logprobs >= 0, suffix
    refused; and a request of more sequences than the server holds is a 400 on n, not a 429."""
    url, chat = server.url + "/v1/completions", server.url + "/v1/chat/completions"
    base = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for patch, param in (({"min_p": 1.0}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"penalty_last_n": -2}, "penalty_last_n"),
                         ({"logit_bias": {"1": 100.5}}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                         ({"prompt": [-1, 2]}, "prompt"), ({"suffix": "x"}, "suffix"),
                         ({"stop": ["y" * 1001]}, "stop"),
                         ({"prompt": ["a", "b", "c", "d", "e"], "n": 16}, "n")):  # 80 sequences > 8 + 64
        err = _check_error(httpx.post(url, json={**base, **patch}), 400)
        assert err["param"] == param and err["code"] == "invalid_value", (patch, err)
    for patch in ({"min_p": 0.5}, {"presence_penalty": 2.0, "frequency_penalty": -2.0}, {"penalty_last_n": -1},
                  {"stop": ["y" * 1000]}, {"logit_bias": {}}, {"logit_bias": {"1": 100, "2": -100}}):
        r = httpx.post(url, json={**base, **patch})
        assert r.status_code == 200, (patch, r.text)
    err = _check_error(httpx.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                              "logprobs": True, "top_logprobs": -1}), 400)
    assert err["param"] == "top_logprobs", err


def test_error_bodies_carry_openai_types_and_count(server):
    """An unknown path is 404 code unknown_url; every error answer moves
    hyspec_request_errors_total{status}."""
    key = 'hyspec_request_errors_total{status="400"}'
    before = metric(server, key)
    _check_error(httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 2}), 400)
    assert metric(server, key) == before + 1
    err = _check_error(httpx.get(server.url + "/v1/nothing-here"), 404, "unknown_url")
    assert err["type"] == "invalid_request_error"


def test_unseeded_sampled_requests_differ(client):
    """A sampled request without a seed gets a random one (docs/server.md): two such requests
    do not repeat each other (nor the seed-0 sample)."""
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=1.5,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    seeded = client.completions.create(**kw, seed=0).choices[0].token_ids
    got = [client.completions.create(**kw).choices[0].token_ids for _ in range(2)]
    assert got[0] != got[1] and seeded not in got


def test_usage_totals_and_every_choice_finishes_in_a_stream(server, client):
    """usage.total_tokens is prompt + completion; a stream of n > 1 choices sends each index
    its finish_reason (once), and chat's streamed logprobs equal the whole reply's."""
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0.8, seed=3, n=2,
                                  extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens == r.usage.prompt_tokens + 8
    for stream in (client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0.8, seed=3,
                                             n=3, stream=True, extra_body={"ignore_eos": True}),
                   client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = "}],
                                                  max_tokens=4, temperature=0.8, seed=3, n=3, stream=True,
                                                  extra_body={"ignore_eos": True})):
        finished = sorted((c.index, c.finish_reason) for ch in stream for c in ch.choices if c.finish_reason)
        assert finished == [(0, "length"), (1, "length"), (2, "length")], finished
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "def f(x):"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for ch in client.chat.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-6)
    # chat without logprobs (the default false) has none
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_echo_logprobs_of_several_prompts_are_each_prompts_own(client, ref_engine):
    """echo + logprobs with a list of prompts: each choice's echoed entries are its own
    prompt's tokens (n choices per prompt, prompt-major); logprobs=0 gives top lists holding
    the chosen token only."""
    prompts = ["x = 1", "import os\nimport sys"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0, echo=True, logprobs=0,
                                  n=2, extra_body={"ignore_eos": True})
    assert len(r.choices) == 4
    for c in r.choices:
        ids = ref_engine.encode(prompts[c.index // 2])
        assert c.text.startswith(prompts[c.index // 2])
        assert len(c.logprobs.tokens) == len(ids) + 1
        assert c.logprobs.tokens[:len(ids)] == [ref_engine.tokenizer.decode([t]) for t in ids]
        assert c.logprobs.top_logprobs[0] is None
        assert all(list(top) == [tok] for tok, top in zip(c.logprobs.tokens[1:], c.logprobs.top_logprobs[1:]))


def test_model_card_and_health_fields(server, client):
    """The model card is OpenAI's (object "model", its id, owned_by) with the context length;
    /health names every prefix-store counter (docs/server.md)."""
    card = httpx.get(server.url + f"/v1/models/{MODEL}").json()
    assert card == httpx.get(server.url + "/v1/models").json()["data"][0]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (MODEL, "model", "hyspec", 4096)
    assert httpx.get(server.url + "/v1/models").json()["object"] == "list"
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["engine"] == "batched" and health["warm_up"] is None
    assert set(health["prefix_store"]) == {"entries", "hits", "misses", "tokens_saved", "bytes_device", "bytes_host"}


def test_spec_metrics_add_up(server, client):
    """hyspec_spec_accepted_tokens_per_pos_total counts from position 0 (a token accepted at
    depth d > 0 was accepted at every depth before it), and the mean acceptance length is
    accepted / drafts + 1; generated tokens count only those a stop string leaves."""
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                              extra_body={"draft": 3, "ignore_eos": True})
    body = httpx.get(server.url + "/metrics").text
    per_pos = {int(p): float(v) for p, v in re.findall(
        r'^hyspec_spec_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)$', body, re.M)}
    assert per_pos and 0 in per_pos
    assert all(per_pos[p] <= per_pos.get(p - 1, 0) for p in per_pos if p > 0), per_pos
    drafts, accepted = metric(server, "hyspec_spec_drafts_total"), metric(server, "hyspec_spec_accepted_tokens_total")
    assert metric(server, "hyspec_spec_mean_acceptance_length") == pytest.approx(accepted / drafts + 1)
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    before = metric(server, "hyspec_generation_tokens_total")
    r = client.completions.create(**kw, stop=[text[len(text) // 2:len(text) // 2 + 3]])
    assert r.choices[0].finish_reason == "stop"
    assert metric(server, "hyspec_generation_tokens_total") - before == r.usage.completion_tokens


def test_sampling_mode_reaches_the_sampler(client, ref_engine):
    """sampling_mode: coupled gives Engine.generate's coupled-mode tokens for the seed (not
    the default rejection mode's)."""
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0.9, seed=11,
              extra_body={"ignore_eos": True, "return_token_ids": True, "draft": 3, "sampling_mode": "coupled"})
    got = client.completions.create(**kw).choices[0].token_ids
    want = {mode: ref_engine.generate(PROMPTS[2], max_new_tokens=10, draft=3, ignore_eos=True, params=SamplingParams(
        temperature=0.9, seed=11, mode=mode)).samples[0].tokens for mode in ("coupled", "rejection")}
    assert got == want["coupled"] and want["coupled"] != want["rejection"]


def test_a_request_without_sampling_fields_gets_the_checkpoints_recommendation(ref_engine):
    """An engine whose checkpoint recommends sampling (Engine.sampling_defaults, from its
    generation_config.json): a request that leaves temperature / top_k out gets them (as
    vLLM's server does; the tokens == Engine.generate with them), one that sends them keeps its
    own (temperature 0: greedy)."""
    eng = Engine.load()
    eng.sampling_defaults = {"temperature": 0.8, "top_k": 5}
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, seed=11,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    want = ref_engine.generate(PROMPTS[2], max_new_tokens=8, ignore_eos=True,
                               params=SamplingParams(temperature=0.8, top_k=5, seed=11)).samples[0].tokens
    greedy = ref_engine.generate(PROMPTS[2], max_new_tokens=8, ignore_eos=True).samples[0].tokens
    with ServerThread(create_app(eng, ServerConfig(served_model_name=MODEL, draft=0))) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert c.completions.create(**kw).choices[0].token_ids == want != greedy
        assert c.completions.create(**kw, temperature=0).choices[0].token_ids == greedy


def test_the_api_key_guards_detokenize_and_429_is_a_rate_limit_error():
    """--api-key covers /tokenize and /detokenize as /v1/* (docs/server.md); a full queue's 429
    has OpenAI's type rate_limit_error and Retry-After."""
    from hyspec.server.errors import error_response
    from hyspec.server.params import APIError

    with ServerThread(create_app(Engine.load(), ServerConfig(served_model_name=MODEL, api_key="k"))) as s:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            _check_error(httpx.post(s.url + path, json=body), 401, "invalid_api_key")
            assert httpx.post(s.url + path, json=body, headers={"authorization": "Bearer k"}).status_code == 200
    resp = error_response(APIError(429, "full", code="queue_full"))
    assert json.loads(resp.body)["error"]["type"] == "rate_limit_error" and resp.headers["retry-after"] == "1"


def test_token_ids_hold_every_counted_token(client, ref_engine):
    """return_token_ids: a choice's token_ids are the tokens usage counts, the stop token id
    that ended it included (its text is left out)."""
    toks = reference(ref_engine, PROMPTS[0], 12, ignore_eos=True)[0]
    j = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [toks[j]], "return_token_ids": True})
    c = r.choices[0]
    assert (c.finish_reason, c.token_ids, r.usage.completion_tokens) == ("stop", toks[:j + 1], j + 1)
    assert c.text == ref_engine.tokenizer.decode(toks[:j], skip_special_tokens=True)


def test_a_queued_request_whose_client_leaves_is_cancelled_and_the_gauges_split():
    """hyspec_requests_running / _waiting: a sequence queued behind a full batch counts as
    waiting, not running; its client leaving cancels it from the queue (finish_reason
    "cancelled" in the metrics, not "length")."""
    app = create_app(Engine.load(), ServerConfig(served_model_name=MODEL, max_batch=1, max_queue=2, warm_up=False))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with ServerThread(app) as s:
        def wait_for(name, labels, value):
            t_end = time.monotonic() + 20
            while metric(s, name, labels) != value and time.monotonic() < t_end:
                time.sleep(0.05)
            return metric(s, name, labels)

        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as first:
            lines = first.iter_lines()  # (kept: a dropped iterator closes the response)
            next(line for line in lines if line.startswith("data:"))
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as queued:
                queued_lines = queued.iter_lines()
                next(line for line in queued_lines if line.startswith("data:"))  # (the role chunk)
                assert wait_for("hyspec_requests_waiting", "", 1) == 1
                assert metric(s, "hyspec_requests_running") == 1
            assert wait_for("hyspec_requests_total", '{finish_reason="cancelled"}', 1) == 1
            assert metric(s, "hyspec_requests_total", '{finish_reason="length"}') == 0
            assert metric(s, "hyspec_requests_waiting") == 0


def test_request_fields_are_checked_at_their_documented_edges():
    """hyspec.server.params directly (no server): each documented bound holds at its edge,
    both sides (a mutation run moved them unseen): prompt and stop ids below the vocabulary
    size, top_k >= -1, repetition_penalty in [1/1e4, 1e4], n at most 16 however much the
    server holds, a seed of 64 bits (signed or not), draft in 0..16, non-finite floats; on a
    model without an MTP head a request that sends no draft decodes plainly (the server's
    default K is not an error); empty stop strings are dropped before they are counted; vLLM's
    unsupported fields pass only at their "off" value of its own type."""
    from hyspec.sampling import PENALTY_MAX
    from hyspec.server.params import (
        MAX_N,
        MAX_STOPS,
        APIError,
        Limits,
        check_prompt_ids,
        max_new_tokens,
        refuse_unsupported,
        sampling,
        stop_strings,
    )
    from hyspec.server.schemas import CompletionRequest
    from hyspec.speculative.loop import MAX_DRAFT

    lim = Limits(vocab_size=100, max_model_len=64, has_mtp=True, default_draft=3, capacity=72)

    def req(**kw):
        return CompletionRequest(model=MODEL, prompt="x", **kw)

    def refused(fn, *args):
        with pytest.raises(APIError) as ei:
            fn(*args)
        assert ei.value.status == 400 and ei.value.code == "invalid_value"
        return ei.value.param

    check_prompt_ids([0, 99], lim, "prompt")
    assert refused(check_prompt_ids, [100], lim, "prompt") == "prompt"
    for field, good, bad_value in (("top_k", -1, -2), ("repetition_penalty", PENALTY_MAX, PENALTY_MAX * 1.5),
                                   ("repetition_penalty", 1 / PENALTY_MAX, 0.5 / PENALTY_MAX),
                                   ("n", MAX_N, MAX_N + 1), ("seed", (1 << 64) - 1, 1 << 64),
                                   ("seed", -(1 << 63), -(1 << 63) - 1), ("draft", MAX_DRAFT, MAX_DRAFT + 1),
                                   ("draft", 0, -1), ("stop_token_ids", [99], [100]),
                                   ("temperature", 0.5, float("nan")), ("top_p", 0.5, float("nan")),
                                   ("min_p", 0.5, float("inf"))):
        sampling(req(**{field: good}), lim)
        assert refused(sampling, req(**{field: bad_value}), lim) == field, (field, bad_value)
    params, n, draft = sampling(req(top_k=-1, seed=-1), lim)
    assert (params.top_k, params.seed, params.penalty_last_n, params.mode, n, draft) == \
        (0, (1 << 64) - 1, 64, "rejection", 1, 3)
    assert refused(sampling, req(n=2, best_of=1), lim) == "best_of"  # (only best_of = n)
    # max_tokens 0 only where nothing need be generated (an echo that scores its prompt)
    assert max_new_tokens(req(max_tokens=0), 5, lim, 16, allow_zero=True) == 0
    assert refused(max_new_tokens, req(max_tokens=0), 5, lim, 16, False) == "max_tokens"
    assert max_new_tokens(req(max_tokens=59), 5, lim, 16, allow_zero=False) == 59
    assert refused(max_new_tokens, req(max_tokens=60), 5, lim, 16, False) == "max_tokens"
    no_mtp = Limits(vocab_size=100, max_model_len=64, has_mtp=False, default_draft=3, capacity=72)
    assert sampling(req(), no_mtp)[2] == 0
    # the checkpoint's recommended sampling (generation_config.json) fills the fields a request leaves out
    assert (sampling(req(), lim)[0].temperature, sampling(req(), lim)[0].top_p) == (1.0, 1.0)  # (OpenAI's)
    rec = Limits(vocab_size=100, max_model_len=64, has_mtp=True, default_draft=3, capacity=72,
                 sampling_defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                    "repetition_penalty": 1.1})
    p = sampling(req(), rec)[0]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.95, 20, 0.05, 1.1)
    p = sampling(req(temperature=0, top_p=1.0, top_k=-1, min_p=0, repetition_penalty=1), rec)[0]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.0, 1.0, 0, 0.0, 1.0)
    assert refused(sampling, req(draft=2), no_mtp) == "draft"
    assert stop_strings(req(stop="")) == [] and stop_strings(req(stop=["", "a"])) == ["a"]
    assert len(stop_strings(req(stop=[""] + [f"@{i}@" for i in range(MAX_STOPS)]))) == MAX_STOPS
    # vLLM's "off" values pass only as their own type: min_tokens false is not 0, skip_special_tokens 1 not true
    refuse_unsupported(req(min_tokens=0, skip_special_tokens=True, use_beam_search=False))
    for field, value in (("min_tokens", False), ("skip_special_tokens", 1), ("use_beam_search", 0)):
        with pytest.raises(APIError) as ei:
            refuse_unsupported(req(**{field: value}))
        assert (ei.value.status, ei.value.param, ei.value.code) == (400, field, "unsupported_value")


def test_each_prompt_of_a_request_is_one_prefix_query():
    """A request of two prompts (one sample each) is two prefix-store queries, each observed
    when that prompt's own sample finishes (not one for the whole request when it ends)."""
    from types import SimpleNamespace

    from hyspec.server.choices import Choice, Run
    from hyspec.server.metrics import Metrics
    from hyspec.server.text import StopMatcher
    from hyspec.server.worker import Job

    metrics = Metrics()
    metrics.prefix_store = True
    state = SimpleNamespace(metrics=metrics, worker=SimpleNamespace(cancel=lambda job: None))
    run = Run(state, "req", time.perf_counter())
    for p in ([1, 2, 3], [4, 5]):
        job = Job(prompt_ids=p, max_new_tokens=4, params=None, draft=0, stop_ids=set())
        run.choices.append(Choice(run, len(run.choices), p, job, StopMatcher(_chars_decode)))
    run.choices[0].job.on_finish("length", {"prompt_tokens": 3, "cached_tokens": 2})
    assert metrics.prefix_queries._value.get() == 1 and metrics.prefix_cached_tokens._value.get() == 2
    run.choices[1].job.on_finish("eos", {"prompt_tokens": 2, "cached_tokens": 0})
    assert metrics.prefix_queries._value.get() == 2 and metrics.prefix_cached_tokens._value.get() == 2
    assert [c.finish_reason for c in run.choices] == ["length", "stop"]


def _chars_decode(ids):
    return "".join(map(chr, ids))


# ---- the streaming glue and the engine worker: what a mutation run found unchecked ------------


def test_a_stream_cut_by_a_stop_string_waits_for_its_sequence_before_the_usage(server, client):
    """A stop string ends a choice (finish_reason "stop") before its engine sequence has
    ended (it is cancelled then): the stream waits for that end before its usage chunk, so the
    usage carries the sequence's stats (prompt_tokens_details.cached_tokens, here a prompt that
    extends a stored one) as the whole response's does, not the zero of stats not yet come."""
    head = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[2] + "\n        self.x = "}).json()["tokens"]
    base = client.completions.create(model=MODEL, prompt=head, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    body = {"model": MODEL, "prompt": head + base.choices[0].token_ids + [13], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}  # (it extends the stored end state of the request above)
    text = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["text"]
    body["stop"] = [text[4:7]]
    whole = httpx.post(server.url + "/v1/completions", json=body).json()
    assert whole["choices"][0]["finish_reason"] == "stop" and whole["usage"]["prompt_tokens_details"]["cached_tokens"]
    events = _sse_events(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["usage"] == whole["usage"]


def test_a_stream_logs_its_request_line(server, caplog):
    """A streamed request logs its one line (id, tokens in/out, acceptance length, latency,
    finish reasons) as a whole response does, once its stream has ended."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with caplog.at_level(logging.INFO, logger="hyspec.server"):
        rid = _sse_events(server, "/v1/completions", body)[0]["id"]
        t_end = time.monotonic() + 5  # (the line is written after [DONE] went out)
        while time.monotonic() < t_end and not any(r.getMessage().startswith(rid) for r in caplog.records):
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(rid)]
    assert len(lines) == 1 and re.fullmatch(rf"{rid} in=\d+ out=4 accept_len=[0-9.]+ latency=[0-9.]+s finish=length",
                                            lines[0]), lines


def _planted_worker(engine, **kw):
    """An EngineWorker (not started) whose callbacks run at once (no event loop)."""
    from types import SimpleNamespace

    from hyspec.server.worker import EngineWorker

    worker = EngineWorker(engine, warm_up=False, **kw)
    worker._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, *args: fn(*args))
    return worker


def _job(**kw):
    from hyspec.server.worker import Job

    return Job(prompt_ids=[1, 2], max_new_tokens=4, params=SamplingParams(), draft=0, stop_ids=set(), **kw)


def test_a_submission_is_refused_whole_when_all_its_sequences_do_not_fit(ref_engine):
    """EngineWorker.submit counts every sequence of a submission (a request's n x prompts)
    against max_batch + max_queue: all of them are queued or none (QueueFull, the 429), and
    the refused ones take no room."""
    from hyspec.server.worker import QueueFull

    worker = _planted_worker(ref_engine, max_batch=1, max_queue=2)  # (not started: the jobs stay queued)
    worker.submit([_job(), _job()])
    with pytest.raises(QueueFull):
        worker.submit([_job(), _job()])
    assert worker.counts() == (0, 2)
    worker.submit([_job()])
    assert worker.counts() == (0, 3)
    with pytest.raises(QueueFull):
        worker.submit([_job()])


def test_a_failed_graph_round_fails_its_lanes_only_and_keeps_the_runners_seconds(ref_engine):
    """A batched-graph round that raises fails the sequences on its lanes ("error", named),
    not those running on the engine core beside them; the runner is dropped (the next round
    gets a fresh one) and its seconds stay in engine_seconds, added up over every dropped runner."""
    from types import SimpleNamespace

    class Broken:
        def step(self):
            raise RuntimeError("planted")

        def stats(self):
            return {"prefill_s": 1.0, "rounds_s": 2.0, "store_s": 0.5, "graph_capture_s": 0.25}

    worker = _planted_worker(ref_engine)
    ends = []
    for _ in range(2):  # (two faults: engine_seconds adds up both dropped runners)
        lane = _job(on_finish=lambda reason, stats: ends.append(("lane", reason, stats)), _lane=SimpleNamespace())
        core = _job(on_finish=lambda reason, stats: ends.append(("core", reason, stats)), _req=SimpleNamespace())
        worker._running, worker._n_pending, worker._runner = {lane, core}, 2, Broken()
        worker._step_graphs()
        assert worker._runner is None and worker._running == {core} and worker.counts() == (1, 0)
        assert ends == [("lane", "error", {"error": "engine failure: RuntimeError"})]
        ends.clear()
    seconds = worker.engine_seconds()
    assert [seconds[f"graph_{p}"] for p in ("prefill", "rounds", "store", "capture")] == [2.0, 4.0, 1.0, 0.5]


def test_an_engine_step_that_raises_fails_the_running_sequences_and_the_worker_goes_on(ref_engine):
    """An exception out of an engine-core step (the batched path) ends every running
    sequence in "error" (their requests answer 500) instead of leaving them waiting for ever;
    the worker drops that Scheduler and serves the next sequence on a fresh one."""
    import asyncio
    from types import SimpleNamespace

    made = []

    class Scheduler:  # the engine core: its first step raises, later ones end their requests
        def __init__(self, *args, **kw):
            self.reqs = []
            made.append(self)

        def validate(self, req):
            pass

        def submit(self, req):
            self.reqs.append(req)

        def has_work(self):
            return bool(self.reqs)

        def cancel(self, req):
            pass

        def step(self):
            if len(made) == 1:
                raise RuntimeError("planted")
            for req in self.reqs:
                req.on_finish(SimpleNamespace(stop_reason="length", stats={"n": 1}))
            self.reqs.clear()

    worker = _planted_worker(ref_engine, max_batch=2)
    worker._sched_mod = SimpleNamespace(Scheduler=Scheduler, Request=lambda **kw: SimpleNamespace(**kw))
    worker.graph_path = False

    async def run():
        worker._loop = asyncio.get_running_loop()
        ends = []

        async def finish(k):
            done = asyncio.Event()
            jobs = [_job(on_finish=lambda reason, stats: (ends.append((reason, stats)), done.set())) for _ in range(k)]
            worker.submit(jobs)
            while len(ends) < k:
                await asyncio.wait_for(done.wait(), 10)
                done.clear()
            got = list(ends)
            ends.clear()
            return got

        worker.start(worker._loop)
        try:
            assert await finish(2) == [("error", {"error": "engine failure: RuntimeError"})] * 2
            assert await finish(1) == [("length", {"n": 1})]
        finally:
            await asyncio.to_thread(worker.stop)
        assert len(made) == 2 and worker.counts() == (0, 0)

    asyncio.run(run())


def test_a_call_into_the_engine_hands_back_its_result_or_its_exception(ref_engine):
    """EngineWorker.call (echo's prompt scoring): fn(engine) runs on the engine thread between
    steps and its future gets the result, or fn's own exception (not a None the caller then
    trips over: a TypeError in the log instead of what failed)."""
    import asyncio

    worker = _planted_worker(ref_engine)

    def fail(engine):
        raise ValueError("planted")

    async def run():
        worker._loop = asyncio.get_running_loop()
        ok, bad = worker.call(lambda engine: engine is ref_engine), worker.call(fail)
        worker._drain(block=False)  # (here, in place of the engine thread)
        assert await ok is True
        with pytest.raises(ValueError, match="planted"):
            await bad

    asyncio.run(run())
