"""Tool calling: hyspec.tools' parsers on both Qwen formats, and `hyspec serve` answering
`tools` / `tool_choice` in OpenAI's `tool_calls` form, driven with the official `openai`
client. The replies are made deterministic with constraints: guided_regex makes the tiny
model write a given tool call ("auto" parsing), tool_choice required / named constrain the
output by the tools' schemas, compared token for token with Engine.generate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hyspec.tools import (
    EMPTY_PARAMETERS,
    ToolError,
    ToolStream,
    check_tools,
    convert_parameter,
    parse_forced,
    parse_tool_calls,
    template_messages,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}, "limit": {"type": ["integer", "null"]}, "exact": {"type": "boolean"},
        "score": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"}}}}}
TOOLS = check_tools([WEATHER, CLOCK, SEARCH]).tools

HERMES = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
XML = ("<tool_call>\n<function=search>\n<parameter=q>\nbest  café\n in Oslo\n</parameter>\n"
       "<parameter=limit>\n5\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n"
       "<parameter=score>\n0.5\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
       "<parameter=opts>\n{\"x\": null}\n</parameter>\n</function>\n</tool_call>\n"
       "<tool_call>\n<function=now>\n</function>\n</tool_call>")


def test_both_formats_parse_and_bad_blocks_stay_text():
    content, calls = parse_tool_calls(HERMES, TOOLS)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    assert calls[0].id.startswith("call_") and calls[0].openai(2)["index"] == 2
    content, calls = parse_tool_calls(XML, TOOLS)
    assert content == "" and [c.name for c in calls] == ["search", "now"]
    assert json.loads(calls[0].arguments) == {"q": "best  café\n in Oslo", "limit": 5, "exact": True, "score": 0.5,
                                              "tags": ["a", 1], "opts": {"x": None}}
    assert json.loads(calls[1].arguments) == {}
    # arguments given as JSON text, "parameters" for "arguments"
    _, calls = parse_tool_calls('<tool_call>{"name": "now", "parameters": "{}"}</tool_call>', TOOLS)
    assert calls[0].arguments == "{}"
    # an undeclared function, broken JSON (closed or not), stray text in XML: all stay text
    for text in ['<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "now", "arguments": {}\n</tool_call>',
                 'ok <tool_call>\n{"name": "now", "arguments": {}',
                 "<tool_call>\n<function=now>\nhello\n</function>\n</tool_call>",
                 "no call here",
                 # a name that is no string, nesting too deep for the parser: were a 500 (TypeError,
                 # RecursionError); they stay text
                 '<tool_call>{"name": ["now"], "arguments": {}}</tool_call>',
                 '<tool_call>{"name": {"a": 1}, "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "now", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + '}}</tool_call>']:
        assert parse_tool_calls(text, TOOLS) == (text, [])
    # an unclosed last block that parses whole is a call (an EOS before </tool_call>, or the
    # client's stop=["</tool_call>"] cut it): it stayed text, and the call was lost
    content, calls = parse_tool_calls('ok <tool_call>\n{"name": "now", "arguments": {}}\n', TOOLS)
    assert content == "ok" and [c.name for c in calls] == ["now"]
    two = HERMES + "\n<tool_call>\n<function=now>\n</function>\n"
    content, calls = parse_tool_calls(two, TOOLS)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather", "now"]
    content, calls = parse_tool_calls(HERMES + '\n<tool_call>{"name": "now"', TOOLS)  # cut: text
    assert content == 'Let me look.\n<tool_call>{"name": "now"' and [c.name for c in calls] == ["get_weather"]
    # a mention of the tag before a real call: the mention is content, the call is parsed
    said = "Use the <tool_call> tag to call it:\n" + XML.split("\n<tool_call>\n<function=now>")[0]
    content, calls = parse_tool_calls(said, TOOLS)
    assert content == "Use the <tool_call> tag to call it:" and [c.name for c in calls] == ["search"]
    # a bad block beside a good one: the bad one is content
    bad = '<tool_call>{"name": "rm_rf"}</tool_call>'
    content, calls = parse_tool_calls("A\n" + bad + "\n" + HERMES.split("\n", 1)[1] + "\nB", TOOLS)
    assert content == "A\n" + bad + "\nB" and len(calls) == 1


def test_a_stray_close_tag_or_a_mention_keeps_the_calls_and_the_text_as_written():
    """A </tool_call> with no <tool_call> before it ("each call ends with </tool_call>") made
    every later block, whole valid calls too, one unclosed block that did not parse: the calls
    came back as content (finish_reason "stop"). A block kept as text ended its piece of
    content, so the text after it was stripped and joined with a newline ("</tool_call> tags"
    came back "</tool_call>\ntags"). A stream gives the same content and calls."""
    rome = HERMES.split("\n", 1)[1].replace("Paris", "Oslo")
    for text, want_content, want in (
            ("Each call ends with </tool_call>.\n" + HERMES, "Each call ends with </tool_call>.\nLet me look.",
             ["Paris"]),
            (HERMES + "\nstray </tool_call> then\n" + rome, "Let me look.\nstray </tool_call> then", ["Paris", "Oslo"]),
            ("I will use <tool_call> and </tool_call> tags.\n\nSecond paragraph.\n" + rome,
             "I will use <tool_call> and </tool_call> tags.\n\nSecond paragraph.", ["Oslo"])):
        content, calls = parse_tool_calls(text, TOOLS)
        assert content == want_content and [json.loads(c.arguments)["city"] for c in calls] == want, text
        for step in (1, 5):
            stream, sent = ToolStream(TOOLS), ""
            for end in range(step, len(text) + step, step):
                sent += stream.update(text[:end], False)
            sent += stream.update(text, True)
            assert sent == content and [c.arguments for c in stream.calls] == [c.arguments for c in calls]


def test_a_call_whose_json_holds_half_a_surrogate_pair_stays_text():
    """A lone surrogate escape in a call's JSON ("\\ud83d", half an emoji) is valid JSON but
    not Unicode a response can carry: its arguments made the UTF-8 JSON response (a 500) and
    the stream's event fail. The block stays text, as one with NaN does."""
    from hyspec.server.streaming import sse

    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "half \\ud83d", "days": 1}}\n</tool_call>'
    assert parse_tool_calls(bad, TOOLS) == (bad, [])
    msg = Reply.of(check_tools([WEATHER]), None).whole(bad)
    assert "tool_calls" not in msg and json.dumps(msg, ensure_ascii=False).encode("utf-8")
    sse({"delta": msg}).encode("utf-8")
    # a "required" array: the call with half a pair is dropped, the others stay (one such call
    # dropped them all)
    required = check_tools([WEATHER, CLOCK], "required")
    calls = parse_forced('[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": '
                         '{"city": "half \\ud83d", "days": 2}}]', required)
    assert [c.name for c in calls] == ["now"]
    calls = parse_forced('[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": '
                         '{"city": "x", "days": 1e999}}]', required)  # (a number beyond the float range: the same)
    assert [c.name for c in calls] == ["now"]
    ok = bad.replace("\\ud83d", "\\ud83d\\ude00")  # the whole pair: one emoji
    assert json.loads(parse_tool_calls(ok, TOOLS)[1][0].arguments)["city"] == "half \U0001F600"


def test_parameter_conversion_follows_the_schema():
    assert convert_parameter("007", {"type": "string"}) == "007"
    assert convert_parameter(" 7 ", {"type": "integer"}) == 7
    assert convert_parameter("7.5", {"type": "integer"}) == "7.5"  # not an integer: kept as text
    assert convert_parameter("null", {"type": ["integer", "null"]}) is None
    assert convert_parameter("false", {"type": "boolean"}) is False
    assert convert_parameter("[1]", {"type": "object"}) == "[1]"
    # undeclared, or declared without a type ($ref): a string, never a guess
    assert convert_parameter("[1]", None) == "[1]" and convert_parameter("true", {"$ref": "#/$defs/X"}) == "true"
    # the types of anyOf branches and enum values; null where allowed (Qwen3.5's template writes None)
    assert convert_parameter("12345", {"anyOf": [{"type": "string"}, {"type": "null"}]}) == "12345"
    assert convert_parameter("1", {"enum": ["1", "2"]}) == "1" and convert_parameter("2", {"enum": [1, 2]}) == 2
    assert convert_parameter("None", {"type": ["integer", "null"]}) is None
    assert convert_parameter("null", {"type": "string"}) == "null"
    # NaN / Infinity are no JSON: kept as text, and a JSON call holding one is no call
    assert convert_parameter("NaN", {"type": "number"}) == "NaN"
    bad = '<tool_call>{"name": "search", "arguments": {"score": Infinity}}</tool_call>'
    assert parse_tool_calls(bad, TOOLS) == (bad, [])


def test_parameter_conversion_by_the_declared_types_only():
    """A boolean is no integer or number (JSON's true is no 1); "null" is null where the
    schema declares no string; every anyOf branch's type counts; a parameter's text loses
    one line break at each end, no more."""
    assert convert_parameter("true", {"type": "integer"}) == "true"
    assert convert_parameter("false", {"type": "number"}) == "false"
    assert convert_parameter("null", {"type": "integer"}) is None
    assert convert_parameter("5", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 5
    assert convert_parameter("[1]", {"oneOf": [{"type": "array"}, {"type": "string"}]}) == [1]
    xml = "<tool_call>\n<function=search>\n<parameter=q>\n a \n\n</parameter>\n</function>\n</tool_call>"
    assert json.loads(parse_tool_calls(xml, TOOLS)[1][0].arguments) == {"q": " a \n"}
    # a number beyond the float range (1e999, Python's inf: no response carries it) is no
    # number: the text stays a string and the call stands, as "NaN" does (the call was dropped)
    assert convert_parameter("1e999", {"type": "number"}) == "1e999"
    assert convert_parameter("[1, -1e999]", {"type": ["array", "string"]}) == "[1, -1e999]"
    xml = "<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n<parameter=score>\n1e999\n</parameter>\n</function>\n</tool_call>"
    assert json.loads(parse_tool_calls(xml, TOOLS)[1][0].arguments) == {"q": "x", "score": "1e999"}


def test_json_calls_content_and_forced_output_edge_cases():
    """"parameters" for "arguments" keeps its values; arguments that are no object, or a
    number JSON cannot carry (1e999), leave the block as text; an unclosed last block runs
    from the last <tool_call> (an earlier one is a mention); the content before a call keeps
    its leading whitespace; a whole reply's call has no "index" (a stream's has)."""
    _, calls = parse_tool_calls('<tool_call>{"name": "search", "parameters": {"q": "x"}}</tool_call>', TOOLS)
    assert json.loads(calls[0].arguments) == {"q": "x"}
    for text in ('<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
                 '<tool_call>{"name": "search", "arguments": {"score": 1e999}}</tool_call>'):
        assert parse_tool_calls(text, TOOLS) == (text, [])
    content, calls = parse_tool_calls('a <tool_call> b <tool_call>{"name": "now"}', TOOLS)
    assert content == "a <tool_call> b" and [c.name for c in calls] == ["now"]
    content, calls = parse_tool_calls('  Sure. <tool_call>{"name": "now"}</tool_call>', TOOLS)
    assert content == "  Sure." and len(calls) == 1
    assert "index" not in calls[0].openai() and calls[0].openai(0)["index"] == 0
    # "required": an array of declared calls only (a lone object, an undeclared name: no call)
    spec = check_tools([WEATHER, CLOCK], "required")
    assert parse_forced('{"name": "now", "parameters": {}}', spec) == []
    assert [c.name for c in parse_forced('[{"name": "rm", "parameters": {}}, {"name": "now", "parameters": {}}]',
                                         spec)] == ["now"]


def test_tool_checks_refuse_what_is_no_function_tool():
    """parameters of another type than object (an array too), a description that is no
    string and a parallel_tool_calls that is no boolean are refused by field; history
    arguments given as empty text are none ({}), and only an assistant message's tool calls
    are read."""
    for tool, words in (({"name": "f", "parameters": {"type": "array"}}, "must describe an object"),
                        ({"name": "f", "description": 5}, "description must be a string")):
        with pytest.raises(ToolError, match=words) as e:
            check_tools([{"type": "function", "function": tool}])
        assert e.value.param == "tools"
    with pytest.raises(ToolError, match="parallel_tool_calls must be a boolean") as e:
        check_tools([CLOCK], None, "no")
    assert e.value.param == "parallel_tool_calls"
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": " "}}
    out = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {}
    other = [{"role": "user", "content": "x", "tool_calls": [call]}]
    assert template_messages(other) == other


def test_stream_content_equals_the_whole_reply_at_every_split():
    for text in [HERMES, XML, "plain <tool reply>  \n", "ends in <tool_c", 'x <tool_call>{"bad"}</tool_call> y',
                 "  lead and trail  ", "Use the <tool_call> tag:\n" + HERMES, "a <tool_call> b <tool_call>\n{",
                 'ok <tool_call>\n{"name": "now", "arguments": {}}\n', HERMES + "\n<tool_call><function=now></function>"]:
        content, calls = parse_tool_calls(text, TOOLS)
        for step in (1, 3, 7):
            stream, sent = ToolStream(TOOLS), ""
            for end in range(step, len(text) + step, step):
                sent += stream.update(text[:end], False)
            sent += stream.update(text, True)
            assert sent == content, (text, step)
            assert [c.name for c in stream.calls] == [c.name for c in calls]
            if calls:
                assert "<tool_call>\n" not in sent  # (a mention of the tag may be content)
    # each call goes out as soon as its block closes, once, with one id
    stream, seen = ToolStream(TOOLS), []
    first_close = XML.index("</tool_call>") + len("</tool_call>")
    for end in range(1, len(XML) + 1):
        stream.update(XML[:end], end == len(XML))
        seen += stream.new_calls
        assert len(seen) == (0 if end < first_close else 1 if end < len(XML) else 2)
    assert [c.name for c in seen] == ["search", "now"] and stream.calls == seen


def test_tool_checks_name_the_field():
    assert check_tools(None) is None and check_tools([], "none") is None
    spec = check_tools([WEATHER, CLOCK], {"type": "function", "function": {"name": "now"}}, False)
    assert spec.choice == "named" and spec.named.parameters == EMPTY_PARAMETERS and not spec.parallel
    assert check_tools([CLOCK], "none").parses is False
    cases = [(([], "auto"), "tool_choice needs tools"), (("x",), "tools must be a list"),
             (([{"type": "code"}],), "function tools only"), (([{"type": "function"}],), "name"),
             (([{"type": "function", "function": {"name": "a b"}}],), "got 'a b'"),
             # ("$" matched before a final newline: "now\n" was taken, rendered and forced as the name)
             (([{"type": "function", "function": {"name": "now\n"}}],), r"got 'now\\n'"),
             (([CLOCK, CLOCK],), "a second tool named 'now'"),
             (([{"type": "function", "function": {"name": "f", "parameters": [1]}}],), "JSON schema object"),
             (([CLOCK], "sometimes"), "tool_choice must be one of"),
             (([CLOCK], {"type": "function", "function": {"name": "later"}}), "'later', which is not among"),
             (([CLOCK], {"function": "now"}), "tool_choice must be")]
    for args, words in cases:
        with pytest.raises(ToolError, match=words):
            check_tools(*args)
    # a parameters schema without "type" is an object's in the forced output too (JSON Schema
    # alone let any value through: the arguments came back as '"xml"' or a number)
    jsonschema = pytest.importorskip("jsonschema")
    for params in ({}, {"properties": {"city": {"type": "string"}}}):
        loose = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        named = check_tools(loose, {"type": "function", "function": {"name": "f"}}).constraint_schema()
        required = check_tools(loose, "required").constraint_schema()
        for bad in ('"xml"', -4.1, [1]):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, named)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate([{"name": "f", "parameters": bad}], required)
        jsonschema.validate({"city": "Oslo"}, named)
        jsonschema.validate([{"name": "f", "parameters": {}}], required)
    # required: an array of {name, parameters}; at most one without parallel calls
    schema = check_tools([WEATHER, CLOCK], "required", False).constraint_schema()
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    spec = check_tools([WEATHER, CLOCK], "required")
    calls = parse_forced('[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": '
                         '{"city": "Oslo", "days": 2}}]', spec)
    assert [c.name for c in calls] == ["now", "get_weather"] and parse_forced('[{"name": "now", "par', spec) == []


def test_history_tool_calls_reach_the_template_as_objects():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    out = template_messages(msgs)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"tz": "UTC"}'  # the request is not changed
    for bad in ("{tz", '{"a": ' + "[" * 5000 + "]" * 5000 + "}"):  # (the deep one was a RecursionError: a 500)
        msgs[1]["tool_calls"][0]["function"]["arguments"] = bad
        with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not valid JSON"):
            template_messages(msgs)


def test_a_tool_name_may_have_64_characters():
    """OpenAI's limit on a function name is 64 characters: a 64-character name is taken, a
    65-character one is refused by field (an off-by-one refused every tool at the limit)."""
    assert list(check_tools([{"type": "function", "function": {"name": "a" * 64}}]).tools) == ["a" * 64]
    with pytest.raises(ToolError, match="1-64 letters") as e:
        check_tools([{"type": "function", "function": {"name": "a" * 65}}])
    assert e.value.param == "tools"


def test_parameter_conversion_keeps_undeclared_null_text_and_takes_whole_numbers():
    """A parameter the schema does not declare, or declares without a type ($ref), stays a
    string even when its text is "null" / "None" (a string never becomes something else by
    guessing); a whole number is a value of a "number" parameter (JSON's 3 is a number), in
    a whole XML call too (it stayed the string "3")."""
    assert convert_parameter("null", None) == "null" and convert_parameter("None", {"$ref": "#/$defs/X"}) == "None"
    for text, want in (("3", 3), ("-2", -2), ("0", 0)):
        got = convert_parameter(text, {"type": "number"})
        assert got == want and type(got) is int, text
    xml = ("<tool_call>\n<function=search>\n<parameter=score>\n3\n</parameter>\n"
           "<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>")
    assert json.loads(parse_tool_calls(xml, TOOLS)[1][0].arguments) == {"score": 3, "note": "null"}


def test_an_xml_call_is_its_function_block_whole():
    """An XML block is one <function=...> element and nothing else: text after </function>
    leaves the block as text (it was parsed as a call and the text was lost); spaces around
    the function's name are no part of it."""
    text = "<tool_call>\n<function=now>\n</function>\nand then rm -rf\n</tool_call>"
    assert parse_tool_calls(text, TOOLS) == (text, [])
    _, calls = parse_tool_calls("<tool_call>\n<function= now >\n</function>\n</tool_call>", TOOLS)
    assert [c.name for c in calls] == ["now"]


def test_a_reply_that_is_one_unclosed_call_is_that_call():
    """A reply that is nothing but a call cut before its </tool_call> (an EOS, or a client's
    stop=["</tool_call>"]) is that call, in both formats, whole and streamed (an unclosed
    block at the very start of the reply stayed text)."""
    for text in ('<tool_call>\n{"name": "now", "arguments": {}}\n', "<tool_call>\n<function=now>\n</function>\n"):
        assert [(c.name, c.arguments) for c in parse_tool_calls(text, TOOLS)[1]] == [("now", "{}")], text
        assert parse_tool_calls(text, TOOLS)[0] == ""
        stream, sent = ToolStream(TOOLS), ""
        for end in range(1, len(text)):
            sent += stream.update(text[:end], False)
        sent += stream.update(text, True)
        assert sent == "" and [c.name for c in stream.calls] == ["now"]


# ------------------------------------------------------------------------------------------
# Through the server
# ------------------------------------------------------------------------------------------

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

# A template that shows tools and replays tool calls (the shape of Qwen's, in our own words)
TEMPLATE = """{%- if tools %}<|im_start|>system
You can call these tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content or '' }}{% for c in m.tool_calls %}<tool_call>
<function={{ c.function.name }}>
{% for k, v in c.function.arguments | items %}<parameter={{ k }}>
{{ v }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
MSGS = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
MODEL = "tools-model"


def checkpoint_with(d: Path, template: str, source=None) -> Path:
    """A copy of a checkpoint directory (default: the embedded model) in `d`, with `template`
    as its chat template."""
    from hyspec.engine import default_model_dir

    for f in Path(source or default_model_dir()).iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return d


@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory):
    from hyspec.engine import Engine

    return Engine.load(checkpoint_with(tmp_path_factory.mktemp("tools_model"), TEMPLATE))


@pytest.fixture(scope="module")
def tool_server(tool_engine):
    from hyspec.engine import Engine
    from hyspec.server.app import ServerConfig, create_app
    from hyspec.server.thread import ServerThread

    app = create_app(Engine.load(tool_engine.model_dir), ServerConfig(served_model_name=MODEL, draft=3, max_batch=8))
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def tool_client(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def prompt_ids(server, tools, messages=MSGS):
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": tools})
    assert r.status_code == 200
    return r.json()["tokens"]


def streamed_calls(chunks):
    """(content, {index: {id, name, arguments}}, finish_reason) of one streamed choice
    (content: None while no delta had a content string, as the openai client accumulates it)."""
    content, calls, reason = None, {}, None
    for ch in chunks:
        for c in ch.choices:
            if c.delta.content is not None:
                content = (content or "") + c.delta.content
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            reason = c.finish_reason or reason
    return content, calls, reason


def regex_of(text):
    import re

    return re.escape(text)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_what_the_model_writes(tool_client, stream):
    """guided_regex makes the model write a reply with tool calls (both formats): the answer
    carries them as tool_calls, the rest as content, finish_reason tool_calls."""
    for text, names, content in [(HERMES, ["get_weather"], "Let me look."), (XML, ["search", "now"], None)]:
        r = tool_client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER, CLOCK, SEARCH],
                                                max_tokens=200, temperature=0, stream=stream,
                                                extra_body={"guided_regex": regex_of(text)})
        want = parse_tool_calls(text, TOOLS)[1]
        if stream:
            got_content, got, reason = streamed_calls(r)
            assert (got_content or "") == (content or "")  # (auto: the role chunk cannot know it will be calls only)
            got = [got[i] for i in sorted(got)]
            assert all(g["id"].startswith("call_") for g in got)
        else:
            msg = r.choices[0].message
            reason, got_content = r.choices[0].finish_reason, msg.content
            assert got_content == content
            got = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls]
            assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
        assert reason == "tool_calls"
        assert [(g["name"], json.loads(g["arguments"])) for g in got] == \
               [(c.name, json.loads(c.arguments)) for c in want]
    # tool_choice none: the same reply is plain content
    r = tool_client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], tool_choice="none",
                                            max_tokens=200, temperature=0,
                                            extra_body={"guided_regex": regex_of(HERMES)})
    assert r.choices[0].message.content == HERMES and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_are_constrained_and_exact(tool_server, tool_client, tool_engine, stream):
    """A named function's arguments, and required's calls, match the tools' schemas, and are
    the tokens Engine.generate gives under the same JSON-schema constraint (speculative,
    draft 3)."""
    from hyspec.sampling import SamplingParams

    ids = prompt_ids(tool_server, [WEATHER, CLOCK])
    assert ids != prompt_ids(tool_server, None)  # the tools are in the prompt
    for choice in [{"type": "function", "function": {"name": "get_weather"}}, "required"]:
        spec = check_tools([WEATHER, CLOCK], choice)
        r = tool_client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER, CLOCK],
                                                tool_choice=choice, max_tokens=120, temperature=0, stream=stream,
                                                extra_body={"draft": 3})
        ref = tool_engine.generate(ids, max_new_tokens=120, params=SamplingParams(temperature=0.0), draft=3,
                                   constraint=tool_engine.constraint("json_schema", spec.constraint_schema()))
        want = parse_forced(tool_engine.tokenizer.decode(
            [t for t in ref.tokens if t not in tool_engine.eos_ids], skip_special_tokens=True), spec)
        assert want, "the reference output must be a complete call"
        if stream:
            content, got, reason = streamed_calls(r)
            assert content is None  # as the whole reply's (the role chunk's content is null here)
            got = [got[i] for i in sorted(got)]
        else:
            msg, reason = r.choices[0].message, r.choices[0].finish_reason
            assert msg.content is None
            got = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls]
        assert reason == ("stop" if choice != "required" else "tool_calls")  # a named call ends as OpenAI's
        assert [(g["name"], json.loads(g["arguments"])) for g in got] == \
               [(c.name, json.loads(c.arguments)) for c in want]
        for g in got:
            if g["name"] == "get_weather":
                jsonschema.validate(json.loads(g["arguments"]), WEATHER["function"]["parameters"])
        if choice != "required":
            assert [g["name"] for g in got] == ["get_weather"]


def test_history_with_tool_calls_renders(tool_client, tool_engine):
    """A second turn: the assistant's call (arguments as JSON text) and the tool's answer
    are rendered by the template (arguments iterated as an object)."""
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = tool_client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=4,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    from hyspec.chat_template import ChatTemplate

    text = ChatTemplate(TEMPLATE).render(template_messages(msgs), tools=[WEATHER])
    assert "<parameter=city>\nParis\n</parameter>" in text and "<tool_response>sunny</tool_response>" in text
    assert r.usage.prompt_tokens == len(tool_engine.tokenizer.encode(text))


BAD = [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
        "not among the tools"),
       ({"tool_choice": "required"}, "tool_choice", "needs tools"),
       ({"tools": [{"type": "function", "function": {"name": "x", "parameters": "obj"}}]}, "tools", "JSON schema"),
       ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}]}, "tools",
        "must describe an object"),
       ({"functions": [WEATHER["function"]]}, "functions", "give tools"),
       ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format", "at most one output constraint"),
       ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "object",
                                                                                  "required": 5}}}],
         "tool_choice": "required"}, "tools", ""),
       ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
           {"id": "c", "type": "function", "function": {"name": "x", "arguments": "{oops"}}]}]},
        "messages", "not valid JSON"),
       ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
           {"id": "c", "type": "function", "function": {"name": "x", "arguments": "[1, 2]"}}]}]},
        "messages", "must be a JSON object"),
       ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"$defs": {"X": {"type": "string"}}}}},
                   {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"X": {"type": "integer"}}}}}],
         "tool_choice": "required"}, "tools", "define $defs/X differently"),
       # a tool's schema the library cannot take: the tool is named (the combined schema's error did not)
       ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {
           "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}],
         "tool_choice": "required"}, "tools", "tools: tool 'g': parameters: Unimplemented keys: [\"uniqueItems\"]"),
       ({"tools": [WEATHER, {"type": "function", "function": {"name": "h", "parameters": {
           "type": "object", "properties": {"a": {"type": "foo"}}}}}],
         "tool_choice": {"type": "function", "function": {"name": "h"}}}, "tools", "tool 'h': parameters: Invalid type")]


@pytest.mark.parametrize("body,param,words", BAD)
def test_bad_tool_requests_are_400(tool_server, body, param, words):
    r = httpx.post(tool_server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert "Traceback" not in r.text


def test_a_template_without_tools_refuses_them(server):
    """The embedded default model's plain template never shows tools: a 400, not a reply
    from a model that could not see them."""
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": MSGS, "tools": [WEATHER], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "does not show tools" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------
# Thinking replies: reasoning_content
# ------------------------------------------------------------------------------------------

from hyspec.reasoning import ReasoningStream, prompt_opens_thinking, split_reasoning  # noqa: E402
from hyspec.reply import Reply  # noqa: E402

THOUGHT = "The user wants weather.\nCall it.\n</think>\n\n" + HERMES


def test_reasoning_splits_at_the_closing_tag_or_a_tool_call():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<think>\n\n</think>\n\n") and not prompt_opens_thinking("hi")
    assert split_reasoning(THOUGHT, True) == ("The user wants weather.\nCall it.\n", HERMES)
    assert split_reasoning("<think>a</think>b", False) == ("a", "b")  # the model opens it itself
    assert split_reasoning("still thinking", True) == ("still thinking", "")  # cut while thinking
    assert split_reasoning("plain answer", False) == (None, "plain answer")
    assert split_reasoning("\n <think>a</think>b", False) == ("a", "b")  # (after leading whitespace too)
    # a reply cut right after a <tool_call> tag (nothing yet says it starts a call) is still reasoning,
    # and a stream sends neither the tag as content nor as reasoning before it can tell
    assert split_reasoning("hmm <tool_call>", True) == ("hmm <tool_call>", "")
    assert Reply("off", None, True).delta("hmm <tool_call>", False) == {"reasoning_content": "hmm "}
    assert split_reasoning("hmm\n<tool_call>\n{}</tool_call>", True) == ("hmm\n", "<tool_call>\n{}</tool_call>")
    # a mention of the tag is reasoning text; only a tag that starts a call ends the reasoning
    said = "I should answer with a <tool_call> block.\n</think>\n\n" + HERMES
    assert split_reasoning(said, True) == ("I should answer with a <tool_call> block.\n", HERMES)
    # a constrained reply's reasoning ends at </think> only (its grammar lets calls through there)
    odd = "a <tool_call>\n{} b</think>[1]"
    assert split_reasoning(odd, True, calls_end=False) == ("a <tool_call>\n{} b", "[1]")
    assert Reply.of(None, True, constrained=True).whole(odd)["reasoning_content"] == "a <tool_call>\n{} b"
    stream, got = Reply.of(None, True, constrained=True), ""
    for end in range(1, len(odd)):
        got += stream.delta(odd[:end], False).get("reasoning_content", "")
    got += stream.delta(odd, True).get("reasoning_content", "")
    assert got == "a <tool_call>\n{} b"
    # only the generation prompt opens thinking: a user's "<think>" does not
    from hyspec.chat_template import ChatTemplate

    tpl = ChatTemplate("{% for m in messages %}{{ m.content }}|{% endfor %}{% if add_generation_prompt %}A:"
                       "{% endif %}{# </think> #}")
    msgs = [{"role": "user", "content": "What is the <think> tag for?"}]
    prompt = tpl.render(msgs)
    assert prompt_opens_thinking(prompt) and tpl.generation_suffix(prompt, msgs) == "A:"
    assert not prompt_opens_thinking(tpl.generation_suffix(prompt, msgs))


def test_reasoning_that_closes_at_once_or_is_ended_by_a_call_before_its_close():
    """A reply that closes its thinking at once ("</think>" first) has empty reasoning and
    its answer (it was all reasoning, the answer lost); one that calls a tool at once is
    that call. A call written before a later </think> ends the reasoning there: the call is
    made, not shown as reasoning text."""
    assert split_reasoning("</think>\n\nHello", True) == ("", "Hello")
    msg = Reply("auto", check_tools([CLOCK]), True).whole("</think>\n\nHello")
    assert msg["content"] == "Hello" and "reasoning_content" not in msg
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert split_reasoning(call, True) == ("", call)
    msg = Reply("auto", check_tools([CLOCK]), True).whole(call)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["now"] and "reasoning_content" not in msg
    late = "Plan: call it. " + call + "\n</think>\n\nDone."
    assert split_reasoning(late, True)[0] == "Plan: call it. "
    msg = Reply("auto", check_tools([CLOCK]), True).whole(late)
    assert msg["reasoning_content"] == "Plan: call it. " and [c["function"]["name"] for c in msg["tool_calls"]] == ["now"]


PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
SAID = '<tool_call>\n{"name": "search", "arguments": {"q": "what </think> means"}}\n</tool_call>'
NOW_XML = "<tool_call>\n<function=now>\n</function>\n</tool_call>"
# (reply text (the prompt opens <think>), reasoning, answer, content, calls' names)
LATE_CLOSE = [
    # (a) a call ends the reasoning, then the model writes the </think> it owed: dropped, with the
    # whitespace after it (it stayed in the content: "</think>\n\nDone.")
    ("I should look it up.\n" + PARIS + "\n</think>\n\nDone.", "I should look it up.\n",
     PARIS + "\nDone.", "Done.", ["get_weather"]),
    ("Hm.\n" + NOW_XML + "\n</think>\n\n" + PARIS, "Hm.\n", NOW_XML + "\n" + PARIS, None, ["now", "get_weather"]),
    # only the first such </think> goes; text before it stays
    ("x " + NOW_XML + " ok</think>  a </think> b", "x ", NOW_XML + " oka </think> b", "oka </think> b", ["now"]),
    # (b) a </think> inside a call's arguments is theirs, not the owed tag; the one after the call goes
    ("Look.\n" + SAID + "\n</think>\n\nDone.", "Look.\n", SAID + "\nDone.", "Done.", ["search"]),
    ("Look.\n" + SAID, "Look.\n", SAID, None, ["search"]),
    # a block never closed runs to the end: a </think> in it stays
    ("a " + PARIS[:-len("</tool_call>")] + "</think> b", "a ", PARIS[:-len("</tool_call>")] + "</think> b",
     PARIS[:-len("</tool_call>")] + "</think> b", []),
    # (c) reasoning closed by </think>: as before (a later </think> in the answer is answer text)
    ("Plan.\n</think>\n\n" + PARIS + "\n</think>\nDone.", "Plan.\n", PARIS + "\n</think>\nDone.",
     "</think>\nDone.", ["get_weather"]),
    ("a <tool_call> b\n</think>\n\nc </think>", "a <tool_call> b\n", "c </think>", "c </think>", []),
]
LATE_IDS = ["call-close-text", "call-close-call", "first-close-only", "close-in-args-then-close", "close-in-args",
            "unclosed-block", "closed-first", "mention-then-closed"]


@pytest.mark.parametrize("text, reasoning, answer, content, names", LATE_CLOSE, ids=LATE_IDS)
def test_a_think_close_after_the_call_that_ended_the_reasoning_is_dropped(text, reasoning, answer, content, names):
    """Qwen3.5 may call a tool before it closes its thinking, then close it: the reasoning
    ends at the call (as before), and the first </think> after it outside every call block
    is no part of the answer (it stayed as stray content); one inside a call's arguments, or
    in a reply whose reasoning </think> closed, is text as written."""
    assert split_reasoning(text, True) == (reasoning, answer)
    msg = Reply("auto", check_tools([WEATHER, CLOCK, SEARCH]), True).whole(text)
    assert msg["content"] == content and msg.get("reasoning_content") == reasoning
    assert [c["function"]["name"] for c in msg.get("tool_calls", [])] == names
    if names and names[0] == "search":
        assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"q": "what </think> means"}


@pytest.mark.parametrize("text, reasoning, answer, content, names", LATE_CLOSE, ids=LATE_IDS)
def test_a_think_close_after_the_call_is_dropped_streamed_too(text, reasoning, answer, content, names):
    """Streamed a character at a time: `answer` is a prefix of the whole reply's at every
    step (a trailing start of the owed </think> is held back until it is the tag or is not),
    and the pieces (reasoning, content, calls) add up to the whole reply's fields."""
    stream, sent = ReasoningStream(True), ""
    for end in range(len(text) + 1):
        sent += stream.update(text[:end], end == len(text))
        assert answer.startswith(stream.answer), (text[:end], stream.answer)
    assert (sent, stream.answer) == (reasoning, answer)
    spec = check_tools([WEATHER, CLOCK, SEARCH])
    whole = Reply("auto", spec, True).whole(text)
    reply, got = Reply("auto", spec, True), {"reasoning_content": "", "content": "", "tool_calls": []}
    for end in range(1, len(text) + 1):
        out = reply.delta(text[:end], end == len(text))
        for key in got:
            got[key] += out.get(key, "" if key != "tool_calls" else [])
    assert got["reasoning_content"] == whole.get("reasoning_content", "") == reasoning
    assert got["content"] == (whole["content"] or "") == (content or "")
    assert [c["function"] for c in got["tool_calls"]] == [c["function"] for c in whole.get("tool_calls", [])]
    assert [c["function"]["name"] for c in got["tool_calls"]] == names


def test_a_stream_holds_back_a_start_of_the_owed_think_close():
    """A reply whose reasoning a call ended, cut in its owed "</think>": the stream's answer
    stops before the piece of the tag, and a piece that does not become it is let through."""
    head = "Hm.\n" + PARIS + "\n"
    stream = ReasoningStream(True)
    stream.update(head + "</thi", False)
    assert stream.answer == PARIS + "\n"
    stream.update(head + "</thin", False)
    assert stream.answer == PARIS + "\n"
    stream.update(head + "</thing", False)
    assert stream.answer == PARIS + "\n</thing"
    stream = ReasoningStream(True)
    stream.update(head + "</think>\n", False)
    assert stream.answer == PARIS + "\n"
    stream.update(head + "</think>\n\nOK", False)
    assert stream.answer == PARIS + "\nOK"
    # inside a block nothing is held or dropped: the arguments are the call's
    stream = ReasoningStream(True)
    stream.update('Hm.\n<tool_call>\n{"name": "search", "arguments": {"q": "</thi', False)
    assert stream.answer == '<tool_call>\n{"name": "search", "arguments": {"q": "</thi'
    out = Reply("auto", check_tools([WEATHER]), True).delta(head + "</think", True)  # cut in it: text
    assert (out["reasoning_content"], out["content"], out["tool_calls"][0]["function"]["name"]) == \
        ("Hm.\n", "</think", "get_weather")


def test_reply_stream_equals_the_whole_reply_at_every_split():
    """Reply (reasoning, then content / tool calls) streamed in pieces of any size gives the
    non-streamed message's fields."""
    cases = [(THOUGHT, True, "auto"), (THOUGHT, True, "off"), ("<think>x</thi", False, "off"),
             ("\n<think>abc</think>x", True, "off"), ("a <tool_call> b\n</think>\n\n" + HERMES, True, "auto"),
             ("thinking <tool_call>\n<function=now>\n</function>\n</tool_call>", True, "auto"),
             ("<think>a</think>\n\nb <tool_c", False, "auto"), ("answer only", False, "auto"),
             ("think </thin", True, "off"), ("  <thinking> is not the tag", False, "off"),
             ("<think></think>\n\nHello", False, "off"), ("</think>\n\nHello", True, "auto")]
    spec = check_tools([WEATHER, CLOCK, SEARCH])
    for text, opens, mode in cases:
        whole = Reply(mode, spec, opens).whole(text)
        for step in (1, 2, 5):
            reply, got = Reply(mode, spec, opens), {"reasoning_content": "", "content": "", "tool_calls": []}
            ends = list(range(step, len(text), step)) + [len(text)]
            for k, end in enumerate(ends):
                out = reply.delta(text[:end], k == len(ends) - 1)
                got["reasoning_content"] += out.get("reasoning_content", "")
                got["content"] += out.get("content", "")
                got["tool_calls"] += out.get("tool_calls", [])
            assert got["reasoning_content"] == whole.get("reasoning_content", ""), (text, step)
            assert whole.get("reasoning_content") != ""  # (a stream's client never sees an empty field)
            assert got["content"] == (whole["content"] or ""), (text, step)
            assert [c["function"] for c in got["tool_calls"]] == [c["function"] for c in whole.get("tool_calls", [])]
    # a stream never shows a piece of a tag
    reply = Reply("off", None, True)
    assert reply.delta("abc </th", False) == {"reasoning_content": "abc "}
    assert reply.delta("abc </think>\n\nDone", False) == {"content": "Done"}


def test_parallel_tool_calls_false_keeps_the_first_call_of_an_auto_reply():
    """parallel_tool_calls=false in "auto": the reply's first call only, whole and streamed
    (it returned every call the model wrote). A fails-before check: two calls with the default."""
    two = check_tools([WEATHER, CLOCK, SEARCH])
    assert [c["function"]["name"] for c in Reply("auto", two, None).whole(XML)["tool_calls"]] == ["search", "now"]
    one = check_tools([WEATHER, CLOCK, SEARCH], parallel_tool_calls=False)
    whole = Reply("auto", one, None).whole(XML)
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["search"]
    for step in (1, 4):
        reply, calls = Reply("auto", one, None), []
        ends = list(range(step, len(XML), step)) + [len(XML)]
        for k, end in enumerate(ends):
            calls += reply.delta(XML[:end], k == len(ends) - 1).get("tool_calls", [])
        assert [c["function"] for c in calls] == [c["function"] for c in whole["tool_calls"]]
        assert [c["index"] for c in calls] == [0] and len(reply.calls) == 1


CLOCK_SCHEMA = {"type": "object", "required": ["ok"], "additionalProperties": False,
                "properties": {"ok": {"type": "boolean"}}}
THINKING_TEMPLATE = TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_thinking_template_gives_reasoning_content(tmp_path, tool_engine, stream):
    """With a template whose generation prompt opens <think>, the reply is reasoning until
    </think> (the tiny model never closes it: all reasoning); thinking switched off, or the
    parser off, gives content; a constrained output is content from its first token."""
    from hyspec.engine import Engine
    from hyspec.sampling import SamplingParams
    from hyspec.server.app import ServerConfig, create_app
    from hyspec.server.thread import ServerThread

    assert THINKING_TEMPLATE != TEMPLATE
    checkpoint_with(tmp_path, THINKING_TEMPLATE)
    eng = Engine.load(tmp_path)
    for parser in ("auto", "none"):
        app = create_app(Engine.load(tmp_path), ServerConfig(served_model_name=MODEL, draft=3, max_batch=4,
                                                             reasoning_parser=parser))
        with ServerThread(app) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            for thinking in (True, False):
                kw = {"chat_template_kwargs": {"enable_thinking": thinking}, "ignore_eos": True}
                ids = httpx.post(s.url + "/tokenize", json={"messages": MSGS, **kw}).json()["tokens"]
                ref = eng.generate(ids, max_new_tokens=12, params=SamplingParams(temperature=0.0), draft=3,
                                   ignore_eos=True)
                text = eng.tokenizer.decode(ref.tokens, skip_special_tokens=True)
                r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0,
                                                   stream=stream, extra_body=kw)
                if stream:
                    reasoning, content = "", ""
                    for ch in r:
                        for c in ch.choices:
                            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
                            content += c.delta.content or ""
                else:
                    msg = r.choices[0].message
                    reasoning, content = (msg.model_extra or {}).get("reasoning_content") or "", msg.content
                if parser == "auto" and thinking:
                    want_reasoning, want_content = split_reasoning(text, True)
                    assert want_reasoning  # the split is exercised
                else:
                    want_reasoning, want_content = "", text
                assert (reasoning, content) == (want_reasoning, want_content), (parser, thinking)
            # a constrained reply: with thinking on (and the parser), the grammar starts after
            # </think> (the tiny model never closes its thinking: all reasoning, no content);
            # with thinking off, or no parser, from the first token
            rf = {"type": "json_schema", "json_schema": {"name": "ok", "schema": CLOCK_SCHEMA}}
            for thinking in (True, False):
                kw = {"chat_template_kwargs": {"enable_thinking": thinking}}
                ids = httpx.post(s.url + "/tokenize", json={"messages": MSGS, **kw}).json()["tokens"]
                c = eng.constraint("json_schema", CLOCK_SCHEMA)
                after = parser == "auto" and thinking
                ref = eng.generate(ids, max_new_tokens=12, params=SamplingParams(temperature=0.0), draft=3,
                                   constraint=c.after_text("</think>") if after else c)
                r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0,
                                                   response_format=rf, extra_body={**kw, "return_token_ids": True})
                msg = r.choices[0].message
                assert r.choices[0].model_extra["token_ids"] == ref.tokens, (parser, thinking)
                if after:
                    assert msg.content == "" and msg.model_extra["reasoning_content"]
                    assert r.choices[0].finish_reason == "length"
                else:
                    assert isinstance(json.loads(msg.content), dict)
                    assert not (msg.model_extra or {}).get("reasoning_content")


def test_a_grammar_after_the_reasoning():
    """Constraint.after_text("</think>"): any text up to the first </think>, whitespace, then
    the grammar; no EOS before the answer is complete; each kind of constraint."""
    from hyspec.engine import Engine

    eng = Engine.load()
    cases = [("json_schema", CLOCK_SCHEMA, '{"ok":true}'), ("regex", r"[0-9]{4}", "2024"),
             ("choice", ["yes", "no"], "no"), ("grammar", 'start: "A" ("B" | "C")', "AC"), ("json_object", None, "{}")]

    def walk(c, text):
        for t in eng.tokenizer.encode(text):
            if not bool(c.allowed()[t]):
                return False
            c.commit([t])
        return True

    for kind, value, answer in cases:
        c = eng.constraint(kind, value).after_text("</think>")
        assert not bool(c.allowed()[eng.eos_ids[0]])  # no EOS while thinking
        for text in ("I <b>think</thi\n</think>\n\n" + answer, "</think>" + answer):
            d = c.clone()
            assert walk(d, text) and d.finished and d.accepting, (kind, text)
        d = c.clone()
        assert not walk(d, "x</think>\n" + "zz")  # the answer is constrained
        d = c.clone()
        assert walk(d, "x</think>") and not bool(d.allowed()[eng.eos_ids[0]])
    with pytest.raises(ValueError, match="non-empty"):
        c.after_text("")
    # wrapped again for another close: both free parts, then the answer (the two grammars were
    # both named "answer": ValueError "duplicate grammar name: @answer")
    c = eng.constraint("regex", r"[0-9]{4}").after_text("</think>").after_text("</plan>")
    d = c.clone()
    assert walk(d, "a plan</plan> some thought</think>\n2024") and d.accepting
    d = c.clone()
    assert walk(d, "a plan</plan> some thought\n2024") and not d.accepting  # (still in the inner free part)


# ------------------------------------------------------------------------------------------
# The same from Python (Engine.chat) and in batch files (hyspec generate --prompts-file)
# ------------------------------------------------------------------------------------------

def test_engine_chat_reads_the_reply_as_the_server_does(tool_server, tool_engine):
    """Engine.chat_prompt is the server's prompt; Engine.chat's message is the server's
    answer (forced call: Engine.generate under the tools' constraint; auto: the parsed
    reply)."""
    from hyspec.sampling import SamplingParams

    eng = tool_engine
    assert eng.encode(eng.chat_prompt(MSGS, tools=[WEATHER])) == prompt_ids(tool_server, [WEATHER])
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = eng.chat(MSGS, tools=[WEATHER, CLOCK], tool_choice=choice, max_new_tokens=120, draft=3)
    spec = check_tools([WEATHER, CLOCK], choice)
    ref = eng.generate(eng.chat_prompt(MSGS, tools=[WEATHER, CLOCK]), max_new_tokens=120, draft=3,
                       params=SamplingParams(temperature=0.0),
                       constraint=eng.constraint("json_schema", spec.constraint_schema()))
    assert out.tokens == ref.tokens
    call = out.message["tool_calls"][0]
    assert out.message["content"] is None and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    r = httpx.post(tool_server.url + "/v1/chat/completions", json={
        "messages": MSGS, "tools": [WEATHER, CLOCK], "tool_choice": choice, "max_tokens": 120, "temperature": 0})
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == call["function"]["arguments"]
    # auto, the reply written under a regex constraint: parsed, two samples each with its message
    out = eng.chat(MSGS, tools=[WEATHER], max_new_tokens=80, num_samples=2,
                   params=SamplingParams(temperature=0.7, seed=1), constraint=eng.constraint("regex", regex_of(HERMES)))
    for sample in out.samples:
        assert sample.message["content"] == "Let me look."
        assert json.loads(sample.message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert out.to_dict()["message"] == out.samples[0].message
    with pytest.raises(ValueError, match="cannot be combined"):
        eng.chat(MSGS, tools=[WEATHER], tool_choice="required", constraint=eng.constraint("regex", "a"))
    with pytest.raises(ValueError, match=r"messages\[0\]: content parts of type 'image_url'"):
        eng.chat_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    from hyspec.engine import Engine

    with pytest.raises(ValueError, match="does not show tools"):
        Engine.load().chat(MSGS, tools=[WEATHER])


def test_prompts_file_chat_lines(tool_engine, tmp_path):
    """--prompts-file lines with messages: rendered as the server renders them, the result
    carries the reply message; bad chat lines are named."""
    from cli_helpers import cli_each

    choice = {"type": "function", "function": {"name": "get_weather"}}
    lines = [{"messages": MSGS, "tools": [WEATHER, CLOCK], "tool_choice": choice, "max_new_tokens": 120},
             {"prompt": "def f(x):", "max_new_tokens": 5},
             {"messages": MSGS, "max_new_tokens": 6, "chat_template_kwargs": {"unused": 1}}]
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "tools": [WEATHER]}) + "\n")
    bad2 = tmp_path / "bad2.jsonl"
    bad2.write_text(json.dumps({"messages": MSGS, "tool_choice": "required"}) + "\n")
    (code, out), (code_bad, _), (code_bad2, _) = cli_each(
        [["generate", "--model", str(tool_engine.model_dir), "--prompts-file", str(f), "--draft", "3"],
         ["generate", "--model", str(tool_engine.model_dir), "--prompts-file", str(bad)],
         ["generate", "--model", str(tool_engine.model_dir), "--prompts-file", str(bad2)]])
    assert code == 0 and code_bad == 2 and code_bad2 == 2
    rows = [json.loads(x) for x in out.strip().splitlines()]
    want = tool_engine.chat(MSGS, tools=[WEATHER, CLOCK], tool_choice=choice, max_new_tokens=120, draft=3)
    assert rows[0]["tokens"] == want.tokens
    assert rows[0]["message"]["tool_calls"][0]["function"]["arguments"] == \
        want.message["tool_calls"][0]["function"]["arguments"]
    assert "message" not in rows[1]
    assert rows[2]["message"]["role"] == "assistant" and rows[2]["message"]["content"] == \
        tool_engine.chat(MSGS, max_new_tokens=6, draft=3).message["content"]


LOCATED = {"type": "function", "function": {"name": "weather", "description": None, "parameters": {
    "type": "object", "required": ["loc"], "additionalProperties": False,
    "$defs": {"Loc": {"type": "object", "required": ["city"], "additionalProperties": False,
                      "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}},
    "properties": {"loc": {"$ref": "#/$defs/Loc"}}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_with_refs_and_cut_short(tool_client, stream):
    """tool_choice required with a tool whose schema uses $defs (pydantic's, zod's): the
    definitions move to the root, the call matches the schema. A named call cut by a stop
    string comes back as a tool call with the arguments as far as generated, streamed or not."""
    r = tool_client.chat.completions.create(model=MODEL, messages=MSGS, tools=[LOCATED, CLOCK],
                                            tool_choice="required", max_tokens=80, temperature=0, stream=stream)
    if stream:
        _, got, reason = streamed_calls(r)
        got = [got[i] for i in sorted(got)]
    else:
        reason = r.choices[0].finish_reason
        got = [{"name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
    assert reason == "tool_calls" and got
    for g in got:
        if g["name"] == "weather":
            jsonschema.validate(json.loads(g["arguments"]), LOCATED["function"]["parameters"])
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = tool_client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], tool_choice=choice,
                                            max_tokens=80, temperature=0, stream=stream, stop=[","])
    if stream:
        content, got, reason = streamed_calls(r)
        args = got[0]["arguments"]
    else:
        content, reason = r.choices[0].message.content, r.choices[0].finish_reason
        args = r.choices[0].message.tool_calls[0].function.arguments
    assert args.startswith("{") and "," not in args and reason == "stop" and not content



def test_a_chat_template_file_replaces_the_checkpoints(tmp_path, capsys):
    """`hyspec serve --chat-template FILE` / `hyspec chat --chat-template FILE` /
    Engine.use_chat_template: the embedded model (plain template, no tools) with a tool
    template renders and answers tools; a missing or broken file fails before the model
    loads, naming the flag."""
    import io

    from hyspec.chat import main as chat_main
    from hyspec.server import build_parser as serve_parser
    from hyspec.server import make_app
    from hyspec.server.thread import ServerThread

    f = tmp_path / "tools.jinja"
    f.write_text(TEMPLATE)
    app = make_app(serve_parser().parse_args(["--port", "0", "--chat-template", str(f), "--no-prefix-store"]))
    st = app.state.hyspec
    assert st.template.source == TEMPLATE and st.template_reads_tools
    with ServerThread(app) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={
            "messages": MSGS, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name":
                                                                                             "get_weather"}},
            "max_tokens": 60, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        ids = httpx.post(s.url + "/tokenize", json={"messages": MSGS, "tools": [WEATHER]}).json()["tokens"]
    from hyspec.engine import Engine

    eng = Engine.load()
    eng.use_chat_template(f)
    assert eng.encode(eng.chat_prompt(MSGS, tools=[WEATHER])) == ids
    eng.use_chat_template("{{ messages[0].content }}!")  # the text itself
    assert eng.chat_prompt(MSGS) == MSGS[0]["content"] + "!"
    out = io.StringIO()
    assert chat_main(["--chat-template", str(f), "--max-new-tokens", "2"], stdin=io.StringIO("hi\n/stats\n"),
                     stdout=out) == 0
    stats = [json.loads(x[len("[stats] "):]) for x in out.getvalue().splitlines() if x.startswith("[stats] ")]
    assert stats[0]["turn_prefilled"] == len(eng.encode(render_file(f, [{"role": "user", "content": "hi"}])))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    for path, words in ((tmp_path / "missing.jinja", "no such file"), (bad, "does not parse")):
        with pytest.raises(ValueError, match=f"--chat-template.*{words}"):
            make_app(serve_parser().parse_args(["--chat-template", str(path)]))
        assert chat_main(["--chat-template", str(path)], stdin=io.StringIO("")) == 2
        err = capsys.readouterr().err
        assert "--chat-template" in err and words in err and "Traceback" not in err


def render_file(path, messages):
    from hyspec.chat_template import ChatTemplate

    return ChatTemplate(path.read_text()).render(messages)


def test_template_variables_and_history_arguments_are_checked(tool_engine, tool_server, tmp_path):
    """chat_template_kwargs may override add_generation_prompt / tools (as the server lets
    them) and may be named like Python parameters (special, source, self) in every front end;
    messages is refused by name; history arguments that are no object are named (were:
    TypeError tracebacks from the batch file and Engine.chat, a generic 400 from the server)."""
    from cli_helpers import cli_each

    eng = tool_engine
    no_gen = eng.chat_prompt(MSGS, add_generation_prompt=False)
    assert eng.chat_prompt(MSGS, **{"add_generation_prompt": False, "special": 1, "source": 2, "self": 3}) == no_gen
    turn = eng.prepare_chat(MSGS, template_kwargs={"add_generation_prompt": False, "special": 1})
    assert turn.prompt == no_gen
    r = httpx.post(tool_server.url + "/tokenize", json={"messages": MSGS, "chat_template_kwargs": {
        "add_generation_prompt": False, "special": 1}})
    assert r.status_code == 200 and r.json()["tokens"] == eng.encode(no_gen)
    with pytest.raises(ValueError, match="messages is the conversation itself"):
        eng.chat_prompt(MSGS, messages=[])
    for args in (5, [1], "[1]"):
        history = MSGS + [{"role": "assistant", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "now", "arguments": args}}]}]
        with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments must be a JSON object"):
            eng.chat_prompt(history)
        r = httpx.post(tool_server.url + "/v1/chat/completions", json={"messages": history, "max_tokens": 2})
        assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
    history = MSGS + [{"role": "assistant", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": None}}]}]
    assert "<function=now>" in eng.chat_prompt(history)  # null arguments: none
    lines = tmp_path / "l.jsonl"
    lines.write_text(json.dumps({"messages": MSGS, "chat_template_kwargs": {"add_generation_prompt": False},
                                 "max_new_tokens": 2}) + "\n"
                     + json.dumps({"messages": MSGS, "chat_template_kwargs": None, "max_new_tokens": 2}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": history[:1] + [{"role": "assistant", "content": "x", "tool_calls": [
        {"function": {"name": "now", "arguments": 5}}]}]}) + "\n")
    (code, out), (code_bad, _) = cli_each(
        [["generate", "--model", str(eng.model_dir), "--prompts-file", str(lines)],
         ["generate", "--model", str(eng.model_dir), "--prompts-file", str(bad)]])
    assert code == 0 and len(out.strip().splitlines()) == 2 and code_bad == 2


def test_after_the_reasoning_with_the_tokenizers_own_close_token(tmp_path):
    """Qwen's tokenizers have </think> as one added token, which llguidance counts as special
    (no text lexeme matches it): after_text must allow that token to end the free part, as
    well as the spelled form, and nothing spelled before it; wrapping twice is wrapping once."""
    from hyspec.engine import Engine

    checkpoint_with(tmp_path, "{{ messages[0].content }}")
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    piece, tid = max(vocab.items(), key=lambda kv: kv[1])  # the last BPE piece becomes </think>
    del vocab[piece]
    tok["model"]["merges"] = [m for m in tok["model"]["merges"]
                              if (m if isinstance(m, str) else " ".join(m)).replace(" ", "") != piece]
    tok["added_tokens"].append({"id": tid, "content": "</think>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": False})
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    eng = Engine.load(tmp_path)
    assert tid in eng.tokenizer.encode("a</think>b")
    c = eng.constraint("json_schema", CLOCK_SCHEMA).after_text("</think>")
    assert bool(c.allowed()[tid]) and not bool(c.allowed()[eng.eos_ids[0]])
    d = c.clone()
    d.commit(eng.tokenizer.encode('I think</think>\n\n{"ok":true}'))  # the token form
    assert d.finished
    spelled = [t for p in ("I think</", "think", '>{"ok":false}') for t in eng.tokenizer.encode(p)]
    assert tid not in spelled
    d = c.clone()
    d.commit(spelled)
    assert d.finished
    d = c.clone()  # a spelled close ends the free part: what follows must be the answer
    d.commit([t for p in ("a</", "think", ">") for t in eng.tokenizer.encode(p)])
    assert not bool(d.allowed()[tid]) and not bool(d.allowed()[eng.tokenizer.encode("b")[0]])
    twice = c.after_text("</think>")
    assert twice.grammar_text == c.grammar_text and twice.committed == 0


def test_hyspec_chat_constrains_the_answer_after_the_thinking(tool_engine, tmp_path):
    """`hyspec chat --regex ...` with a template whose replies think first: the grammar
    starts after </think> (the tiny model never closes its thinking: free text), and from
    the first token with enable_thinking false."""
    import io

    from hyspec.chat import main as chat_main

    checkpoint_with(tmp_path, THINKING_TEMPLATE)
    replies = []
    for extra in ([], ["--chat-template-kwargs", '{"enable_thinking": false}']):
        out = io.StringIO()
        assert chat_main(["--model", str(tmp_path), "--regex", "Z{1,40}", "--max-new-tokens", "6", *extra],
                         stdin=io.StringIO("hi\n"), stdout=out) == 0
        replies.append(out.getvalue().strip())
    assert replies[1] == "Z" * 6 and "Z" * 6 not in replies[0] and replies[0]



def test_reasoning_effort_reaches_the_template(tmp_path):
    """OpenAI's reasoning_effort goes to the chat template as a variable (chat_template_kwargs
    wins), for templates that read it."""
    from hyspec.engine import Engine
    from hyspec.server.app import ServerConfig, create_app
    from hyspec.server.thread import ServerThread

    checkpoint_with(tmp_path, "{{ messages[0].content }}{% if reasoning_effort is defined %} "
                              "effort={{ reasoning_effort }}{% endif %}")
    encode = Engine.load(tmp_path).encode
    with ServerThread(create_app(Engine.load(tmp_path), ServerConfig(served_model_name=MODEL))) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for kw, want in (({}, "hi"), ({"reasoning_effort": "low"}, "hi effort=low"),
                         ({"reasoning_effort": "low", "extra_body": {"chat_template_kwargs": {"reasoning_effort": "x y z w"}}},
                          "hi effort=x y z w")):  # (a count unlike "low"'s: the kwarg must win)
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=1, temperature=0, **kw)
            assert r.usage.prompt_tokens == len(encode(want)), kw


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_before_any_output_has_null_content_whole_and_streamed(choice):
    """tool_choice required / named, cut by max_tokens before the model wrote anything of the
    call (here: still thinking): the whole reply said content "" while its stream (whose role
    chunk opens with content null, docs/server.md: "as the whole reply's") adds up to null."""
    from hyspec.reply import Reply

    spec = check_tools([WEATHER, CLOCK], choice)
    for think, text in ((True, "still thinking"), (None, "")):
        reply = Reply.of(spec, think, constrained=True)
        msg = reply.whole(text)
        stream = Reply.of(spec, think, constrained=True)
        pieces = [stream.delta(text[:i], False) for i in range(1, len(text))] + [stream.delta(text, True)]
        assert not any("content" in p for p in pieces)  # the stream sends no content: null, from its role chunk
        assert msg["content"] is None and "tool_calls" not in msg


def test_a_required_array_cut_short_is_content_text_whole_and_streamed():
    """docs/server.md: a `required` array cut by max_tokens is returned as `content` text
    (whole, and at the end of a stream); complete, it is the calls. A named call keeps the id
    its first streamed piece carried."""
    from hyspec.reply import Reply

    spec = check_tools([WEATHER, CLOCK], "required")
    cut = '[{"name": "get_weather", "parameters": {"city": "Par'
    msg = Reply.of(spec, None, constrained=True).whole(cut)
    assert msg["content"] == cut and "tool_calls" not in msg
    stream = Reply.of(spec, None, constrained=True)
    pieces = [stream.delta(cut[:i], False) for i in range(1, len(cut))] + [stream.delta(cut, True)]
    assert pieces[:-1] == [{}] * (len(cut) - 1) and pieces[-1] == {"content": cut}
    done = '[{"name": "now", "parameters": {}}]'
    assert Reply.of(spec, None, constrained=True).delta(done, True)["tool_calls"][0]["function"] == {
        "name": "now", "arguments": "{}"}
    named = check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    stream = Reply.of(named, None, constrained=True)
    first = stream.delta('{"city": ', False)["tool_calls"][0]
    assert stream.delta('{"city": "Oslo"', True)["tool_calls"][0] == {"index": 0, "function": {"arguments": '"Oslo"'}}
    assert first["function"]["name"] == "get_weather" and [c.id for c in stream.calls] == [first["id"]]
