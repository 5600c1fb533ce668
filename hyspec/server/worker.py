"""The only place the server touches the engine.

One engine thread owns the model (and, when hyspec.core.scheduler exists, the batched
Scheduler). The asyncio side talks to it through a thread-safe inbox: submissions,
cancellations and calls into the engine (prompt scoring for echo logprobs) are taken
between scheduler steps; tokens, finishes and call results go back to the event loop with
loop.call_soon_threadsafe, so Job callbacks always run on the loop thread.

Two paths share the engine thread. Where the engine's batched GPU graphs run (a CUDA
model, or engine.batch_graphs in tests), a job they can serve (hyspec.gpu.batch_loop.
graph_eligible: logprobs read from the verify logits, penalties on the device, a
constraint masked there; it fits the decoder) becomes a lane of a BatchRunner; every other job goes to the engine core's
Scheduler. Both paths share the prefix store: a lane resumes from the longest stored state
its prompt extends and leaves its end state there, as a core sequence does. The thread
alternates one graph round and one core step while both have work, so both kinds
progress; a cancel reaches either within one round.

Admission: at most max_batch jobs are inside the scheduler or the runner ("running"); the
rest wait in this module's FIFO ("waiting"). submit() refuses at once (QueueFull -> HTTP
429) when running + waiting + new jobs would exceed max_batch + max_queue.

Without the Scheduler (HYSPEC_SERVE_SCHEDULER=0, or a hyspec without hyspec.core.scheduler)
a fallback runs jobs one at a time through Engine.generate: same outputs, no batching; a
job's tokens stream as its rounds commit them (with logprobs: all at its end, scored then),
and a cancel (a client gone, a stop string matched) ends it after the round (Engine.generate's
cancel), reported as the batched path reports it: "cancelled" with the stats of the run so far.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hyspec.envknobs import switch
from hyspec.sampling import SamplingParams

log = logging.getLogger("hyspec.server")


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Job:
    """One sequence to generate (a request with n > 1 or several prompts is several jobs)."""

    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    draft: int
    stop_ids: set[int]
    logprobs: int | None = None  # None: no logprobs; N >= 0: chosen token's logprob + top N
    constraint: Any = None  # this sequence's own hyspec.constraints.Constraint (a clone), or None
    # loop-thread callbacks: on_tokens(ids, logprobs or None), on_finish(stop_reason, stats)
    on_tokens: Callable[[list[int], list | None], None] = lambda ids, lps: None
    on_finish: Callable[[str, dict], None] = lambda reason, stats: None
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    _req: Any = None  # its hyspec.core.request.Request once admitted to the engine core (batched path)
    _lane: Any = None  # its hyspec.gpu.batch_loop.LaneRequest once admitted to the batched graphs
    _n_logprobs: int = 0  # logprob entries already handed to on_tokens


def scheduler_module():
    """hyspec.core.scheduler, or None (absent, or HYSPEC_SERVE_SCHEDULER=0)."""
    if not switch("HYSPEC_SERVE_SCHEDULER"):
        return None
    import hyspec

    # only this hyspec's own scheduler (an editable install elsewhere must not leak one in)
    if not (Path(hyspec.__file__).parent / "core" / "scheduler.py").is_file():
        return None
    try:
        from hyspec.core import scheduler
    except ImportError:
        return None
    return scheduler


def graph_decoder(engine, max_batch: int, k_max: int):
    """The server's BatchDecoder: a lane per batch slot (at most 64) and room for a whole
    context (prompt + max tokens + drafts), halved while the lanes would take more than half
    the free GPU memory (down to 2048 positions; longer requests then run on the engine core)."""
    import torch

    slots = min(max_batch, 64)
    max_len = engine.context_length + k_max + 2
    if engine.model.device.type == "cuda":
        budget = torch.cuda.mem_get_info(engine.model.device)[0] // 2
        while max_len > 2048 and slots * engine.memory(max_len)["slot_bytes"]["total"] > budget:
            max_len //= 2
    return engine.new_batch_decoder(slots, max_len, k_max)


# hyspec_engine_seconds parts taken from the batched-graph runner's stats() (part -> key)
_RUNNER_SECONDS = {"prefill": "prefill_s", "rounds": "rounds_s", "store": "store_s", "capture": "graph_capture_s"}


class EngineWorker:
    def __init__(self, engine, *, max_batch: int = 16, max_queue: int = 256, prefix_store: bool = True,
                 draft: int = 3, warm_up: bool | None = None) -> None:
        self.engine = engine
        self.max_batch = max(1, int(max_batch))
        self.max_queue = max(0, int(max_queue))
        self._sched_mod = scheduler_module()
        self.batched = self._sched_mod is not None
        # HYSPEC_PROFILE_ENGINE (a diagnostic): a file that cannot be written is said now, before
        # the server starts (the profile is written when it stops: a traceback then, the run's profile lost)
        self.profile_path = os.environ.get("HYSPEC_PROFILE_ENGINE") or None
        if self.profile_path:
            try:
                open(self.profile_path, "ab").close()
            except OSError as e:
                raise ValueError(f"HYSPEC_PROFILE_ENGINE={self.profile_path!r}: cannot write the profile there "
                                 f"({e.strerror or e})") from None
        # the engine's prefix store (hyspec/prefix_store.py): every finished sequence leaves its
        # end state there, and a prompt that extends a stored sequence resumes from it (engine
        # core and batched graphs; the sequential fallback neither stores nor looks up)
        self.store = engine.store if (prefix_store and self.batched) else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: deque[Job] = deque()  # engine thread only
        self._running: set[Job] = set()  # engine thread only
        self._n_pending = 0  # submitted and not finished (any thread, under _lock)
        self._n_waiting = 0
        self._loop = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._sched = None
        # the batched GPU graphs beside the engine core (a BatchRunner made on first use; its
        # decoder drafts up to max(3, the server's default draft))
        self.graph_path = self.batched and engine.graphs_available()
        self._k_max = max(3, int(draft))
        self._draft = max(0, int(draft))
        self._graph_dec = None
        self._runner = None
        # warm_up (default: on a GPU with the batched graphs): before the first request the
        # engine thread runs three short sequences through the graphs (_warm_up)
        self.warm_up = (self.graph_path and engine.model.device.type == "cuda") if warm_up is None else bool(warm_up)
        self.warm_s: float | None = None  # how long the warm-up took (None: none ran yet)
        self.warm_rounds = 0  # rounds the warm-up ran
        # the warm-up's speculative sequences (greedy, sampled); then one plain greedy
        self.warm_up_params = [None, SamplingParams(temperature=0.8, top_p=0.95, seed=0)]
        # engine-thread seconds by part (GET /metrics: hyspec_engine_seconds{part}); a
        # runner's own counters are folded in when it is dropped after a fault
        self._core_s = self._graphs_s = 0.0
        self._dropped = dict.fromkeys(_RUNNER_SECONDS, 0.0)
        self.warming_up = False
        self.warm_up_ok: bool | None = None  # None: no warm-up ran

    # ---- loop-thread API -------------------------------------------------------------
    def start(self, loop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="hyspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def capacity(self) -> int:
        return self.max_batch + self.max_queue

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._lock:
            return self._n_pending - self._n_waiting, self._n_waiting

    def engine_seconds(self) -> dict[str, float]:
        """Engine-thread wall seconds so far: warm_up (before the first request), core
        (engine-core steps), graphs (batched-graph steps); inside graphs: graph_prefill
        (admitting lanes) and graph_rounds; graph_store (exporting end states) lies inside
        those two, graph_capture (CUDA-graph captures) inside graph_rounds."""
        run = self._runner  # (read once: the engine thread may drop it meanwhile)
        st = run.stats() if run is not None else {}
        out = {"warm_up": self.warm_s or 0.0, "core": self._core_s, "graphs": self._graphs_s}
        for part, key in _RUNNER_SECONDS.items():
            out[f"graph_{part}"] = self._dropped[part] + st.get(key, 0.0)
        return out

    def _drop_runner(self) -> None:
        """Forget the batched-graph runner (after a fault), keeping its seconds."""
        run, self._runner = self._runner, None
        if run is not None:
            st = run.stats()
            for part, key in _RUNNER_SECONDS.items():
                self._dropped[part] += st[key]

    def submit(self, jobs: list[Job]) -> None:
        """Queue all jobs or none (QueueFull)."""
        with self._lock:
            if self._n_pending + len(jobs) > self.capacity:
                raise QueueFull(f"the server is at capacity ({self.capacity} sequences running or queued)")
            self._n_pending += len(jobs)
            self._n_waiting += len(jobs)
        for job in jobs:
            self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        if not job.cancelled:
            job.cancelled = True
            self._inbox.put(("cancel", job))

    def call(self, fn: Callable[[Any], Any]):
        """Run fn(engine) in the engine thread between steps; returns an asyncio future."""
        fut = self._loop.create_future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    # ---- engine thread ---------------------------------------------------------------
    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _set_future(self, fut, result=None, exc=None) -> None:
        def done():
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        self._to_loop(done)

    def _finish(self, job: Job, reason: str, stats: dict) -> None:
        with self._lock:
            self._n_pending -= 1
        self._running.discard(job)
        self._to_loop(job.on_finish, reason, stats)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self._waiting.append(payload)
            elif kind == "cancel":
                job = payload
                if job in self._waiting:
                    self._waiting.remove(job)
                    with self._lock:
                        self._n_waiting -= 1
                    self._finish(job, "cancelled", {})
                elif job in self._running:
                    if job._lane is not None and self._runner is not None:
                        self._runner.cancel(job._lane)
                    elif job._req is not None and self._sched is not None:
                        self._sched.cancel(job._req)
            elif kind == "call":
                fn, fut = payload
                try:
                    self._set_future(fut, fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    self._set_future(fut, exc=e)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _pop_waiting(self) -> Job:
        job = self._waiting.popleft()
        with self._lock:
            self._n_waiting -= 1
        self._running.add(job)
        return job

    def _run(self) -> None:
        path = self.profile_path
        if not path:
            self._loop_forever()
            return
        import cProfile  # a diagnostic: the engine thread's profile, written when the server stops

        prof = cProfile.Profile()
        try:
            prof.runcall(self._loop_forever)
        finally:
            prof.dump_stats(path)

    def _warm_up(self) -> None:
        """Run three short sequences through the batched graphs before the first request
        (greedy and sampled at the server's draft: warm_up_params; greedy plain), so that the first users do
        not pay for the one-time work: imports (flash-linear-attention's prefill pulls in
        transformers and inductor: ~10 s seen on the H200), Triton compilation and the first
        graph captures. Their states are not stored; a failure is logged and the server
        goes on (the first requests then pay instead)."""
        from hyspec.gpu.batch_loop import BatchRunner, LaneRequest

        if not self.graph_path:
            return
        t0 = time.perf_counter()
        self.warming_up = True
        ok = False
        try:
            if self._graph_dec is None:
                self._graph_dec = graph_decoder(self.engine, self.max_batch, self._k_max)
            runner = BatchRunner(self._graph_dec)
            k = min(self._draft, self._graph_dec.k_max) if self._graph_dec.has_mtp else 0
            prompt = [1, 2, 3, 4, 5, 6, 7, 8]
            for params, kk in [(p, k) for p in self.warm_up_params] + [(None, 0)]:
                # one full round each: the first token comes from the prefill, the round drafts kk
                runner.submit(LaneRequest(prompt=prompt, max_new_tokens=kk + 2, k=kk, params=params))
            while runner.has_work() and not self._stop.is_set():
                runner.step()
            ok = not runner.has_work()
            self.warm_rounds = runner.round
        except Exception:  # noqa: BLE001 - a warm-up fault must not stop the server
            log.exception("the warm-up of the batched graphs failed; the first requests pay for it instead")
        # the requests get a runner of their own (its counters start after the warm-up)
        self._runner = None
        self.warm_s = time.perf_counter() - t0
        self.warm_up_ok = ok
        self.warming_up = False
        if ok:
            log.info("batched graphs warmed up in %.1f s", self.warm_s)

    def _loop_forever(self) -> None:
        import torch

        with torch.inference_mode():
            if self.warm_up:
                self._warm_up()
            while not self._stop.is_set():
                busy = bool(self._running) or bool(self._waiting)
                self._drain(block=not busy)
                try:
                    if self.batched:
                        self._step_batched()
                    elif self._waiting:
                        self._run_one(self._pop_waiting())
                except Exception as e:  # noqa: BLE001 - the server must survive an engine fault
                    log.exception("engine step failed; failing the running requests")
                    for job in list(self._running):
                        self._finish(job, "error", {"error": f"engine failure: {type(e).__name__}"})
                    self._sched = None
                    self._drop_runner()

    # -- batched path (hyspec.core.scheduler, and the batched graphs) -----------------------
    def _step_batched(self) -> None:
        scheduler = self._sched_mod
        if self._sched is None:
            self._sched = scheduler.Scheduler(self.engine.model, max_batch=self.max_batch, store=self.store,
                                              backend=getattr(self.engine, "backend", None))
        while self._waiting and len(self._running) < self.max_batch:
            self._admit(self._pop_waiting())
        if self._runner is not None and self._runner.has_work():
            t0 = time.perf_counter()
            self._step_graphs()  # one round of the batched graphs, then one step of the engine core
            self._graphs_s += time.perf_counter() - t0
        if self._sched.has_work():
            t0 = time.perf_counter()
            self._sched.step()
            self._core_s += time.perf_counter() - t0

    def _admit(self, job: Job) -> None:
        """Hand a job to the batched graphs when they can run it, else to the engine core."""
        req = self._sched_mod.Request(prompt_ids=job.prompt_ids, max_new_tokens=job.max_new_tokens,
                                      params=job.params, draft=job.draft, stop_ids=set(job.stop_ids),
                                      logprobs=job.logprobs, constraint=job.constraint,
                                      on_tokens=self._cb_tokens(job), on_finish=self._cb_finish(job),
                                      use_store=False, store_state=False)
        try:
            self._sched.validate(req)
            lane = self._graph_lane(job, req)
            if lane is not None:
                job._lane = self._runner.submit(lane)
                return
            req.use_store = req.store_state = self.store is not None
            job._req = req
            self._sched.submit(req)
        except ValueError as e:  # refused by the scheduler's own checks: this job only
            log.error("sequence refused by the scheduler: %s", e)
            self._finish(job, "error", {"error": str(e)})

    def _graph_lane(self, job: Job, req):
        """The job as a LaneRequest of the batched graphs, or None: the engine core runs it
        (graph_eligible refuses it, or it drafts more / runs longer than the decoder holds).
        With the prefix store, the lane resumes from the longest stored state its prompt
        extends and leaves its end state there, as the engine core's sequences do."""
        if not self.graph_path:
            return None
        from hyspec.gpu.batch_loop import BatchRunner, LaneRequest, graph_eligible, lane_stats, stored_state

        if graph_eligible([req]) is not None:
            return None
        if self._graph_dec is None:
            try:
                self._graph_dec = graph_decoder(self.engine, self.max_batch, self._k_max)
            except Exception:  # noqa: BLE001 - e.g. out of memory: the engine core serves everything
                log.exception("the batched graphs could not be set up; every request runs on the engine core")
                self.graph_path = False
                return None
        dec = self._graph_dec
        if job.draft > dec.k_max or len(job.prompt_ids) + job.max_new_tokens + job.draft + 2 > dec.max_len:
            return None
        if self._runner is None:
            self._runner = BatchRunner(dec)
        store = self.store
        resume = stored_state(store, job.prompt_ids, job.draft) if store is not None else None
        return LaneRequest(prompt=list(job.prompt_ids), max_new_tokens=job.max_new_tokens, k=job.draft,
                           stop_ids=frozenset(job.stop_ids), params=job.params, constraint=job.constraint,
                           resume=resume, on_state=store.put if store is not None else None,
                           logprobs=job.logprobs, token_logprobs=req.token_logprobs,
                           on_tokens=lambda ids, cb=self._cb_tokens(job): cb(req, ids),
                           on_finish=lambda lane: self._finish(job, lane.reason, lane_stats(lane, dec)))

    def _step_graphs(self) -> None:
        """One round of the batched graphs; a fault fails their sequences only (the next
        runner starts from idle lanes)."""
        try:
            self._runner.step()
        except Exception as e:  # noqa: BLE001 - the server must survive an engine fault
            log.exception("a batched-graph round failed; failing its sequences")
            for job in [j for j in self._running if j._lane is not None]:
                self._finish(job, "error", {"error": f"engine failure: {type(e).__name__}"})
            self._drop_runner()

    def _cb_tokens(self, job: Job):
        def on_tokens(req, new_ids):
            logprobs = None
            if job.logprobs is not None:
                every = getattr(req, "token_logprobs", None) or []
                logprobs = list(every[job._n_logprobs: job._n_logprobs + len(new_ids)])
                job._n_logprobs += len(logprobs)
            self._to_loop(job.on_tokens, list(new_ids), logprobs)
        return on_tokens

    def _cb_finish(self, job: Job):
        def on_finish(req):
            stats = dict(getattr(req, "stats", None) or {})
            if req.stop_reason == "error":
                err = str(getattr(req, "error", None))  # a request's own constraint: its 400, not an engine fault
                (log.info if err.startswith("ConstraintFailure: ") else log.error)(
                    "sequence failed in the engine: %s", err)
                stats["error"] = getattr(req, "error", None) or "engine failure"
            self._finish(job, req.stop_reason, stats)
        return on_finish

    # -- fallback path: one job at a time through Engine.generate ---------------------------
    def _run_one(self, job: Job) -> None:
        if job.cancelled:
            self._finish(job, "cancelled", {})
            return
        eng = self.engine
        streamed = job.logprobs is None  # (with logprobs the tokens go out at the end, scored then)

        def on_tokens(_, new_ids):
            if streamed and new_ids and not job.cancelled:
                self._to_loop(job.on_tokens, list(new_ids), None)

        try:
            # a cancel (the client left, or a stop string matched) ends the job after its round:
            # stop_reason "cancelled" and its stats so far, as the batched path reports it
            out = eng.generate(job.prompt_ids, max_new_tokens=job.max_new_tokens, params=job.params,
                               draft=job.draft, stop_ids=job.stop_ids, ignore_eos=True, constraint=job.constraint,
                               use_store=False, on_tokens=on_tokens, cancel=lambda: job.cancelled)
        except ValueError as e:
            log.error("sequence failed in the engine: %s", e)
            self._finish(job, "error", {"error": f"{type(e).__name__}: {e}"})
            return
        sample = out.samples[0]
        if not streamed and sample.stop_reason != "cancelled":  # (a cancelled job's tokens go nowhere)
            try:
                logprobs = self._logprobs(job.prompt_ids, sample.tokens, job.logprobs)
            except ValueError as e:  # (e.g. logits that overflow the model's dtype: named, this request's)
                log.error("sequence failed in the engine: %s", e)
                self._finish(job, "error", {"error": f"{type(e).__name__}: {e}"})
                return
            if sample.tokens:
                self._to_loop(job.on_tokens, list(sample.tokens), logprobs)
        stats = dict(sample.stats)
        if "spec" in out.stats:
            stats["spec"] = out.stats["spec"]
        self._finish(job, sample.stop_reason, stats)

    def _logprobs(self, prompt: list[int], tokens: list[int], top: int) -> list:
        """[(logprob, [(id, logprob), ...top]), ...] of each generated token under the
        model's raw distribution (teacher-forced, one forward over prompt + tokens)."""
        if not tokens:
            return []
        scored = self.engine.score(list(prompt) + list(tokens), top_logprobs=max(top, 1))
        rows = range(len(prompt) - 1, len(prompt) - 1 + len(tokens))  # logprobs[r] scores token r + 1
        return [(scored["logprobs"][r], [(int(t[0]), float(t[1])) for t in scored["top_logprobs"][r][:top]])
                for r in rows]
