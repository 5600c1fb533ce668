"""POST /v1/chat/completions: messages rendered with the chat template, one prompt, n
choices; streamed as `chat.completion.chunk` deltas or answered whole. With `tools`, each
choice's reply is read for tool calls (hyspec.tools: parsed in "auto", constrained for
"required" or a named function) and answered in OpenAI's `tool_calls` form."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from hyspec.server import schemas
from hyspec.server.errors import parse_body
from hyspec.server.generation import new_run, request_constraint
from hyspec.server.logprobs import chat_logprobs
from hyspec.server.params import MAX_LOGPROBS, ConstraintSpec, bad
from hyspec.server.streaming import stream_response, whole_response
from hyspec.tools import ToolCall, ToolError, ToolStream, check_tools, parse_forced, parse_tool_calls


def check_request_tools(state, req):
    """The request's ToolSpec (None: no tool calling) and the constraint a forced call needs."""
    if req.functions is not None or req.function_call is not None:
        raise bad("functions / function_call are OpenAI's deprecated fields: give tools and tool_choice instead",
                  "functions" if req.functions is not None else "function_call")
    try:
        tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    except ToolError as e:
        raise bad(str(e), e.param) from None
    if tools is not None and tools.parses and not state.template_reads_tools:
        raise bad("this model's chat template does not show tools to the model (it never reads `tools`): "
                  "tool calling needs a checkpoint whose chat template renders them", "tools")
    schema = tools.constraint_schema() if tools is not None else None
    return tools, (None if schema is None else ConstraintSpec("json_schema", schema, "tools"))


def register(app, state) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0 = time.perf_counter()
        req = await parse_body(request, schemas.ChatCompletionRequest)
        state.check_model(req.model)
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise bad(f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {req.top_logprobs}", "top_logprobs")
            if not req.logprobs:
                raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        top_n = (req.top_logprobs or 0) if req.logprobs else None  # None: no logprobs
        tools, forced = check_request_tools(state, req)
        text = state.render_chat(req.messages, bool(req.add_generation_prompt), req.tools, req.chat_template_kwargs)
        ids = state.tokenizer.encode(text)
        request_id = "chatcmpl-" + uuid.uuid4().hex
        constraint = await request_constraint(state.engine, req, forced)
        run = new_run(state, req, [ids], "messages", None, False, top_n, request_id, t0, constraint)
        run.object, run.created = "chat.completion.chunk", int(time.time())
        run.start()
        mode = "off" if tools is None or not tools.parses else tools.choice  # off | auto | required | named
        calls: dict[int, list[ToolCall]] = {}  # per choice, once final

        def logprobs(entries):
            return chat_logprobs(state, entries) if top_n is not None else None

        def finish_reason(choice) -> str:
            return "tool_calls" if calls.get(choice.index) and choice.finish_reason == "stop" else choice.finish_reason

        def message(choice, entries) -> dict:
            text = choice.matcher.emittable(final=True)
            if mode == "off":
                return {"message": {"role": "assistant", "content": text}, "logprobs": logprobs(entries)}
            if mode == "auto":
                content, found = parse_tool_calls(text, tools.tools)
            else:
                found = parse_forced(text, tools)
                content = "" if found else text  # an output cut by max_tokens stays text
            calls[choice.index] = found
            msg = {"role": "assistant", "content": content if content or not found else None}
            if found:
                msg["tool_calls"] = [c.openai() for c in found]
            return {"message": msg, "logprobs": logprobs(entries)}

        if not req.stream:
            return await whole_response(state, request, run, req, "chat.completion", message, finish_reason)

        streams = {c.index: ToolStream(tools.tools) for c in run.choices} if mode == "auto" else {}
        texts = {c.index: "" for c in run.choices}  # each choice's text so far
        named_ids = {c.index: ToolCall(tools.named.name, "").id for c in run.choices} if mode == "named" else {}

        def chunk(choice, delta: str, entries):
            final = choice.finish_reason is not None
            texts[choice.index] += delta
            out: dict = {}
            if mode == "off":
                if delta or entries:
                    out["content"] = delta
            elif mode == "auto":
                stream = streams[choice.index]
                content = stream.update(texts[choice.index], final)
                if content:
                    out["content"] = content
                if final and stream.calls:
                    calls[choice.index] = stream.calls
                    out["tool_calls"] = [c.openai(i) for i, c in enumerate(stream.calls)]
            elif mode == "named":  # the output is the arguments: streamed as they come
                if delta:
                    call = {"index": 0, "function": {"arguments": delta}}
                    if len(texts[choice.index]) == len(delta):  # the first piece names the call
                        call = {"index": 0, "id": named_ids[choice.index], "type": "function",
                                "function": {"name": tools.named.name, "arguments": delta}}
                    out["tool_calls"] = [call]
                if final:
                    calls[choice.index] = parse_forced(texts[choice.index], tools)
            elif final:  # required: a JSON array, sent whole once complete
                found = parse_forced(texts[choice.index], tools)
                calls[choice.index] = found
                if found:
                    out["tool_calls"] = [c.openai(i) for i, c in enumerate(found)]
                elif texts[choice.index]:
                    out["content"] = texts[choice.index]
            if not out and not entries:
                return None
            return {"delta": out, "logprobs": logprobs(entries), "finish_reason": None}

        return stream_response(
            state, request, run, req, chunk, {"delta": {}},
            [(c, {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
             for c in run.choices],
            finish_reason)
