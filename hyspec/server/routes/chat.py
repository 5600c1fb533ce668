"""POST /v1/chat/completions: messages rendered with the chat template, one prompt, n
choices; streamed as `chat.completion.chunk` deltas or answered whole."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from hyspec.server import schemas
from hyspec.server.errors import parse_body
from hyspec.server.generation import new_run, request_constraint
from hyspec.server.logprobs import chat_logprobs
from hyspec.server.params import MAX_LOGPROBS, bad
from hyspec.server.streaming import stream_response, whole_response


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
        text = state.render_chat(req.messages, bool(req.add_generation_prompt), req.tools, req.chat_template_kwargs)
        ids = state.tokenizer.encode(text)
        request_id = "chatcmpl-" + uuid.uuid4().hex
        constraint = await request_constraint(state.engine, req)
        run = new_run(state, req, [ids], "messages", None, False, top_n, request_id, t0, constraint)
        run.object, run.created = "chat.completion.chunk", int(time.time())
        run.start()

        def logprobs(entries):
            return chat_logprobs(state, entries) if top_n is not None else None

        if req.stream:
            return stream_response(
                state, request, run, req,
                lambda choice, delta, entries: {"delta": {"content": delta}, "logprobs": logprobs(entries),
                                                "finish_reason": None},
                {"delta": {}},
                [(c, {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
                 for c in run.choices])
        return await whole_response(
            state, request, run, req, "chat.completion",
            lambda choice, entries: {"message": {"role": "assistant", "content": choice.matcher.emittable(final=True)},
                                     "logprobs": logprobs(entries)})
