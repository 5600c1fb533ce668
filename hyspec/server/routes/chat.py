"""POST /v1/chat/completions: messages rendered with the chat template, one prompt, n
choices; streamed as `chat.completion.chunk` deltas or answered whole. Each choice's text
is shown as a Reply: the reasoning of a thinking model (hyspec.reasoning) as
`reasoning_content`, and with `tools` its calls (hyspec.tools: parsed in "auto",
constrained for "required" or a named function) as `tool_calls`."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request

from hyspec.reasoning import THINK_CLOSE, prompt_opens_thinking
from hyspec.reply import Reply
from hyspec.server import schemas
from hyspec.server.errors import parse_body
from hyspec.server.generation import new_run, request_constraint
from hyspec.server.logprobs import chat_logprobs
from hyspec.server.params import MAX_LOGPROBS, UNSUPPORTED_CHAT, ConstraintSpec, bad, refuse_unsupported
from hyspec.server.streaming import stream_response, whole_response
from hyspec.tools import ToolError, check_tools


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
    try:
        schema = tools.constraint_schema() if tools is not None else None
    except ToolError as e:
        raise bad(str(e), e.param) from None
    if schema is None:
        return tools, None
    chosen = [tools.named] if tools.choice == "named" else list(tools.tools.values())
    parts = tuple((f"tool {t.name!r}: parameters", {"type": "object", **t.parameters}) for t in chosen)
    return tools, ConstraintSpec("json_schema", schema, "tools", parts)


def register(app, state) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0 = time.perf_counter()
        req = await parse_body(request, schemas.ChatCompletionRequest)
        state.check_model(req.model)
        refuse_unsupported(req, UNSUPPORTED_CHAT)  # (before the template renders; the shared ones: new_run)
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise bad(f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {req.top_logprobs}", "top_logprobs")
            if not req.logprobs:
                raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        top_n = (req.top_logprobs or 0) if req.logprobs else None  # None: no logprobs
        tools, forced = check_request_tools(state, req)
        template_vars = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:  # OpenAI's field, for templates that read it (as vLLM passes it)
            template_vars.setdefault("reasoning_effort", req.reasoning_effort)
        # (rendered and encoded in a thread: a large conversation on the event loop stalled every
        # other request and stream)
        text, generation = await asyncio.to_thread(state.render_chat, req.messages, bool(req.add_generation_prompt),
                                                   req.tools, template_vars, suffix=True)
        ids = await asyncio.to_thread(state.tokenizer.encode, text)
        request_id = "chatcmpl-" + uuid.uuid4().hex
        constraint = await request_constraint(state.engine, req, forced)
        think = prompt_opens_thinking(generation) if state.reasoning else None
        if constraint is not None and think:  # the model thinks first: the grammar starts after </think>
            try:
                constraint = await asyncio.to_thread(constraint.after_text, THINK_CLOSE)
            except ValueError as e:
                raise bad(str(e), "response_format") from None
        run = new_run(state, req, [ids], "messages", None, False, top_n, request_id, t0, constraint)
        run.object, run.created = "chat.completion.chunk", int(time.time())
        run.start()
        replies = {c.index: Reply.of(tools, think, constraint is not None) for c in run.choices}
        texts = {c.index: "" for c in run.choices}  # each choice's text so far (streaming)

        def logprobs(entries):
            return chat_logprobs(state, entries) if top_n is not None else None

        def finish_reason(choice) -> str:  # a named call ends as "stop", as OpenAI's and vLLM's do
            called = replies[choice.index].calls and tools.choice != "named"
            return "tool_calls" if called and choice.finish_reason == "stop" else choice.finish_reason

        if not req.stream:
            return await whole_response(
                state, request, run, req, "chat.completion",
                lambda choice, entries: {"message": replies[choice.index].whole(choice.matcher.emittable(final=True)),
                                         "logprobs": logprobs(entries)},
                finish_reason)

        # a named / required reply is tool calls: its content opens null (an auto reply's role
        # chunk cannot know, and opens with "" as vLLM's does)
        forced_calls = any(r.mode in ("named", "required") for r in replies.values())

        def chunk(choice, delta: str, entries):
            texts[choice.index] += delta
            out = replies[choice.index].delta(texts[choice.index], choice.finish_reason is not None)
            if not out and not entries:
                return None
            if not out:
                out = {} if forced_calls else {"content": ""}
            return {"delta": out, "logprobs": logprobs(entries), "finish_reason": None}

        return stream_response(
            state, request, run, req, chunk, {"delta": {}},
            [(c, {"delta": {"role": "assistant", "content": None if forced_calls else ""}, "logprobs": None,
                  "finish_reason": None})
             for c in run.choices],
            finish_reason)
