"""What a caller asks the engine core for, and what it reads back while and after it runs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from hyspec.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One sequence to generate.

    Inputs
        prompt_ids      the prompt's token ids (>= 1)
        max_new_tokens  tokens to generate at most
        params          sampling (temperature 0 = greedy), per request
        draft           K drafts per round (0 = plain decoding), per request
        spec            other drafter options (hyspec.speculative.loop.SpecOptions; its k is replaced by `draft`)
        stop_ids        generation ends after emitting one of these (EOS ids unless the caller ignores EOS)
        stop_text       stop strings (hyspec.engine.StopStrings): generation ends after the token
                        that completes one (stop_reason "stop"), inside a round as at a stop id
        reference       the forced-acceptance drafter's continuation (tests, benchmarks)
        logprobs        None, or N >= 0: record each emitted token's log-probability (raw target
                        logits) and the top-N alternatives in `token_logprobs`
        constraint      an object with allowed(prefix) -> bool [V], commit(tokens), finished
                        (hyspec.constraints); masks every draft and verify row
        on_tokens       called as on_tokens(request, new_token_ids) after each round that emits
        on_finish       called as on_finish(request) once it is done
        telemetry       a SpecTelemetry to record rounds into (default: a fresh one)
        keep            sessions: do not free the slot at the end; the Sequence is left in
                        `sequence` (its state continues in a later request's `resume`)
        resume          continue from a kept Sequence or a hyspec.core.state.SeqState; the
                        prompt_ids are then only the tokens after it (may be empty when the
                        state has a pending token)
        use_store       look the prompt up in the scheduler's prefix store (if it has one)
        store_state     put the final state into the scheduler's prefix store
    Outputs (filled by the scheduler)
        tokens          generated ids so far
        done            finished (see stop_reason: "eos" | "stop" | "length" | "cancelled" | "constraint" | "error")
        stats           counters and timings (the same keys as `hyspec generate --json`'s stats)
        token_logprobs  per emitted token: (logprob, [(id, logprob), ...top-N])
        error           the exception message when stop_reason == "error"
        sequence        keep on the engine core: the kept Sequence (its slot stays taken)
        end_state       keep on the CUDA-graph lanes: the end state as a SeqState (the lane
                        is freed; None where no state can be built: a one-token transcript)
    """

    prompt_ids: list[int]
    max_new_tokens: int = 64
    params: SamplingParams = GREEDY
    draft: int = 0
    spec: Any = None
    stop_ids: Any = ()
    stop_text: Any = None
    reference: list[int] | None = None
    logprobs: int | None = None
    constraint: Any = None
    on_tokens: Callable[["Request", list[int]], None] | None = None
    on_finish: Callable[["Request"], None] | None = None
    telemetry: Any = None
    request_id: Any = None
    keep: bool = False
    resume: Any = None
    use_store: bool = True
    store_state: bool = False

    tokens: list[int] = field(default_factory=list)
    done: bool = False
    stop_reason: str | None = None
    stats: dict = field(default_factory=dict)
    token_logprobs: list = field(default_factory=list)
    error: str | None = None
    cancel_requested: bool = False
    sequence: Any = None
    end_state: Any = None

    def __post_init__(self) -> None:
        if self.request_id is None:
            self.request_id = next(_ids)
