"""Pipeline parallelism: the decoder layers split into stages, one process (GPU) per stage.
(One module on purpose: the driver and the stage workers speak one message protocol,
and each command's sender and receiver sit side by side.)

Split rule (split_layers): contiguous layer ranges, one per rank in order, chosen to make the
largest stage's weight bytes as small as possible (balanced bytes; every stage gets >= 1
layer). Stage 0 holds the embedding (its input); the last stage holds the final norm, the LM
head and the MTP head (and also reads the embedding: the MTP head embeds its draft tokens
and a tied LM head is the embedding). Each rank reads only its stage's tensors from the
checkpoint (hyspec/loading.py, load_model(layers=...)).

Roles: the LAST rank is the *driver*: it runs the scheduler and the round driver
(hyspec/core) unchanged, with PipelineBackend. It owns everything the round needs besides
the early layers (LM head, MTP head, draft KV, acceptance, RNG), so drafting, accept and
commit never cross a process boundary; only the target forwards (prefill chunks, verify
rows) do. The other ranks are *workers*: run_worker executes each command the driver
sends over their own layers. Output leaves through rank 0 (the driver hands it the text
at the end), so a run prints exactly what a single process prints.

Protocol per target forward (driver D = world-1, workers 0..D-1):
    D -> every worker: one pickled message {ops, fwd} (send_obj)
        ops: the cache operations the driver's round made since the last forward, in order
             ("snap", uid, sid) / ("restore", uid, sid) / ("keep", uid, sid, j) / ("clear", uid)
             -- each stage applies them to its own layers' state, so every stage holds the
             same accepted length (rollback of the Gated-DeltaNet state of its own layers)
        fwd: token ids [N] and per sequence (cache uid, cache length, StepCtx fields, rows)
    worker 0: embed ids, run its layers -> status + residual [N, H] to rank 1
    worker r: status + residual from r-1, its layers -> to r+1
    D: status + residual from D-1, its layers, final norm (-> logits, accept, commit)
A worker error travels down the chain as status 1 plus the message; the driver raises it.
At the end D sends {"stop": True, "result": (stdout, stderr, rc)} to every worker.

Optimistic fork (--optimistic, hyspec/parallel/fork.py): once a verify's reply is in, D may
send {fork: fwd} -- the next round's forward on a guess. Each worker puts aside what the
forward changes in the forked caches and runs it (worker r passes its rows to r+1 as
usual; the last worker keeps its output). The next command D sends carries fork_res:
"hit" (it is the forked forward: the workers apply its cache ops to the put-aside state,
put the forked state back, and the last worker sends the kept rows) or "miss" (every
worker restores the put-aside state, then serves the command as usual). {"settle": True}
throws a fork away when the scheduler runs out of work.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from hyspec.cache import HybridCache
from hyspec.core.backend import ReferenceBackend
from hyspec.model.hybrid import HybridLM, check_batch
from hyspec.model.ops import StepCtx
from hyspec.parallel import sigint_deferred
from hyspec.parallel.fork import (ForkController, ForkTelemetry, PendingFork, capture, fork_fwd, install, is_hit,
                                  same_state)


# ---------------------------------------------------------------------------------------
# the split rule
# ---------------------------------------------------------------------------------------
def layer_bytes(cfg, dtype: torch.dtype = torch.float32) -> tuple[list[int], int, int]:
    """(bytes of each decoder layer, bytes only stage 0 holds, bytes only the last stage
    holds), from the config alone (the model is built on the meta device)."""
    with torch.device("meta"):
        m = HybridLM(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0)
    e = torch.empty((), dtype=dtype).element_size()

    def nb(mod) -> int:
        return sum(p.numel() for p in mod.parameters()) * e if mod is not None else 0

    per = [nb(layer) for layer in m.model.layers]
    emb = nb(m.model.embed_tokens)
    last = emb + nb(m.model.norm) + nb(getattr(m, "lm_head", None)) + nb(m.mtp)
    return per, emb, last


def split_layers(per: list[int], first_extra: int, last_extra: int, stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the largest stage's bytes
    (stage 0 also counts first_extra, the last stage last_extra); ties: the earlier cut."""
    L = len(per)
    if not 1 <= stages <= L:
        raise ValueError(f"--pp {stages}: the model has {L} layers; each stage needs at least one")
    pre = [0] + list(itertools.accumulate(per))

    def cost(s: int, a: int, b: int) -> int:
        return pre[b] - pre[a] + (first_extra if s == 0 else 0) + (last_extra if s == stages - 1 else 0)

    # best[s][b]: (max bytes, cuts) for layers 0..b-1 in stages 0..s
    best = {(0, b): (cost(0, 0, b), [0, b]) for b in range(1, L + 1)}
    for s in range(1, stages):
        for b in range(s + 1, L + 1):
            cands = []
            for a in range(s, b):
                m, cuts = best[(s - 1, a)]
                cands.append((max(m, cost(s, a, b)), cuts + [b]))
            best[(s, b)] = min(cands, key=lambda c: c[0])
    cuts = best[(stages - 1, L)][1]
    return [range(cuts[i], cuts[i + 1]) for i in range(stages)]


def stage_ranges(cfg, stages: int, dtype: torch.dtype = torch.float32) -> list[range]:
    per, first, last = layer_bytes(cfg, dtype)
    return split_layers(per, first, last, stages)


# ---------------------------------------------------------------------------------------
# messages
# ---------------------------------------------------------------------------------------
class Link:
    """Point-to-point messages between ranks (gloo on CPU, NCCL on CUDA: tensors then travel
    on the rank's GPU)."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world = rank, world
        self.comm_dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
        self.wait_s = 0.0  # time this rank had nothing to do: every lane blocked in a recv (the bubble)
        self.lanes = 1  # threads that use this link (lanes on the driver); idle = all of them waiting
        self._waiting = 0
        self._idle_since = 0.0
        self._mu = threading.Lock()

    def _wait_begin(self) -> None:
        with self._mu:
            self._waiting += 1
            if self._waiting == self.lanes:
                self._idle_since = time.perf_counter()

    def _wait_end(self) -> None:
        with self._mu:
            if self._waiting == self.lanes:
                self.wait_s += time.perf_counter() - self._idle_since
            self._waiting -= 1

    def send_obj(self, obj, dst: int, tag: int = 0) -> None:
        data = pickle.dumps(obj)
        dist.send(torch.tensor([len(data)], dtype=torch.long, device=self.comm_dev), dst, tag=tag)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.comm_dev), dst, tag=tag)

    def recv_obj(self, src: int, tag: int = 0):
        self._wait_begin()
        try:
            n = torch.empty(1, dtype=torch.long, device=self.comm_dev)
            dist.recv(n, src, tag=tag)
            buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self.comm_dev)
            dist.recv(buf, src, tag=tag)
        finally:
            self._wait_end()
        return pickle.loads(buf.cpu().numpy().tobytes())

    def send_x(self, x: torch.Tensor | None, dst: int, error: str | None = None, tag: int = 1) -> None:
        dist.send(torch.tensor([0 if error is None else 1], dtype=torch.long, device=self.comm_dev), dst, tag=tag)
        if error is not None:
            self.send_obj(error, dst, tag=tag)
        else:
            dist.send(x.contiguous().to(self.comm_dev), dst, tag=tag)

    def recv_x(self, src: int, shape, dtype, device, tag: int = 1, account: bool = True) -> torch.Tensor:
        """A stage's output rows from rank src (tag = 1 + lane)."""
        if account:
            self._wait_begin()
        try:
            st = torch.empty(1, dtype=torch.long, device=self.comm_dev)
            dist.recv(st, src, tag=tag)
            if int(st.item()) != 0:
                raise RuntimeError(f"pipeline stage before rank {self.rank} failed: "
                                   f"{self.recv_obj(src, tag=tag)}")
            x = torch.empty(shape, dtype=dtype, device=self.comm_dev)
            dist.recv(x, src, tag=tag)
        finally:
            if account:
                self._wait_end()
        return x.to(device)


# ---------------------------------------------------------------------------------------
# the driver side (last rank)
# ---------------------------------------------------------------------------------------
_uids = itertools.count(1)


class PipelineCache(HybridCache):
    """The driver's cache of one sequence (its own layers), whose snapshot / restore /
    rollback are queued for the other stages (applied there before the next forward)."""

    def __init__(self, cfg, max_len, device, dtype, layers, driver: "Driver") -> None:
        super().__init__(cfg, max_len, device, dtype, layers)
        self.uid = next(_uids)
        self.driver = driver
        self._sid = itertools.count(1)

    def snapshot(self):
        snap = super().snapshot()
        snap.sid = next(self._sid)
        self.driver.ops.append(("snap", self.uid, snap.sid))
        return snap

    def restore(self, snap) -> None:
        super().restore(snap)
        self.driver.ops.append(("restore", self.uid, snap.sid))

    def keep_from_records(self, snap, j: int) -> None:
        super().keep_from_records(snap, j)
        self.driver.ops.append(("keep", self.uid, snap.sid, j))

    def clear_records(self) -> None:
        super().clear_records()
        self.driver.ops.append(("clear", self.uid))


class Driver:
    """Runs target forwards through every stage; installed on the driver's stage model so
    every caller of HybridLM.forward_batch / forward_states / forward_hidden (the backend,
    the replay rollback, scoring) goes through the pipeline."""

    def __init__(self, model: HybridLM, link: Link) -> None:
        self.model, self.link = model, link
        self._ops: dict[int, list[tuple]] = {}
        self._local = threading.local()  # .lane: which lane (thread) is calling
        self._send = threading.Lock()  # one command message at a time on the wire
        # replies come back in command order (the workers serve commands first come, first
        # served), so the lanes receive in ticket order: no reliance on message tags (NCCL
        # ignores them) and never two receives from the same rank at once
        self._turn = threading.Condition()
        # NCCL calls on one communicator must not run from two threads at once: there a
        # lane's receive also holds the send lock (the lanes still alternate: a lane sends
        # its next command as soon as the other lane's reply is in)
        self._recv_lock = self._send if link.comm_dev.type == "cuda" else contextlib.nullcontext()
        self._next_ticket = 0
        self._serving = 0
        self.forwards = 0
        self.compute_s = 0.0
        self.t_mark = time.perf_counter()
        # optimistic fork (hyspec/parallel/fork.py): off unless asked for; one lane only
        self.optimistic = False
        self.fork: PendingFork | None = None
        self.fork_ctl = ForkController()
        self.fork_tel = ForkTelemetry()
        model.cache_factory = lambda max_len: PipelineCache(model.cfg, max_len, model.device, model.dtype,
                                                            model.stage_layers, self)
        model.forward_batch = self.forward_batch  # instance attribute: shadows the class method

    @property
    def lane(self) -> int:
        return getattr(self._local, "lane", 0)

    @lane.setter
    def lane(self, v: int) -> None:
        self._local.lane = v

    @property
    def ops(self) -> list[tuple]:
        """The calling lane's queued cache operations (each cache belongs to one lane)."""
        return self._ops.setdefault(self.lane, [])

    @property
    def forking(self) -> bool:
        """Whether a verify may fork now: --optimistic, and one lane (the lanes already keep
        stage 0 busy with the other lane's rows)."""
        return self.optimistic and self.link.lanes == 1

    def forward_batch(self, ids, ctxs: list[StepCtx], caches: list, sizes: list[int], *, layers=None, x=None):
        if layers is not None or x is not None:
            raise ValueError("a pipelined model runs whole forwards only")
        check_batch(ctxs, caches, sizes)
        lane = self.lane
        N = int(sum(sizes))
        guess, self._local.guess = getattr(self._local, "guess", None), None
        fwd = {"ids": ids.tolist(), "sizes": list(sizes),
               "seqs": [(None if c is None else c.uid, 0 if c is None else c.max_len, ctx.start, ctx.exact, ctx.record,
                         ctx.chunked) for ctx, c in zip(ctxs, caches)]}
        msg = {"ops": self.ops, "fwd": fwd, "lane": lane}
        with sigint_deferred():  # (a Ctrl-C between the send and the reply waits for the reply)
            self._ops[lane] = []
            with self._send:
                if self.fork is not None:  # the fork in flight: this command uses it or throws it away
                    msg["fork_res"] = self._resolve_fork(fwd, msg["ops"])
                ticket = self._next_ticket
                self._next_ticket += 1
                for r in range(self.link.world - 1):
                    self.link.send_obj(msg, r)
            # the guess of the next round is made while stage 0 works on this one; it is sent
            # once this command's reply is in (a blocking send now would wait on a worker that
            # is itself blocked sending its reply to this rank)
            nxt = self._fork_guess(fwd, guess) if guess is not None else None
            m = self.model
            self.link._wait_begin()
            try:
                with self._turn:
                    while self._serving != ticket:
                        self._turn.wait()
                with self._recv_lock:
                    h = self.link.recv_x(self.link.rank - 1, (N, m.cfg.hidden_size), m.dtype, m.device, tag=1 + lane,
                                         account=False)
            finally:
                self.link._wait_end()
                with self._turn:
                    self._serving += 1
                    self._turn.notify_all()
            if nxt is not None:
                self._fork_send(nxt, lane)
        t0 = time.perf_counter()
        out = HybridLM.forward_batch(m, None, ctxs, caches, sizes, layers=m.stage_layers, x=h)
        self.compute_s += time.perf_counter() - t0
        self.forwards += 1
        return out

    # -- the optimistic fork (hyspec/parallel/fork.py) ----------------------------------
    def _fork_guess(self, fwd: dict, guess) -> dict | None:
        """Right after sending a verify command: the forward command of the next round on
        the guess (the driver's MTP steps overlap stage 0's work on this round), or None
        (the controller pauses forking, or there is no guess)."""
        tel = self.fork_tel
        if not self.fork_ctl.allow():
            tel.paused += 1
            tel.event("p")
            return None
        t0 = time.perf_counter()
        try:
            guesses = guess()
        except Exception as e:  # a guess must never break a round: forking stops, loudly
            import sys
            print(f"[optimistic fork disabled: the guess failed: {type(e).__name__}: {e}]", file=sys.stderr)
            self.optimistic = False
            guesses = None
        tel.guess_s += time.perf_counter() - t0
        nxt = fork_fwd(fwd, guesses) if guesses is not None else None
        if nxt is None:
            tel.no_guess += 1
            tel.event(".")
        return nxt

    def _fork_send(self, nxt: dict, lane: int) -> None:
        """Have the stages run the guessed forward now (they are done with this round's)."""
        tel = self.fork_tel
        with self._send:
            for r in range(self.link.world - 1):
                self.link.send_obj({"fork": nxt, "lane": lane}, r)
            self.fork = PendingFork(nxt, len(nxt["ids"]))
        tel.forks += 1
        tel.forked_rows += self.fork.rows

    def _resolve_fork(self, fwd: dict | None, ops: list) -> str:
        """Hit or miss of the fork in flight against the command about to be sent (None: a
        mark or stop, which throws it away). Caller holds the send lock."""
        f, self.fork = self.fork, None
        tel = self.fork_tel
        if fwd is None:
            tel.dropped += 1
            tel.wasted_rows += f.rows
            tel.event("d")
            return "miss"
        hit = is_hit(f, fwd, ops)
        if hit:
            tel.hits += 1
            tel.hit_rows += f.rows
        else:
            tel.misses += 1
            tel.wasted_rows += f.rows
        tel.event("h" if hit else "m")
        if self.fork_ctl.resolve(hit):
            tel.trips += 1
        return "hit" if hit else "miss"

    def settle(self) -> None:
        """The run is over: throw away a fork still in flight (the stages roll it back now,
        not at the next run's first command). Its rows count as wasted ("dropped")."""
        with self._send:
            if self.fork is None:
                return
            msg = {"settle": True, "fork_res": self._resolve_fork(None, [])}
            for r in range(self.link.world - 1):
                self.link.send_obj(msg, r)

    def fork_stats(self, reset: bool = False) -> dict:
        """The fork telemetry (ForkTelemetry.to_dict + "enabled"); reset: start the
        counters and the controller afresh after reading them."""
        d = self.fork_tel.to_dict()
        d["enabled"] = self.optimistic
        if reset:
            self.fork_ctl, self.fork_tel = ForkController(), ForkTelemetry()
        return d

    def mark(self) -> None:
        """Start the timing counters here, on every rank (the bench calls it after warm-up)."""
        with self._send:
            msg = {"mark": True}
            if self.fork is not None:
                msg["fork_res"] = self._resolve_fork(None, [])
            for r in range(self.link.world - 1):
                self.link.send_obj(msg, r)
        self.link.wait_s, self.compute_s, self.forwards = 0.0, 0.0, 0
        self.fork_ctl, self.fork_tel = ForkController(), ForkTelemetry()
        self.t_mark = time.perf_counter()

    def stop(self, result=None) -> None:
        with self._send:
            if self.fork is not None:
                self._resolve_fork(None, [])
            for r in range(self.link.world - 1):
                self.link.send_obj({"stop": True, "result": result if r == 0 else None}, r)


class PipelineBackend(ReferenceBackend):
    """The round driver's backend on the last rank: ReferenceBackend's calls, with the
    target forwards (prefill, verify) running through every stage. The MTP head, draft
    logits and LM head are local (they live on the last stage)."""

    name = "pipeline"

    def __init__(self, model: HybridLM, link: Link) -> None:
        if model.stage_layers is None or model.stage_layers.stop != model.cfg.num_hidden_layers:
            raise ValueError("the pipeline driver runs on the last stage")
        self.driver = Driver(model, link)
        super().__init__(model)

    @property
    def forking(self) -> bool:
        """Whether the round driver should offer a guess of the next round (--optimistic)."""
        return self.driver.forking

    def settle(self) -> None:
        """No more rounds for now: a fork still in flight is thrown away (Driver.settle)."""
        self.driver.settle()

    def verify(self, items: list[tuple], guess=None) -> list[tuple]:
        """ReferenceBackend.verify; with `guess` (a callable returning the next round's
        tokens per sequence, hyspec/core/round.py next_round_guess) the stages fork the
        next round's verify on it while this one resolves (hyspec/parallel/fork.py)."""
        self.driver._local.guess = guess if self.driver.forking else None
        try:
            return super().verify(items)
        finally:
            self.driver._local.guess = None


# ---------------------------------------------------------------------------------------
# the worker side (every other rank)
# ---------------------------------------------------------------------------------------
def _reset(cache: HybridCache) -> None:
    cache.pos = 0
    for s in cache.linear_states:
        s.conv = torch.zeros_like(s.conv)
        s.ssm = torch.zeros_like(s.ssm)
        s.record = None


class Worker:
    """One stage's caches (by the driver's cache uid) and the loop that serves the driver."""

    def __init__(self, model: HybridLM, link: Link) -> None:
        self.model, self.link = model, link
        self.caches: dict[int, HybridCache] = {}
        self.snaps: dict[int, dict[int, object]] = {}
        self.busy_s = 0.0
        self.forwards = 0
        self.t_mark = time.perf_counter()
        # the optimistic fork in flight (hyspec/parallel/fork.py): {"fwd", "pre": {uid: state}, "out", "s"}
        self.fork: dict | None = None
        self.deferred_error: str | None = None  # an error on a hit that had no reply to travel in
        self.fork_counts = {"forks": 0, "hits": 0, "rollbacks": 0, "fork_s": 0.0, "wasted_s": 0.0}

    @property
    def last_worker(self) -> bool:
        return self.link.rank == self.link.world - 2

    def _cache(self, uid, max_len: int, start: int):
        if uid is None:
            return None
        c = self.caches.get(uid)
        if c is None or c.max_len != max_len:
            if start != 0:
                raise RuntimeError(f"pipeline desync: no state for cache {uid} at position {start}")
            c = self.caches[uid] = HybridCache(self.model.cfg, max_len, self.model.device, self.model.dtype,
                                               self.model.stage_layers)
            self.snaps[uid] = {}
        elif start == 0:
            _reset(c)  # a reused slot starts a new sequence
        return c

    def _apply(self, op: tuple) -> None:
        kind, uid = op[0], op[1]
        c = self.caches[uid]
        snaps = self.snaps[uid]
        if kind == "snap":
            snaps[op[2]] = c.snapshot()
            for old in [s for s in snaps if s <= op[2] - 4]:  # a round uses its own snapshot only
                del snaps[old]
        elif kind == "restore":
            c.restore(snaps[op[2]])
        elif kind == "keep":
            c.keep_from_records(snaps[op[2]], op[3])
        elif kind == "clear":
            c.clear_records()
        else:
            raise RuntimeError(f"unknown pipeline op {kind!r}")

    def _forward(self, fwd: dict, h: torch.Tensor | None) -> torch.Tensor:
        m = self.model
        ctxs = [StepCtx(start=s, exact=e, record=r, chunked=ch) for _, _, s, e, r, ch in fwd["seqs"]]
        caches = [self._cache(uid, L, s) for uid, L, s, _, _, _ in fwd["seqs"]]
        ids = torch.tensor(fwd["ids"], dtype=torch.long, device=m.device) if h is None else None
        x, _ = HybridLM.forward_batch(m, ids, ctxs, caches, fwd["sizes"], layers=m.stage_layers, x=h)
        return x

    # -- the optimistic fork ---------------------------------------------------------------
    def _run_fork(self, msg: dict) -> None:
        """Run the driver's guess of the next round's rows on this stage's layers, after
        putting aside what the forward will change; the last worker keeps its output for
        the driver (sent on a hit), the others pass theirs on as usual."""
        link, m = self.link, self.model
        fwd, tag = msg["fork"], 1 + msg.get("lane", 0)
        t0 = time.perf_counter()
        error, h, x = None, None, None
        pre = {}
        try:
            for uid, *_ in fwd["seqs"]:
                pre[uid] = capture(self.caches[uid])
        except KeyError as e:
            error = f"rank {link.rank}: fork on unknown cache {e}"
        if link.rank > 0:
            h, err = _recv_hidden(link, m, len(fwd["ids"]), tag)
            error = error or err
            t0 = time.perf_counter()
        if error is None:
            try:
                x = self._forward(fwd, h)
            except Exception:
                error = f"rank {link.rank} (fork): " + traceback.format_exc(limit=3)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.fork_counts["forks"] += 1
        self.fork_counts["fork_s"] += dt
        self.fork = {"fwd": fwd, "pre": pre, "out": None, "error": error, "s": dt}
        if self.last_worker:
            self.fork["out"] = x
        else:
            link.send_x(x, link.rank + 1, error, tag=tag)

    def _fork_rollback(self) -> None:
        """A miss: every forked cache back to its state before the fork."""
        f, self.fork = self.fork, None
        for uid, state in f["pre"].items():
            install(self.caches[uid], state)
        self.fork_counts["rollbacks"] += 1
        self.fork_counts["wasted_s"] += f["s"]

    def _fork_hit(self, msg: dict) -> None:
        """A hit: the command is the forked forward. Its cache operations (round r's full
        accept `clear`, round r+1's `snap`) belong before the forked rows: they are applied
        to the state from before the fork, which must come out of them unchanged, then the
        forked state is put back; the last worker sends the kept output."""
        f, self.fork = self.fork, None
        link = self.link
        t0 = time.perf_counter()
        error = f["error"] or self.deferred_error
        self.deferred_error = None
        try:
            if msg["fwd"] != f["fwd"]:
                raise RuntimeError("pipeline desync: a fork hit for a different forward")
            post = {uid: capture(self.caches[uid]) for uid in f["pre"]}
            for uid, state in f["pre"].items():
                install(self.caches[uid], state)
            for op in msg["ops"]:
                if op[1] in f["pre"] and op[0] not in ("clear", "snap"):
                    raise RuntimeError(f"pipeline desync: cache op {op[0]!r} on a forked cache at a fork hit")
                self._apply(op)
            for uid, state in f["pre"].items():
                if not same_state(self.caches[uid], state):
                    raise RuntimeError("pipeline desync: a fork hit's cache ops changed the state")
            for uid, state in post.items():
                install(self.caches[uid], state)
        except Exception:
            error = error or f"rank {link.rank}: " + traceback.format_exc(limit=3)
        self.fork_counts["hits"] += 1
        self.busy_s += time.perf_counter() - t0
        if self.last_worker:
            link.send_x(f["out"] if error is None else None, link.rank + 1, error, tag=1 + msg.get("lane", 0))
        elif error is not None:
            self.deferred_error = error  # no reply travels from here on a hit: the next one carries it

    def run(self):
        """Serve until the driver says stop; returns the stop message's result."""
        link, m = self.link, self.model
        driver = link.world - 1
        while True:
            msg = link.recv_obj(driver)
            if msg.get("stop"):
                return msg.get("result")
            if msg.get("status"):  # the driver's start-up question (hyspec.parallel.check_stages): loaded
                link.send_obj({"load_error": None}, driver)
                continue
            if "fork" in msg:
                self._run_fork(msg)
                continue
            if self.fork is not None:
                if msg.get("fork_res") == "hit":
                    self._fork_hit(msg)
                    continue
                self._fork_rollback()
            if msg.get("settle"):
                continue
            if msg.get("mark"):
                link.wait_s, self.busy_s, self.forwards = 0.0, 0.0, 0
                self.fork_counts = {k: type(v)() for k, v in self.fork_counts.items()}
                self.t_mark = time.perf_counter()
                continue
            t0 = time.perf_counter()
            error, self.deferred_error = self.deferred_error, None
            try:
                for op in msg["ops"]:
                    self._apply(op)
            except Exception:
                error = error or f"rank {link.rank}: " + traceback.format_exc(limit=3)
            fwd, tag = msg["fwd"], 1 + msg.get("lane", 0)
            h = None
            if link.rank > 0:
                h, err = _recv_hidden(link, m, len(fwd["ids"]), tag)
                error = error or err
                t0 = time.perf_counter()
            x = None
            if error is None:
                try:
                    x = self._forward(fwd, h)
                    self.forwards += 1
                except Exception:
                    error = f"rank {link.rank}: " + traceback.format_exc(limit=3)
            self.busy_s += time.perf_counter() - t0
            link.send_x(x, link.rank + 1, error, tag=tag)


# ---------------------------------------------------------------------------------------
# process group and stage loading
# ---------------------------------------------------------------------------------------
def rank_device(device: str) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if d.index is None else d.index)
    return d


def init(world: int, device: str = "cpu") -> tuple[int, torch.device]:
    """Join the process group that the launcher (launch() or torchrun) described in the
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Returns (rank, this rank's device)."""
    import datetime

    n = int(env_number("WORLD_SIZE", 1, integer=True))
    if n != world:
        raise ValueError(f"--pp {world} needs {world} processes; this launch has WORLD_SIZE={n}")
    rank = int(env_number("RANK", 0, integer=True))
    env_number("MASTER_PORT", 0, integer=True)  # (torch's own error named no variable)
    dev = rank_device(device)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        # a worker waits for the driver's next command as long as the driver lives (an idle
        # server may send nothing for days); a dead rank ends the others through the launcher
        timeout = datetime.timedelta(seconds=env_number("HYSPEC_PP_TIMEOUT", 365 * 86400))
        # but joining is bounded on its own: a rank whose others never start (a torchrun rank
        # that failed before it joined, stale RANK / WORLD_SIZE in a shell) waited that year
        join = env_number("HYSPEC_PP_JOIN_TIMEOUT", 300)
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        joined = threading.Event()

        def give_up() -> None:
            if not joined.wait(join):
                print(f"hyspec: error: pipeline rank {rank} of {n}: the other ranks did not join at {where} within "
                      f"{join:g} s (HYSPEC_PP_JOIN_TIMEOUT); a launch of {n} processes needs all of them",
                      file=sys.stderr, flush=True)
                os._exit(1)  # (this thread cannot interrupt the rendezvous the main thread waits in)

        threading.Thread(target=give_up, daemon=True, name="hyspec-pp-join").start()
        try:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        except Exception as e:  # (a store timeout, an unreachable MASTER_ADDR: one line, not torch's traceback)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"pipeline rank {rank} of {n}: joining the other ranks at {where} failed: {first}") \
                from None
        finally:
            joined.set()
    return dist.get_rank(), dev


MAX_TIMEOUT_S = 1e9  # (about 31 years) the longest timeout env_number takes


def env_number(name: str, default: float, integer: bool = False) -> float:
    """An environment variable's number (default when unset); ValueError naming the variable."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw) if integer else float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not {'an integer' if integer else 'a number'}") \
            from None
    if not integer and not (v > 0 and v != float("inf")):
        raise ValueError(f"environment variable {name}={raw!r} must be a positive number of seconds")
    if not integer and v > MAX_TIMEOUT_S:  # (torch's deadline in int64 nanoseconds, and Python's
        # threading waits, overflow near 9.2e9 s: a traceback, a hang, or a join that failed at once)
        raise ValueError(f"environment variable {name}={raw!r} must be at most {MAX_TIMEOUT_S:g} seconds")
    return v


def load_stage(path, world: int, rank: int, *, dtype="auto", device="cpu", ssm_dtype=None) -> HybridLM:
    """This rank's stage of the checkpoint at `path` (only its layers' tensors are read)."""
    from hyspec.config import ModelConfig
    from hyspec.loading import load_model, parse_dtype, resolve_model_dir

    path = resolve_model_dir(path)
    cfg = ModelConfig.from_dir(path)
    ranges = stage_ranges(cfg, world, parse_dtype(dtype, device))
    return load_model(path, dtype=dtype, device=device, layers=ranges[rank], ssm_dtype=ssm_dtype)


def _recv_hidden(link, m, rows: int, tag: int):
    """The previous stage's hidden rows [rows, H] -> (tensor, None), or (None, error text)."""
    try:
        return link.recv_x(link.rank - 1, (rows, m.cfg.hidden_size), m.dtype, m.device, tag=tag), None
    except RuntimeError as e:
        return None, str(e)
