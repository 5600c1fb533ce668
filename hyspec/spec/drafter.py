"""Drafters: the MTP head (its own draft KV cache) and a forced-acceptance variant for tests
and benchmarks that runs the same MTP forwards but proposes tokens from a reference run.

Draft-KV layout: row i holds the pair (token at target position i+1, hidden at position i);
it is also that row's RoPE position. Rows past the committed length are scratch: a round's
first MTP call rewrites them starting from the first row whose pairing is not yet final.
"""

from __future__ import annotations

from typing import Callable

import torch

from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx
from hyspec.rng import u01

# choose(logits [V] over the full vocabulary, depth j, absolute position) -> (token, q row or None, prob)
Chooser = Callable[[torch.Tensor, int, int], tuple[int, "torch.Tensor | None", float]]

FORCED_STREAM = 11  # rng stream for the forced drafter's corruption draws


class MTPDrafter:
    """Chains the checkpoint's MTP head K times per round."""

    def __init__(self, model: HybridLM, max_len: int, *, hidden: str = "post") -> None:
        if not model.has_mtp:
            raise ValueError("this checkpoint has no MTP head (no mtp.* weights), so it cannot speculate; "
                             "use --draft 0 for plain decoding")
        if hidden not in ("post", "pre"):
            raise ValueError(f"hidden convention must be 'post' or 'pre', got {hidden!r}")
        self.model = model
        self.hidden = hidden
        self.kv = model.new_draft_kv(max_len)
        self.d2t = _draft_vocab(model)
        self.forwards = 0  # MTP forward calls (telemetry / cost accounting)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """MTP hidden [T, H] -> logits [T, V] over the full target vocabulary (a reduced
        draft vocabulary scores only its ids; the rest get -inf)."""
        if self.d2t is None:
            return self.model.logits(h)
        ids, w = self.d2t
        sub = h.to(w.dtype) @ w.T
        sub = sub if sub.dtype == torch.float64 else sub.float()
        full = sub.new_full((h.shape[0], self.model.cfg.vocab_size), float("-inf"))
        full[:, ids] = sub
        return full

    def propose(self, tokens: list[int], hidden: torch.Tensor, start: int, k: int, first_pos: int,
                choose: Chooser, p_min: float = 0.0):
        """Refill draft rows start.. with (tokens[r], hidden[r]), then chain up to k drafts.

        tokens [n] / hidden [n, H]: the pairs for rows start..start+n-1; the last pair's
        output predicts the token at absolute position first_pos (the first draft).
        Returns (drafts, q_rows [k', V] or None, probs)."""
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        probs: list[float] = []
        if k <= 0:
            return drafts, None, probs
        model = self.model
        ids = torch.tensor(tokens, device=model.device)
        h = model.mtp_hidden(ids, hidden, StepCtx(start=start), self.kv)  # [n, H]
        self.forwards += 1
        row = start + len(tokens)  # next draft row
        h_last = h[-1:]
        for j in range(k):
            logits = self.draft_logits(h_last)[0]
            tok, q, p = choose(logits, j, first_pos + j)
            if p_min > 0.0 and p < p_min:
                break
            if p_min > 0.0 and q is not None:
                # a kept draft is distributed as q restricted to {q >= p_min}: acceptance
                # must test against that distribution, or sampling stops being lossless
                q = q * (q >= p_min)
                q = q / q.sum()
            drafts.append(tok)
            probs.append(p)
            if q is not None:
                qs.append(q)
            if j + 1 < k:
                h_last = model.mtp_hidden(torch.tensor([tok], device=model.device), h_last, StepCtx(start=row),
                                          self.kv)
                self.forwards += 1
                row += 1
        return drafts, (torch.stack(qs) if qs else None), probs


class ForcedDrafter(MTPDrafter):
    """Runs the real MTP forwards (same cost) but proposes the reference run's token at
    each position, corrupted with probability 1 - rate[depth]; so the acceptance rate at
    depth j, given the drafts before it were accepted, is rate[j] (greedy decoding)."""

    def __init__(self, model: HybridLM, max_len: int, reference: list[int], rates: list[float], *,
                 seed: int = 0, hidden: str = "post") -> None:
        super().__init__(model, max_len, hidden=hidden)
        if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"forced acceptance rates must be in [0, 1], got {rates}")
        self.reference = reference  # absolute position -> token (prompt + plain continuation)
        self.rates = rates
        self.seed = seed

    def forced_token(self, depth: int, position: int) -> int:
        if position >= len(self.reference):
            return 0
        ref = self.reference[position]
        rate = self.rates[min(depth, len(self.rates) - 1)]
        if u01(self.seed, FORCED_STREAM, position * 64 + depth) < rate:
            return ref
        return (ref + 1) % self.model.cfg.vocab_size

    def propose(self, tokens, hidden, start, k, first_pos, choose, p_min=0.0):
        def forced(logits, j, pos):
            _, q, _ = choose(logits, j, pos)  # keep the cost of the real choice
            tok = self.forced_token(j, pos)
            if hasattr(choose, "drafts"):  # the chooser tracks drafts for penalty history
                choose.drafts[j:] = [tok]
            if q is not None:  # sampled: the proposal is deterministic, i.e. q is one-hot at tok
                q = torch.zeros_like(q)
                q[tok] = 1.0
            return tok, q, 1.0
        return super().propose(tokens, hidden, start, k, first_pos, forced, 0.0)


def _draft_vocab(model: HybridLM):
    """A reduced draft vocabulary from the checkpoint (`mtp.d2t`: EAGLE-style offsets,
    target id = i + d2t[i]), as (target ids [Vd], head rows [Vd, H]); None when absent."""
    d2t = getattr(model, "d2t", None)
    if d2t is None:
        return None
    ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t.to(torch.long)
    return ids, model.head_weight[ids]
