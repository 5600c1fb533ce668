"""POST /v1/chat/completions: messages rendered with the chat template, one prompt, n
choices; streamed as `chat.completion.chunk` deltas or answered whole. Each choice's text
is shown as a Reply: the reasoning of a thinking model (hyspec.reasoning) as
`reasoning_content`, and with `tools` its calls (hyspec.tools: parsed in "auto",
constrained for "required" or a named function) as `tool_calls`."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from hyspec.reasoning import ReasoningStream, prompt_opens_thinking, split_reasoning
from hyspec.server import schemas
from hyspec.server.errors import parse_body
from hyspec.server.generation import new_run, request_constraint
from hyspec.server.logprobs import chat_logprobs
from hyspec.server.params import MAX_LOGPROBS, ConstraintSpec, bad
from hyspec.server.streaming import stream_response, whole_response
from hyspec.tools import ToolCall, ToolError, ToolSpec, ToolStream, check_tools, parse_forced, parse_tool_calls


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


class Reply:
    """One choice's text as the chat API shows it. `think`: None when the reply is not
    split (no reasoning parser, or a constrained output, which is answer from its first
    token), else whether it starts inside a thinking block. `mode`: off | auto | required |
    named (tools)."""

    def __init__(self, mode: str, tools: ToolSpec | None, think: bool | None) -> None:
        self.mode, self.tools, self.think = mode, tools, think
        self.reasoning = ReasoningStream(think) if think is not None else None
        self.tool_stream = ToolStream(tools.tools) if mode == "auto" else None
        self.calls: list[ToolCall] = []  # once final
        self.sent = 0  # characters of answer streamed (off / named)
        self.call_id = ToolCall("", "").id  # a named call's id, streamed with its first piece

    def whole(self, text: str) -> dict:
        """The message of a finished reply."""
        reasoning, answer = split_reasoning(text, self.think) if self.think is not None else (None, text)
        content = answer
        if self.mode == "auto":
            content, self.calls = parse_tool_calls(answer, self.tools.tools)
        elif self.mode in ("named", "required"):
            self.calls = parse_forced(answer, self.tools)
            content = "" if self.calls else answer  # an output cut by max_tokens stays text
        msg = {"role": "assistant", "content": content if content or not self.calls else None}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if self.calls:
            msg["tool_calls"] = [c.openai() for c in self.calls]
        return msg

    def delta(self, text: str, final: bool) -> dict:
        """The delta fields of a stream that has produced `text` so far."""
        out: dict = {}
        answer = text
        if self.reasoning is not None:
            piece = self.reasoning.update(text, final)
            if piece:
                out["reasoning_content"] = piece
            answer = self.reasoning.answer
        if self.mode == "auto":
            piece = self.tool_stream.update(answer, final)
            if piece:
                out["content"] = piece
            if final and self.tool_stream.calls:
                self.calls = self.tool_stream.calls
                out["tool_calls"] = [c.openai(i) for i, c in enumerate(self.calls)]
        elif self.mode == "named":  # the output is the arguments: streamed as they come
            piece = answer[self.sent:]
            if piece:
                call = {"index": 0, "function": {"arguments": piece}}
                if self.sent == 0:  # the first piece names the call
                    call = {"index": 0, "id": self.call_id, "type": "function",
                            "function": {"name": self.tools.named.name, "arguments": piece}}
                out["tool_calls"] = [call]
                self.sent = len(answer)
            if final:
                self.calls = [ToolCall(c.name, c.arguments, self.call_id) for c in parse_forced(answer, self.tools)]
        elif self.mode == "required":  # a JSON array: sent whole once complete
            if final:
                self.calls = parse_forced(answer, self.tools)
                if self.calls:
                    out["tool_calls"] = [c.openai(i) for i, c in enumerate(self.calls)]
                elif answer:
                    out["content"] = answer
        else:
            piece = answer[self.sent:]
            if piece:
                out["content"] = piece
                self.sent = len(answer)
        return out


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
        think = prompt_opens_thinking(text) if state.reasoning and constraint is None else None
        replies = {c.index: Reply(mode, tools, think) for c in run.choices}
        texts = {c.index: "" for c in run.choices}  # each choice's text so far (streaming)

        def logprobs(entries):
            return chat_logprobs(state, entries) if top_n is not None else None

        def finish_reason(choice) -> str:
            called = replies[choice.index].calls
            return "tool_calls" if called and choice.finish_reason == "stop" else choice.finish_reason

        if not req.stream:
            return await whole_response(
                state, request, run, req, "chat.completion",
                lambda choice, entries: {"message": replies[choice.index].whole(choice.matcher.emittable(final=True)),
                                         "logprobs": logprobs(entries)},
                finish_reason)

        def chunk(choice, delta: str, entries):
            texts[choice.index] += delta
            out = replies[choice.index].delta(texts[choice.index], choice.finish_reason is not None)
            if not out and not entries:
                return None
            if not out:
                out = {"content": ""}
            return {"delta": out, "logprobs": logprobs(entries), "finish_reason": None}

        return stream_response(
            state, request, run, req, chunk, {"delta": {}},
            [(c, {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
             for c in run.choices],
            finish_reason)
