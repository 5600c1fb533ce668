"""Tool (function) calling for OpenAI-style chat requests.

The chat template shows the model the request's `tools`; the model answers with calls in the
format its family was trained on, each between ``<tool_call>`` and ``</tool_call>``:

* JSON ("hermes"; Qwen3, Qwen3-Next):
  ``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``
* XML (Qwen3.5, Qwen3-Coder): ``<tool_call>\\n<function=get_weather>\\n<parameter=city>\\n
  Paris\\n</parameter>\\n</function>\\n</tool_call>``; a parameter's text becomes a JSON value
  by the type its tool's schema declares (string, integer, number, boolean, object, array).

Both are recognised in any reply, block by block; a block that does not parse, or that
calls a function the request did not declare, stays in the content as text, so nothing the
model wrote is lost. `tool_choice`:

* ``"auto"`` (the default when tools are given): the reply is parsed as above.
* ``"none"``: the reply is plain content (the tools are still rendered, as in vLLM).
* ``"required"`` and a named function: the output is *constrained* (hyspec.constraints), as
  vLLM does: a named function's output is its arguments object, valid against its
  ``parameters`` schema; ``"required"``'s output is a JSON array of one or more
  ``{"name": ..., "parameters": {...}}`` objects (exactly one when
  ``parallel_tool_calls`` is false), each valid against its tool's schema.

With ``parallel_tool_calls`` false an "auto" reply keeps its first call only (the later
blocks the model wrote are dropped, as vLLM drops them), whole or streamed.

The server (hyspec/server/routes/chat.py) uses this module; so can any Python caller:
:func:`parse_tool_calls` on a finished reply, :class:`ToolStream` on a growing one."""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI: a-z, A-Z, 0-9, underscores and dashes, <= 64 (fullmatch:
# "$" also matched before a final newline, so "get\n" passed)
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # no parameters: {}


class ToolError(ValueError):
    """A malformed `tools` / `tool_choice`; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # the JSON schema of its arguments object


@dataclass
class ToolSpec:
    """A request's checked tools and what it asks of them."""

    tools: dict[str, Tool]
    choice: str  # "none" | "auto" | "required" | "named"
    named: Tool | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def constraint_schema(self) -> dict | None:
        """The JSON schema the output must match ("required" / named), else None."""
        # (a parameters schema without "type" -- {} or properties alone, which check_tools takes as an
        # object's -- is pinned to an object here: JSON Schema would let any value through)
        if self.choice == "named":
            return {"type": "object", **self.named.parameters}
        if self.choice != "required":
            return None
        # each tool's schema sits under items...parameters, where its "#/$defs/..." references
        # would not resolve: its definitions move to the root (one name, one definition)
        shared: dict[str, dict] = {}
        items = []
        for t in self.tools.values():
            params = {"type": "object", **t.parameters}
            for key in ("$defs", "definitions"):
                defs = params.pop(key, None)
                if defs is None:
                    continue
                if not isinstance(defs, dict):
                    raise ToolError(f"tool {t.name!r}: parameters.{key} must be an object", "tools")
                for name, sub in defs.items():
                    if shared.setdefault(key, {}).setdefault(name, sub) != sub:
                        raise ToolError(f"tools define {key}/{name} differently; tool_choice \"required\" needs "
                                        f"one definition per name (rename one)", "tools")
            items.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                          "properties": {"name": {"const": t.name}, "parameters": params}})
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        schema.update(shared)
        return schema


def check_tools(tools, tool_choice=None, parallel_tool_calls=None) -> ToolSpec | None:
    """The request's ToolSpec (None: no tools, nothing to parse). ToolError names the field."""
    if tools is not None and not isinstance(tools, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools: this request declares none", "tool_choice")
        return None
    checked: dict[str, Tool] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"{where}: expected {{\"type\": \"function\", \"function\": {{...}}}} "
                            f"(function tools only)", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object with a name", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_', '-', '.' or ':', "
                            f"got {name!r}", "tools")
        if name in checked:
            raise ToolError(f"{where}: a second tool named {name!r}", "tools")
        params = fn.get("parameters")
        if params is None:
            params = dict(EMPTY_PARAMETERS)
        elif not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object", "tools")
        elif params.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters must describe an object (the arguments), got type "
                            f"{params.get('type')!r}", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError(f"{where}.function.description must be a string", "tools")
        checked[name] = Tool(name, params)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    spec = ToolSpec(checked, "auto", parallel=parallel_tool_calls is not False)
    if tool_choice is None or tool_choice == "auto":
        return spec
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)} or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice!r}",
                            "tool_choice")
        spec.choice = tool_choice
        return spec
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError('tool_choice must be "none", "auto", "required" or '
                        '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in checked:
        raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools "
                        f"({', '.join(checked)})", "tool_choice")
    spec.choice, spec.named = "named", checked[name]
    return spec


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    v = float(text)
    if math.isinf(v):  # (1e999: Python's float is inf, which no response can carry)
        raise ValueError(f"the number {text[:40]} is beyond the float range")
    return v


def loads(text: str, finite: bool = True):
    """json.loads without Python's NaN / Infinity (no JSON parser outside Python reads them),
    nor a number that overflows to it (1e999; finite=False: read as inf, for a caller whose
    dumps refuses it per item); nesting too deep for the parser is a ValueError too (a
    RecursionError escaped as a 500)."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float if finite else float)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def dumps(value) -> str:
    """JSON text of `value`; ValueError for what a response cannot carry: NaN / Infinity, and a
    lone surrogate (valid JSON as "\\ud83d", half an emoji: the UTF-8 response failed)."""
    out = json.dumps(value, ensure_ascii=False, allow_nan=False)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode ({e.reason})") from None
    return out


def declared_types(schema) -> list[str]:
    """The JSON types a parameter's schema declares, in order: its `type` (a name or a list),
    else those of its anyOf / oneOf branches, else those of its `enum` values."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out = []
            for branch in schema[key]:
                out += [x for x in declared_types(branch) if x not in out]
            return out
    if isinstance(schema.get("enum"), list):
        names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
                 list: "array", dict: "object"}
        out = []
        for v in schema["enum"]:
            name = names.get(type(v))
            if name is not None and name not in out:
                out.append(name)
        return out
    return []


def convert_parameter(text: str, schema) -> object:
    """An XML-format parameter's text as a JSON value, by the types its schema declares
    (:func:`declared_types`, tried in order; null last): a string type takes the text as it
    is; integer, number, boolean (true / false), object and array take text that is such a
    value; ``null`` / ``None`` is null where the schema allows null or declares no string.
    A parameter the schema does not declare, or declares no type for (a ``$ref``), and text
    that is no value of a declared type stay strings: a string never becomes something else
    by guessing (vLLM's qwen3_coder parser reads them the same way)."""
    types = declared_types(schema)
    s = text.strip()
    if s in ("null", "None") and ("null" in types or (types and "string" not in types)):
        return None
    for t in [x for x in types if x != "null"]:
        try:
            if t == "string":
                return text
            if t == "boolean" and s.lower() in ("true", "false"):
                return s.lower() == "true"
            if t == "integer":
                v = loads(s)
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
            if t == "number":
                v = loads(s)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    return v
            if t in ("object", "array"):
                v = loads(s)
                if isinstance(v, dict if t == "object" else list):
                    return v
        except ValueError:
            continue
    return text


def _xml_call(body: str, tools: dict[str, Tool]) -> ToolCall | None:
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    tool = tools.get(name)
    if tool is None:
        return None
    props = tool.parameters.get("properties") if isinstance(tool.parameters.get("properties"), dict) else {}
    args = {}
    for pm in _PARAMETER.finditer(inner):
        key, value = pm.group(1).strip(), pm.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = convert_parameter(value, props.get(key))
    if _PARAMETER.sub("", inner).strip():  # text outside the parameters: not this format
        return None
    try:
        return ToolCall(name, dumps(args))
    except ValueError:
        return None


def _json_call(body: str, tools: dict[str, Tool]) -> ToolCall | None:
    try:
        obj = loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tools:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as JSON text
            args = loads(args)
        return ToolCall(obj["name"], dumps(args)) if isinstance(args, dict) else None
    except ValueError:
        return None


def parse_block(body: str, tools: dict[str, Tool]) -> ToolCall | None:
    """The call in one ``<tool_call>`` block's text (either format), or None."""
    s = body.strip()
    return _json_call(s, tools) if s.startswith("{") else _xml_call(s, tools)


def parse_tool_calls(text: str, tools: dict[str, Tool]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished reply. A block runs from the last ``<tool_call>``
    before a ``</tool_call>`` (an earlier one is text: "use the <tool_call> tag"), or from the
    last ``<tool_call>`` after every close to the end of the text when that parses; a close
    with no open before it is text. With calls, content is the text outside the parsed blocks
    (a block that does not parse stays in its text as written; the part before the first
    call right-stripped, the parts between and after calls stripped, joined by newlines);
    without, `text` unchanged."""
    pieces, calls, pos = [], [], 0
    held = ""  # text since the last parsed call (blocks that did not parse stay in it, as written)
    while True:
        j = text.find(TOOL_CLOSE, pos)
        if j < 0:  # no block closes after pos: an unclosed last one is a call when its text parses whole
            rest = text[pos:]  # (an EOS before </tool_call>, or a client's stop=["</tool_call>"]; as vLLM)
            k = rest.rfind(TOOL_OPEN)
            call = parse_block(rest[k + len(TOOL_OPEN):], tools) if k >= 0 else None
            if call is None:
                held += rest
            else:
                pieces.append(held + rest[:k])
                held = ""
                calls.append(call)
            break
        # (a close with no open before it, "each call ends with </tool_call>", is text: it made
        # every later block, whole calls too, one unclosed block that did not parse)
        i = text.rfind(TOOL_OPEN, pos, j)
        end = j + len(TOOL_CLOSE)
        call = parse_block(text[i + len(TOOL_OPEN):j], tools) if i >= 0 else None
        if call is None:
            held += text[pos:end]  # kept as text (its piece goes on: "</tool_call> tags" kept its space)
        else:
            pieces.append(held + text[pos:i])
            held = ""
            calls.append(call)
        pos = end
    pieces.append(held)
    if not calls:
        return text, []
    first = pieces[0].rstrip()
    rest = [p.strip() for p in pieces[1:] if p.strip()]
    return "\n".join(([first] if first else []) + rest), calls


def parse_forced(text: str, spec: ToolSpec) -> list[ToolCall]:
    """The calls of a constrained output. A named function's output is its arguments: one
    call with that text as generated (incomplete JSON when cut by max_tokens or a stop
    string, as a stream has sent it). "required": the array's calls; [] when it is
    incomplete."""
    if spec.choice == "named":
        return [ToolCall(spec.named.name, text)] if text else []
    try:
        value = loads(text, finite=False)  # (a call holding 1e999 is dropped below by dumps, not the whole array)
        if not isinstance(value, list):
            return []
    except ValueError:
        return []
    calls = []
    for c in value:
        if isinstance(c, dict) and c.get("name") in spec.tools and isinstance(c.get("parameters"), dict):
            try:
                calls.append(ToolCall(c["name"], dumps(c["parameters"])))
            except ValueError:  # (a lone surrogate or 1e999 in this call's arguments: this call only is dropped)
                continue
    return calls


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


_CALL_STARTS = ("{", "<function=")


def call_follows(text: str, pos: int) -> bool | None:
    """Whether the ``<tool_call>`` ending at `pos` starts a call (a ``{`` or ``<function=``
    follows, after whitespace): True, False (a mention of the tag), or None while `text`
    ends too soon to tell."""
    rest = text[pos:].lstrip()
    if any(rest.startswith(p) for p in _CALL_STARTS):
        return True
    if any(p.startswith(rest) for p in _CALL_STARTS):  # "" or a start of one
        return None
    return False


def first_call(text: str, start: int = 0) -> int:
    """Where the first ``<tool_call>`` from `start` that starts (or may still start) a call
    begins; else where a trailing partial tag begins; else len(text)."""
    pos = start
    while True:
        i = text.find(TOOL_OPEN, pos)
        if i < 0:
            return len(text) - partial_tag(text[start:], TOOL_OPEN)
        if call_follows(text, i + len(TOOL_OPEN)) is not False:
            return i
        pos = i + len(TOOL_OPEN)


class ToolStream:
    """A growing reply of an "auto" request, for streaming: `update(text, final)` (the whole
    text so far) gives the content not yet sent, and puts in `new_calls` the calls whose
    blocks closed since the last update (each call is sent once, as soon as its
    ``</tool_call>`` is there; `calls`: all so far; with `parallel` False only the first
    call, as in a whole reply with ``parallel_tool_calls`` false). Content stops at the first
    ``<tool_call>`` that starts a call (:func:`first_call`; held back while the text ends in
    what may become one, or in whitespace); at the end, what :func:`parse_tool_calls` calls
    content is completed, so a stream's content and calls equal the whole response's."""

    def __init__(self, tools: dict[str, Tool], parallel: bool = True) -> None:
        self.tools = tools
        self.parallel = parallel  # False: the first call only (parallel_tool_calls=false)
        self.sent = 0
        self.calls: list[ToolCall] = []
        self.new_calls: list[ToolCall] = []
        self._closed = -1  # where the last </tool_call> parsed starts

    def _take_calls(self, found: list[ToolCall]) -> None:
        # the blocks before the last close never change as the text grows: the first
        # len(self.calls) are the ones already sent (their ids kept)
        if not self.parallel:
            found = found[:1]
        self.new_calls = found[len(self.calls):]
        self.calls = self.calls + self.new_calls

    def update(self, text: str, final: bool) -> str:
        if final:
            content, found = parse_tool_calls(text, self.tools)
            self._take_calls(found)
            delta = content[self.sent:]
            self.sent = max(self.sent, len(content))
            return delta
        end = text.rfind(TOOL_CLOSE)
        if end != self._closed:  # a block closed since the last update: parse the blocks up to it
            self._closed = end
            self._take_calls(parse_tool_calls(text[:end + len(TOOL_CLOSE)], self.tools)[1])
        else:
            self.new_calls = []
        safe = text[:first_call(text)].rstrip()
        delta = safe[self.sent:]
        self.sent = max(self.sent, len(safe))
        return delta


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as the Qwen templates expect them: an assistant message's tool call
    ``arguments`` given as JSON text (OpenAI's form) become an object (the XML-format templates
    iterate over them; the JSON-format ones print either). ValueError names a bad one."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be a list")
            fixed = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"messages[{i}].tool_calls[{j}] needs a function with a name")
                args = fn.get("arguments")
                if args is None and "arguments" in fn:
                    fn = {**fn, "arguments": {}}
                elif args is not None and not isinstance(args, (str, dict)):
                    raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object "
                                     f"(or its JSON text), got {type(args).__name__}")
                if isinstance(args, str):
                    try:
                        args = loads(args) if args.strip() else {}
                    except ValueError:
                        raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON") \
                            from None
                    if not isinstance(args, dict):
                        raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
                    fn = {**fn, "arguments": args}
                fixed.append({**call, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


__all__ = ["Tool", "ToolSpec", "ToolCall", "ToolError", "ToolStream", "check_tools", "parse_tool_calls",
           "parse_forced", "parse_block", "convert_parameter", "template_messages", "partial_tag", "TOOL_OPEN",
           "TOOL_CLOSE"]
