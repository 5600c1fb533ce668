"""Sessions: a conversation whose decoding state is kept between turns.

    eng = Engine.load()
    s = eng.session(draft=3)                 # or params=SamplingParams(temperature=0.8, seed=1)
    out = s.send("def fib(n):\\n", max_new_tokens=48)
    out = s.send("def main():\\n")            # prefills only [pending] + these tokens
    s.rewind()                                # back to the exact state before the last turn
    t = s.fork()                              # an independent copy
    s.save("chat.pt"); s2 = Session.load(eng, "chat.pt")

A session is a Sequence of the engine core (hyspec/core/round.py) whose slot is not freed
when a turn ends (Request.keep). The next turn is a Request that resumes it: the
scheduler prefills [pending token] + the new tokens after the kept state, carries the
drafter's queued rows, and runs the same rounds as any request. A turn that starts from
a SeqState (a fork, a rewind, a loaded file, a prefix-store hit) goes through the same
path: the state is written into a slot, then resumed. At every turn boundary the state
is captured (hyspec.core.state.capture) — it is the next turn's rewind point and goes
into the engine's prefix store, where any request extending the transcript finds it.

On a GPU a turn runs on the engine's CUDA-graph lanes instead (Session._graph_turn): the
boundary state is loaded into a lane, the lane prefills [pending] + the new tokens and
decodes, and its end state (Request.end_state) becomes the next boundary; the session then
holds no slot between turns. The engine core still runs a turn the graph round cannot take
(hyspec.gpu.batch_loop.graph_eligible) or when Engine.session_graphs is False.

The transcript (`tokens`) is every token so far: the first turn's prompt, each turn's
generated tokens, each later turn's new tokens. The last generated token is *pending*
(emitted, not yet run through the model); the next turn runs it first. Sampling draws
are keyed by absolute position, so a seeded session is reproducible as a whole.

Constraints (hyspec/constraints.py): `eng.session(constraint=c)` constrains every reply;
`send(..., constraint=c)` one turn (`constraint=False`: this turn free). Each reply starts
its own copy of the constraint at c's state, except a turn with an empty message
(`send([])`: "go on") after a reply the constraint had not finished (cut by
max_new_tokens): that turn continues the same matcher. The matcher's state after each turn
is part of the turn's checkpoint: rewind() restores it, fork() copies it, save() writes it
(kind, grammar and the tokens consumed; load rebuilds it by consuming them again).

A session is plain (draft 0) or speculative (draft >= 1) from its first turn on: a
speculative turn needs the drafter's rows for the whole transcript, which a plain turn
does not build. K may change between speculative turns; a send() without draft= takes
the session's `draft` where it agrees with the session's mode, else plain for a plain
session and the last turn's K for a speculative one (docs/sessions.md).

Words: *boundary* = the state captured when the last turn ended (what `state()` returns
and the store keeps); *history* = the boundary before each turn (the rewind points);
*live* = the slot's current contents (the Sequence the next turn resumes).
"""

from __future__ import annotations

import functools
import hashlib
import io
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hyspec.core.request import GREEDY, Request
from hyspec.core.state import SeqState, bytes_checksum, capture, check_state
from hyspec.engine import Engine, _cancellable, engine_call
from hyspec.files import write_whole
from hyspec.sampling import ParamError, SamplingParams, int_in
from hyspec.speculative.loop import MAX_DRAFT
from hyspec.speculative.telemetry import SpecTelemetry

FORMAT = "hyspec-session/1"


FINGERPRINT_CHUNK = 1 << 24  # elements summed per float64 copy (128 MiB of temporary at most)


def _sum64(p: torch.Tensor) -> float:
    """A tensor's sum in float64, its float64 copy made a chunk at a time: the whole copy of a
    large model's embedding (1.27 G elements in Qwen3.5-27B: 10 GB) could not be allocated
    beside the weights and slots on the device. A tensor of at most one chunk sums as a
    whole (the fingerprint of every model without larger tensors is what it was)."""
    flat = p.detach().reshape(-1)
    if flat.numel() <= FINGERPRINT_CHUNK:
        return float(flat.double().sum())
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for i in range(0, flat.numel(), FINGERPRINT_CHUNK):
        total += flat[i:i + FINGERPRINT_CHUNK].double().sum()
    return float(total)


def model_fingerprint(model) -> str:
    """Identifies a model's config and weights (a saved session loads only into the same model)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(repr(sorted(model.cfg.__dict__.items())).encode())
    h.update(str(model.dtype).encode())
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(repr(_sum64(p)).encode())
    return h.hexdigest()


def model_info(model) -> dict:
    """What a session file says of its model beside the fingerprint: the figures that name
    the difference when the fingerprint does not match (another family, dtype, SSM dtype...)."""
    cfg = model.cfg
    return {"model_type": getattr(cfg, "model_type", None), "dtype": str(model.dtype).removeprefix("torch."),
            "ssm_dtype": getattr(cfg, "mamba_ssm_dtype", None), "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers}


def _model_mismatch(saved, here: dict) -> str:
    """The refusal of a session saved with another model: what differs, where the file says."""
    if isinstance(saved, dict):
        diff = [f"{k} {saved.get(k)!r} there, {v!r} here" for k, v in here.items() if saved.get(k, v) != v]
        what = "; ".join(diff) if diff else "the same config and dtype, other weights"
        return f"this session was saved with a different model ({what})"
    return "this session was saved with a different model (config or weights differ)"


_STATE_KEYS = ("state", "history", "digests")  # the states have their own digests (SeqState.digest)


def _record_digest(d: dict) -> str:
    """A digest of everything in a session file's dict but its states: settings, constraint
    and reply records, draft lengths, telemetry and `extra` (a damaged byte there loaded
    without a word and ran differently: another seed, another penalty)."""
    def enc(x) -> bytes:  # a value's canonical bytes (equal values, equal bytes, in any process)
        if isinstance(x, dict):  # (keys and a set's items ordered by their own bytes: a set's repr
            items = sorted((enc(k), enc(v)) for k, v in x.items())  # follows the hash seed)
            return b"{%d" % len(items) + b"".join(k + v for k, v in items) + b"}"
        if isinstance(x, (set, frozenset)):
            return b"<%d" % len(x) + b"".join(sorted(enc(v) for v in x)) + b">"
        if isinstance(x, (list, tuple)):
            return b"[%d" % len(x) + b"".join(enc(v) for v in x) + b"]"
        if isinstance(x, torch.Tensor):  # (its bytes' checksum, as a state's digest takes it, where it lives)
            t = x.detach()
            if t.layout != torch.strided:  # (sparse: its dense values)
                t = t.to_dense()
            t = t.resolve_conj().resolve_neg()
            return f"T{t.dtype}{tuple(t.shape)}:{bytes_checksum([t]) if t.numel() else ''};".encode()
        return f"{type(x).__name__}:{x!r};".encode()

    return hashlib.blake2b(enc({k: v for k, v in d.items() if k not in _STATE_KEYS}), digest_size=12).hexdigest()


def _check_extra(extra) -> None:
    """Session.save's `extra`: a dict that Session.load can read back (torch.load with
    weights_only: None, bools, numbers, strings, bytes, tensors, dtypes and containers of
    them; not functions, numpy values or other objects). Checked by that very round trip
    before the file is written (a value it cannot read back made the whole file
    unloadable); the error names the first key that fails."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict (or None), got {type(extra).__name__}")

    def loads_back(value) -> str | None:
        buf = io.BytesIO()
        try:
            torch.save(value, buf)
            buf.seek(0)
            torch.load(buf, map_location="cpu", weights_only=True)
        except Exception as e:  # (pickling or the weights-only unpickler refusing a type)
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return None

    if loads_back(extra) is None:
        return
    for key, value in extra.items():
        why = loads_back({key: value})
        if why is not None:
            raise ValueError(f"extra[{key!r}] ({type(value).__name__}) cannot be saved in a session file that "
                             f"Session.load reads back (torch.load weights_only: None, bools, numbers, strings, "
                             f"tensors and lists / tuples / dicts of them): {why[:200]}")
    raise ValueError("extra cannot be saved in a session file that Session.load reads back")


# a Session method that uses the engine's session scheduler or slots: one at a time per engine
_engine_turn = engine_call(lambda session: session.engine)


def _not_in_own_turn(method):
    """For the methods that move the session (send, rewind, reset, park, close), inside the
    engine's lock: refused while this session's own turn runs, i.e. from its on_tokens
    callback (the lock is re-entrant for its thread). A rewind there handed back the slot the
    turn was still writing, which the next session then took: its output and this one's
    went wrong in silence. send marks its turn."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._in_turn:
            raise RuntimeError(f"Session.{method.__name__}() was called during this session's own turn (from its "
                               "on_tokens callback): a turn cannot move its session; call it after send() returns")
        if method.__name__ != "send":
            return method(self, *args, **kwargs)
        self._in_turn = True
        try:
            return method(self, *args, **kwargs)
        finally:
            self._in_turn = False
    return run


class _WriteErrors:
    """A binary file for torch.save that records the OSError of a failed write in `failed`
    (torch's writer reports only that its position is not the one expected)."""

    def __init__(self, f, failed: list) -> None:
        self.f, self.failed = f, failed

    def write(self, b) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.failed.append(e)
            raise

    def flush(self) -> None:
        self.f.flush()


@dataclass(frozen=True)
class RewindPoint:
    """The session before one turn: what rewind restores (never mutated: forks share them)."""
    state: SeqState | None  # the model state (None: empty)
    matcher: object  # the constraint's state (None: free)
    telemetry: SpecTelemetry  # the acceptance over the turns before
    stats: dict  # last_stats ({} when unknown: a loaded session's)
    draft: int  # the K a send without draft= follows
    reply: list[int]  # the reply in progress (a stop string may straddle a "go on")


class Session:
    def __init__(self, engine, *, draft: int | None = None, params: SamplingParams | None = None, spec=None,
                 max_new_tokens: int = 64, stop_ids=None, ignore_eos: bool = False, use_store: bool = True,
                 constraint=None) -> None:
        self.engine = engine
        if constraint is not None:
            engine._check_constraint(constraint)
        self.constraint = constraint  # every reply's constraint (each turn uses a copy)
        from hyspec.core.scheduler import check_stop
        from hyspec.engine import _bool_arg, _int_arg, _token_ids, draft_of

        self.draft = draft_of(draft, spec)  # (None: spec's k, or 0 without spec)
        engine._spec_options(self.draft, spec)  # validates spec, draft / MTP head

        if params is not None and not isinstance(params, SamplingParams):
            raise ParamError("params", params, "must be a hyspec.sampling.SamplingParams (or None for greedy)")
        self.params = params if params is not None else GREEDY
        self.spec = spec

        self.max_new_tokens = _int_arg("max_new_tokens", max_new_tokens, 1)  # every turn's default
        self.stop_ids = _token_ids("stop_ids", stop_ids, ordered=False) if stop_ids is not None else []
        check_stop(self.stop_ids, engine.model.cfg.vocab_size)
        self.ignore_eos = _bool_arg("ignore_eos", ignore_eos)
        self.use_store = _bool_arg("use_store", use_store)
        self._seq = None  # the live Sequence (holds a slot) ...
        self._state: SeqState | None = None  # ... or the state the next turn resumes from
        self._boundary: SeqState | None = None  # the current state, captured when the last turn ended
        self._points: list[RewindPoint] = []  # the session before each turn: what rewind restores
        self._matcher = None  # the constraint's state after the last turn (None: that turn was free)
        self._speculative: bool | None = None
        self._last_draft = 0  # the last turn's K (a speculative session's default when its own draft is 0)
        self._reply: list[int] = []  # the reply in progress: the last turn's tokens, and those of the turns
        # before it that it went on from (send([])): a stop string may straddle them
        self.telemetry = SpecTelemetry()  # the turns in the conversation (rewind takes a turn's rounds out)
        self.last_stats: dict = {}
        self.closed = False
        self._in_turn = False  # send() is running (its callbacks may not move the session)

    # -- what the session holds ----------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """The transcript: every token so far (the last one is pending when `pending` is not None)."""
        return list(self._boundary.tokens) if self._boundary is not None else []

    @property
    def pending(self) -> int | None:
        return self._boundary.pending if self._boundary is not None else None

    def state(self) -> SeqState | None:
        """The current state (captured at the end of the last turn; None before the first)."""
        return self._boundary

    @_engine_turn  # (a turn in another thread changes the slot meanwhile)
    def live_state(self) -> SeqState | None:
        """A fresh capture of the slot's contents (what the next turn reads)."""
        return capture(self._seq) if self._seq is not None else self._state

    @property
    def num_turns(self) -> int:
        return len(self._points)

    turns = num_turns  # (the same count: the turns in the conversation; an undone one no longer counts)

    @property
    def matcher(self):
        """A copy of the constraint's state after the last turn (None: that turn was unconstrained)."""
        return None if self._matcher is None else self._matcher.clone()

    def _turn_constraint(self, ids: list[int], constraint):
        """The matcher this turn runs (a copy: the checkpoints are never mutated), or None."""
        if constraint is False:
            return None
        if constraint is not None:
            self.engine._check_constraint(constraint)
            return constraint.clone()
        if not ids and self._matcher is not None and getattr(self._matcher, "failure", None) is not None:
            from hyspec.core.scheduler import ConstraintFailure

            raise ConstraintFailure(f"the last reply's constraint cannot go on ({self._matcher.failure}): rewind, "
                                    f"or send a message (with constraint=False or another constraint)")
        if not ids and self._matcher is not None and self._matcher.ended:  # (a reply cut at the EOS that ended
            from hyspec.core.scheduler import ConstraintFailure  # its constraint: the uncut reply ended there)

            raise ConstraintFailure("the last reply's constraint is complete (an EOS ended it): nothing may follow "
                                    "it; send a message (with constraint=False or another constraint), or rewind")
        if not ids and self._matcher is not None and not self._matcher.ended:  # (a reply cut where the grammar
            # is complete goes on too: only its EOS may follow)
            return self._matcher.clone()  # "go on": the unfinished reply (constrained by the session's
            # constraint or by its own turn's) continues under its matcher
        return None if self.constraint is None else self.constraint.clone()

    # -- a turn ------------------------------------------------------------------------
    @_engine_turn
    @_not_in_own_turn
    def send(self, message, *, max_new_tokens: int | None = None, params: SamplingParams | None = None,
             draft: int | None = None, stop_ids=None, on_tokens=None, constraint=None, logprobs: int | None = None,
             stop=None, stop_skips_opening_break: bool = False, cancel=None):
        """Append `message` (text or token ids) to the conversation and generate; returns the
        turn's Output (stats: this turn; stats["session"]: the whole session; the store's stats).
        on_tokens(new_ids) is called as rounds commit tokens. constraint: this turn's (None: the
        session's; with an empty message after an unfinished constrained reply, that reply's
        matcher goes on, whichever constraint it was; False: none).
        logprobs=N: the reply's tokens' log-probabilities and top-N alternatives (the raw
        logits', as Engine.generate reports them) in Output.logprobs[0].
        stop: stop strings (a string or a list), as in Engine.generate: the reply ends with the
        token that completes one (stop_reason "stop"; the transcript keeps that token) and
        its text ends before the stop string. stop_skips_opening_break: a line break that opens
        the reply is no part of a match (a match begins after it): `hyspec chat`'s plain
        template sends a line without its newline, so the model's reply opens with it, and
        `--stop "\\n"` still ends a reply at the end of its first whole line.
        cancel: None, or a callable () -> bool asked after each round that emits tokens (after
        on_tokens): once True the reply ends after that round, stop_reason "cancelled", and the
        turn is kept as it stands (its tokens are in the transcript, the next turn goes on
        from them exactly as after a turn that had ended there by max_new_tokens; rewind(1)
        drops it). A Ctrl-C (KeyboardInterrupt) mid-turn undoes the whole turn instead."""
        from hyspec.core.scheduler import check_stop
        from hyspec.engine import Sample, StopStrings, _int_arg, _token_ids, stop_list
        from hyspec.engine import _bool_arg as bool_arg

        self._check_open()
        eng = self.engine
        ids = eng.encode(message, arg="message")  # text, or token ids (integers: 1.7 is refused, not truncated)
        if on_tokens is not None and not callable(on_tokens):
            raise ValueError(f"on_tokens must be a callable (new token ids) or None, got {on_tokens!r}")
        if cancel is not None and not callable(cancel):
            raise ParamError("cancel", cancel, "must be a callable () -> bool or None")
        if params is not None and not isinstance(params, SamplingParams):
            raise ParamError("params", params, "must be a hyspec.sampling.SamplingParams (or None: the session's)")
        n_drafts = self.draft if draft is None else _int_arg("draft", draft, 0, MAX_DRAFT)
        if draft is None and self._speculative is not None and (n_drafts > 0) != self._speculative:
            # a session stays as its first turn went by default (a plain one plain; a speculative one at
            # its last turn's K): its other default then refused every send without draft=
            n_drafts = 0 if not self._speculative else (self._last_draft or (self.spec.k if self.spec else 3))
        opts = eng._spec_options(n_drafts, self.spec)
        if self._speculative is not None and (n_drafts > 0) != self._speculative:
            if self._speculative:  # (a plain turn needs no drafter rows: it builds none for the turns after it)
                raise ValueError("this session decodes with drafts since its first turn; a plain turn (draft=0) "
                                 "would not build the drafter's rows that its later speculative turns need (send "
                                 "with draft >= 1, or use a new session)")
            raise ValueError(f"this session decodes without drafts since its first turn; draft={n_drafts} would need "
                             "the drafter's rows for the whole transcript, which its plain turns did not build (use a "
                             "new session)")
        given = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        limit = int_in(given, 1)  # (a numpy integer as a Python int)
        if limit is None:
            raise ValueError(f"max_new_tokens must be an integer >= 1 in a session turn, got {given!r}")
        context = eng.model.cfg.max_position_embeddings
        total = len(self.tokens) + len(ids) + limit
        if total > context:
            held = len(self.tokens) + len(ids)  # (with no room for one new token, a lower max_new_tokens cannot help)
            fix = "rewind, reset, or lower max_new_tokens" if held < context else \
                f"no room is left for a reply ({held} tokens before it): " + \
                ("rewind, reset, or send a shorter message" if ids else "rewind or reset")
            raise ValueError(f"the conversation would reach {total} tokens ({len(self.tokens)} so far + {len(ids)} "
                             f"new + max_new_tokens {limit}), beyond the model's maximum context of {context} tokens "
                             f"(max_position_embeddings): {fix}")
        if logprobs is not None:
            top = int_in(logprobs, 0)
            if top is None:
                raise ValueError(f"logprobs must be None or an integer >= 0, got {logprobs!r}")
            logprobs = top
        extra = _token_ids("stop_ids", stop_ids, ordered=False) if stop_ids is not None else []
        check_stop(extra, eng.model.cfg.vocab_size)
        stops = eng._stops(list(self.stop_ids) + extra, self.ignore_eos)
        stop_strings = stop_list(stop)
        skip_break = bool_arg("stop_skips_opening_break", stop_skips_opening_break)  # ("no" is not True)
        cut = StopStrings(eng, stop_strings, stops, skip_break=skip_break) if stop_strings else None
        if cut is not None and not ids and self._reply:  # "go on": the reply so far comes first
            cut.prime(self._reply)
        stream = None if on_tokens is None else (lambda r, t: on_tokens(t))
        if cancel is not None:
            stream = _cancellable(stream, cancel, None)  # (Request.cancel_requested: ends after the round)
        matcher = self._turn_constraint(ids, constraint)
        req = Request(prompt_ids=ids, max_new_tokens=limit, params=params if params is not None else self.params,
                      draft=n_drafts, spec=opts, stop_ids=stops, stop_text=cut, on_tokens=stream, keep=True,
                      use_store=self.use_store, resume=self._seq if self._seq is not None else self._state,
                      constraint=matcher, logprobs=logprobs)
        sched = eng.session_scheduler()
        sched.validate(req)  # invalid input raises here; the session is unchanged
        # the rewind point of this turn: the session before it (made now, so that nothing but
        # the assignments below runs between the turn's end and its record)
        point = RewindPoint(self._boundary, self._matcher, self.telemetry.copy(), self.last_stats, self._last_draft,
                            self._reply)
        if self._graph_turn(req):
            seq, end = None, req.end_state
        else:
            sched.submit(req)
            try:
                while not req.done:
                    sched.step()
            except BaseException:  # escaped a step (on_tokens raised, Ctrl-C mid-round): the turn is undone,
                sched.abandon(req)  # the scheduler cleaned, the session back at its state before the turn
                self._release()
                self._state = self._boundary
                raise
            seq = req.sequence
            if req.stop_reason == "error" and (seq is None or not getattr(seq, "started", False)):
                # failed before the first round (admission or prefill): back to the state before the turn
                if seq is not None:
                    sched.pool.release(seq.slot)
                    self._seq, self._state = None, self._boundary
                raise req.exception
            try:
                end = capture(seq)
            except BaseException:  # (a Ctrl-C after the last round, before the turn is recorded): undone,
                sched.abandon(req)  # as mid-round; the session stayed pointed at a Sequence already continued
                self._release()
                self._state = self._boundary
                raise
        reply = (self._reply if not ids else []) + list(req.tokens)
        # a turn that ran (or failed mid-round: the round was undone, the earlier rounds are committed)
        self._seq, self._state, self._boundary = seq, (end if seq is None else None), end
        self._points.append(point)
        self._reply = reply
        self._matcher = matcher  # its state after the turn (the round driver committed the tokens)
        self._speculative = n_drafts > 0
        self._last_draft = n_drafts
        try:
            if self.use_store:
                eng.store.put(self._boundary)
            if "spec" in req.stats:
                self.telemetry.merge(SpecTelemetry.from_dict(req.stats["spec"]))
        except BaseException:  # (a Ctrl-C after the turn's record): the turn is undone, as one mid-round
            self._undo(1)
            raise
        if req.stop_reason == "error":  # failed mid-round: the rounds before it stay, a turn
            # (its stats are the last turn's: /stats and turn_tokens speak of it, not of the one before)
            self.last_stats = {**req.stats, "finish_reason": "error", "error": f"{type(req.exception).__name__}: "
                               f"{req.exception}", **self._turn_stats(n_drafts)}
            raise req.exception
        try:
            text = cut.apply(req) if cut is not None else None
            if text is None:  # a "go on" turn's text in the context of the reply before it: a character cut
                text = _continued_text(eng, [] if ids else point.reply, list(req.tokens))  # there is this turn's
            out = eng._output([Sample(list(req.tokens), text, req.stop_reason,
                                      req.stats)], ids, n_drafts > 0)
            if logprobs is not None:
                out.logprobs = [list(req.token_logprobs)]
            out.stats.update(self._turn_stats(n_drafts))
            out.stats["store"] = eng.store.stats() if eng._store is not None else None
        except BaseException:  # (a Ctrl-C before the turn's reply is handed back: undone, the caller
            self._undo(1)      # never saw it)
            raise
        self.last_stats = out.stats
        return out

    def _turn_stats(self, n_drafts: int) -> dict:
        """The session's part of a turn's stats, taken once the turn is recorded: its number,
        the context after it, the conversation's turns and (speculative turns) telemetry."""
        return {"turn": self.num_turns, "context_tokens": len(self.tokens),
                "session": {"turns": self.num_turns, "spec": self.telemetry.to_dict() if n_drafts > 0 else None}}

    def _graph_turn(self, req: Request) -> bool:
        """Run the turn on the engine's CUDA-graph lanes when they run here (a GPU) and can
        take it (hyspec.gpu.batch_loop.graph_eligible): the lane loads the session's state,
        prefills [pending] + the new tokens, decodes, and hands back its end state
        (req.end_state). Returns False (nothing run) where the engine core must run it.
        An exception leaves the session as it was before the turn."""
        eng = self.engine
        if not (eng.session_graphs and eng.graphs_available()):
            return False
        from hyspec.gpu.batch_loop import graph_eligible, run_requests

        core_resume, req.resume = req.resume, self._boundary  # (a live engine-core slot holds this very state)
        decoder = None
        if graph_eligible([req]) is None and (req.resume is not None or req.prompt_ids):
            decoder = eng._graph_batch([req], 1)
        if decoder is None:
            req.resume = core_resume
            return False
        if self._seq is not None:  # the state lives on in the boundary; the core's slot is given back
            self._release()
            self._state = self._boundary
        with eng.on_lanes():
            run_requests(decoder, [req], 1, store=eng._store if self.use_store else None)
        if req.end_state is None and req.stop_reason == "error" and getattr(req, "exception", None) is not None:
            raise req.exception  # (failed at its admission, NonFiniteLogits: the session is as before the turn;
            # failed in a later round: it has the rounds before it, as on the engine core, and raises in send)
        if req.end_state is None:
            raise RuntimeError("a one-token conversation ended its turn without a reply: it has no state to keep "
                               "(send a longer message)")
        return True

    # -- moving in the conversation ----------------------------------------------------
    @_engine_turn
    @_not_in_own_turn
    def rewind(self, n: int = 1) -> None:
        """Return to the exact state before the last n turns: the model state, the constraint's,
        the telemetry (the undone turns' rounds no longer count), last_stats (the stats of
        the turn that is now the last; {} when it is unknown: none, or a loaded session's) and
        the draft length a send without draft= takes (the one before the undone turns)."""
        self._check_open()
        turns = int_in(n, 1)
        if turns is None:
            raise ValueError(f"rewind needs a number of turns >= 1, got {n!r}")
        n = turns
        if n > len(self._points):
            raise ValueError(f"cannot rewind {n} turn(s): the session has {len(self._points)}")
        self._undo(n)

    def _undo(self, n: int) -> None:
        """rewind's work, unchecked: back to the state before the last n turns."""
        p = self._points[-n]
        del self._points[-n:]
        self._matcher, self.last_stats = p.matcher, p.stats
        self.telemetry = p.telemetry.copy()  # (the points are never mutated)
        self._last_draft, self._reply = p.draft, p.reply
        self._release()
        self._state = self._boundary = p.state
        if p.state is None:
            self._speculative = None

    @_engine_turn
    @_not_in_own_turn
    def reset(self) -> None:
        """Back to an empty conversation (the same settings)."""
        self._check_open()
        self._release()
        self._state = self._boundary = None
        self._points, self._matcher = [], None
        self._speculative, self._last_draft, self._reply = None, 0, []
        self.telemetry = SpecTelemetry()
        self.last_stats = {}

    def empty_copy(self) -> "Session":
        """A new, empty session with this one's settings (draft, sampling, constraint, ...)."""
        self._check_open()
        return self._clone_settings()

    @_engine_turn
    def fork(self) -> "Session":
        """An independent copy: the same transcript, state and rewind points, its own slot."""
        self._check_open()
        other = self._clone_settings()
        other._state = other._boundary = self._boundary
        other._points = list(self._points)  # (the points, matchers and replies are never mutated: shared)
        other._matcher, other._reply = self._matcher, self._reply
        other._speculative, other._last_draft = self._speculative, self._last_draft
        other.telemetry = self.telemetry.copy()
        other.last_stats = self.last_stats
        return other

    @_engine_turn
    @_not_in_own_turn
    def park(self) -> None:
        """Let the engine's slot (and its buffers) go and keep everything else: the transcript,
        the state (as the boundary, which the next turn resumes from, as after a rewind) and
        the rewind points. For a session kept aside that may be used again."""
        self._check_open()
        if self._seq is not None:  # (the slot's buffers let go of: the state lives on in the boundary, and a
            self._release(keep=False)  # chat's restarts, each parking a session, piled up free slots no
            self._state = self._boundary  # later turn was small enough to reuse)

    @_engine_turn
    @_not_in_own_turn
    def close(self) -> None:
        """Free the slot (the session cannot be used afterwards)."""
        if not self.closed:
            self._release()
            self._state = self._boundary = None
            self._points, self._reply = [], []
            self.closed = True

    def __del__(self) -> None:  # a dropped session gives its slot back to the pool
        try:
            seq = getattr(self, "_seq", None)
            if seq is None:
                return
            lock = self.engine._lock
            if lock.acquire(blocking=False):  # never wait in a finalizer (it may run inside any thread)
                try:
                    self._release()
                finally:
                    lock.release()
            else:  # another call holds the engine: the slot is given back when the next one starts
                self.engine._orphans.append(seq.slot)
                self._seq = None
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def _release(self, keep: bool = True) -> None:
        with self.engine._lock:  # (also from __del__, in whichever thread collects the session)
            if self._seq is not None:
                self.engine.session_scheduler().pool.release(self._seq.slot, keep=keep)
                self._seq = None

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this session is closed")

    def _clone_settings(self) -> "Session":
        return Session(self.engine, draft=self.draft, params=self.params, spec=self.spec,
                       max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids, ignore_eos=self.ignore_eos,
                       use_store=self.use_store, constraint=self.constraint)

    @classmethod
    def from_state(cls, engine, state: SeqState, **settings) -> "Session":
        """A session that continues from a captured state (no rewind points); ValueError when
        the state does not fit the engine's model (hyspec.core.state.check_state)."""
        if not isinstance(state, SeqState):
            raise ValueError(f"state must be a hyspec.core.state.SeqState, got {type(state).__name__}")
        check_state(state, engine.model)
        session = cls(engine, **settings)
        session._state = session._boundary = state
        return session

    # -- on disk -----------------------------------------------------------------------
    @_engine_turn  # (taken whole between turns: a turn ending in another thread tore it, e.g. a boundary
    def to_dict(self, extra: dict | None = None) -> dict:  # of one turn beside the rewind points of the one before)
        d = {
            "format": FORMAT, "model": model_fingerprint(self.engine.model),
            "model_info": model_info(self.engine.model),  # (names what differs when the fingerprint does not match)
            "tokenizer": None if self.engine.tokenizer is None else self.engine.tokenizer.fingerprint,
            "settings": {"draft": self.draft, "params": asdict(self.params),
                         "spec": None if self.spec is None else asdict(self.spec),
                         "max_new_tokens": self.max_new_tokens, "stop_ids": list(self.stop_ids),
                         "ignore_eos": self.ignore_eos, "use_store": self.use_store},
            "state": None if self._boundary is None else self._boundary.to_dict(),
            # the rewind points, one list per field (a turn's stats are not saved)
            "history": [None if p.state is None else p.state.to_dict() for p in self._points],
            # each state's identity (SeqState.digest), checked at load: a damaged file fails there
            "digests": {"state": None if self._boundary is None else self._boundary.digest(),
                        "history": [None if p.state is None else p.state.digest() for p in self._points]},
            "constraint": _constraint_dict(self.constraint), "matcher": _constraint_dict(self._matcher),
            "matchers": [_constraint_dict(p.matcher) for p in self._points],
            "speculative": self._speculative, "turns": self.turns, "telemetry": self.telemetry.to_dict(),
            "last_draft": self._last_draft, "drafts": [p.draft for p in self._points],  # a send without draft=
            "reply": list(self._reply), "replies": [list(p.reply) for p in self._points],  # stop strings in a "go on"
            "telemetries": [p.telemetry.to_dict() for p in self._points],
            "extra": extra or {},
        }
        d["digests"]["record"] = _record_digest(d)  # (the rest of the file, checked at load too)
        return d

    def save(self, path, extra: dict | None = None) -> None:
        """Write the session (state, rewind points, settings) to a file; Session.load reads it
        back bitwise, in any process, for the same model. It takes the session as it is between
        turns: a turn running in another thread is waited for (the engine's lock; called from
        the turn's own on_tokens, it saves the session before that turn)."""
        self._check_open()
        _check_extra(extra)
        path = given = Path(_path_arg(path)).expanduser()
        if path.is_symlink():  # the file it points to is written (the link stays a link)
            path = path.resolve()
        if path.is_dir():
            raise IsADirectoryError(f"{given} is a directory: give a file name to save the session to")
        if given.exists() and not given.is_file():  # a device, a pipe, a socket: never replaced by a file (also
            # one behind a link through /proc, /dev/stdout into a pipe: resolved, "/proc/PID/fd/pipe:[N]" was no file)
            raise ValueError(f"cannot save the session to {given}: it is not a regular file")
        if not path.parent.is_dir():
            if path.parent.exists():  # (a file where the folder should be)
                raise NotADirectoryError(f"cannot save the session to {given}: {path.parent} is not a folder")
            raise FileNotFoundError(f"cannot save the session to {given}: the folder {path.parent} does not exist")
        # written beside it, then moved over it (hyspec.files.write_whole): a failed or interrupted save
        # leaves an older file whole; an existing file's mode stays
        failed = []  # a write's own OSError (torch's writer swallows it: "[enforce fail at inline_container.cc]
        try:  # ... unexpected pos 3648 vs 3542" said nothing of a full disk)
            write_whole(path, lambda f: torch.save(self.to_dict(extra), _WriteErrors(f, failed)))
        except (RuntimeError, OSError) as e:  # (a folder not writable named the temporary file, not this one)
            why = failed[0].strerror if failed and failed[0].strerror else (
                e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0][:200])
            raise OSError(f"cannot save the session to {given}: {why}") from None

    @classmethod
    def load(cls, engine, path) -> "Session":
        p = Path(_path_arg(path)).expanduser()
        if p.is_dir():
            raise IsADirectoryError(f"{path} is a directory, not a session file")
        if not p.exists():
            raise FileNotFoundError(f"no session file {path}")
        if not p.is_file():  # a pipe, a device, a socket (a FIFO blocked the load until a writer came)
            raise ValueError(f"{path} is not a regular file, not a session file")
        try:
            d = torch.load(str(p), map_location="cpu", weights_only=True)
        except Exception as e:  # not a torch file at all (pickle / zip errors of every kind; torch's zip reader
            if isinstance(e, OSError) and e.filename is not None:  # says "[Errno 22] Invalid argument", naming no
                raise  # file, for some truncated ones); the file's own OSError (permission denied) names it
            raise ValueError(f"{path}: not a hyspec session file, or a damaged (truncated?) one (torch.load cannot "
                             f"read it: {type(e).__name__})") from None
        if not isinstance(engine, Engine):  # (the file read: an engine's AttributeError was blamed on it)
            raise ParamError("engine", engine, "must be the hyspec.engine.Engine of the model the session ran on")
        try:
            return cls.from_dict(engine, d)
        except (KeyError, TypeError, AttributeError, IndexError) as e:  # a torch file with the wrong contents
            raise ValueError(f"{path}: not a hyspec session file (missing or malformed {e})") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, engine, d: dict) -> "Session":
        from hyspec.speculative.loop import SpecOptions

        fmt = d.get("format") if isinstance(d, dict) else None
        if isinstance(fmt, str) and fmt.startswith("hyspec-session/") and fmt != FORMAT:
            raise ValueError(f"a session file of format {fmt!r}, which this hyspec cannot read (it reads {FORMAT!r}: "
                             f"a newer hyspec wrote it?)")
        if fmt != FORMAT:
            raise ValueError(f"not a hyspec session file (expected format {FORMAT!r})")
        if d["model"] != model_fingerprint(engine.model):
            raise ValueError(_model_mismatch(d.get("model_info"), model_info(engine.model)))
        saved_tok, tok = d.get("tokenizer"), engine.tokenizer  # (absent in files written before it was saved)
        if saved_tok is not None and tok is not None and saved_tok != tok.fingerprint:
            raise ValueError("this session was saved with another tokenizer (its tokenizer.json maps text to other "
                             "ids: the transcript would read as other text, a constraint replay on other tokens)")
        digests = d.get("digests")  # (absent in files written before they were saved)
        if digests is not None and "record" in digests and digests["record"] != _record_digest(d):
            raise ValueError("the session file is damaged: its settings, replies, telemetry or extra are not the "
                             "ones saved (their digest differs)")
        settings = d["settings"]
        spec = settings["spec"]
        if spec is not None and spec.get("forced_rates") is not None:
            spec["forced_rates"] = tuple(spec["forced_rates"])
        session = cls(engine, draft=settings["draft"], params=SamplingParams(**settings["params"]),
                      spec=None if spec is None else SpecOptions(**spec), max_new_tokens=settings["max_new_tokens"],
                      stop_ids=settings["stop_ids"], ignore_eos=settings["ignore_eos"],
                      use_store=settings["use_store"])
        dev = engine.model.device

        def state_of(x, digest, what):
            if x is None:
                return None
            st = SeqState.from_dict(x, dev)
            check_state(st, engine.model)
            if digests is not None and st.digest() != digest:
                raise ValueError(f"the session file is damaged: the {what} state's contents are not the ones "
                                 f"saved (its digest differs)")
            return st

        session._state = session._boundary = state_of(d["state"], digests and digests["state"], "current")
        history = d["history"]
        if digests is not None and len(digests["history"]) != len(history):
            raise ValueError("the session file is damaged: its rewind points and their digests differ in number")
        states = [state_of(h, digests and digests["history"][i], f"rewind point {i}'s")
                  for i, h in enumerate(history)]
        n = len(states)
        session.constraint = _constraint_from(engine, d.get("constraint"))
        session._matcher = _constraint_from(engine, d.get("matcher"))
        matchers = [_constraint_from(engine, m) for m in d.get("matchers", [None] * n)]
        session._speculative = d["speculative"]
        # (a file written before they were saved: a speculative session's default K is then its spec's, or 3)
        session._last_draft = int(d.get("last_draft", 0))
        drafts = [int(k) for k in d.get("drafts", [0] * n)]
        session._reply = [int(t) for t in d.get("reply", [])]
        replies = [[int(t) for t in r] for r in d.get("replies", [[] for _ in range(n)])]
        session.telemetry = SpecTelemetry.from_dict(d["telemetry"])
        # the telemetry before each turn (a file written before they were saved: the current one,
        # so a rewind there keeps counting the undone turns' rounds, as it did then)
        telemetries = [SpecTelemetry.from_dict(t) for t in d.get("telemetries", [d["telemetry"]] * n)]
        if any(len(x) != n for x in (matchers, drafts, replies, telemetries)):
            raise ValueError("the session file is damaged: its rewind points and their constraint states, draft "
                             "lengths, replies or telemetries differ in number")
        session._points = [RewindPoint(st, m, t, {}, k, r)  # (a turn's stats are not saved)
                           for st, m, t, k, r in zip(states, matchers, telemetries, drafts, replies)]
        session.extra = d.get("extra", {})
        return session


def _continued_text(eng, before: list[int], tokens: list[int]) -> str:
    """The text of `tokens` that follow `before` (the reply so far): a character whose first
    bytes ended `before` (shown there as U+FFFD) is completed here, as the whole reply's text
    has it (decoded alone, the continuation began with U+FFFD for its last bytes)."""
    return continuation(eng, before, tokens)[1]


def continuation(eng, before: list[int], tokens: list[int]) -> tuple[int, str]:
    """(drop, text): the text of `tokens` after `before` as the whole reply's text has it, and
    how many characters at the end of `before`'s own text (the U+FFFD of a character cut in
    its bytes there, completed by `tokens`) that text replaces: ``decode(before)[:-drop or
    None] + text == decode(before + tokens)`` where the decoding allows it."""
    if not before:
        return 0, eng.decode(tokens)
    head = eng.decode(before)
    if head is None or not head.endswith("\ufffd"):  # (None: no tokenizer, no text)
        return 0, eng.decode(tokens)
    whole, settled = eng.decode(before + tokens), head.rstrip("\ufffd")
    if whole.startswith(head):  # (its U+FFFD were real characters, EF BF BD: the earlier turn's)
        return 0, whole[len(head):]
    if whole.startswith(settled):
        return len(head) - len(settled), whole[len(settled):]
    return 0, eng.decode(tokens)


def _constraint_dict(c) -> dict | None:
    """A constraint as data: its kind, grammar, the tokens it has consumed, the failure marked
    on it (a dead end the last reply ran into) and the text its answer comes after, if any."""
    if c is None:
        return None
    return {"kind": c.kind, "grammar": c.grammar_text, "tokens": list(c.tokens), "failure": c.failure,
            "after": c.after}


def _constraint_from(engine, d: dict | None):
    """_constraint_dict's inverse for this engine's vocabulary: the grammar at its start,
    then its tokens consumed again."""
    if d is None:
        return None
    from hyspec.constraints import Constraint, vocab_for

    c = Constraint(vocab_for(engine), d["grammar"], kind=d["kind"])
    c.commit(d["tokens"])
    c.after = d.get("after")
    if d.get("failure"):  # (a dead end found again stops the matcher where it stood; the saved reason stays)
        c.dead_end()
        c.failure = None
        c.fail(d["failure"])
    return c


def _path_arg(path):
    """A file path argument (str or os.PathLike), refused by name otherwise (pathlib said only
    "expected str, bytes or os.PathLike object, not NoneType")."""
    import os

    if not isinstance(path, (str, os.PathLike)):
        raise ParamError("path", path, "must be a file path (str or os.PathLike)")
    return path
