"""The HTTP layer: FastAPI routes, OpenAI response shapes, SSE streaming, auth, limits.

All model work goes through hyspec.server.worker.EngineWorker; this module only turns
requests into Jobs and Job events into responses."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyspec.engine import derive_seed
from hyspec.server import schemas as S
from hyspec.server.metrics import Metrics
from hyspec.server.params import MAX_LOGPROBS, APIError, Limits, bad, check_prompt_ids, max_new_tokens, sampling
from hyspec.server.params import ConstraintSpec, constraint_spec, stop_strings
from hyspec.server.text import ChatTemplate, StopMatcher, TemplateError, load_chat_template
from hyspec.server.worker import EngineWorker, Job, QueueFull

log = logging.getLogger("hyspec.server")
SSE = "text/event-stream"
# how constraint errors name a response_format schema (the `param` stays "response_format")
CONSTRAINT_ARGS = {"json_schema": "response_format.json_schema.schema", "json_object": "response_format"}


@dataclass
class ServerConfig:
    served_model_name: str = "hyspec-default"
    draft: int = 0
    max_batch: int = 16
    max_queue: int = 256
    api_key: str | None = None
    max_body_bytes: int = 4 << 20


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------


def _error_response(err: APIError, metrics: Metrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.http_errors.labels(status=str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status)


class BodyLimit:
    """ASGI middleware: read the whole request body, refusing it with 413 past `limit` bytes
    (by Content-Length when given, else by counting), then replay it to the app."""

    def __init__(self, app, limit: int, metrics: Metrics) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics

    async def _refuse(self, send, err: APIError) -> None:
        await _send_error(send, err, self.metrics)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"request body larger than {self.limit} bytes", code="request_too_large")
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    return await self._refuse(send, bad("invalid Content-Length header"))
                if n > self.limit:
                    return await self._refuse(send, too_big)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await self._refuse(send, too_big)
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class ApiKey:
    """ASGI middleware: with --api-key, /v1/*, /tokenize and /detokenize need
    `Authorization: Bearer KEY` (/health and /metrics stay open)."""

    def __init__(self, app, key: str, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self.want = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope.get("path", "")
            if path.startswith("/v1") or path in ("/tokenize", "/detokenize"):
                got = dict(scope.get("headers", [])).get(b"authorization", b"")
                if not hmac.compare_digest(got, self.want):
                    err = APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                   code="invalid_api_key")
                    return await _send_error(send, err, self.metrics)
        return await self.app(scope, receive, send)


async def _send_error(send, err: APIError, metrics: Metrics) -> None:
    metrics.http_errors.labels(status=str(err.status)).inc()
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# ------------------------------------------------------------------------------------------
# One request's sequences
# ------------------------------------------------------------------------------------------


class Choice:
    """One output sequence (index in the response), fed by its Job's callbacks on the loop."""

    def __init__(self, run: "Run", index: int, prompt_ids: list[int], job: Job, matcher: StopMatcher) -> None:
        self.run, self.index, self.prompt_ids, self.job, self.matcher = run, index, prompt_ids, job, matcher
        self.lps: list = []
        self.finish_reason: str | None = None  # set when the text is final (stop / length)
        self.job_done = False
        self.stats: dict = {}
        self.error: str | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.sent_text = 0  # characters streamed
        self.sent_lps = 0
        self.sent_final = False
        job.on_tokens = self._on_tokens
        job.on_finish = self._on_finish

    def _on_tokens(self, ids: list[int], lps) -> None:
        if self.finish_reason is not None:
            return
        now = time.perf_counter()
        m = self.run.state.metrics
        before = self.matcher.n_tokens
        self.matcher.feed(ids)
        got = self.matcher.n_tokens - before
        if lps is not None:
            self.lps.extend(lps[:got])
        if got:
            m.generation_tokens.inc(got)
            if self.t_first is None:
                self.t_first = now
                m.ttft.observe(now - self.run.t0)
            else:
                for _ in range(got):
                    m.itl.observe((now - self.t_last) / got)
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
            elif reason == "cancelled":
                self.finish_reason = "cancelled"
            else:
                self.finish_reason = "length"
        st = self.run.state
        st.metrics.observe_finish(self.finish_reason, stats)
        st.metrics.e2e.observe(time.perf_counter() - self.run.t0)
        self.run.notify()

    @property
    def completion_tokens(self) -> int:
        return self.matcher.n_tokens


class Run:
    def __init__(self, state: "ServerState", rid: str, t0: float) -> None:
        self.state, self.id, self.t0 = state, rid, t0
        self.choices: list[Choice] = []
        self.prompts: list[list[int]] = []
        self.event = asyncio.Event()

    def notify(self) -> None:
        self.event.set()

    def add(self, prompt_ids, max_tokens, params, n, draft, stops, stop_ids, logprobs, constraint=None) -> None:
        self.prompts.append(prompt_ids)
        for j in range(n):
            p = params if j == 0 else replace(params, seed=derive_seed(params.seed, j))
            job = Job(prompt_ids=prompt_ids, max_new_tokens=max_tokens, params=p, draft=draft, stop_ids=stop_ids,
                      logprobs=logprobs, constraint=None if constraint is None else constraint.clone())
            matcher = StopMatcher(self.state.decode_skip, stops, drop_ids=stop_ids)
            self.choices.append(Choice(self, len(self.choices), prompt_ids, job, matcher))

    def start(self) -> None:
        jobs = [c.job for c in self.choices if c.job.max_new_tokens > 0]
        for c in self.choices:
            if c.job.max_new_tokens == 0:
                c.job_done, c.finish_reason = True, "length"
        try:
            self.state.worker.submit(jobs)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full") from None
        self.state.metrics.prompt_tokens.inc(sum(len(p) for p in self.prompts))

    @property
    def done(self) -> bool:
        return all(c.job_done for c in self.choices)

    def cancel(self) -> None:
        for c in self.choices:
            if not c.job_done:
                self.state.worker.cancel(c.job)

    async def wait_change(self) -> None:
        await self.event.wait()
        self.event.clear()

    def check_error(self) -> None:
        for c in self.choices:
            if c.error is not None:
                raise APIError(500, "the engine failed while generating this request", code="engine_error")

    def usage(self) -> dict:
        p = sum(len(x) for x in self.prompts)
        c = sum(ch.completion_tokens for ch in self.choices)
        cached = sum(int(ch.stats.get("cached_tokens", 0) or 0) for ch in self.choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def log_line(self) -> None:
        u = self.usage()
        lens = [c.stats["spec"]["acceptance_length"] for c in self.choices
                if isinstance(c.stats.get("spec"), dict) and c.stats["spec"].get("acceptance_length")]
        acc = f"{sum(lens) / len(lens):.2f}" if lens else "-"
        reasons = ",".join(sorted({str(c.finish_reason) for c in self.choices}))
        log.info("%s in=%d out=%d accept_len=%s latency=%.3fs finish=%s", self.id, u["prompt_tokens"],
                 u["completion_tokens"], acc, time.perf_counter() - self.t0, reasons)


# ------------------------------------------------------------------------------------------
# Server state
# ------------------------------------------------------------------------------------------


class ServerState:
    def __init__(self, engine, cfg: ServerConfig) -> None:
        if engine.tokenizer is None:
            raise ValueError("hyspec serve needs a checkpoint with tokenizer.json")
        self.engine, self.cfg = engine, cfg
        self.tok = engine.tokenizer
        mc = engine.model.cfg
        self.metrics = Metrics()
        self.worker = EngineWorker(engine, max_batch=cfg.max_batch, max_queue=cfg.max_queue)
        self.limits = Limits(vocab_size=mc.vocab_size, max_model_len=int(mc.max_position_embeddings),
                             has_mtp=bool(engine.model.has_mtp), default_draft=cfg.draft,
                             capacity=self.worker.capacity)
        src, self.own_template, specials = load_chat_template(engine.model_dir)
        if "eos_token" not in specials and engine.eos_ids:
            specials["eos_token"] = self.tok.decode([engine.eos_ids[0]])
        self.template = ChatTemplate(src, specials)
        try:  # the constraint vocabulary (~0.1 s once), so the first constrained request does not pay it
            from hyspec.constraints import vocab_for

            vocab_for(engine)
        except Exception as e:  # noqa: BLE001 - no llguidance: constrained requests get a 400 later
            log.debug("constraint vocabulary not prepared: %s", e)
        self.created = int(time.time())

    def decode_skip(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_str(self, tid: int) -> str:
        return self.tok.decode([tid])

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.cfg.served_model_name!r}", param="model", code="model_not_found")

    def render_chat(self, messages: list[S.ChatMessage], add_generation_prompt: bool, tools=None,
                    kwargs: dict | None = None) -> str:
        if not messages:
            raise bad("messages must not be empty", "messages")
        msgs = []
        for m in messages:
            d = m.model_dump(exclude_none=False)
            c = m.content
            if isinstance(c, list):
                parts = []
                for p in c:
                    if p.type != "text" or p.text is None:
                        raise bad(f"message content parts of type {p.type!r} are not supported (text only)",
                                  "messages")
                    parts.append(p.text)
                d["content"] = "".join(parts)
            elif c is None:
                d["content"] = ""
            msgs.append(d)
        try:
            return self.template.render(msgs, add_generation_prompt=add_generation_prompt, tools=tools,
                                        **(kwargs or {}))
        except TemplateError as e:
            raise bad(str(e), "messages") from None
        except Exception:  # noqa: BLE001 - a template bug must not become a 500 with a traceback
            raise bad("the chat template failed to render these messages", "messages") from None


# ------------------------------------------------------------------------------------------
# Response pieces
# ------------------------------------------------------------------------------------------


def _chat_logprobs(st: ServerState, entries: list) -> dict:
    content = []
    for tid, lp, top in entries:
        s = st.token_str(tid)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": st.token_str(t), "logprob": v,
                                          "bytes": list(st.token_str(t).encode("utf-8"))} for t, v in (top or [])]})
    return {"content": content, "refusal": None}


def _entries(choice: Choice, start: int, end: int) -> list:
    """(token id, logprob, top list) for generated tokens start..end of a choice."""
    ids = choice.matcher.ids
    out = []
    for i in range(start, min(end, len(choice.lps))):
        lp, top = choice.lps[i]
        out.append((ids[i], float(lp), [(int(t), float(v)) for t, v in top]))
    return out


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


# ------------------------------------------------------------------------------------------
# App
# ------------------------------------------------------------------------------------------


def create_app(engine, cfg: ServerConfig | None = None) -> FastAPI:
    cfg = cfg or ServerConfig()
    st = ServerState(engine, cfg)

    @asynccontextmanager
    async def lifespan(app):
        st.worker.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            st.worker.stop()

    app = FastAPI(title="hyspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hyspec = st

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error_response(exc, st.metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err = APIError(404, f"no such path: {request.method} {request.url.path}", code="unknown_url")
        else:
            err = APIError(exc.status_code, str(exc.detail), code=None)
        return _error_response(err, st.metrics)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(APIError(500, "internal server error", code="internal_error"), st.metrics)

    async def parse(request: Request, model):
        body = await request.body()
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            errs = e.errors()
            first = errs[0] if errs else {}
            loc = str(first["loc"][0]) if first.get("loc") else None  # the request field at fault
            if first.get("type") == "json_invalid":
                raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
            msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()))}: {er.get('msg')}" for er in errs[:5])
            raise APIError(400, f"invalid request: {msg}", param=loc, code="invalid_type") from None

    # ---- simple endpoints --------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok", "engine": "batched" if st.worker.batched else "sequential"}

    def model_card():
        return {"id": cfg.served_model_name, "object": "model", "created": st.created, "owned_by": "hyspec",
                "max_model_len": st.limits.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model_get(name: str):
        st.check_model(name)
        return model_card()

    @app.get("/metrics")
    async def metrics():
        running, waiting = st.worker.counts()
        return Response(st.metrics.render(running, waiting), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse(request, S.TokenizeRequest)
        st.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad("give exactly one of prompt or messages", "prompt")
        text = req.prompt if req.prompt is not None else st.render_chat(req.messages, bool(req.add_generation_prompt))
        ids = st.tok.encode(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": st.limits.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse(request, S.DetokenizeRequest)
        st.check_model(req.model)
        V = st.limits.vocab_size
        badids = [t for t in req.tokens if not 0 <= t < V]
        if badids:
            raise bad(f"token id(s) {badids[:5]} out of range for vocabulary size {V}", "tokens")
        return {"prompt": st.tok.decode(req.tokens)}

    # ---- generation --------------------------------------------------------------------
    def build_constraint(spec: ConstraintSpec):
        """The request's Constraint (built once; each sequence gets a clone). Any failure is
        a 400 naming the field, with the library's message."""
        try:
            return engine.constraint(spec.kind, spec.value, arg=CONSTRAINT_ARGS.get(spec.kind, spec.param)
                                     if spec.param == "response_format" else spec.param)
        except ImportError as e:
            raise APIError(400, f"{spec.param}: constrained decoding is not available on this server ({e})",
                           param=spec.param, code="unsupported_value") from None
        except Exception as e:  # noqa: BLE001 - the library's message on the user's input: a 400, never a 500
            raise bad(str(e) or type(e).__name__, spec.param) from None

    async def request_constraint(req):
        """Validate the request's constraint fields and build its Constraint, off the event
        loop (a few ms for ordinary schemas; a large one must not stall other requests)."""
        spec = constraint_spec(req)
        if spec is None:
            return None
        return await asyncio.to_thread(build_constraint, spec)

    def common(req, prompts: list[list[int]], param: str, default_max, allow_zero: bool, logprobs, rid, t0,
               constraint=None) -> Run:
        params, n, draft = sampling(req, st.limits)
        stops = stop_strings(req)
        stop_ids = set(req.stop_token_ids or ()) | (set() if req.ignore_eos else set(engine.eos_ids))
        run = Run(st, rid, t0)
        if len(prompts) * n > st.limits.capacity:
            raise bad(f"too many sequences in one request ({len(prompts)} prompts x n={n})", "n")
        for ids in prompts:
            check_prompt_ids(ids, st.limits, param)
            mt = max_new_tokens(req, len(ids), st.limits, default_max, allow_zero)
            run.add(ids, mt, params, n, draft, stops, stop_ids, logprobs, constraint)
        return run

    async def watch_disconnect(request: Request) -> None:
        """Returns when the client has gone (the body was read already: the next message
        is the disconnect)."""
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    async def next_change(run: Run, watcher) -> bool:
        """Wait for news from the engine; False when the client disconnected instead."""
        waiter = asyncio.ensure_future(run.wait_change())
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            return False
        return True

    def cancelled(run: Run) -> None:
        if not run.done:
            run.cancel()
            log.info("%s cancelled: the client disconnected after %.3fs", run.id, time.perf_counter() - run.t0)

    async def wait_all(run: Run, request: Request) -> None:
        """Until every sequence finished; a client that disconnects cancels the run."""
        watcher = asyncio.ensure_future(watch_disconnect(request))
        try:
            while not run.done:
                if not await next_change(run, watcher):
                    raise asyncio.CancelledError()
        finally:
            watcher.cancel()
            cancelled(run)

    async def stream(request: Request, run: Run, make_chunks, finish_chunk, usage_on: bool, header_chunks):
        """SSE generator: header chunks, then per change each choice's new text, then each
        choice's finish chunk, the usage chunk if asked, and [DONE]."""
        watcher = asyncio.ensure_future(watch_disconnect(request))
        try:
            for h in header_chunks:
                yield _sse(h)
            while True:
                for c in run.choices:
                    if c.sent_final:
                        continue
                    final = c.finish_reason is not None
                    if c.error is not None:
                        raise APIError(500, "the engine failed while generating this request", code="engine_error")
                    text = c.matcher.emittable(final=final)
                    delta = text[c.sent_text:]
                    n_lp = len(c.lps) if c.job.logprobs is not None else 0
                    if final:
                        n_lp = min(n_lp, c.matcher.n_tokens)
                    entries = _entries(c, c.sent_lps, n_lp) if c.job.logprobs is not None else None
                    if delta or entries:
                        chunk = make_chunks(c, delta, entries)
                        c.sent_text, c.sent_lps = len(text), n_lp
                        yield _sse(chunk)
                    if final and c.finish_reason != "cancelled":
                        c.sent_final = True
                        yield _sse(finish_chunk(c))
                if all(c.sent_final or c.finish_reason == "cancelled" for c in run.choices) and run.done:
                    break
                if not await next_change(run, watcher):
                    return  # the client went away (finally cancels the run)
            if usage_on:
                yield _sse({"id": run.id, "object": run.object, "created": run.created, "model": cfg.served_model_name,
                            "choices": [], "usage": run.usage()})
            yield "data: [DONE]\n\n"
            run.log_line()
        except APIError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
        except Exception:  # noqa: BLE001
            log.exception("stream %s failed", run.id)
            yield _sse(APIError(500, "internal server error", code="internal_error").body())
        finally:
            watcher.cancel()
            cancelled(run)

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        req = await parse(request, S.CompletionRequest)
        st.check_model(req.model)
        if req.suffix:
            raise bad("suffix is not supported", "suffix")
        p = req.prompt
        if isinstance(p, str):
            prompts = [st.tok.encode(p)]
        elif p and isinstance(p[0], str):
            prompts = [st.tok.encode(x) for x in p]
        elif p and isinstance(p[0], list):
            prompts = [list(x) for x in p]
        else:
            prompts = [list(p)]
        if not prompts:
            raise bad("prompt must not be an empty list", "prompt")
        lp = req.logprobs
        if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
            raise bad(f"logprobs must be in 0..{MAX_LOGPROBS}, got {lp}", "logprobs")
        rid = "cmpl-" + uuid.uuid4().hex
        constraint = await request_constraint(req)
        run = common(req, prompts, "prompt", 16, bool(req.echo), lp, rid, t0, constraint)
        run.object, run.created = "text_completion", int(time.time())
        echo_lps: dict[int, list] = {}
        if req.echo and lp is not None:
            for i, ids in enumerate(prompts):
                res = await st.worker.call(lambda eng, ids=ids: eng.score(ids, top_logprobs=max(lp, 1))
                                           if len(ids) > 1 else {"logprobs": [], "top_logprobs": []})
                rows = zip(ids[1:], res["logprobs"], res["top_logprobs"])
                echo_lps[i] = [(ids[0], None, None)] + [
                    (t, float(v), [(int(a[0]), float(a[1])) for a in top[:lp]]) for t, v, top in rows]
        run.start()
        n = len(run.choices) // len(prompts)

        def prompt_text(c: Choice) -> str:
            return st.decode_skip(c.prompt_ids) if req.echo else ""

        def logprobs_obj(c: Choice, entries, first: bool):
            if lp is None:
                return None
            pre = echo_lps.get(c.index // n, []) if (req.echo and first) else []
            off = 0
            if not first:
                off = len(prompt_text(c)) + sum(len(st.token_str(t)) for t in c.matcher.ids[: c.sent_lps])
            return _cmpl_logprobs_echo(st, pre, entries or [], off)

        if req.stream:
            usage_on = bool(req.stream_options and req.stream_options.include_usage)
            base = {"id": rid, "object": "text_completion", "created": run.created, "model": cfg.served_model_name}
            extra = {"usage": None} if usage_on else {}
            first_sent: set[int] = set()

            def chunk(c: Choice, delta: str, entries):
                first = c.index not in first_sent
                first_sent.add(c.index)
                text = (prompt_text(c) if first else "") + delta
                return {**base, "choices": [{"index": c.index, "text": text, "finish_reason": None,
                                             "logprobs": logprobs_obj(c, entries, first)}], **extra}

            def finish(c: Choice):
                return {**base, "choices": [{"index": c.index, "text": "", "logprobs": None,
                                             "finish_reason": c.finish_reason}], **extra}

            headers = []
            if req.echo:  # the prompt goes out at once
                for c in run.choices:
                    first_sent.add(c.index)
                    ch = {"index": c.index, "text": prompt_text(c), "logprobs": logprobs_obj(c, [], True),
                          "finish_reason": None}
                    headers.append({**base, "choices": [ch], **extra})
            return StreamingResponse(stream(request, run, chunk, finish, usage_on, headers), media_type=SSE)

        await wait_all(run, request)
        run.check_error()
        choices = []
        for c in run.choices:
            ch = {"index": c.index, "text": prompt_text(c) + c.matcher.emittable(final=True),
                  "logprobs": logprobs_obj(c, _entries(c, 0, c.matcher.n_tokens), True) if lp is not None else None,
                  "finish_reason": c.finish_reason}
            if req.return_token_ids:
                ch["token_ids"] = list(c.matcher.ids)
            choices.append(ch)
        run.log_line()
        return {"id": rid, "object": "text_completion", "created": run.created, "model": cfg.served_model_name,
                "choices": choices, "usage": run.usage()}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0 = time.perf_counter()
        req = await parse(request, S.ChatCompletionRequest)
        st.check_model(req.model)
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise bad(f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {req.top_logprobs}", "top_logprobs")
            if not req.logprobs:
                raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        lp = (req.top_logprobs or 0) if req.logprobs else None
        text = st.render_chat(req.messages, bool(req.add_generation_prompt), req.tools, req.chat_template_kwargs)
        ids = st.tok.encode(text)
        rid = "chatcmpl-" + uuid.uuid4().hex
        constraint = await request_constraint(req)
        run = common(req, [ids], "messages", None, False, lp, rid, t0, constraint)
        run.object, run.created = "chat.completion.chunk", int(time.time())
        run.start()

        if req.stream:
            usage_on = bool(req.stream_options and req.stream_options.include_usage)
            base = {"id": rid, "object": "chat.completion.chunk", "created": run.created,
                    "model": cfg.served_model_name}
            extra = {"usage": None} if usage_on else {}

            def chunk(c: Choice, delta: str, entries):
                return {**base, "choices": [{"index": c.index, "delta": {"content": delta},
                                             "logprobs": _chat_logprobs(st, entries) if lp is not None else None,
                                             "finish_reason": None}], **extra}

            def finish(c: Choice):
                return {**base, "choices": [{"index": c.index, "delta": {}, "logprobs": None,
                                             "finish_reason": c.finish_reason}], **extra}

            headers = [{**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}], **extra} for c in run.choices]
            return StreamingResponse(stream(request, run, chunk, finish, usage_on, headers), media_type=SSE)

        await wait_all(run, request)
        run.check_error()
        choices = []
        for c in run.choices:
            ch = {"index": c.index, "message": {"role": "assistant", "content": c.matcher.emittable(final=True)},
                  "logprobs": _chat_logprobs(st, _entries(c, 0, c.matcher.n_tokens)) if lp is not None else None,
                  "finish_reason": c.finish_reason}
            if req.return_token_ids:
                ch["token_ids"] = list(c.matcher.ids)
            choices.append(ch)
        run.log_line()
        return {"id": rid, "object": "chat.completion", "created": run.created, "model": cfg.served_model_name,
                "choices": choices, "usage": run.usage()}

    if cfg.api_key:
        app.add_middleware(ApiKey, key=cfg.api_key, metrics=st.metrics)
    if cfg.max_body_bytes:
        app.add_middleware(BodyLimit, limit=cfg.max_body_bytes, metrics=st.metrics)
    return app


def _cmpl_logprobs_echo(st: ServerState, pre: list, entries: list, offset0: int) -> dict:
    toks, tlps, tops, offs = [], [], [], []
    off = offset0
    for tid, lpv, top in list(pre) + list(entries):
        s = st.token_str(tid)
        toks.append(s)
        tlps.append(lpv)
        tops.append(None if top is None else {st.token_str(t): v for t, v in top})
        offs.append(off)
        off += len(s)
    return {"tokens": toks, "token_logprobs": tlps, "top_logprobs": tops, "text_offset": offs}
