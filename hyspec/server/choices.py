"""One request in flight: a Run (the HTTP request) and its Choices (one per output
sequence: prompts x n), each fed by its worker Job's callbacks on the event loop.

Words: a *choice* is one output sequence, `index` its place in the response; it is
*final* once its finish_reason is set (stop / length / error / cancelled); `sent_*`
count what a stream has already sent of it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from hyspec.engine import derive_seed
from hyspec.server.params import APIError
from hyspec.server.text import StopMatcher
from hyspec.server.worker import Job, QueueFull

if TYPE_CHECKING:
    from hyspec.server.state import ServerState

log = logging.getLogger("hyspec.server")
SHUTDOWN_ERROR = "ServerShutdown: the server is shutting down"  # a Choice's error when begin_shutdown stopped it


class Choice:
    """One output sequence (index in the response), fed by its Job's callbacks on the loop."""

    def __init__(self, run: "Run", index: int, prompt_ids: list[int], job: Job, matcher: StopMatcher) -> None:
        self.run, self.index, self.prompt_ids, self.job, self.matcher = run, index, prompt_ids, job, matcher
        self.token_logprobs: list = []  # per generated token: (logprob, [(id, logprob), ...] top list)
        self.finish_reason: str | None = None  # set when the text is final (stop / length)
        self.job_done = False
        self.stats: dict = {}
        self.error: str | None = None
        self.shutdown = False  # stopped because the server is shutting down (ServerState.begin_shutdown)
        self.t_first: float | None = None  # perf_counter of the first token
        self.t_last: float | None = None
        self.sent_text = 0  # characters streamed
        self.sent_logprobs = 0  # tokens whose logprobs were streamed
        self.sent_final = False
        job.on_tokens = self._on_tokens
        job.on_finish = self._on_finish

    def _on_tokens(self, ids: list[int], logprobs) -> None:
        if self.finish_reason is not None:
            return
        now = time.perf_counter()
        metrics = self.run.state.metrics
        before = self.matcher.n_tokens
        self.matcher.feed(ids)
        kept = self.matcher.n_tokens - before  # tokens before a stop string / stop id
        if logprobs is not None:
            self.token_logprobs.extend(logprobs[:kept])
        if kept:
            metrics.generation_tokens.inc(kept)
            if self.t_first is None:
                self.t_first = now
                metrics.ttft.observe(now - self.run.t0)
            else:
                for _ in range(kept):
                    metrics.itl.observe((now - self.t_last) / kept)
            self.t_last = now
        if self.matcher.stopped:
            self.finish_reason = "stop"
            self.run.state.worker.cancel(self.job)
        self.run.notify()

    def _on_finish(self, reason: str, stats: dict) -> None:
        self.job_done = True
        self.stats = stats
        if self.finish_reason is None:
            if reason == "error":
                self.error = stats.get("error", "engine failure")
                self.finish_reason = "error"
            elif reason in ("eos", "stop", "constraint"):  # a stop id, or a finished constraint
                self.finish_reason = "stop"
            elif reason == "cancelled" and self.shutdown:
                self.error, self.finish_reason = SHUTDOWN_ERROR, "error"
            elif reason == "cancelled":
                self.finish_reason = "cancelled"
            else:
                self.finish_reason = "length"
        state = self.run.state
        state.metrics.observe_finish(self.finish_reason, stats)
        state.metrics.e2e.observe(time.perf_counter() - self.run.t0)
        siblings = [c for c in self.run.choices if c.prompt_ids is self.prompt_ids]  # (Run.add: one shared list)
        if all(c.job_done for c in siblings):  # the prompt's last sample: its prefix figures, once
            state.metrics.observe_prefix([c.stats for c in siblings])
        self.run.notify()

    @property
    def completion_tokens(self) -> int:
        return self.matcher.n_tokens

    def logprob_entries(self, start: int, end: int) -> list:
        """(token id, logprob, top list) for generated tokens start..end."""
        ids = self.matcher.ids
        out = []
        for i in range(start, min(end, len(self.token_logprobs))):
            logprob, top = self.token_logprobs[i]
            out.append((ids[i], float(logprob), [(int(t), float(v)) for t, v in top]))
        return out


class Run:
    """One HTTP request's sequences; `event` wakes the route when any of them changes."""

    def __init__(self, state: "ServerState", request_id: str, t0: float) -> None:
        self.state, self.id, self.t0 = state, request_id, t0
        self.choices: list[Choice] = []
        self.prompts: list[list[int]] = []
        self.event = asyncio.Event()
        self.object: str | None = None  # the response's "object" field, set by the route
        self.created: int | None = None

    def notify(self) -> None:
        self.event.set()

    def add(self, prompt_ids, max_tokens, params, n, draft, stops, stop_ids, logprobs, constraint=None,
            include_stop: bool = False) -> None:
        """n sequences for one prompt (sample j > 0 gets a seed derived from the request's)."""
        self.prompts.append(prompt_ids)
        for j in range(n):
            sample_params = params if j == 0 else replace(params, seed=derive_seed(params.seed, j))
            job = Job(prompt_ids=prompt_ids, max_new_tokens=max_tokens, params=sample_params, draft=draft,
                      stop_ids=stop_ids, logprobs=logprobs,
                      constraint=None if constraint is None else constraint.clone())
            # (include_stop_str_in_output keeps a stop token id's text too, as vLLM's: special ones have none)
            matcher = StopMatcher(self.state.decode_skip, stops, drop_ids=() if include_stop else stop_ids,
                                  include_stop=include_stop)
            self.choices.append(Choice(self, len(self.choices), prompt_ids, job, matcher))

    def start(self) -> None:
        if self.state.closing:
            raise engine_error(SHUTDOWN_ERROR)
        jobs = [c.job for c in self.choices if c.job.max_new_tokens > 0]
        try:
            self.state.worker.submit(jobs)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full") from None
        self.state.runs.add(self)
        metrics = self.state.metrics
        metrics.prompt_tokens.inc(sum(len(p) for p in self.prompts))
        for choice in self.choices:
            if choice.job.max_new_tokens == 0:  # echo only: finished without running (counted as one, as usage does)
                choice.job_done, choice.finish_reason = True, "length"
                metrics.observe_finish("length", {})
                metrics.e2e.observe(time.perf_counter() - self.t0)

    @property
    def done(self) -> bool:
        return all(c.job_done for c in self.choices)

    def cancel(self) -> None:
        for choice in self.choices:
            if not choice.job_done:
                self.state.worker.cancel(choice.job)

    def shutdown(self) -> None:
        """Stop the sequences still running or queued: the server is shutting down (each
        ends in error, the request's answer a 503)."""
        for choice in self.choices:
            if not choice.job_done:
                choice.shutdown = True
                self.state.worker.cancel(choice.job)

    async def wait_change(self) -> None:
        await self.event.wait()
        self.event.clear()

    def check_error(self) -> None:
        for choice in self.choices:
            if choice.error is not None:
                raise engine_error(choice.error)

    def usage(self) -> dict:
        prompt = sum(len(x) for x in self.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        # a prompt's tokens count once however many samples it has (as in prompt_tokens): the most
        # any of its samples reused from the prefix store (a sibling may resume from another's state)
        by_prompt: dict[int, int] = {}
        for c in self.choices:
            key = id(c.prompt_ids)  # (the samples of one prompt share its list: Run.add)
            by_prompt[key] = max(by_prompt.get(key, 0), int(c.stats.get("cached_tokens", 0) or 0))
        cached = sum(by_prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def log_line(self) -> None:
        usage = self.usage()
        lengths = [c.stats["spec"]["acceptance_length"] for c in self.choices
                   if isinstance(c.stats.get("spec"), dict) and c.stats["spec"].get("acceptance_length")]
        acceptance = f"{sum(lengths) / len(lengths):.2f}" if lengths else "-"
        reasons = ",".join(sorted({str(c.finish_reason) for c in self.choices}))
        log.info("%s in=%d out=%d accept_len=%s latency=%.3fs finish=%s", self.id, usage["prompt_tokens"],
                 usage["completion_tokens"], acceptance, time.perf_counter() - self.t0, reasons)


def engine_error(error: str) -> APIError:
    """The API error of a choice that ended in error: a constraint that could not go on
    (hyspec.core.scheduler.ConstraintFailure: the request's grammar, not the server) is a
    400 naming why; a server shutting down a 503; anything else is the engine's 500."""
    if str(error).startswith("ConstraintFailure: "):
        return APIError(400, f"the request's constraint could not be satisfied: {error[len('ConstraintFailure: '):]}",
                        code="constraint_failed")
    if error == SHUTDOWN_ERROR:
        return APIError(503, "the server is shutting down: the request was stopped before it finished",
                        code="server_shutting_down")
    return APIError(500, "the engine failed while generating this request", code="engine_error")
