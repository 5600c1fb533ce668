"""The drafter's side of the vocabulary: its logits over the full target vocabulary (with
an optional reduced draft vocabulary, `mtp.d2t`), shared by the round driver's backends,
the GPU decoder and `hyspec replay`.

Draft-KV layout (the MTP head's own cache): row i holds the pair (token at target
position i+1, target hidden at position i); it is also that row's RoPE position. Rows past
the committed length are scratch: a round's first MTP call rewrites them starting from
the first row whose pairing is not yet final.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from hyspec.model.ops import StepCtx, linear, upcast

FORCED_STREAM = 11  # rng stream for the forced-acceptance drafter's corruption draws


def draft_vocab(model):
    """A reduced draft vocabulary from the checkpoint (`mtp.d2t`: EAGLE-style offsets,
    target id = i + d2t[i]), as (target ids [Vd], head rows [Vd, H]); None when absent."""
    d2t = getattr(model, "d2t", None)
    if d2t is None or not model.has_mtp:
        return None
    ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t.to(torch.long)
    if not bool(d2t.any()):  # the first Vd ids: the head's rows are a view (no second copy)
        return ids, model.head_weight[: d2t.shape[0]]
    return ids, model.head_weight[ids].contiguous()


def build_d2t(size: int, vocab_size: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    """A reduced draft vocabulary of `size` ids as EAGLE offsets (target id = i + d2t[i]):
    the `size` most frequent ids of `counts` ([vocab_size] token counts of a corpus), in
    ascending id order; without counts the first `size` ids (random weights: no corpus)."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    if counts is None:
        ids = torch.arange(size)
    else:
        if counts.shape != (vocab_size,):
            raise ValueError(f"token counts must have shape [{vocab_size}], got {list(counts.shape)}")
        ids = torch.sort(torch.topk(counts.double(), size, sorted=True).indices).values
    return ids - torch.arange(size)


@contextmanager
def first_ids_draft_vocab(model, size: int):
    """Inside: model drafts over its first `size` ids (build_d2t without counts: random
    weights have no corpus to rank by); the model's own d2t is put back after. Decoders
    built inside read it at construction (draft_vocab)."""
    saved = model.d2t
    model.d2t = build_d2t(size, model.cfg.vocab_size).to(model.device)
    try:
        yield
    finally:
        model.d2t = saved


def draft_logits(model, h: torch.Tensor, vocab=None, ctx: StepCtx | None = None) -> torch.Tensor:
    """MTP hidden h [T, H] -> logits [T, V] over the full target vocabulary; with a reduced
    draft vocabulary (from draft_vocab) only its ids are scored, the rest get -inf."""
    if vocab is None:
        return model.logits(h, ctx)
    target_ids, head_rows = vocab  # [Vd], [Vd, H]
    scored = upcast(linear(h.to(head_rows.dtype), head_rows, ctx))  # [T, Vd]
    full = scored.new_full((h.shape[0], model.cfg.vocab_size), float("-inf"))  # [T, V]
    full[:, target_ids] = scored
    return full
