"""POST /v1/chat/completions: messages rendered with the chat template, one prompt, n
choices; streamed as `chat.completion.chunk` deltas or answered whole."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from hyspec.server import schemas
from hyspec.server.errors import parse_body
from hyspec.server.generation import new_run, request_constraint
from hyspec.server.logprobs import chat_logprobs
from hyspec.server.params import MAX_LOGPROBS, bad
from hyspec.server.streaming import SSE, stream_events, wait_all


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

        if req.stream:
            usage_on = bool(req.stream_options and req.stream_options.include_usage)
            base = {"id": request_id, "object": "chat.completion.chunk", "created": run.created,
                    "model": state.model_name}
            extra = {"usage": None} if usage_on else {}

            def chunk(choice, delta: str, entries):
                return {**base, "choices": [{"index": choice.index, "delta": {"content": delta},
                                             "logprobs": chat_logprobs(state, entries) if top_n is not None else None,
                                             "finish_reason": None}], **extra}

            def finish(choice):
                return {**base, "choices": [{"index": choice.index, "delta": {}, "logprobs": None,
                                             "finish_reason": choice.finish_reason}], **extra}

            headers = [{**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}], **extra} for c in run.choices]
            return StreamingResponse(stream_events(state, request, run, chunk, finish, usage_on, headers),
                                     media_type=SSE)

        await wait_all(run, request)
        run.check_error()
        choices = []
        for choice in run.choices:
            entries = choice.logprob_entries(0, choice.matcher.n_tokens)
            body = {"index": choice.index,
                    "message": {"role": "assistant", "content": choice.matcher.emittable(final=True)},
                    "logprobs": chat_logprobs(state, entries) if top_n is not None else None,
                    "finish_reason": choice.finish_reason}
            if req.return_token_ids:
                body["token_ids"] = list(choice.matcher.ids)
            choices.append(body)
        run.log_line()
        return {"id": request_id, "object": "chat.completion", "created": run.created, "model": state.model_name,
                "choices": choices, "usage": run.usage()}
