"""POST /v1/completions: one or more prompts (text or ids) x n choices, optional echo of
the prompt (with its logprobs, scored by the engine); streamed as `text_completion`
chunks or answered whole."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request

from hyspec.server import schemas
from hyspec.server.errors import parse_body
from hyspec.server.generation import new_run, request_constraint
from hyspec.server.logprobs import TextOffsets, completion_logprobs
from hyspec.server.params import MAX_LOGPROBS, bad
from hyspec.server.streaming import stream_response, whole_response


def prompt_ids(state, prompt) -> list[list[int]]:
    """The request's prompts as id lists (a string, strings, an id list or id lists). Text is
    encoded in a thread by the route (a 4 MB prompt took seconds: on the event loop every other
    request and stream stood still)."""
    if isinstance(prompt, str):
        return [state.tokenizer.encode(prompt)]
    if prompt and isinstance(prompt[0], str):
        return [state.tokenizer.encode(x) for x in prompt]
    if prompt and isinstance(prompt[0], list):
        return [list(x) for x in prompt]
    return [list(prompt)]


async def echo_entries(state, prompts: list[list[int]], top_n: int) -> dict[int, list]:
    """Logprob entries of each prompt's own tokens (echo + logprobs), by prompt index; the
    first token has none."""
    out: dict[int, list] = {}
    for i, ids in enumerate(prompts):
        scored = await state.worker.call(lambda eng, ids=ids: eng.score(ids, top_logprobs=max(top_n, 1))
                                         if len(ids) > 1 else {"logprobs": [], "top_logprobs": []})
        rows = zip(ids[1:], scored["logprobs"], scored["top_logprobs"])
        out[i] = [(ids[0], None, None)] + [
            (t, float(v), [(int(a[0]), float(a[1])) for a in top[:top_n]]) for t, v, top in rows]
    return out


def register(app, state) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        req = await parse_body(request, schemas.CompletionRequest)
        state.check_model(req.model)
        if req.suffix:
            raise bad("suffix is not supported", "suffix")
        prompts = await asyncio.to_thread(prompt_ids, state, req.prompt)
        if not prompts:
            raise bad("prompt must not be an empty list", "prompt")
        top_n = req.logprobs  # None: no logprobs
        if top_n is not None and not 0 <= top_n <= MAX_LOGPROBS:
            raise bad(f"logprobs must be in 0..{MAX_LOGPROBS}, got {top_n}", "logprobs")
        request_id = "cmpl-" + uuid.uuid4().hex
        constraint = await request_constraint(state.engine, req)
        run = new_run(state, req, prompts, "prompt", 16, bool(req.echo), top_n, request_id, t0, constraint)
        run.object, run.created = "text_completion", int(time.time())
        run.start()  # (first: a full server answers 429 at once; it scored the prompts for seconds before)
        try:
            echoed = await echo_entries(state, prompts, top_n) if req.echo and top_n is not None else {}
        except BaseException:  # (a failed scoring, or the request cancelled meanwhile: its sequences go too)
            run.cancel()
            raise
        n = len(run.choices) // len(prompts)  # choices per prompt

        def prompt_text(choice) -> str:
            return state.tokenizer.decode(choice.prompt_ids) if req.echo else ""  # special tokens kept: as sent

        counters: dict[int, TextOffsets] = {}  # per choice: generated tokens' offsets, after the echo

        def logprobs_obj(choice, entries, first: bool):
            if top_n is None:
                return None
            echo = echoed.get(choice.index // n, []) if (req.echo and first) else []
            if choice.index not in counters:
                counters[choice.index] = TextOffsets(state, len(prompt_text(choice)))
            return completion_logprobs(state, echo, entries or [], counters[choice.index])

        if req.stream:
            first_sent: set[int] = set()

            def chunk(choice, delta: str, entries):
                first = choice.index not in first_sent
                first_sent.add(choice.index)
                text = (prompt_text(choice) if first else "") + delta
                if not text and not entries:
                    return None
                return {"text": text, "finish_reason": None, "logprobs": logprobs_obj(choice, entries, first)}

            headers = []
            if req.echo:  # the prompt goes out at once
                for choice in run.choices:
                    first_sent.add(choice.index)
                    headers.append((choice, {"text": prompt_text(choice), "logprobs": logprobs_obj(choice, [], True),
                                             "finish_reason": None}))
            return stream_response(state, request, run, req, chunk, {"text": ""}, headers)
        return await whole_response(
            state, request, run, req, "text_completion",
            lambda choice, entries: {"text": prompt_text(choice) + choice.matcher.emittable(final=True),
                                     "logprobs": logprobs_obj(choice, entries, True) if top_n is not None else None})
