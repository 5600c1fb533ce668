"""The compute behind a round: the few calls the round driver makes over a batch.

ReferenceBackend runs the model's own modules (hyspec/model): the readable definition,
on the CPU or eagerly on any device. Every batched call runs in exact mode (row-invariant
matmuls, one query row at a time in attention, the row-by-row Gated-DeltaNet scan, norms
in fixed row blocks on CUDA: hyspec.model.ops.row_reduce), so a sequence's numbers never
depend on which other sequences share the forward. Prefill
runs one sequence at a time in the chunked form.
"""

from __future__ import annotations

import torch

from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx
from hyspec.speculative.drafter import draft_logits, draft_vocab

PREFILL_CHUNK = 512  # prompt rows per prefill forward (fixed, so prefill is a function of the prompt alone)


class ReferenceBackend:
    name = "reference"

    def __init__(self, model: HybridLM) -> None:
        self.model = model
        self.device = model.device
        self.draft_vocab = draft_vocab(model)  # None, or a reduced draft vocabulary (mtp.d2t)

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, device=self.device, dtype=torch.long)

    # -- one sequence alone --------------------------------------------------------------
    def prefill(self, cache, tokens: list[int]):
        """Run prompt tokens (appended at cache.pos) in the chunked form: (pre [T, H], post [T, H])."""
        start = cache.pos
        return self.model.forward_states(self._ids(tokens), cache, StepCtx(start=start, chunked=True))

    def prefill_draft(self, draft_kv, tokens: list[int], hidden: torch.Tensor, start: int) -> None:
        """Fill draft KV rows start.. with (tokens[r], hidden[r]) pairs (the prompt's rows)."""
        for s in range(0, len(tokens), PREFILL_CHUNK):
            part = tokens[s: s + PREFILL_CHUNK]
            self.model.mtp_hidden(self._ids(part), hidden[s: s + len(part)], StepCtx(start=start + s), draft_kv)

    def logits(self, h: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return self.model.logits(h, StepCtx(exact=True) if exact else None)

    # -- a batch of sequences (exact) -----------------------------------------------------
    def mtp(self, items: list[tuple]) -> list[torch.Tensor]:
        """items: (draft_kv, tokens [n], hidden [n, H], start row) per sequence -> MTP hidden [n, H] each."""
        sizes = [len(t) for _, t, _, _ in items]
        toks = self._ids([x for _, t, _, _ in items for x in t])
        h = torch.cat([hid for _, _, hid, _ in items])
        ctxs = [StepCtx(start=s, exact=True) for _, _, _, s in items]
        out = self.model.mtp_batch(toks, h, ctxs, [kv for kv, _, _, _ in items], sizes)
        return list(out.split(sizes))

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """MTP hidden [B, H] -> logits [B, V] over the full target vocabulary (a reduced draft
        vocabulary scores only its ids; the rest get -inf)."""
        return draft_logits(self.model, h, self.draft_vocab, StepCtx(exact=True))

    def verify(self, items: list[tuple]) -> list[tuple]:
        """items: (cache, tokens [t], record) per sequence, appended at each cache's pos ->
        (pre [t, H], post [t, H], logits [t, V]) per sequence."""
        sizes = [len(t) for _, t, _ in items]
        toks = self._ids([x for _, t, _ in items for x in t])
        ctxs = [StepCtx(start=c.pos, exact=True, record=r) for c, _, r in items]
        pre, post = self.model.forward_batch(toks, ctxs, [c for c, _, _ in items], sizes)
        logits = self.model.logits(post, ctxs[0])
        return list(zip(pre.split(sizes), post.split(sizes), logits.split(sizes)))
