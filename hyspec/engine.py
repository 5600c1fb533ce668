"""The front door: load a checkpoint (weights + tokenizer) once, then generate or score.

    from hyspec import Engine
    eng = Engine.load("path/to/checkpoint")            # or Engine.load() for the embedded default
    out = eng.generate("def fibonacci(n):", max_new_tokens=64, draft=3)
    print(out.text, out.stats["spec"]["acceptance_length"])

Long on purpose: it is the whole public Python API in one class (load, encode, generate,
generate_batch, chat, session, constraint, memory, score), and each method validates
its own arguments here so errors name them and picks the path that runs them; the work
itself is in hyspec/core/ (and hyspec/gpu/ on a GPU).

Words: a *sample* is one completion of a --num-samples run (seed derived per sample); the
*graph batch* is hyspec/gpu's BatchDecoder (CUDA graphs over lanes), which runs every
request a GPU can take, one or many; *capped*: max_new_tokens cut to what fits in the
context after the prompt.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import math
import operator
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hyspec.chat_template import normalize_messages
from hyspec.config import checkpoint_sampling_defaults, no_mtp_error
from hyspec.core.request import Request
from hyspec.core.scheduler import Scheduler
from hyspec.decode import GREEDY, generate_plain
from hyspec.envknobs import check as check_env
from hyspec.loading import load_model, parse_dtype, resolve_model_dir
from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx
from hyspec.sampling import ParamError, SamplingParams, as_bool, as_int, top_ids
from hyspec.speculative.loop import MAX_DRAFT, SpecOptions
from hyspec.speculative.telemetry import SpecTelemetry
from hyspec.tokenizer import Tokenizer

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
_MASK64 = (1 << 64) - 1
# counters that add up over the samples of a --num-samples run (the rest is per-run constant)
_SUMMED_STATS = ("generated_tokens", "target_forwards", "mtp_forwards", "direct_tokens", "prefill_s", "decode_s")


def _int_arg(name: str, value, lo: int, hi: int | None = None) -> int:
    """`value` as a Python int (a numpy integer is taken), checked against lo..hi."""
    value_in = value
    value = as_int(value)
    if value is None:
        raise ParamError(name, value_in, "must be an integer")
    if value < lo or (hi is not None and value > hi):
        raise ParamError(name, value, f"must be in {lo}..{hi}" if hi is not None else f"must be >= {lo}")
    return value


def draft_of(draft, spec) -> int:
    """The K a request drafts: `draft` (0 = plain) or, when it is None, spec's k (0 without
    spec: `generate(p, spec=SpecOptions(k=3))` speculates, as it reads)."""
    if draft is None:
        return spec.k if isinstance(spec, SpecOptions) else 0
    return _int_arg("draft", draft, 0, MAX_DRAFT)


def _bool_arg(name: str, value) -> bool:
    """`value` as a Python bool; a string such as "no" or a number is refused, not taken by
    its truthiness."""
    flag = as_bool(value)
    if flag is None:
        raise ParamError(name, value, "must be True or False")
    return flag


def _token_ids(name: str, value, ordered: bool = True) -> list[int]:
    """`value` as a list of Python ints; ordered=False (stop ids) also takes a set."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ParamError(name, value, "must be a list of token ids")
    if "bool" in str(getattr(value, "dtype", "")):  # a bool tensor or array: not token ids
        raise ParamError(name, value, "must be a list of integer token ids")
    if getattr(value, "ndim", 1) != 1:  # a 2-D tensor / array (its [N, 1] rows were flattened in silence)
        raise ParamError(name, value, "must be a 1-D sequence of token ids")
    # a dict gave its keys, a set its hash order (not the caller's), as the prompt's ids
    if ordered and (isinstance(value, (dict, set, frozenset)) or hasattr(value, "keys")):
        raise ParamError(name, value, "must be a list of token ids (an ordered sequence, not a dict or set)")
    try:
        items = list(value)  # (once: a generator is read one time)
        if any(isinstance(t, bool) for t in items):  # (True is an int to Python, not a token id)
            raise TypeError
        return [operator.index(t) for t in items]
    except TypeError:
        raise ParamError(name, value, "must be a list of integer token ids") from None


def check_device(device) -> torch.device:
    """torch.device for 'cpu', 'cuda' or 'cuda:N', with an error naming the argument."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ParamError("device", device, "must be cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ParamError("device", device, f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def default_model_dir() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the embedded default model is missing from {DEFAULT_MODEL_DIR}; pass --model DIR")
    return DEFAULT_MODEL_DIR


def derive_seed(seed: int, i: int) -> int:
    """Seed of sample i of a --num-samples run (sample 0 keeps the given seed): a
    splitmix64 hash, so runs with neighbouring seeds do not share samples."""
    if i == 0:
        return seed
    z = (seed * 0x9E3779B97F4A7C15 + i * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class Sample:
    tokens: list[int]
    text: str | None
    stop_reason: str
    stats: dict = field(default_factory=dict)
    message: dict | None = None  # Engine.chat: {"role", "content", "reasoning_content"?, "tool_calls"?}


@dataclass
class Output:
    samples: list[Sample]
    prompt_tokens: list[int]
    stats: dict
    logprobs: list | None = None  # per sample: (logprob, [(id, logprob), ...]) per token

    @property
    def tokens(self) -> list[int]:
        return self.samples[0].tokens

    @property
    def text(self) -> str | None:
        return self.samples[0].text

    @property
    def stop_reason(self) -> str:
        """Why the first sample ended ("eos", "length", "stop", "context", "constraint", ...)."""
        return self.samples[0].stop_reason

    @property
    def message(self) -> dict | None:
        """Engine.chat's reply of the first sample, as an OpenAI-style assistant message."""
        return self.samples[0].message

    def to_dict(self) -> dict:
        """stats: totals over all samples (counters and times add up; spec telemetry is
        merged); samples[i].stats: that sample's own. With logprobs: "logprobs" (each
        token's log-probability) and "top_logprobs" ([id, logprob] pairs per token), as
        Engine.score's, for the first sample at the top and for each sample in samples."""
        samples = [{"tokens": s.tokens, "text": s.text, "stop_reason": s.stop_reason, "stats": s.stats}
                   for s in self.samples]
        for s, d in zip(self.samples, samples):
            if s.message is not None:
                d["message"] = s.message
        d = {"tokens": self.tokens, "text": self.text, "stop_reason": self.samples[0].stop_reason,
             "prompt_tokens": self.prompt_tokens, "samples": samples, "stats": self.stats}
        if self.message is not None:
            d["message"] = self.message
        if self.logprobs is not None:
            for s, entries in zip(samples, self.logprobs):
                s["logprobs"] = [float(lp) for lp, _ in entries]
                s["top_logprobs"] = [[[int(i), float(v)] for i, v in top] for _, top in entries]
            d["logprobs"], d["top_logprobs"] = samples[0]["logprobs"], samples[0]["top_logprobs"]
        return d


SAMPLES_AT_ONCE = 64  # Engine.generate's num_samples decode in batches of at most this many


def stop_list(stop) -> list[str]:
    """A request's stop strings: None, one string or a list of strings (empty ones dropped)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ParamError("stop", stop, "must be a string or a list of strings")
    stop = list(stop)
    if any(not isinstance(x, str) for x in stop):
        raise ParamError("stop", stop, "must be a string or a list of strings")
    for x in stop:
        why = lone_surrogate(x)
        if why:
            raise ParamError("stop", x, why + ", which no generated text holds, so it would never match")
    return [x for x in stop if x]


def lone_surrogate(text: str) -> str | None:
    """Where `text` holds a lone UTF-16 surrogate (U+D800..U+DFFF: a JSON "\\ud800" escape, or
    a command-line byte that is not UTF-8, which Python keeps as U+DC80..U+DCFF), which no
    tokenizer encodes and no decoded text holds: "character i is a lone surrogate (...)".
    None when it has none."""
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            return (f"character {i} is a lone surrogate (U+{ord(ch):04X}: not UTF-8 on the command line, or a "
                    f"broken \\u escape, e.g. an emoji's two halves decoded apart)")
    return None


class TextStream:
    """Text of a growing list of generated tokens, for streaming (Engine.text_stream): each
    `feed(ids)` returns only the text that is final so far (a character whose bytes are split
    over tokens or rounds comes out whole, never as U+FFFD; with stop strings, a tail that may
    still become one is held back and nothing after a match comes out), and `finish()` the
    rest. The pieces joined are the request's Output.text (decoding each round's ids alone
    printed U+FFFD for every split character)."""

    def __init__(self, decode, stop: list[str] | None = None, drop_ids=(), whole_decode=None, check=None) -> None:
        from hyspec.server.text import StopMatcher

        self._matcher = StopMatcher(decode, list(stop or []), drop_ids=drop_ids)
        self._whole = whole_decode  # Output.text's decode of a run no stop string ended (EOS text kept)
        self._check = check  # ids -> the ids as a list of ints, refused by name when not this model's
        self._sent = 0
        self._done = False

    def _take(self, text: str) -> str:
        new = text[self._sent:]
        self._sent = max(self._sent, len(text))
        return new

    def feed(self, ids) -> str:
        if self._done:
            raise ValueError("this text stream is finished (finish() was called): a new sample needs a new "
                             "Engine.text_stream()")
        self._matcher.feed(self._check(ids) if self._check is not None else ids)
        return self._take(self._matcher.emittable())

    def finish(self) -> str:
        self._done = True
        m = self._matcher
        if self._whole is not None and not m.stopped:  # no stop string met: Output.text is the tokens' whole
            whole = self._whole(m.ids)  # text (its special tokens, EOS, too)
            sent = m.text[:self._sent]
            if whole.startswith(sent):
                self._sent = len(whole)
                return whole[len(sent):]
        return self._take(m.emittable(final=True))

    @property
    def text(self) -> str:
        """The whole text so far (what finish() completes)."""
        return self._matcher.text


class StopStrings:
    """One request's stop strings (the server's matcher, hyspec.server.text.StopMatcher), as
    its Request.stop_text: the round driver (engine core and CUDA-graph lanes) ends the
    sequence at the token that completes a match, inside a round as at a stop id (`peek`:
    where in a round's accepted drafts one completes; `check`: consume one emitted token);
    `apply(request)` gives the text cut before the stop string (as the server shows it:
    special tokens left out). Stop ids (EOS) never complete a stop string."""

    def __init__(self, engine, stops: list[str], stop_ids=(), skip_break: bool = False) -> None:
        from hyspec.server.text import StopMatcher

        if engine.tokenizer is None:
            raise ValueError("stop strings need the checkpoint's tokenizer.json (use stop_ids instead)")
        # as the server matches: the text without special tokens, the stop ids (EOS) never part of it
        tok = engine.tokenizer
        self.matcher = StopMatcher(lambda ids: tok.decode(ids, skip_special_tokens=True), stops, drop_ids=stop_ids,
                                   skip_break=skip_break)

    def prime(self, tokens: list[int]) -> None:
        """The reply's tokens before this request (a session's "go on" turn): a stop string
        may begin in them and complete in this request's tokens."""
        self.matcher.prime(tokens)

    def peek(self, tokens: list[int]) -> int | None:
        """The index of the token in `tokens` that would complete a stop string (None: none
        does); nothing is consumed."""
        if self.matcher.stopped:
            return 0 if tokens else None
        m = self.matcher.clone()
        for i, t in enumerate(tokens):
            m.feed([t])
            if m.stopped:
                return i
        return None

    def check(self, token: int) -> bool:
        """Consume one emitted token: whether it completed a stop string."""
        self.matcher.feed([token])
        return self.matcher.stopped

    def apply(self, req) -> str | None:
        """A finished request's text cut before its stop string (None: no stop string met;
        after primed tokens, the text after theirs: "" when the match began in theirs)."""
        m = self.matcher
        return m.text[m.primed_end:] if m.stopped else None  # (a character cut in the primed tokens: this text's)


@dataclass
class ChatTurn:
    """A prepared chat request (Engine.prepare_chat): generate from `prompt` under
    `constraint`, then `message(tokens, stop_ids)` is the reply."""

    engine: "Engine"
    prompt: str
    constraint: object
    tools: object  # hyspec.tools.ToolSpec or None
    think: bool | None  # None: no reasoning split; else whether the reply starts inside one

    def message(self, tokens: list[int], stop_ids=(), stop_strings=()) -> dict:
        """The reply message of generated tokens; stop_strings: the text ends before the first
        one (a sample that ended on a stop string)."""
        from hyspec.reply import Reply

        tok = self.engine.tokenizer
        text = tok.decode([t for t in tokens if t not in stop_ids], skip_special_tokens=True) if tok else ""
        found = [i for i in (text.find(x) for x in stop_strings) if i >= 0]
        if found:
            text = text[:min(found)]
        return Reply.of(self.tools, self.think, self.constraint is not None).whole(text)


def engine_call(engine_of=lambda obj: obj):
    """A decorator for methods that run the engine's model (`engine_of(self)`: the Engine):
    calls from several threads take turns (the engine's schedulers, slots, prefix store and
    graph decoder are shared; two sessions' turns in two threads livelocked on the session
    scheduler). The lock is re-entrant for the engine's own nesting (chat -> generate, a
    session's send -> its slot's release); callbacks (on_tokens, on_finish) run while it is
    held, so a callback must not start another model call on the same engine, nor wait for
    a thread that does. Concurrent requests that should batch go through one
    generate_batch call, or the server (which owns its engine while it serves)."""
    def wrap(method):
        @functools.wraps(method)
        def run(obj, *args, **kwargs):
            eng = engine_of(obj)
            with eng._lock:
                eng._free_orphans()
                return method(obj, *args, **kwargs)
        return run
    return wrap


def _cancellable(stream, cancel, requests: list | None):
    """A request's on_tokens that also asks `cancel()` after each emitting round: once True,
    every request of `requests` (None: the request r itself) is asked to stop
    (Request.cancel_requested: the engine core and the CUDA-graph lanes end it after its
    round, stop_reason "cancelled")."""
    def on_tokens(r, toks):
        if stream is not None:
            stream(r, toks)
        if cancel():
            for q in (requests if requests is not None else [r]):
                q.cancel_requested = True
    return on_tokens


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


one_at_a_time = engine_call()  # Engine's own methods (Session's: engine_call(lambda s: s.engine))


class Engine:
    def __init__(self, model: HybridLM, tokenizer: Tokenizer | None = None, model_dir: str | None = None,
                 sampling_defaults: dict | None = None) -> None:
        self._lock = threading.RLock()  # one model call at a time (engine_call)
        self._orphans: collections.deque = collections.deque()  # session slots dropped while the lock was held
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        # the checkpoint's recommended sampling (generation_config.json: hyspec.config.
        # checkpoint_sampling_defaults): what `hyspec chat` and `hyspec serve` use for the
        # settings a user or a request leaves out; Engine.generate's params=None stays greedy.
        # Read from model_dir unless given (Engine.load reads it before the weights load)
        if sampling_defaults is None:
            sampling_defaults = checkpoint_sampling_defaults(model_dir) if model_dir is not None else {}
        self.sampling_defaults: dict = dict(sampling_defaults)
        self.backend = None  # the scheduler's backend (None: ReferenceBackend); a pipeline sets its own
        self.batch_graphs = False  # True: the BatchDecoder also off CUDA (the Triton interpreter; tests)
        self._batch_dec = None
        self._lanes_busy = False  # a call is running on the _batch_dec lanes (Engine.on_lanes)
        self.session_graphs = True  # session turns on the graph lanes where they run (False: the engine core)
        # pipeline only (a request on an Engine without one is refused, as are both together: _check_run_options)
        self.lanes = 1  # batch groups that alternate through the stages (hyspec/parallel/lanes.py)
        self.optimistic = False  # fork the next round's verify early (hyspec/parallel/fork.py)
        self._store = None  # the prefix store (created with the first session, or by .store)
        self._session_sched = None
        self._session_free_bytes = "default"  # (session_free_bytes: until set, the default below)

    # -- sessions and the prefix store ---------------------------------------------------
    @property
    def store(self):
        """The engine's prefix store (hyspec/prefix_store.py): turn-boundary states that any
        request extending them resumes from."""
        if self._store is None:
            from hyspec.prefix_store import PrefixStore

            with self._lock:  # (checked again under the lock: two threads' first sessions made two stores, and
                if self._store is None:  # the second replaced the first with the turns already put in it)
                    self.store = PrefixStore()  # (the setter: sessions share it)
        return self._store

    def _free_orphans(self) -> None:
        """Give back the slots of sessions collected while another call held the lock (their
        __del__ does not wait for it: a finalizer that waits on a lock can deadlock)."""
        while self._orphans:
            slot = self._orphans.popleft()
            if self._session_sched is not None:
                self._session_sched.pool.release(slot)

    @store.setter
    def store(self, store) -> None:
        """Replace the prefix store (e.g. PrefixStore(budget_bytes=..., host_budget_bytes=...)).
        None drops it: one-shot requests then run without a store until one is made again
        (a session makes one, shared from then on by every request and session). A store
        serves one engine: one that another (live) engine holds is refused; one that another
        engine let go (or that was garbage collected) is emptied first (its states are that
        engine's model's)."""
        from hyspec.prefix_store import PrefixStore

        if store is not None and not isinstance(store, PrefixStore):
            raise ParamError("store", store, "must be a hyspec.prefix_store.PrefixStore or None")
        with self._lock:  # (not in the middle of another thread's call)
            if store is not None:
                # (its entries are keyed by tokens alone: another engine's model would resume from them as its own).
                # Checked and taken under the store's lock: two engines taking one store in two threads (each
                # under its own engine lock) would otherwise both see it free and both take it
                with store._lock:
                    owner = store._owner() if store._owner is not None else None
                    if owner is not None and owner is not self:
                        raise ValueError("this PrefixStore already serves another Engine: its states are that "
                                         "engine's model's (weights, dtype, state dtype); give each engine its own "
                                         "PrefixStore")
                    served = store._served() if store._served is not None else None
                    if store._served is not None and served is not self:
                        store.clear()  # (the states of an engine that let it go, or is gone: not this model's)
                    store._owner = store._served = weakref.ref(self)
            if self._store is not None and self._store is not store:
                with self._store._lock:
                    self._store._owner = None  # (free for another engine, which starts it empty)
            self._store = store
            if self._session_sched is not None:
                self._session_sched.store = store

    def session(self, **kw):
        """A conversation whose state is kept between turns (hyspec/session.py): draft, params,
        spec, max_new_tokens, stop_ids, ignore_eos, use_store, constraint."""
        from hyspec.session import Session

        if self.backend is not None:
            raise ValueError("sessions are not supported on a pipeline (--pp): the other stages do not keep "
                             "session states (docs/multi-gpu.md)")
        self._check_run_options()  # (Engine.lanes / optimistic: pipeline only, refused here as for a request)
        self.store  # noqa: B018  (sessions store their turn boundaries)
        return Session(self, **kw)

    def session_scheduler(self) -> Scheduler:
        """The scheduler whose slot pool holds the sessions' slots between turns."""
        if self._session_sched is None:
            from hyspec.core.slots import SlotPool

            # every open session holds a slot; closed sessions' slots are kept for reuse up to a
            # turn batch's worth (was: all of them, one more for each session longer than the last)
            # and up to session_free_bytes (was: no byte cap, 16 long free slots held many GB)
            self._session_sched = Scheduler(self.model, max_batch=16, store=self.store,
                                            pool=SlotPool(self.model, max_slots=1 << 16, max_free=16,
                                                          max_free_bytes=self.session_free_bytes))
        return self._session_sched

    @property
    def session_free_bytes(self) -> int | None:
        """The most bytes the closed sessions' slots kept for reuse may hold (the
        sessions' SlotPool max_free_bytes; at most 16 such slots either way). Default: two
        slots at the model's full context (Engine.memory(context_length)'s slot_bytes total,
        twice): room to keep a slot of any length a session reaches (its growth stops at the
        context plus a round's rows), never more than two full-context sessions' worth held
        once the sessions are gone. Set it to a number of bytes (0: keep none), or None for
        no byte cap; a lower cap lets the shortest free slots go at once."""
        if self._session_free_bytes == "default":
            from hyspec.core.slots import slot_bytes

            m = self.model
            return 2 * slot_bytes(m.cfg, m.dtype, self.context_length, m.has_mtp)["total"]
        return self._session_free_bytes

    @session_free_bytes.setter
    def session_free_bytes(self, value: int | None) -> None:
        from hyspec.core.slots import bytes_arg

        value = bytes_arg("session_free_bytes", value)
        with self._lock:  # (not in the middle of another thread's turn)
            self._session_free_bytes = value
            if self._session_sched is not None:
                self._session_sched.pool.max_free_bytes = value

    @classmethod
    def load(cls, path: str | Path | None = None, *, dtype: str = "auto", device: str = "cpu",
             ssm_dtype: str | None = None) -> "Engine":
        """The checkpoint at `path` (a user's ~ expanded; a Hugging Face model id, `org/name`, comes
        from huggingface_hub's cache or is downloaded there: hyspec.loading.resolve_model_dir;
        default: the embedded model). ssm_dtype: the Gated DeltaNet state's storage dtype
        (hyspec.loading.load_model; None, the default, or "auto": config.json's
        `mamba_ssm_dtype`, else float32; "bfloat16" halves a slot's state bytes and rounds the
        state after every token)."""
        if (path is not None and not isinstance(path, (str, os.PathLike))) or path == "":
            raise ParamError("path", path, "must be a checkpoint directory (str or Path), or None for the embedded "
                             "model")
        check_device(device)  # (before a download)
        check_env()  # a bad HYSPEC_* knob (hyspec.envknobs), before the weights load
        path = resolve_model_dir(path) if path is not None else default_model_dir()
        if (path / "tokenizer.json").is_dir():  # (before the weights load)
            raise ValueError(f"{path / 'tokenizer.json'} is a directory, not the tokenizer's file")
        recommended = checkpoint_sampling_defaults(path)  # (a bad value: before the weights load)
        model = load_model(path, dtype=parse_dtype(dtype, device), device=device, ssm_dtype=ssm_dtype)
        tok = Tokenizer(path) if (path / "tokenizer.json").is_file() else None
        if tok is not None and tok.vocab_size > model.cfg.vocab_size:
            warnings.warn(f"{path}: tokenizer.json has {tok.vocab_size} tokens, more than config.json's vocab_size "
                          f"{model.cfg.vocab_size}: a text whose ids pass it is refused (the tokenizer and the "
                          f"weights may not belong together)", stacklevel=2)
        return cls(model, tok, str(path), sampling_defaults=recommended)

    # -- text <-> ids ------------------------------------------------------------------
    def encode(self, prompt: str | list[int], *, arg: str = "prompt") -> list[int]:
        """Text -> ids with the checkpoint's tokenizer; ids are checked to be integers
        (`arg` names the argument in the error)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass token ids instead of text")
            try:
                return self.tokenizer.encode(prompt)
            except TypeError:  # lone surrogates: bytes that are not UTF-8 (a shell argument's, decoded by Python)
                raise ParamError(arg, prompt[:40], f"is not valid text: {lone_surrogate(prompt) or 'not UTF-8'}") from None
        if prompt is None or isinstance(prompt, bytes) or not hasattr(prompt, "__iter__"):
            raise ParamError(arg, prompt, "must be a str or a list of token ids")
        return _token_ids(arg, prompt)

    def recommended_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the checkpoint's recommended sampling (Engine.sampling_defaults,
        from its generation_config.json), `overrides` on top (e.g. seed=3); the fields neither
        sets keep SamplingParams' defaults (temperature 1). What `hyspec chat` and `hyspec
        serve` use where a flag or a request field is left out; generate(params=None) stays
        greedy."""
        return SamplingParams(**{**self.sampling_defaults, **overrides})

    @property
    def context_length(self) -> int:
        """The model's context (config max_position_embeddings): prompt + new tokens fit in it."""
        return self.model.cfg.max_position_embeddings

    def _check_context(self, n: int, what: str) -> None:
        if n > self.context_length:
            raise ValueError(f"{what} has {n} tokens, more than the model's context of {self.context_length} "
                             f"tokens (max_position_embeddings in config.json)")

    def _cap(self, ids: list[int], max_new_tokens: int) -> tuple[int, bool]:
        """(new tokens that fit in the context after the prompt, whether that capped the request)."""
        self._check_context(len(ids), "the prompt")
        room = self.context_length - len(ids)
        if room == 0 and max_new_tokens > 0:  # (as the server answers it: nothing could be generated)
            raise ValueError(f"the prompt has {len(ids)} tokens, as many as the model's context of "
                             f"{self.context_length} tokens: none is left to generate (max_position_embeddings "
                             f"in config.json)")
        return min(max_new_tokens, room), max_new_tokens > room

    def decode(self, ids: list[int]) -> str | None:
        """The text of token ids (None without a tokenizer). ValueError for ids that are not
        this model's (outside 0..vocab_size-1) or not a list of integers."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(self._vocab_ids("ids", ids))

    def _vocab_ids(self, name: str, ids, ordered: bool = True) -> list[int]:
        """ids as a list of ints, each one of this model's (0..vocab_size-1); ParamError(name) else."""
        ids = _token_ids(name, ids, ordered)
        vocab = self.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ParamError(name, bad[:5], f"token ids must be in 0..{vocab - 1} (the model's vocabulary)")
        return ids

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.model.cfg.eos_token_ids

    def text_stream(self, stop=None, *, stop_ids=None, ignore_eos: bool = False) -> TextStream:
        """An incremental decoder for one sample's tokens as they arrive (on_tokens): feed(ids)
        gives the new final text, finish() the rest; joined they are Output.text. `stop`,
        `stop_ids`, `ignore_eos`: the request's (generate's arguments; then, as Output.text, the
        text ends before the first stop string, and a stop id ends the output before a stop
        string its token would complete). One case differs: with stop strings, a special
        token inside the output (an EOS under ignore_eos) is left out of the pieces as they
        come, while Output.text keeps it when no stop string matched (the pieces cannot know
        that before the end)."""
        if self.tokenizer is None:
            raise ValueError("a text stream needs the checkpoint's tokenizer.json")
        stops = stop_list(stop) if stop is not None else []
        if stop_ids is not None:
            stop_ids = self._vocab_ids("stop_ids", stop_ids, ordered=False)
        ignore_eos = _bool_arg("ignore_eos", ignore_eos)  # (checked without stop strings too)
        check = functools.partial(self._vocab_ids, "ids")  # (feed's ids: -1 was an OverflowError, 99999 "")
        if not stops:
            return TextStream(self.tokenizer.decode, check=check)
        tok = self.tokenizer
        return TextStream(lambda ids: tok.decode(ids, skip_special_tokens=True), stops,
                          drop_ids=self._stops(stop_ids, ignore_eos), whole_decode=tok.decode, check=check)

    # -- chat --------------------------------------------------------------------------
    @property
    def chat_template(self):
        """The checkpoint's chat template (hyspec.chat_template.ChatTemplate; the plain one
        when it has none), loaded once; `eos_token` defaults to the model's EOS."""
        if getattr(self, "_chat_template", None) is None:
            from hyspec.chat_template import ChatTemplate, load_template

            source, where, special = load_template(self.model_dir)
            if special.get("eos_token") is None and self.eos_ids and self.tokenizer is not None:
                special["eos_token"] = self.tokenizer.decode([self.eos_ids[0]])
            self._chat_template = ChatTemplate(source, special, where)
        return self._chat_template

    def use_chat_template(self, template) -> None:
        """Use another chat template than the checkpoint's: a path to a Jinja file
        (pathlib.Path or str), or the template text itself (a str containing "{%" or "{{").
        The checkpoint's special tokens stay. ValueError names a missing file or a template
        that does not parse."""
        from hyspec.chat_template import ChatTemplate

        current = self.chat_template
        if not isinstance(template, (str, os.PathLike)):
            raise ParamError("template", template, "must be a template file's path or the template text (a str)")
        if isinstance(template, str) and ("{%" in template or "{{" in template):
            source, where = template, "given"
        else:
            from hyspec.chat_template import read_template_file

            source, where = read_template_file(template), str(template)
        self._chat_template = ChatTemplate(source, current.special, where)

    def chat_prompt(self, messages: list[dict], /, *, tools=None, add_generation_prompt: bool = True,
                    **template_kwargs) -> str:
        """A conversation as prompt text, rendered as `hyspec serve` renders a chat request:
        OpenAI-style messages (hyspec.chat_template.normalize_messages), `tools` and any
        extra template variables (e.g. enable_thinking=False for the Qwen3.5 templates)."""
        named = {"add_generation_prompt": add_generation_prompt, "tools": tools, **template_kwargs}
        return self.chat_template.render(normalize_messages(messages), **named)

    def prepare_chat(self, messages: list[dict], *, tools=None, tool_choice=None, parallel_tool_calls=None,
                     template_kwargs: dict | None = None, reasoning: bool | None = None,
                     constraint=None) -> "ChatTurn":
        """What :meth:`chat` runs, without running it (batch files use it per line): the
        prompt, the constraint (a forced tool call's, or `constraint`), and the reader that
        turns generated tokens into the reply message."""
        from hyspec.reasoning import prompt_opens_thinking
        from hyspec.tools import check_tools

        if self.tokenizer is None:  # (its prompt is text: encode's "pass token ids instead" cannot be done
            # in a message, whose content is text only)
            raise ValueError("chat needs the checkpoint's tokenizer.json (this model has none): its prompt is "
                             "text; pass the conversation's token ids to generate instead")
        spec = check_tools(tools, tool_choice, parallel_tool_calls)
        if spec is not None and spec.parses and not self.chat_template.reads_tools:
            raise ValueError("this model's chat template does not show tools to the model (it never reads `tools`)")
        normalized = normalize_messages(messages)
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise ValueError(f"template_kwargs must be a dict of template variables, got "
                             f"{type(template_kwargs).__name__}")
        named = {"add_generation_prompt": True, "tools": tools, **(template_kwargs or {})}  # (they may override)
        prompt = self.chat_template.render(normalized, **named)
        schema = spec.constraint_schema() if spec is not None else None
        if schema is not None:
            if constraint is not None:
                raise ValueError(f"tool_choice {tool_choice!r} constrains the output: it cannot be combined with "
                                 f"another constraint")
            constraint = self.constraint("json_schema", schema, arg="tools")
        think = None
        if self.chat_template.thinks if reasoning is None else _bool_arg("reasoning", reasoning):
            think = prompt_opens_thinking(self.chat_template.generation_suffix(prompt, normalized, **named))
        if constraint is not None and think:  # the model thinks first: the grammar starts after </think>
            from hyspec.reasoning import THINK_CLOSE

            constraint = constraint.after_text(THINK_CLOSE)
        return ChatTurn(self, prompt, constraint, spec, think)

    @one_at_a_time
    def chat(self, messages: list[dict], *, tools=None, tool_choice=None, parallel_tool_calls=None,
             template_kwargs: dict | None = None, reasoning: bool | None = None, **generate_kwargs) -> Output:
        """Generate the assistant's reply to `messages`: the prompt is
        :meth:`chat_prompt`'s, generation is :meth:`generate`'s (its keyword arguments:
        max_new_tokens, params, draft, num_samples, constraint, ...), and each sample also
        gets `message`, the reply as `hyspec serve` answers it (hyspec.reply.Reply):
        content; with a thinking template `reasoning_content` (reasoning: None = when the
        template writes </think>, True / False to force); with `tools` the parsed
        `tool_calls` (tool_choice "auto" / "none" / "required" / {"type": "function",
        "function": {"name": ...}}: the last two constrain the output, as in docs/server.md)."""
        turn = self.prepare_chat(messages, tools=tools, tool_choice=tool_choice,
                                 parallel_tool_calls=parallel_tool_calls, template_kwargs=template_kwargs,
                                 reasoning=reasoning, constraint=generate_kwargs.pop("constraint", None))
        if generate_kwargs.get("stop_ids") is not None:  # read once: generate took a generator's ids, and the
            # reply's message then read it empty (its stop token's text kept in the content)
            generate_kwargs["stop_ids"] = _token_ids("stop_ids", generate_kwargs["stop_ids"], ordered=False)
        out = self.generate(turn.prompt, constraint=turn.constraint, **generate_kwargs)
        stops = self._stops(generate_kwargs.get("stop_ids"), bool(generate_kwargs.get("ignore_eos")))
        strings = stop_list(generate_kwargs.get("stop"))
        for sample in out.samples:
            sample.message = turn.message(sample.tokens, stops, strings if sample.stop_reason == "stop" else ())
        return out

    # -- generation --------------------------------------------------------------------
    def _spec_options(self, draft: int | None, spec: SpecOptions | None) -> SpecOptions | None:
        if spec is not None and not isinstance(spec, SpecOptions):
            raise ParamError("spec", spec, "must be a hyspec.speculative.loop.SpecOptions or None")
        draft = draft_of(draft, spec)
        if draft == 0:
            return None
        if not self.model.has_mtp:
            raise no_mtp_error()
        return (spec or SpecOptions()).with_k(draft)

    def _stops(self, stop_ids, ignore_eos: bool) -> set[int]:
        return set(() if ignore_eos else self.eos_ids) | set(stop_ids or ())

    @one_at_a_time
    def generate(self, prompt: str | list[int], *, max_new_tokens: int = 64, params: SamplingParams | None = None,
                 draft: int | None = None, spec: SpecOptions | None = None, stop_ids=None,
                 ignore_eos: bool = False, num_samples: int = 1, reference: list[int] | None = None, on_tokens=None,
                 constraint=None, logprobs: int | None = None, use_store: bool = True, stop=None,
                 cancel=None) -> Output:
        """draft = 0: plain decoding; draft = K: speculative with K drafts per round (spec
        gives the other drafter options; its k is replaced by `draft`); draft None (the
        default): spec's k when spec is given, else 0. The samples of a
        --num-samples run decode together in one batch (each equals a run of its own).
        on_tokens(sample_index, new_token_ids) is called as rounds commit tokens.

        prompt + new tokens must fit in the model's context (max_position_embeddings): a
        longer prompt is an error (one that fills it too, unless max_new_tokens is 0);
        max_new_tokens beyond it is capped, and a sample that
        runs into the cap ends with stop_reason "context" (stats: max_new_tokens_capped_to,
        context_length). stats are totals over the samples; each sample's own are in
        samples[i].stats.

        num_samples: samples of the prompt (sample i > 0 seeded with derive_seed(seed, i)),
        decoded together, at most SAMPLES_AT_ONCE (64) at a time.

        constraint: a hyspec.constraints.Constraint (see Engine.constraint) the output must
        match; each sample runs on its own clone, so the object passed in is not advanced.
        A sample whose constraint allows no further token after an EOS (with ignore_eos) ends
        with stop_reason "constraint"; one that reaches a dead end of its grammar (nothing
        allowed and no EOS ended it) raises hyspec.core.scheduler.ConstraintFailure.

        use_store: resume from the longest prefix held in the engine's prefix store (sessions
        fill it), prefilling only the rest.

        logprobs: None, or N >= 0: each generated token's log-probability (the raw logits')
        and its top-N alternatives, out.logprobs[sample][token] = (logprob, [(id, logprob),
        ...]).

        stop: stop strings (a string or a list), matched across token boundaries as the server
        matches them: a sample ends at the token that completes a match (stop_reason "stop";
        its tokens end with that token, its text ends before the stop string and, as the
        server's, leaves special tokens out); a stop id (EOS) never completes a match.

        cancel: None, or a callable () -> bool asked after each round that emits tokens (after
        on_tokens): once it returns True, every sample ends after its current round with
        stop_reason "cancelled" (unless that round ended it anyway), its tokens and stats those
        of the run so far (the server's sequential fallback ends a cancelled request so)."""
        params = params if params is not None else GREEDY
        stop_strings = stop_list(stop)
        if not isinstance(params, SamplingParams):
            raise ParamError("params", params, "must be a hyspec.sampling.SamplingParams (or None for greedy)")
        max_new_tokens = _int_arg("max_new_tokens", max_new_tokens, 0)
        num_samples = _int_arg("num_samples", num_samples, 1)
        draft = draft_of(draft, spec)  # (a spec that is no SpecOptions: _spec_options below names it)
        ignore_eos, use_store = _bool_arg("ignore_eos", ignore_eos), _bool_arg("use_store", use_store)
        if stop_ids is not None:
            stop_ids = _token_ids("stop_ids", stop_ids, ordered=False)
        if reference is not None:
            reference = _token_ids("reference", reference)
        if on_tokens is not None and not callable(on_tokens):
            raise ParamError("on_tokens", on_tokens, "must be a callable (sample index, token ids) or None")
        if cancel is not None and not callable(cancel):
            raise ParamError("cancel", cancel, "must be a callable () -> bool or None")
        if constraint is not None:
            self._check_constraint(constraint)
        spec = self._spec_options(draft, spec)
        ids = self.encode(prompt)
        max_new_tokens, capped = self._cap(ids, max_new_tokens)
        stops = self._stops(stop_ids, ignore_eos)
        if spec is not None and spec.forced_rates is not None and reference is None:
            # the continuation the forced drafter matches: greedy, with the request's penalties where
            # it is greedy (plain greedy of the bare model split from a penalised one at once)
            reference = generate_plain(self.model, ids, max_new_tokens=max_new_tokens + spec.k + 1,
                                       params=params if params.greedy else GREEDY, stop_ids=()).tokens
        requests, cuts = [], []
        for i in range(num_samples):
            sample_params = params if i == 0 else SamplingParams(**{**params.__dict__,
                                                                     "seed": derive_seed(params.seed, i)})
            stream = None if on_tokens is None else (lambda r, t, i=i: on_tokens(i, t))
            if cancel is not None:
                stream = _cancellable(stream, cancel, requests)
            cuts.append(StopStrings(self, stop_strings, stops) if stop_strings else None)
            requests.append(Request(prompt_ids=ids, max_new_tokens=max_new_tokens, params=sample_params, draft=draft,
                                    spec=spec, stop_ids=stops, stop_text=cuts[-1], reference=reference,
                                    on_tokens=stream,
                                    logprobs=logprobs, constraint=None if constraint is None else constraint.clone(),
                                    use_store=use_store))
        # at most SAMPLES_AT_ONCE sequences hold a slot at a time (the next start as others end;
        # a sample's output does not depend on its batch): 100,000 samples do not take 100,000 slots
        self._run_requests(requests, max_batch=min(num_samples, SAMPLES_AT_ONCE))
        texts = [c.apply(r) if c is not None else None for c, r in zip(cuts, requests)]
        samples = [Sample(r.tokens, self.decode(r.tokens) if t is None else t, r.stop_reason, r.stats)
                   for r, t in zip(requests, texts)]
        out = self._output(samples, ids, draft > 0, capped, max_new_tokens)
        if logprobs is not None:
            out.logprobs = [r.token_logprobs for r in requests]
        return out

    @one_at_a_time
    def generate_batch(self, prompts: list, *, max_new_tokens=64, params=None, draft=None,
                       spec: SpecOptions | None = None, stop_ids=None, ignore_eos: bool = False,
                       max_batch: int = 16, on_tokens=None, on_finish=None, constraint=None,
                       logprobs=None, stop=None, cancel=None) -> list[Output]:
        """One Output per prompt, in order. max_new_tokens, params, draft and logprobs (None,
        or N: each token's log-probability and top-N in Output.logprobs) may each be one
        value for all prompts or a list with one per prompt (a draft of None: spec's k when
        spec is given, else 0, as in generate). Up to max_batch sequences decode
        together (continuous batching); each output is bitwise what generate() gives for that
        prompt alone. on_tokens(i, new_ids) streams; on_finish(i, output) as each one ends.
        constraint: one Constraint (or a list, one per prompt, None for none); each sequence
        runs on its own clone. stop: stop strings for every prompt (a string or a list of
        strings, as in generate), or one entry per prompt (None, a string or a list) when the
        list holds a list or None. A prompt whose decoding fails on its own (its constraint
        cannot go on: hyspec.core.scheduler.ConstraintFailure; its logits overflow:
        hyspec.sampling.NonFiniteLogits) ends with stop_reason "error" and the reason in its
        stats["error"]; the other prompts' outputs are returned as usual (generate() raises
        such an error instead).
        cancel: None; a callable () -> bool, asked after each round that emits tokens for any
        prompt: once it returns True, every prompt still running or waiting ends with
        stop_reason "cancelled" (a prompt that already ended keeps its output); or a list with
        one entry per prompt (a callable () -> bool or None), asked after that prompt's own
        rounds and ending that prompt alone. A cancelled prompt's tokens and stats are those of
        its run so far, as in generate."""
        if hasattr(prompts, "tolist") and getattr(prompts, "ndim", 0) == 2:  # a 2-D array / tensor of ids
            prompts = prompts.tolist()
        if isinstance(prompts, (str, bytes, dict, set, frozenset)) or not hasattr(prompts, "__len__") \
                or not hasattr(prompts, "__getitem__"):
            raise ParamError("prompts", prompts, "must be a list of prompts (texts or token id lists)")
        for name, fn in (("on_tokens", on_tokens), ("on_finish", on_finish)):
            if fn is not None and not callable(fn):
                raise ParamError(name, fn, "must be a callable (prompt index, ...) or None")
        if cancel is not None and not callable(cancel) and not (
                isinstance(cancel, (list, tuple)) and all(c is None or callable(c) for c in cancel)):
            raise ParamError("cancel", cancel, "must be a callable () -> bool, a list of one such callable (or None) "
                                               "per prompt, or None")
        if stop_ids is not None:
            stop_ids = _token_ids("stop_ids", stop_ids, ordered=False)
            from hyspec.core.scheduler import check_stop

            check_stop(stop_ids, self.model.cfg.vocab_size)  # (every prompt's: was blamed on "prompt 0")
        n = len(prompts)

        def per(name, v):  # one value for every prompt, or a sequence of one per prompt
            if hasattr(v, "__iter__") and not isinstance(v, (str, bytes, dict, SamplingParams)) and not (
                    hasattr(v, "allowed") and hasattr(v, "commit")) and getattr(v, "ndim", 1) != 0:
                v = list(v)  # (a list or tuple; a generator, a 1-d numpy array or tensor of per-prompt values)
                if len(v) != n:
                    raise ValueError(f"{name} has {len(v)} entries for {n} prompts")
                return v
            return [v] * n

        if isinstance(stop, (list, tuple)) and any(x is None or isinstance(x, (list, tuple)) for x in stop):
            if len(stop) != n:
                raise ValueError(f"stop has {len(stop)} entries for {n} prompts")
            stops_each = [stop_list(x) for x in stop]
        else:
            stops_each = [stop_list(stop)] * n
        if isinstance(cancel, (list, tuple)) and len(cancel) != n:
            raise ValueError(f"cancel has {len(cancel)} entries for {n} prompts")
        limits, params_each = per("max_new_tokens", max_new_tokens), per("params", params)
        drafts, constraints, lps = per("draft", draft), per("constraint", constraint), per("logprobs", logprobs)
        for c in constraints:
            if c is not None:
                self._check_constraint(c)
        stops = self._stops(stop_ids, _bool_arg("ignore_eos", ignore_eos))
        requests, caps, cuts = [], [], []  # caps[i]: the context capped prompt i's max_new_tokens (stop_reason
        # "context"); cuts[i]: its stop strings
        for i, (prompt, limit, prompt_params, k, c, lp) in enumerate(zip(prompts, limits, params_each, drafts,
                                                                         constraints, lps)):
            try:
                ids = self.encode(prompt)
                k = draft_of(k, spec)
                opts = self._spec_options(k, spec)
                limit = _int_arg("max_new_tokens", limit, 0)
                limit, capped = self._cap(ids, limit)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            stream = None if on_tokens is None else (lambda r, t, i=i: on_tokens(i, t))
            if callable(cancel):  # one for the call: asks every request to stop (requests: the whole list)
                stream = _cancellable(stream, cancel, requests)
            elif cancel is not None and cancel[i] is not None:  # this prompt's own
                stream = _cancellable(stream, cancel[i], None)
            cuts.append(StopStrings(self, stops_each[i], stops) if stops_each[i] else None)
            caps.append(capped)
            finished = None if on_finish is None else (
                lambda r, i=i: on_finish(i, self._request_output(r, caps[i], cuts[i])))
            requests.append(Request(prompt_ids=ids, max_new_tokens=limit,
                                    params=prompt_params if prompt_params is not None else GREEDY, draft=k,
                                    spec=opts, stop_ids=stops, stop_text=cuts[i], on_tokens=stream, on_finish=finished,
                                    constraint=None if c is None else c.clone(), logprobs=lp))
        self._run_requests(requests, max_batch=max_batch, raise_errors=False)  # one prompt's error is its own
        return [self._request_output(r, capped, cut) for r, capped, cut in zip(requests, caps, cuts)]

    def _request_output(self, r: Request, capped: bool = False, cut: StopStrings | None = None) -> Output:
        text = cut.apply(r) if cut is not None else None
        stats = r.stats if getattr(r, "error", None) is None else {**r.stats, "error": r.error}
        # (its own lists and dicts: on_finish's Output and the call's returned one are made apart,
        # so a callback that edits what it gets changes nothing else)
        out = self._output([Sample(list(r.tokens), self.decode(r.tokens) if text is None else text, r.stop_reason,
                                   copy.deepcopy(stats))], list(r.prompt_ids), r.draft > 0, capped, r.max_new_tokens)
        if r.logprobs is not None:
            out.logprobs = [list(r.token_logprobs)]
        return out

    def graphs_available(self) -> bool:
        """Whether the BatchDecoder (CUDA graphs over lanes) runs here: on a GPU, or when
        batch_graphs is set (the Triton interpreter in tests); not on a pipeline; needs triton."""
        if self.backend is not None or not (self.model.device.type == "cuda" or self.batch_graphs):
            return False
        from hyspec.kernels.common import triton_unusable

        why = triton_unusable()
        if why is not None:
            _warn_once(f"the GPU fast path is off: {why}; requests run on the reference engine core (exact, but "
                       "orders of magnitude slower)")
        return why is None

    def new_batch_decoder(self, slots: int, max_len: int, k_max: int):
        """A BatchDecoder of this model (max_len capped by the context; on a GPU the cached
        blocks of a dropped decoder are freed first)."""
        from hyspec.gpu.batch import BatchDecoder

        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        return BatchDecoder(self.model, min(max_len, self.model.cfg.max_position_embeddings + 64), k_max, slots)

    def _graph_batch(self, requests: list[Request], max_batch: int):
        """The BatchDecoder (CUDA graphs over lanes) for these requests, or None: on a GPU
        (or when batch_graphs is set: the Triton interpreter in tests), for requests the
        lanes take (hyspec.gpu.batch_loop.graph_eligible: not an engine-core session slot,
        no pre-norm hidden): one request or many (adaptive K and p_min included), greedy or sampled, with
        logprobs or not, penalised or constrained, and any request whose prompt
        extends a prefix-store state (its lane resumes from it)."""
        if not self.graphs_available():
            return None
        from hyspec.gpu.batch_loop import graph_eligible, lane_prompt_len

        if graph_eligible(requests) is not None:
            return None
        if self._lanes_busy:  # (the lock is re-entrant: only a callback of the running call gets here)
            raise RuntimeError("a model call on this engine was started from a callback (on_tokens / on_finish) of "
                               "a request running on its CUDA-graph lanes: a callback must not start another "
                               "request or turn on the same engine (it would take over the lanes the running "
                               "request decodes on); make the call after the running one returns")
        if len(requests) == 1 and max_batch <= 1:
            slots = 1  # one request: one lane (16 lanes of a long context can outgrow the memory)
        else:
            slots = min(max(16 if self.model.device.type == "cuda" else 2, max_batch), 64)
        need = max(lane_prompt_len(r) + r.max_new_tokens + r.draft + 2 for r in requests)
        k = max(3, max(r.draft for r in requests))
        decoder = self._batch_dec
        if decoder is None or decoder.slots < slots or decoder.max_len < need or decoder.k_max < k:
            grow = 0
            if decoder is not None and decoder.max_len < need:
                grow = 2 * decoder.max_len  # a growing conversation: a new decoder (and graphs) per doubling
            self._batch_dec = decoder = None  # dropped before the new one is allocated
            max_len = max(need, grow, 1024 if self.model.device.type == "cuda" else need)
            self._batch_dec = decoder = self.new_batch_decoder(slots, max_len, k)
        return decoder

    @contextlib.contextmanager
    def on_lanes(self):
        """Marks a run on the engine's BatchDecoder (_batch_dec): a BatchRunner frees every
        lane when it starts, so a second run started meanwhile -- from a callback of this one,
        the only caller the re-entrant lock lets in -- would end this run's lanes in silence
        (its outputs then went wrong with no error); _graph_batch refuses it."""
        self._lanes_busy = True
        try:
            yield
        finally:
            self._lanes_busy = False

    def _check_run_options(self) -> None:
        """Engine.lanes and Engine.optimistic act on pipeline stages only (as hyspec generate's
        --lanes and --optimistic): refused where they cannot act (were ignored in silence)."""
        lanes, optimistic = as_int(self.lanes), as_bool(self.optimistic)
        if lanes is None or lanes < 1:
            raise ParamError("lanes", self.lanes, "must be an integer >= 1 (1: one batch)", owner="Engine")
        if optimistic is None:
            raise ParamError("optimistic", self.optimistic, "must be True or False", owner="Engine")
        pipeline = hasattr(self.backend, "driver")
        if lanes > 1 and not pipeline:
            raise ValueError(f"Engine.lanes = {lanes} alternates batch groups through pipeline stages: it needs a "
                             "pipeline (the driver's Engine of --pp N with N >= 2); set Engine.lanes = 1")
        if optimistic and not pipeline:
            raise ValueError("Engine.optimistic forks pipeline stages: it needs a pipeline (the driver's Engine of "
                             "--pp N with N >= 2); set Engine.optimistic = False")
        if lanes > 1 and optimistic:
            raise ValueError(f"Engine.optimistic does not go with Engine.lanes = {lanes}: the fork runs the "
                             "pipeline's one lane; set Engine.lanes = 1 or Engine.optimistic = False")

    def _run_requests(self, requests: list[Request], max_batch: int, raise_errors: bool = True) -> None:
        """Decode the requests together. A request's own error (a constraint that could not go
        on) ends that request only; with raise_errors it is raised once all are done."""
        self._check_run_options()
        # a pipeline's stages do not share prefix-store states (docs/multi-gpu.md): no store there
        sched = Scheduler(self.model, max_batch=max_batch, backend=self.backend,
                          store=self._store if self.backend is None else None)
        for i, r in enumerate(requests):
            try:
                sched.validate(r)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}" if len(requests) > 1 else str(e)) from None
        decoder = self._graph_batch(requests, max_batch)
        if hasattr(self.backend, "driver"):
            self.backend.driver.optimistic = bool(self.optimistic)
        if decoder is not None:
            from hyspec.gpu.batch_loop import run_requests

            with self.on_lanes():
                run_requests(decoder, requests, max_batch, store=self._store)
        elif self.lanes > 1 and len(requests) > 1 and hasattr(self.backend, "driver"):
            from hyspec.parallel.lanes import run_lanes

            run_lanes(self.model, self.backend, requests, max_batch=max_batch, lanes=self.lanes)
        else:
            for r in requests:
                sched.submit(r)
            sched.run()
        from hyspec.core.scheduler import ConstraintFailure
        from hyspec.sampling import NonFiniteLogits

        for r in requests:  # a request's own error (a constraint that could not go on, its logits overflowing), on
            exc = getattr(r, "exception", None)  # every path
            if exc is not None and (raise_errors or not isinstance(exc, (ConstraintFailure, NonFiniteLogits))):
                raise exc  # (anything else, e.g. a failed forward or out of memory, is the engine's: raised)

    def _output(self, samples: list[Sample], ids: list[int], speculative: bool, capped: bool = False,
                n_new: int | None = None) -> Output:
        """One Output over the samples: stats are totals (counters and times add up, spec
        telemetry is merged); a sample that ran into a context cap ends with "context"."""
        total = SpecTelemetry()
        for sample in samples:
            if capped and sample.stop_reason == "length":
                sample.stop_reason = "context"
            if "spec" in sample.stats:
                total.merge(SpecTelemetry.from_dict(sample.stats["spec"]))
        stats = dict(samples[0].stats)  # per-run constants (prompt_tokens, k, rollback, path...)
        for key in _SUMMED_STATS:
            if any(key in s.stats for s in samples) or key in ("prefill_s", "decode_s"):
                stats[key] = sum(s.stats.get(key, 0) for s in samples)
        if "rollback_extra_bytes_per_round" in stats:
            stats["rollback_extra_bytes_per_round"] = max(s.stats["rollback_extra_bytes_per_round"] for s in samples)
        stats["generated_tokens"] = sum(len(s.tokens) for s in samples)
        stats["num_samples"] = len(samples)
        steps = sum(max(len(s.tokens) - 1, 0) for s in samples)  # the first token comes from the prefill
        stats["decode_tok_s"] = steps / stats["decode_s"] if stats["decode_s"] > 0 and steps else None
        if capped:
            stats["max_new_tokens_capped_to"] = n_new
            stats["context_length"] = self.context_length
        if speculative:
            stats["spec"] = total.to_dict()
        return Output(samples, ids, stats)

    def constraint(self, kind: str, value=None, *, arg: str | None = None):
        """A Constraint for this model (kind: json_schema | json_object | regex | grammar |
        choice); raises ValueError naming the argument when the value is invalid."""
        from hyspec.constraints import make_constraint

        return make_constraint(self, kind, value, arg=arg)

    def _check_constraint(self, constraint) -> None:
        if not hasattr(constraint, "allowed") or not hasattr(constraint, "commit"):
            raise ValueError(f"constraint must be a hyspec.constraints.Constraint, got {type(constraint).__name__}")
        V = getattr(constraint, "vocab_size", self.model.cfg.vocab_size)
        if V != self.model.cfg.vocab_size:
            raise ValueError(f"constraint was built for a vocabulary of {V} tokens; this model has "
                             f"{self.model.cfg.vocab_size}")
        theirs = getattr(getattr(constraint, "vocab", None), "fingerprint", "")
        if theirs and self.tokenizer is not None and theirs != self.tokenizer.fingerprint:
            raise ValueError("constraint was built for another tokenizer than this model's (the same number of "
                             "tokens, other texts or ids): build it with this engine's constraint()")

    def memory(self, context_len: int, budget_bytes: int | None = None) -> dict:
        """Bytes one sequence slot needs at `context_len` tokens, and how many slots fit in
        `budget_bytes` (default: free device memory on CUDA). `model_context_length` is the
        model's own limit (max_position_embeddings): a longer context_len is sized, not run.
        A lower bound of what runs: a request's slot also holds its draft rows and two more
        (prompt + max_new_tokens + K + 2 positions), a session's grows by half again when a
        turn needs more, and a GPU lane pads a few rows and keeps small per-lane buffers.
        weight_bytes: the parameters, with kept-FP8 weights' scales. session_free_bytes: the most
        the closed sessions' slots kept for reuse may hold (Engine.session_free_bytes; None: no cap)."""
        from hyspec.core.slots import slot_bytes

        context_len = _int_arg("context_len", context_len, 1)
        if budget_bytes is not None:
            if isinstance(budget_bytes, float) and math.isfinite(budget_bytes):
                budget_bytes = int(budget_bytes)  # (8e9)
            budget_bytes = _int_arg("budget_bytes", budget_bytes, 0)
        per = slot_bytes(self.model.cfg, self.model.dtype, context_len, self.model.has_mtp)
        if budget_bytes is None and self.model.device.type == "cuda":
            budget_bytes = torch.cuda.mem_get_info(self.model.device)[0]
        from hyspec.quant import weight_bytes

        out = {"context_len": context_len, "slot_bytes": per, "weight_bytes": weight_bytes(self.model),
               "model_context_length": self.model.cfg.max_position_embeddings,  # (context_len may exceed it)
               "session_free_bytes": self.session_free_bytes}
        if budget_bytes is not None:
            out["budget_bytes"] = budget_bytes
            out["slots_that_fit"] = int(budget_bytes // per["total"])
        return out

    # -- scoring -----------------------------------------------------------------------
    @torch.no_grad()
    @one_at_a_time
    def score(self, text: str | list[int], *, top_logprobs: int = 0, chunk: int = 512) -> dict:
        """Per-position log-probabilities of each actual next token (teacher forcing).
        logprobs[i-1] = log p(token i | tokens < i) for i >= 1."""
        ids = self.encode(text, arg="text")
        if len(ids) < 2:
            raise ValueError("scoring needs at least 2 tokens")
        self._check_context(len(ids), "the text to score")
        top_logprobs = _int_arg("top_logprobs", top_logprobs, 0)
        chunk = _int_arg("chunk", chunk, 1)
        vocab_size = self.model.cfg.vocab_size
        out_of_range = [t for t in ids if not 0 <= t < vocab_size]
        if out_of_range:
            raise ValueError(f"token id(s) {out_of_range[:5]} out of range for vocabulary size {vocab_size}")
        from hyspec.speculative.replay import check_finite_logits, perplexity

        model = self.model
        cache = model.new_cache(len(ids))
        logprobs: list[float] = []  # [len(ids) - 1]
        top_lists: list[list[list]] = []  # per position: [[id, logprob(, text)], ...]
        dev = model.device
        for start in range(0, len(ids) - 1, chunk):
            part = ids[start : min(start + chunk, len(ids) - 1)]
            hidden = model.forward_hidden(torch.tensor(part, device=dev), cache, StepCtx(start=start, chunked=True))
            logits = model.logits(hidden)
            check_finite_logits(logits, start, model.dtype)
            log_probs = torch.log_softmax(logits.double(), dim=-1)  # [t, V]
            next_ids = torch.tensor(ids[start + 1 : start + 1 + len(part)], device=dev)  # [t]
            logprobs.extend(log_probs.gather(1, next_ids[:, None])[:, 0].tolist())
            if top_logprobs:
                best = top_ids(logits, top_logprobs)  # (ties by ascending id, as generate's lists)
                values = log_probs.gather(1, best)
                for row_values, row_ids in zip(values.tolist(), best.tolist()):
                    top_lists.append([[t, lp] + ([self.tokenizer.decode([t])] if self.tokenizer else [])
                                      for t, lp in zip(row_ids, row_values)])
        nll = -sum(logprobs)
        return {
            "tokens": ids, "logprobs": logprobs, "top_logprobs": top_lists if top_logprobs else None,
            "nll": nll, "mean_nll": nll / len(logprobs), "perplexity": perplexity(nll / len(logprobs)),
            "scored_tokens": len(logprobs),
        }
