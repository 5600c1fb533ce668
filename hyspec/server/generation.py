"""What the completions and chat routes share: a request's constraint (built off the event
loop) and its Run (sampling, stops and token limits checked, one Choice per sequence)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from hyspec.server.choices import Run
from hyspec.server.params import (
    APIError,
    ConstraintSpec,
    bad,
    check_prompt_ids,
    constraint_spec,
    max_new_tokens,
    refuse_unsupported,
    requested_max_tokens,
    sampling,
    stop_strings,
)

if TYPE_CHECKING:
    from hyspec.server.state import ServerState

# how constraint errors name a response_format schema (the `param` stays "response_format")
CONSTRAINT_ARGS = {"json_schema": "response_format.json_schema.schema", "json_object": "response_format"}


def build_constraint(engine, spec: ConstraintSpec):
    """The request's Constraint (built once; each sequence gets a clone). Any failure is
    a 400 naming the field, with the library's message."""
    try:
        return engine.constraint(spec.kind, spec.value, arg=CONSTRAINT_ARGS.get(spec.kind, spec.param)
                                 if spec.param == "response_format" else spec.param)
    except ImportError as e:
        raise APIError(400, f"{spec.param}: constrained decoding is not available on this server ({e})",
                       param=spec.param, code="unsupported_value") from None
    except Exception as e:  # noqa: BLE001 - the library's message on the user's input: a 400, never a 500
        for label, value in spec.parts:  # which tool's schema it is (the combined one's error does not say)
            try:
                engine.constraint(spec.kind, value, arg=label)
            except Exception as part_error:  # noqa: BLE001 - as above
                raise bad(f"{spec.param}: {part_error}", spec.param) from None
        raise bad(str(e) or type(e).__name__, spec.param) from None


async def request_constraint(engine, req, extra: ConstraintSpec | None = None):
    """Validate the request's constraint fields and build its Constraint, off the event
    loop (a few ms for ordinary schemas; a large one must not stall other requests).
    `extra`: a constraint the route derived (a forced tool call), counted with the others."""
    spec = constraint_spec(req, extra)
    if spec is None:
        return None
    return await asyncio.to_thread(build_constraint, engine, spec)


def new_run(state: "ServerState", req, prompts: list[list[int]], param: str, default_max, allow_zero: bool,
            logprobs, request_id: str, t0: float, constraint=None) -> Run:
    """The Run of `prompts` x n sequences (not started). `param` names the prompt field in
    errors; `default_max` is max_tokens when the request leaves it out (None: the context)."""
    if getattr(req, "stream_options", None) is not None and not req.stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    refuse_unsupported(req)
    params, n, draft = sampling(req, state.limits)
    stops = stop_strings(req)
    stop_ids = set(req.stop_token_ids or ()) | (set() if req.ignore_eos else set(state.engine.eos_ids))
    run = Run(state, request_id, t0)
    if len(prompts) * n > state.limits.capacity:
        raise bad(f"too many sequences in one request ({len(prompts)} prompts x n={n})", "n")
    asked = requested_max_tokens(req)[0]
    for i, ids in enumerate(prompts):
        # (an echo with max_tokens 0 only scores the prompt: it may fill the whole context)
        where = f"prompt {i}: " if len(prompts) > 1 else ""
        check_prompt_ids(ids, state.limits, param, scoring=allow_zero and asked == 0, where=where)
        limit = max_new_tokens(req, len(ids), state.limits, default_max, allow_zero, where)
        run.add(ids, limit, params, n, draft, stops, stop_ids, logprobs, constraint,
                include_stop=bool(req.include_stop_str_in_output))
    return run
