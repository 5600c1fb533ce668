"""Waiting on a Run: server-sent events for `stream: true`, the plain wait otherwise, and
cancellation when the client disconnects; the response envelopes both routes share
(stream_response, whole_response): the route supplies only a choice's own fields."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from hyspec.server.choices import engine_error
from hyspec.server.params import APIError

if TYPE_CHECKING:
    from hyspec.server.choices import Choice, Run
    from hyspec.server.state import ServerState

log = logging.getLogger("hyspec.server")
SSE = "text/event-stream"


def sse(obj) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


async def watch_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body was read already: the next message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def next_change(run: "Run", watcher) -> bool:
    """Wait for news from the engine; False when the client disconnected instead."""
    waiter = asyncio.ensure_future(run.wait_change())
    done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if waiter not in done:
        waiter.cancel()
        return False
    return True


def cancel_unfinished(run: "Run", why: str = "the client disconnected") -> None:
    if not run.done:
        run.cancel()
        log.info("%s cancelled: %s after %.3fs", run.id, why, time.perf_counter() - run.t0)


async def wait_all(run: "Run", request: Request) -> bool:
    """Until every sequence finished (True); a client that disconnects cancels the run
    (False: nobody is left to answer)."""
    watcher = asyncio.ensure_future(watch_disconnect(request))
    try:
        while not run.done:
            if not await next_change(run, watcher):
                return False
        return True
    finally:
        watcher.cancel()
        cancel_unfinished(run)


async def stream_events(state: "ServerState", request: Request, run: "Run",
                        make_chunk: Callable[["Choice", str, list | None], dict],
                        finish_chunk: Callable[["Choice"], dict], usage_on: bool, header_chunks: list):
    """SSE generator: header chunks, then per change each choice's new text (make_chunk),
    then each choice's finish chunk, the usage chunk if asked, and [DONE]."""
    watcher = asyncio.ensure_future(watch_disconnect(request))
    why = "the client disconnected"  # why the sequences still running are cancelled, if any are
    try:
        for header in header_chunks:
            yield sse(header)
        while True:
            for choice in run.choices:
                if choice.sent_final:
                    continue
                final = choice.finish_reason is not None
                if choice.error is not None:
                    raise engine_error(choice.error)
                text = choice.matcher.emittable(final=final)
                delta = text[choice.sent_text:]
                wants_logprobs = choice.job.logprobs is not None
                n_logprobs = len(choice.token_logprobs) if wants_logprobs else 0
                if final:
                    n_logprobs = min(n_logprobs, choice.matcher.n_tokens)
                entries = choice.logprob_entries(choice.sent_logprobs, n_logprobs) if wants_logprobs else None
                if delta or entries or final:
                    chunk = make_chunk(choice, delta, entries)  # None: nothing to send yet
                    choice.sent_text, choice.sent_logprobs = len(text), n_logprobs
                    if chunk is not None:
                        yield sse(chunk)
                if final and choice.finish_reason != "cancelled":
                    choice.sent_final = True
                    yield sse(finish_chunk(choice))
            if all(c.sent_final or c.finish_reason == "cancelled" for c in run.choices) and run.done:
                break
            if not await next_change(run, watcher):
                return  # the client went away (finally cancels the run)
        if usage_on:
            yield sse({"id": run.id, "object": run.object, "created": run.created, "model": state.model_name,
                       "choices": [], "usage": run.usage()})
        yield "data: [DONE]\n\n"
    except APIError as e:  # (the stream's HTTP status is 200 already: the error is its last event)
        why = f"the stream ended with error {e.status}"
        state.metrics.http_errors.labels(status=str(e.status)).inc()
        yield sse(e.body())
        yield "data: [DONE]\n\n"
    except Exception:  # noqa: BLE001
        why = "the stream failed"
        log.exception("stream %s failed", run.id)
        state.metrics.http_errors.labels(status="500").inc()
        yield sse(APIError(500, "internal server error", code="internal_error").body())
        yield "data: [DONE]\n\n"  # (as after any other error event)
    else:  # (outside the try: a failing log line cannot add an error event after [DONE])
        run.log_line()
    finally:
        watcher.cancel()
        cancel_unfinished(run, why)


def stream_response(state: "ServerState", request: Request, run: "Run", req,
                    chunk_fields: Callable[["Choice", str, list | None], dict | None],
                    finish_fields: dict, header_fields: list[tuple["Choice", dict]] = (),
                    finish_reason: Callable[["Choice"], str] = lambda c: c.finish_reason) -> StreamingResponse:
    """The SSE response of a started run: every chunk is {id, object (run.object), created,
    model, choices: [{"index": ..., fields}], "usage": None when the request asked for
    usage}. chunk_fields(choice, delta, entries) gives a choice's new text (and logprobs), or
    None when there is nothing to send (it is also called once with the final text, when the
    choice's finish_reason is set, even if `delta` is empty); finish_fields the content of
    its last chunk (before logprobs None and finish_reason(choice)); header_fields (choice,
    fields) chunks go out first."""
    usage_on = bool(req.stream_options and req.stream_options.include_usage)
    base = {"id": run.id, "object": run.object, "created": run.created, "model": state.model_name}
    extra = {"usage": None} if usage_on else {}

    def chunk(choice: "Choice", fields: dict) -> dict:
        return {**base, "choices": [{"index": choice.index, **fields}], **extra}

    def fields_chunk(choice: "Choice", delta: str, entries) -> dict | None:
        fields = chunk_fields(choice, delta, entries)
        return None if fields is None else chunk(choice, fields)

    return StreamingResponse(
        stream_events(state, request, run, fields_chunk,
                      lambda choice: chunk(choice, {**finish_fields, "logprobs": None,
                                                    "finish_reason": finish_reason(choice)}),
                      usage_on, [chunk(choice, fields) for choice, fields in header_fields]),
        media_type=SSE)


async def whole_response(state: "ServerState", request: Request, run: "Run", req, object_name: str,
                         choice_fields: Callable[["Choice", list], dict],
                         finish_reason: Callable[["Choice"], str] = lambda c: c.finish_reason) -> dict | Response:
    """The non-streamed response once every sequence finished: choices [{"index", fields
    (choice_fields(choice, its logprob entries)), "finish_reason" (finish_reason(choice),
    asked after choice_fields), "token_ids" when asked}] and the usage."""
    if not await wait_all(run, request):  # the client went away: the run is cancelled, and the
        # reply (499, nginx's "client closed request") goes nowhere; no exception, so no traceback in the log
        return Response(status_code=499)
    run.check_error()
    choices = []
    for choice in run.choices:
        entries = choice.logprob_entries(0, choice.matcher.n_tokens)
        body = {"index": choice.index, **choice_fields(choice, entries)}
        body["finish_reason"] = finish_reason(choice)
        if req.return_token_ids:
            body["token_ids"] = list(choice.matcher.ids)
        choices.append(body)
    run.log_line()
    return {"id": run.id, "object": object_name, "created": run.created, "model": state.model_name,
            "choices": choices, "usage": run.usage()}
