"""Continuous batching on the BatchDecoder: sequences join after their prefill, leave on
a stop id or their token limit, and every round runs the active lanes in one captured
graph set.  The host reads one small tensor per round (accepted count, bonus, drafts per
lane) and does the bookkeeping: emit, stop, compaction of the lanes.

Greedy and sampled requests (plain k = 0, or speculative k >= 1, mixed freely in one
batch; sampling without penalties), constrained or not: a request's tokens equal those of
the same request decoded alone, bitwise, and the engine core's.

Constrained requests (a hyspec.constraints.Constraint each): a round with a constrained
lane is a *masked* round (run_masked below; docs/constraints.md, "On the CUDA-graph
path"). The drafter runs depth by depth (a graph per step); between two steps the host
reads the drafted tokens and computes the next depth's mask with llguidance while the
device runs the next drafter step, and the last depth's mask while the device runs the
verify forward; the masks are applied inside the graphs. Masked rounds are not pipelined
(the next round's first mask needs this round's tokens).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hyspec.speculative.telemetry import SpecTelemetry
from hyspec.gpu.batch import BatchDecoder, padded_size


@dataclass
class LaneRequest:
    prompt: list[int]
    max_new_tokens: int
    k: int = 0  # drafts per round; 0 = plain decoding
    stop_ids: frozenset = frozenset()
    reference: list[int] | None = None  # continuation the forced-acceptance drafter proposes from
    arrival: int = 0  # the first round at which this request may join (staggered arrivals in benches)
    on_tokens: Callable[[list[int]], None] | None = None  # streaming: the tokens each round emits
    telemetry: SpecTelemetry = field(default_factory=SpecTelemetry)  # its speculative rounds
    params: Any = None  # SamplingParams (None: greedy)
    constraint: Any = None  # hyspec.constraints.Constraint (advanced in place by the emitted tokens)
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None
    k_now: int = -1  # the k its lane drafts in the current round (k_lane on the device)
    rounds: int = 0  # target forwards (plain steps and speculative rounds)

    def emit(self, toks: list[int]) -> None:
        n0 = len(self.tokens)
        for t in toks:
            self.tokens.append(t)
            if t in self.stop_ids:
                self.reason = "eos"
                break
            if len(self.tokens) >= self.max_new_tokens:
                self.reason = "length"
                break
        if self.constraint is not None and len(self.tokens) > n0:
            self.constraint.commit(self.tokens[n0:])
        if self.on_tokens is not None and len(self.tokens) > n0:
            self.on_tokens(self.tokens[n0:])


def run_batch(dec: BatchDecoder, requests: list[LaneRequest], *, max_batch: int | None = None,
              forced_rates=None, forced_seed: int = 0, pipeline: bool = True) -> dict:
    """Decode every request to its end; returns timing stats (prefill and rounds apart).
    pipeline: queue the next round before reading the current one's result when no lane
    can finish by its token limit and nobody is due to join."""
    from hyspec.core.round import choose_token, masked
    from hyspec.gpu.generate import forced_table

    cap = min(max_batch or dec.slots, dec.slots)
    forced = forced_rates is not None
    for r in requests:
        if r.k > dec.k_max:
            raise ValueError(f"a request drafts k={r.k} > the decoder's k_max {dec.k_max}")
        if len(r.prompt) + r.max_new_tokens + r.k + 2 > dec.max_len:
            raise ValueError(f"a request needs {len(r.prompt) + r.max_new_tokens + r.k + 2} positions > "
                             f"the decoder's max_len {dec.max_len}")
        if forced and r.k > 0 and r.reference is None:
            raise ValueError("the forced-acceptance drafter needs each speculative request's reference")
        if r.constraint is not None and (not hasattr(r.constraint, "allowed_words")
                                         or getattr(r.constraint, "vocab_size", None) != dec.cfg.vocab_size):
            raise ValueError(f"a request's constraint has no packed masks (allowed_words) over this model's "
                             f"vocabulary of {dec.cfg.vocab_size} tokens")
    order = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
    active: list[LaneRequest] = []
    cuda = dec.dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # results of a launched round: copied to pinned host memory behind an event, so the
    # next round can be queued before the host reads this one (two buffers)
    if cuda:
        host = [torch.empty(dec.slots, 2 + dec.k_max, dtype=torch.long, pin_memory=True) for _ in range(2)]
        events = [torch.cuda.Event() for _ in range(2)]
        tok_host = torch.empty(dec.slots, dtype=torch.long, pin_memory=True)  # a masked round's drafts of one depth
        tok_event = torch.cuda.Event()
    # rounds launched, next host buffer, prefill seconds, round tokens, host seconds in the
    # constraints (masks + commits), masked rounds
    progress = {"round": 0, "buf": 0, "prefill_s": 0.0, "tokens": 0, "constraint_s": 0.0, "masked_rounds": 0}

    def admit() -> None:
        t0 = time.perf_counter()
        while order and len(active) < cap and requests[order[0]].arrival <= progress["round"]:
            r = requests[order.popleft()]
            if r.max_new_tokens == 0:
                r.reason = "length"
                continue
            lane = len(active)
            pre, post, logits = dec.prefill(lane, r.prompt)
            row = logits[0]
            if r.constraint is not None:  # the first token under the constraint's state now
                mask = r.constraint.allowed()
                if not bool(mask.any()):
                    r.reason = "constraint"
                    dec.free(lane)
                    continue
                row = masked(row, mask)
            if r.params is None or r.params.greedy:
                first = int(torch.argmax(row))
            else:  # the token at position P, as the engine core chooses it
                first = choose_token(row, r.prompt, r.params, len(r.prompt))
            dec.set_params(lane, r.params)
            t_c = time.perf_counter()
            r.emit([first])
            if r.constraint is not None:
                progress["constraint_s"] += time.perf_counter() - t_c
            if r.reason is not None:
                dec.free(lane)
                continue
            dec.start(lane, r.prompt, pre, post, first, r.k)
            r.k_now = r.k
            if forced and r.k > 0:
                dec.set_forced(lane, forced_table(list(r.prompt) + list(r.reference), list(forced_rates),
                                                  forced_seed, dec.capacity, dec.k_max, dec.cfg.vocab_size))
            active.append(r)
        sync()
        progress["prefill_s"] += time.perf_counter() - t0

    def launch():
        # a lane drafts at most remaining - 1 (the engine core's rule: a round never decides
        # positions past the limit, which keeps sampled output equal to the core's)
        for i, r in enumerate(active):
            k_eff = max(0, min(r.k, r.max_new_tokens - len(r.tokens) - 1))
            if k_eff != r.k_now:
                dec.k_lane[i] = k_eff
                r.k_now = k_eff
        nb = padded_size(len(active), dec.sizes)
        k = max(r.k for r in active)
        sampled = any(r.params is not None and not r.params.greedy for r in active)
        if any(r.constraint is not None for r in active):
            run_masked(nb, k, sampled)
        elif k == 0:
            dec.decode(nb, sampled)
        else:
            dec.round(nb, k, forced, sampled)
        progress["round"] += 1
        buf = progress["buf"]
        progress["buf"] ^= 1
        n = len(active)
        if cuda:
            host[buf][:n, : 2 + k].copy_(dec.result[:n, : 2 + k], non_blocking=True)
            events[buf].record()
            return buf, n, k, None
        return buf, n, k, dec.result[:n, : 2 + k].clone()  # CPU: the call was synchronous

    def run_masked(nb: int, k: int, sampled: bool) -> None:
        """One round with masks: the drafter depth by depth, the host writing mask row j
        (each constrained lane's state after its drafts d1..dj) while the device runs the
        drafter step (or, for the last row, the verify forward) that does not need it."""
        progress["masked_rounds"] += 1
        n = len(active)
        mask_np = dec.mask_host.numpy()  # [t_max, S, W] (on the CPU: the device's own buffer)
        cons = [(i, r) for i, r in enumerate(active) if r.constraint is not None]
        for i in range(nb):  # unconstrained and padding lanes: all-ones rows
            if (i >= n or active[i].constraint is None) and not dec.mask_host_ones[i]:
                mask_np[:, i] = -1
                dec.mask_host_ones[i] = True
        for i, _ in cons:
            dec.mask_host_ones[i] = False
        drafts = {i: [] for i, _ in cons}
        dead = set()  # lanes whose mask emptied this round (every later row is empty too)

        def rows(j: int) -> None:
            t0 = time.perf_counter()
            for i, r in cons:
                if j > r.k_now:  # a row past the lane's drafts: never read
                    continue
                if i in dead:
                    mask_np[j, i] = 0
                    continue
                words = r.constraint.allowed_words(drafts[i][:j])
                mask_np[j, i] = words
                if not words.any():
                    dead.add(i)
            progress["constraint_s"] += time.perf_counter() - t0
            dec.upload_mask(nb, j)

        if k == 0:
            dec.masked_decode_forward(nb)
            rows(0)  # overlaps the target forward
            dec.masked_decode_pick(nb, sampled)
            return
        dec.masked_draft_fill(nb)
        rows(0)  # overlaps the drafter's fill rows
        for i in range(k):
            dec.masked_draft_pick(nb, i, forced, sampled)
            if cuda:
                tok_host[:n].copy_(dec.verify_tokens[:n, 1 + i], non_blocking=True)
                tok_event.record()
            else:
                toks = dec.verify_tokens[:n, 1 + i].tolist()
            if i + 1 < k:
                dec.masked_draft_advance(nb, i)
            else:
                dec.verify(nb, k + 1)
            if cuda:
                tok_event.synchronize()
                toks = tok_host[:n].tolist()
            for lane, _ in cons:
                drafts[lane].append(toks[lane])
            rows(i + 1)  # overlaps the next drafter step / the verify forward
        dec.masked_commit(nb, k + 1, sampled)

    def read(launched) -> list[list[int]]:
        buf, n, k, copy = launched
        if cuda:
            events[buf].synchronize()
            return host[buf][:n, : 2 + k].tolist()
        return copy.tolist()

    def take(rows, lanes) -> None:
        for i in lanes:
            r, row = active[i], rows[i]  # row: (accepted n, bonus, d1..dk) of lane i
            n, bonus = row[0], row[1]
            r.rounds += 1
            if r.k > 0:
                r.telemetry.record_round(r.k_now, n)
            before = len(r.tokens)
            t_c = time.perf_counter()
            if bonus < 0:  # a masked round: the constraint allows nothing after the accepted drafts
                r.emit(row[2: 2 + n])
                r.reason = r.reason or "constraint"
            else:
                r.emit(row[2: 2 + n] + [bonus])
            if r.constraint is not None:
                progress["constraint_s"] += time.perf_counter() - t_c
            progress["tokens"] += len(r.tokens) - before

    def may_queue_next(k) -> bool:
        """Queue the next round before reading this one: only when no lane can reach its
        token limit in this round and nobody is due to join (a stop id may still end a
        lane: its extra round is then dropped)."""
        if not pipeline or any(r.constraint is not None for r in active):
            return False  # a masked round needs this round's tokens for its first mask
        if order and len(active) < cap and requests[order[0]].arrival <= progress["round"]:
            return False
        # (with >= 2k + 2 left before this round, every lane still drafts its full k in the next)
        return all(r.max_new_tokens - len(r.tokens) >= 2 * (k + 1) for r in active)

    t_rounds = 0.0
    inflight = None
    while order or active:
        if inflight is None:
            admit()
            if not active:
                progress["round"] += 1
                continue
        t0 = time.perf_counter()
        if inflight is None:
            inflight = launch()
        nxt = launch() if may_queue_next(inflight[2]) else None
        take(read(inflight), range(len(active)))
        inflight = None
        if nxt is not None:
            done = [r.reason is not None for r in active]
            if any(done):  # drain: the lanes still going keep the queued round's tokens
                take(read(nxt), [i for i in range(len(active)) if not done[i]])
            else:
                inflight = nxt
        if inflight is None:
            for i in reversed(range(len(active))):  # leave: the last lane moves into the hole
                if active[i].reason is not None:
                    last = len(active) - 1
                    if i != last:
                        dec.move(last, i)
                        active[i] = active[last]
                    else:
                        dec.free(i)
                    active.pop()
        t_rounds += time.perf_counter() - t0
    return {"prefill_s": progress["prefill_s"], "rounds_s": t_rounds, "rounds": progress["round"], "round_tokens": progress["tokens"],
            "round_tok_s": progress["tokens"] / t_rounds if t_rounds > 0 else None,
            "constraint_s": progress["constraint_s"], "masked_rounds": progress["masked_rounds"]}


# ---------------------------------------------------------------------------------------
# the engine's entry: hyspec.core.request.Request objects on the graph path
# ---------------------------------------------------------------------------------------
def graph_eligible(reqs) -> str | None:
    """None when every request can run on the BatchDecoder (greedy or sampled without
    penalties, constrained or not, no logprobs / session state, fixed k with the post-norm
    hidden, one forced profile); else the reason it cannot (the engine core serves it)."""
    forced = {(tuple(r.spec.forced_rates), r.spec.forced_seed) if r.spec and r.spec.forced_rates else None
              for r in reqs if r.draft > 0}
    if len(forced) > 1:
        return "requests with different forced-drafter profiles"
    for r in reqs:
        if r.params.has_penalties:
            return "a request with penalties"
        if r.logprobs is not None:
            return "logprobs"
        if r.constraint is not None and not hasattr(r.constraint, "allowed_words"):
            return "a constraint without packed masks (allowed_words)"
        if r.keep or r.resume is not None or r.store_state:
            return "session state"
        o = r.spec
        if r.draft > 0 and o is not None and (o.p_min > 0 or o.adaptive or o.hidden != "post" or not o.prime_pending):
            return "speculative options the graph round does not have (p_min, adaptive, hidden=pre, no priming)"
    return None


def run_requests(dec: BatchDecoder, reqs, max_batch: int) -> None:
    """Run hyspec.core Requests to their end on the BatchDecoder; fills tokens, stop_reason,
    stats and calls on_tokens / on_finish like the engine core's scheduler does."""
    forced = next((r.spec for r in reqs if r.draft > 0 and r.spec is not None and r.spec.forced_rates), None)
    lanes = []
    for r in reqs:
        cb = None if r.on_tokens is None else (lambda toks, r=r: r.on_tokens(r, toks))
        if r.draft > 0 and r.telemetry is None:
            r.telemetry = SpecTelemetry()
        lanes.append(LaneRequest(prompt=list(r.prompt_ids), max_new_tokens=r.max_new_tokens, k=r.draft,
                                 stop_ids=frozenset(r.stop_ids or ()), reference=r.reference, on_tokens=cb,
                                 telemetry=r.telemetry if r.draft > 0 else SpecTelemetry(), params=r.params,
                                 constraint=r.constraint))
    t0 = time.perf_counter()
    stats = run_batch(dec, lanes, max_batch=max_batch, forced_rates=forced.forced_rates if forced else None,
                      forced_seed=forced.forced_seed if forced else 0)
    wall = time.perf_counter() - t0
    for r, lr in zip(reqs, lanes):
        r.tokens[:] = lr.tokens
        r.stop_reason = lr.reason or "length"
        r.done = True
        r.stats = {"prompt_tokens": len(r.prompt_ids), "generated_tokens": len(lr.tokens), "path": "batch-graphs",
                   "graphs": dec.step_graphs.active, "exact": dec.exact, "cached_tokens": 0,
                   "batch_wall_s": wall, "batch_round_tok_s": stats["round_tok_s"]}
        if r.draft > 0:
            r.stats.update({"k": r.draft, "target_forwards": lr.rounds, "spec": r.telemetry.to_dict()})
        if r.on_finish is not None:
            r.on_finish(r)
