"""What every route shares: the server's settings (ServerConfig) and its state
(ServerState: the engine, its worker thread, limits, chat template, metrics)."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

from hyspec.chat_template import TemplateError, normalize_messages
from hyspec.server import schemas
from hyspec.server.metrics import Metrics
from hyspec.server.params import APIError, Limits, bad
from hyspec.server.worker import EngineWorker

log = logging.getLogger("hyspec.server")
REASONING_PARSERS = ("auto", "qwen3", "none")


@dataclass
class ServerConfig:
    served_model_name: str = "hyspec-default"
    draft: int = 0
    max_batch: int = 16
    max_queue: int = 256
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    prefix_store: bool = True  # requests resume from / leave their end states in engine.store
    warm_up: bool | None = None  # run the batched graphs once before the first request (None: on a GPU)
    reasoning_parser: str = "auto"  # qwen3: replies' <think> part is reasoning_content; none; auto: qwen3
    # when the chat template writes </think>


class ServerState:
    """One per app (`app.state.hyspec`): the engine and the worker thread that owns it, the
    request limits, the chat template, the metrics."""

    def __init__(self, engine, cfg: ServerConfig) -> None:
        if engine.tokenizer is None:
            raise ValueError("hyspec serve needs a checkpoint with tokenizer.json")
        self.engine, self.cfg = engine, cfg
        self.tokenizer = engine.tokenizer
        model_cfg = engine.model.cfg
        self.metrics = Metrics()
        self.worker = EngineWorker(engine, max_batch=cfg.max_batch, max_queue=cfg.max_queue,
                                   prefix_store=cfg.prefix_store, draft=cfg.draft,
                                   warm_up=cfg.warm_up)
        self.metrics.prefix_store = self.worker.store is not None
        self.limits = Limits(vocab_size=model_cfg.vocab_size, max_model_len=int(model_cfg.max_position_embeddings),
                             has_mtp=bool(engine.model.has_mtp), default_draft=cfg.draft,
                             capacity=self.worker.capacity,
                             sampling_defaults=dict(engine.sampling_defaults))
        self.template = engine.chat_template
        self.own_template = not self.template.plain
        self.template_reads_tools = self.template.reads_tools  # else a request's tools would never reach the model
        if cfg.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {cfg.reasoning_parser!r}")
        self.reasoning = cfg.reasoning_parser == "qwen3" or (cfg.reasoning_parser == "auto" and self.template.thinks)
        try:  # the constraint vocabulary (~0.1 s once), so the first constrained request does not pay it
            from hyspec.constraints import vocab_for

            vocab_for(engine)
        except Exception as e:  # noqa: BLE001 - no llguidance: constrained requests get a 400 later
            log.debug("constraint vocabulary not prepared: %s", e)
        self.created = int(time.time())
        self.runs: weakref.WeakSet = weakref.WeakSet()  # the requests started (Run.start), while alive
        self.closing = False  # the server is shutting down: new requests get 503, running ones are stopped

    def begin_shutdown(self) -> None:
        """On the event loop, once the server was told to exit (SIGINT / SIGTERM): refuse new
        requests and stop every running and queued sequence, so that each request ends at
        once with a 503 (a stream: its error event and [DONE]) instead of the server waiting
        for every open request to run to its max_tokens before it exits."""
        if self.closing:
            return
        self.closing = True
        runs = [r for r in list(self.runs) if not r.done]
        if runs:
            log.info("shutting down: stopping %d running request(s)", len(runs))
        for run in runs:
            run.shutdown()

    @property
    def model_name(self) -> str:
        return self.cfg.served_model_name

    def decode_skip(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens left out (what responses show)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)

    def is_special(self, token_id: int) -> bool:
        return self.tokenizer.is_special(token_id)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.cfg.served_model_name!r}", param="model", code="model_not_found")

    def render_chat(self, messages: list[schemas.ChatMessage], add_generation_prompt: bool, tools=None,
                    kwargs: dict | None = None, *, suffix: bool = False):
        """The prompt text of a chat request (the checkpoint's template); a 400 on bad input.
        suffix: also the part the generation prompt added ((text, suffix); a thinking
        template's open <think> is looked for there)."""
        try:
            rendered = normalize_messages([m.model_dump(exclude_none=False) for m in messages])
        except ValueError as e:
            raise bad(str(e), "messages") from None
        named = dict(add_generation_prompt=add_generation_prompt, tools=tools)
        named.update(kwargs or {})  # chat_template_kwargs may set the named ones too (as vLLM lets them)
        try:
            text = self.template.render(rendered, **named)
            if not suffix:
                return text
            return text, self.template.generation_suffix(text, rendered, **named)
        except TemplateError as e:
            raise bad(str(e), "messages") from None
        except Exception:  # noqa: BLE001 - a template bug must not become a 500 with a traceback
            raise bad("the chat template failed to render these messages", "messages") from None
