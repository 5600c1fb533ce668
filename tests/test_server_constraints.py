"""Constrained decoding through `hyspec serve`: response_format json_schema / json_object and
the guided_* extensions, driven with the official `openai` client; outputs validated with
`jsonschema` and compared token for token with `Engine.generate(..., constraint=...)`."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from hyspec.engine import Engine, default_model_dir  # noqa: E402
from hyspec.sampling import SamplingParams  # noqa: E402
from hyspec.server.app import ServerConfig, create_app  # noqa: E402
from hyspec.server.thread import ServerThread  # noqa: E402

from conftest import SERVER_MODEL as MODEL  # noqa: E402  (server, client, ref_engine: conftest.py fixtures)
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
TAGS = {"type": "object", "additionalProperties": False, "required": ["ok", "tags"],
        "properties": {"ok": {"type": "boolean"},
                       "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["a", "b", "c"]}}}}
MSGS = [{"role": "user", "content": "Describe a person as JSON."}]


def rf_schema(schema, name="out"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def reference(eng, prompt, kind, value, *, max_tokens=64, temperature=0.0, seed=0, n=1, draft=3):
    out = eng.generate(prompt, max_new_tokens=max_tokens, params=SamplingParams(temperature=temperature, seed=seed),
                       draft=draft, num_samples=n, constraint=eng.constraint(kind, value))
    return [s.tokens for s in out.samples]


def text_of(eng, tokens):
    return eng.tokenizer.decode([t for t in tokens if t not in eng.eos_ids], skip_special_tokens=True)


def chat_ids(server):
    return httpx.post(server.url + "/tokenize", json={"messages": MSGS}).json()["tokens"]


def streamed(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            piece = (c.delta.content if chat else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons


# (temperature, seed, n, draft, stream, endpoint)
CASES = [(0.0, None, 1, 0, False, "cmpl"), (0.0, None, 1, 3, True, "chat"), (0.9, 7, 2, 3, False, "chat"),
         (0.9, 11, 2, 0, True, "cmpl"), (0.9, 7, 2, 0, False, "cmpl"), (0.0, None, 1, 3, False, "cmpl")]


@pytest.mark.parametrize("temperature,seed,n,draft,stream,endpoint", CASES)
def test_json_schema_validates_and_equals_engine(server, client, ref_engine, temperature, seed, n, draft, stream,
                                                 endpoint):
    schema = PERSON if endpoint == "cmpl" else TAGS
    common = dict(model=MODEL, temperature=temperature, seed=seed, n=n, stream=stream)
    extra = {"draft": draft, "return_token_ids": True}
    if endpoint == "cmpl":
        prompt = "def fibonacci(n):"
        r = client.completions.create(prompt=prompt, max_tokens=64, **common,
                                      extra_body={**extra, "response_format": rf_schema(schema)})
    else:
        prompt = chat_ids(server)
        r = client.chat.completions.create(messages=MSGS, max_completion_tokens=64, response_format=rf_schema(schema),
                                           **common, extra_body=extra)
    want = reference(ref_engine, prompt, "json_schema", schema, temperature=temperature, seed=seed or 0, n=n,
                     draft=draft)
    if stream:
        texts, reasons = streamed(r, endpoint == "chat")
        got = [texts[i] for i in range(n)]
        assert [reasons[i] for i in range(n)] == ["stop"] * n
    else:
        got = [c.text if endpoint == "cmpl" else c.message.content for c in r.choices]
        assert [c.finish_reason for c in r.choices] == ["stop"] * n
        assert [c.token_ids for c in r.choices] == want
    assert got == [text_of(ref_engine, w) for w in want]
    for t in got:
        jsonschema.validate(json.loads(t), schema)


def test_json_object_choice_regex_grammar(client, ref_engine):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=48, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}, "draft": 0})
    assert isinstance(json.loads(r.choices[0].text), dict)
    # text is no constraint at all
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=6, temperature=0,
                                  extra_body={"response_format": {"type": "text"}, "ignore_eos": True})
    assert r.choices[0].finish_reason == "length"

    choices = ["yes", "no", "maybe so"]
    r = client.completions.create(model=MODEL, prompt="Answer: ", max_tokens=8, temperature=0.9, seed=3, n=3,
                                  extra_body={"guided_choice": choices, "return_token_ids": True})
    assert all(c.text in choices and c.finish_reason == "stop" for c in r.choices)
    assert [c.token_ids for c in r.choices] == reference(ref_engine, "Answer: ", "choice", choices, max_tokens=8,
                                                         temperature=0.9, seed=3, n=3)
    # ignore_eos: the grammar's end stops the sample (stop_reason "constraint") -> "stop"
    r = client.completions.create(model=MODEL, prompt="Answer: ", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": choices, "ignore_eos": True})
    assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"

    # chat logprobs' bytes are each token's own bytes: joined they rebuild characters split
    # over byte tokens (they were once the UTF-8 of a lone U+FFFD)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=16, temperature=0,
                                       logprobs=True, top_logprobs=1, extra_body={"guided_choice": ["é😀 世"]})
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "é😀 世"
    assert bytes(b for e in content for b in e.bytes).decode("utf-8").startswith("é😀 世")

    pat = r"[a-z]{1,8}_[0-9]{2}"
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=16, temperature=0.7, seed=5,
                                       stream=True, extra_body={"guided_regex": pat})
    texts, reasons = streamed(r, True)
    assert re.fullmatch(pat, texts[0]) and reasons[0] == "stop"

    lark = 'start: "return " NAME\nNAME: /[a-z]{1,6}/'
    r = client.completions.create(model=MODEL, prompt="def f():\n    ", max_tokens=16, temperature=0,
                                  extra_body={"guided_grammar": lark, "draft": 3})
    assert re.fullmatch(r"return [a-z]{1,6}", r.choices[0].text), r.choices[0].text

    # guided_json: the vLLM name for a schema
    r = client.completions.create(model=MODEL, prompt="{", max_tokens=64, temperature=0,
                                  extra_body={"guided_json": PERSON, "return_token_ids": True})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    assert r.choices[0].token_ids == reference(ref_engine, "{", "json_schema", PERSON)[0]
    # the schema true (any JSON value), as the Python API takes it (was a 400: "Input should be an object")
    r = client.completions.create(model=MODEL, prompt="[", max_tokens=8, temperature=0,
                                  extra_body={"guided_json": True, "return_token_ids": True})
    assert r.choices[0].token_ids == reference(ref_engine, "[", "json_schema", True, max_tokens=8)[0]


BAD = [
    ({"response_format": rf_schema({"type": "foo"})}, "response_format", "Invalid type"),
    ({"response_format": rf_schema({"type": "object", "properties": {"a": {"$ref": "#/nope"}}})},
     "response_format", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"guided_regex": "(("}, "guided_regex", "regex"),
    ({"guided_regex": ""}, "guided_regex", "guided_regex"),
    ({"guided_grammar": "start: ("}, "guided_grammar", "guided_grammar"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "guided_grammar"),
    ({"guided_choice": []}, "guided_choice", "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice", None),  # a list is required (type error)
    ({"guided_json": "{not json"}, "guided_json", "guided_json"),
    # a string is JSON text, never a path: the server must not read its own files for a client
    ({"guided_json": str(default_model_dir() / "config.json")}, "guided_json", "not valid JSON"),
    ({"guided_json": "/no/such/file.json"}, "guided_json", "not valid JSON"),
    ({"guided_json": False}, "guided_json", "admits no value"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "at most one"),
]


def _metric(server, name):
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", httpx.get(server.url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_bad_constraints_are_400(server, client):
    before = _metric(server, "hyspec_prompt_tokens_total")
    for path, base in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        for patch, param, words in BAD:
            resp = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 4, **base, **patch})
            assert resp.status_code == 400, (patch, resp.text)
            assert "Traceback" not in resp.text
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error" and err["param"] == param, (patch, err)
            if words:
                assert words in err["message"], (patch, err)
    assert _metric(server, "hyspec_prompt_tokens_total") == before  # nothing was queued
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=4,
                                       response_format=rf_schema({"type": "object", "required": 5}))
    assert ei.value.body["param"] == "response_format"
    assert ei.value.body["message"].startswith("response_format.json_schema.schema:")
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices  # still serving


def test_concurrent_requests_with_different_schemas(client, ref_engine):
    cases = [(PERSON, 0.0, 3, 1), (TAGS, 0.8, 21, 2), (PERSON, 0.8, 5, 2), (TAGS, 0.0, 0, 1)]

    def go(c):
        schema, t, seed, n = c
        r = client.completions.create(model=MODEL, prompt="def main():", max_tokens=64, temperature=t, seed=seed, n=n,
                                      extra_body={"response_format": rf_schema(schema), "return_token_ids": True})
        return [ch.token_ids for ch in r.choices], [ch.text for ch in r.choices]

    with cf.ThreadPoolExecutor(len(cases)) as ex:
        got = list(ex.map(go, cases))
    for (schema, t, seed, n), (ids, texts) in zip(cases, got):
        for s in texts:
            jsonschema.validate(json.loads(s), schema)
        assert ids == reference(ref_engine, "def main():", "json_schema", schema, temperature=t, seed=seed, n=n)


def test_sequential_fallback_worker(monkeypatch, ref_engine):
    """Without the scheduler the worker passes the constraint to Engine.generate: same outputs."""
    monkeypatch.setenv("HYSPEC_SERVE_SCHEDULER", "0")
    app = create_app(Engine.load(), ServerConfig(served_model_name=MODEL, draft=3))
    with ServerThread(app) as s:
        assert httpx.get(s.url + "/health").json()["engine"] == "sequential"
        body = {"model": MODEL, "prompt": "def main():", "max_tokens": 64, "temperature": 0.8, "seed": 9, "n": 2,
                "response_format": rf_schema(TAGS), "return_token_ids": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
    assert [c["token_ids"] for c in r["choices"]] == reference(ref_engine, "def main():", "json_schema", TAGS,
                                                               temperature=0.8, seed=9, n=2)
    for c in r["choices"]:
        jsonschema.validate(json.loads(c["text"]), TAGS)
        assert c["finish_reason"] == "stop"


def test_a_constraint_that_cannot_go_on_is_a_400_and_its_neighbours_keep_their_output(server, ref_engine):
    """A grammar that cannot be completed fails at generation time: its request gets a 400
    naming the constraint (was: a 500 engine_error), streamed or not; requests running
    beside it in the same batch return their own output (were: all ended with 500)."""
    poison = {"model": MODEL, "prompt": "a", "max_tokens": 8,
              "guided_grammar": 'start: "ab" x\nx: /[^\\x00-\\U0010FFFF]/'}
    r = httpx.post(server.url + "/v1/completions", json=poison, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "constraint_failed" and "grammar constraint" in err["message"], err
    victim = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}
    want = httpx.post(server.url + "/v1/completions", json=victim, timeout=60).json()["choices"][0]["text"]
    with cf.ThreadPoolExecutor(6) as ex:
        victims = [ex.submit(httpx.post, server.url + "/v1/completions", json=victim, timeout=60) for _ in range(3)]
        poisons = [ex.submit(httpx.post, server.url + "/v1/completions", json=poison, timeout=60) for _ in range(3)]
        assert [p.result().status_code for p in poisons] == [400] * 3
        assert [v.result().json()["choices"][0]["text"] for v in victims] == [want] * 3
    def errors_400() -> float:
        for line in httpx.get(server.url + "/metrics").text.splitlines():
            if line.startswith('hyspec_request_errors_total{status="400"}'):
                return float(line.split()[-1])
        return 0.0

    before = errors_400()
    with httpx.stream("POST", server.url + "/v1/completions", json={**poison, "stream": True}, timeout=60) as s:
        body = "".join(s.iter_text())
    assert "constraint_failed" in body and "Traceback" not in body
    assert errors_400() == before + 1  # a stream's error event is counted too (it was not)
    # nothing allowed at the very first token: a 400 too (it was a 200 with an empty "stop" output), now
    # before any generation, naming the field
    never = {**poison, "guided_grammar": 'start: x\nx: /[^\x00-\U0010FFFF]/'}
    r = httpx.post(server.url + "/v1/completions", json=never, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_value" and err["param"] == "guided_grammar", r.text
    assert "the grammar admits no output" in err["message"]


def test_response_format_shapes_are_checked_before_any_grammar():
    """check_response_format directly: a json_schema response_format without its schema, with
    a non-string name or a non-boolean strict is a 400 on response_format saying which (the
    mutation run dropped each check unseen); strict null, a name and a description pass, and
    text is no constraint."""
    from hyspec.server.params import APIError, check_response_format
    from hyspec.server.schemas import ResponseFormat

    schema = {"type": "object"}
    assert check_response_format(ResponseFormat(type="text")) is None
    ok = check_response_format(ResponseFormat(type="json_schema", json_schema={
        "name": "n", "strict": None, "description": "d", "schema": schema}))
    assert (ok.kind, ok.value, ok.param) == ("json_schema", schema, "response_format")
    for js, words in (({"name": "n"}, "json_schema.schema is missing"),
                      ({"name": 5, "schema": schema}, "json_schema.name must be a string"),
                      ({"strict": "yes", "schema": schema}, "json_schema.strict must be a boolean")):
        with pytest.raises(APIError) as ei:
            check_response_format(ResponseFormat(type="json_schema", json_schema=js))
        assert (ei.value.status, ei.value.param) == (400, "response_format") and words in ei.value.message, js
