"""Continuous batching on the BatchDecoder: sequences join after their prefill, leave on
a stop id or their token limit, and every round runs the active lanes in one captured
graph set.  The host reads one small tensor per round (accepted count, bonus, drafts per
lane) and does the bookkeeping: emit, stop, compaction of the lanes.

Greedy requests only (plain k = 0, or speculative k >= 1, mixed freely in one batch):
a request's tokens equal those of the same request decoded alone, bitwise.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from hyspec.gpu.batch import BatchDecoder, padded_size


@dataclass
class LaneRequest:
    prompt: list[int]
    max_new_tokens: int
    k: int = 0  # drafts per round; 0 = plain decoding
    stop_ids: frozenset = frozenset()
    reference: list[int] | None = None  # continuation the forced-acceptance drafter proposes from
    arrival: int = 0  # the first round at which this request may join (staggered arrivals in benches)
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    def emit(self, toks: list[int]) -> None:
        for t in toks:
            self.tokens.append(t)
            if t in self.stop_ids:
                self.reason = "eos"
                return
            if len(self.tokens) >= self.max_new_tokens:
                self.reason = "length"
                return


def run_batch(dec: BatchDecoder, requests: list[LaneRequest], *, max_batch: int | None = None,
              forced_rates=None, forced_seed: int = 0) -> dict:
    """Decode every request to its end; returns timing stats (prefill and rounds apart)."""
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
    order = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
    active: list[LaneRequest] = []
    round_no = 0
    t_prefill = t_rounds = 0.0
    emitted_in_rounds = 0
    sync = torch.cuda.synchronize if dec.dev.type == "cuda" else (lambda: None)
    while order or active:
        # admit (between rounds): prefill into the next free lane
        t0 = time.perf_counter()
        while order and len(active) < cap and requests[order[0]].arrival <= round_no:
            r = requests[order.popleft()]
            if r.max_new_tokens == 0:
                r.reason = "length"
                continue
            lane = len(active)
            pre, post, logits = dec.prefill(lane, r.prompt)
            first = int(torch.argmax(logits[0]))
            r.emit([first])
            if r.reason is not None:
                dec.free(lane)
                continue
            dec.start(lane, r.prompt, pre, post, first, r.k)
            if forced and r.k > 0:
                dec.set_forced(lane, forced_table(list(r.prompt) + list(r.reference), list(forced_rates),
                                                  forced_seed, dec.capacity, dec.k_max, dec.cfg.vocab_size))
            active.append(r)
        sync()
        t_prefill += time.perf_counter() - t0
        if not active:
            round_no += 1
            continue
        t0 = time.perf_counter()
        nb = padded_size(len(active), dec.sizes)
        k = max(r.k for r in active)
        if k == 0:
            dec.decode(nb)
        else:
            dec.round(nb, k, forced)
        res = dec.result[: len(active), : 2 + k].tolist()  # the one sync of the round
        for r, row in zip(active, res):
            n, bonus = row[0], row[1]
            r.rounds += 1
            r.drafted += r.k
            r.accepted += n
            before = len(r.tokens)
            r.emit(row[2: 2 + n] + [bonus])
            emitted_in_rounds += len(r.tokens) - before
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
        round_no += 1
    return {"prefill_s": t_prefill, "rounds_s": t_rounds, "rounds": round_no, "round_tokens": emitted_in_rounds,
            "round_tok_s": emitted_in_rounds / t_rounds if t_rounds > 0 else None}
