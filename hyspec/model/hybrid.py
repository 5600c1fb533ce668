"""The target model (embedding, hybrid decoder stack, final norm, LM head) and its MTP head.

Parameter names mirror the Hugging Face checkpoints, so loading is a name check plus a copy:
    model.embed_tokens.weight, model.layers.{i}.{linear_attn|self_attn}.*, model.layers.{i}.mlp.*,
    model.norm.weight, lm_head.weight, mtp.fc.weight, mtp.pre_fc_norm_embedding.weight,
    mtp.pre_fc_norm_hidden.weight, mtp.layers.0.*, mtp.norm.weight
"""

from __future__ import annotations

import torch
from torch import nn

from hyspec.cache import HybridCache
from hyspec.config import FULL, ModelConfig, no_mtp_error
from hyspec.model.attention import GatedAttention, KVBuffer
from hyspec.model.ffn import MLP, MoE
from hyspec.model.gdn import GatedDeltaNet, LinearState
from hyspec.model.ops import Linear, RMSNorm, StepCtx, exact_rows


def check_batch(ctxs: list[StepCtx], caches: list, sizes: list[int]) -> None:
    """The checks before a batched forward (positions, room in the cache, one mode)."""
    if len({c.exact for c in ctxs}) > 1:
        raise ValueError("a batched forward runs all sequences in the same (exact or not) mode")
    for ctx, cache, n in zip(ctxs, caches, sizes):
        if cache is not None and ctx.start != cache.pos:
            raise ValueError(f"forward at position {ctx.start} but the cache holds {cache.pos} tokens")
        if cache is not None and ctx.start + n > cache.max_len:
            raise ValueError(f"context full: {ctx.start + n} tokens exceed the cache's max length "
                             f"{cache.max_len}")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, moe: bool) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == FULL:
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: StepCtx, state: KVBuffer | LinearState | None) -> torch.Tensor:
        """One sequence: x [T, H] -> [T, H]."""
        return self.forward_batch(x, [ctx], [state], [x.shape[0]])

    def forward_batch(self, x: torch.Tensor, ctxs: list[StepCtx], states: list, sizes: list[int]) -> torch.Tensor:
        """Several sequences' rows stacked: x [N, H] = sequence 0's sizes[0] rows, then
        sequence 1's, ... The token mixer (attention or Gated DeltaNet) runs per sequence on
        its own state and positions; the norms and the FFN run on all N rows at once. In
        exact mode every op is row-invariant, so a row's result does not depend on the
        other sequences in the batch."""
        h = self.input_layernorm(x)
        mixer = self.self_attn if self.layer_type == FULL else self.linear_attn
        x = x + mixer.forward_batch(h, ctxs, states, sizes)
        return x + self.mlp(self.post_attention_layernorm(x), ctxs[0])


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, cfg.layer_types[i], cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPHead(nn.Module):
    """One extra full-attention decoder block that predicts the token after next.

    step: x = fc(cat(norm_e(embed(tok)), norm_h(h_prev))) -> block -> norm -> (shared LM head)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.fc = Linear(2 * H, H)
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, FULL, cfg.has_moe)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, emb: torch.Tensor, h_prev: torch.Tensor, ctxs: list[StepCtx], kvs: list, sizes: list[int]):
        """emb [N, H] embeddings of tokens at positions p..p+T-1 (per sequence), h_prev [N, H]
        target (or chained MTP) hiddens of positions p-1..p+T-2 -> post-norm hidden [N, H].
        Rows of several sequences are stacked as in DecoderLayer.forward_batch."""
        x = torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(h_prev)], dim=-1)
        x = self.layers[0].forward_batch(self.fc(x, ctxs[0]), ctxs, kvs, sizes)
        return self.norm(x)


class HybridLM(nn.Module):
    """Target model + optional MTP head. Single sequence (no batch dim): tokens [T]."""

    def __init__(self, cfg: ModelConfig, with_mtp: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = MTPHead(cfg) if with_mtp else None
        # optional reduced draft vocabulary (EAGLE-style offsets: target id = i + d2t[i]), set by the loader
        self.d2t: torch.Tensor | None = None

    # -- weights ---------------------------------------------------------------------
    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # a pipeline stage (hyspec/parallel) holds only layers[stage_layers] (the others are
    # placeholders without weights); None = the whole model
    stage_layers: range | None = None
    cache_factory = None  # set by a pipeline driver: max_len -> its stage cache

    def new_cache(self, max_len: int) -> HybridCache:
        if self.cache_factory is not None:
            return self.cache_factory(max_len)
        return HybridCache(self.cfg, max_len, self.device, self.dtype, self.stage_layers)

    # -- target ------------------------------------------------------------------------
    def forward_states(self, ids: torch.Tensor, cache: HybridCache | None, ctx: StepCtx):
        """ids [T] at positions ctx.start.. -> (pre-norm residual [T, H], post-final-norm hidden [T, H]).
        With a cache, ctx.start must equal cache.pos; the cache advances by T."""
        return self.forward_batch(ids, [ctx], [cache], [ids.shape[0]])

    def forward_batch(self, ids: torch.Tensor | None, ctxs: list[StepCtx], caches: list, sizes: list[int],
                      *, layers: range | None = None, x: torch.Tensor | None = None):
        """Several sequences in one forward: ids [N] = sizes[0] tokens of sequence 0 (at
        positions ctxs[0].start..), then sequence 1's, ...; each sequence has its own cache
        (or None). Returns (pre-norm residual [N, H], post-final-norm hidden [N, H]); every
        cache advances by its sequence's rows. The one layer loop of the model.

        A pipeline stage runs a layer range: `layers` (default all), starting from the
        embedding of ids, or from the previous stage's residual `x` [N, H]; the final norm
        runs only when the range ends at the last layer (else post is None)."""
        check_batch(ctxs, caches, sizes)
        rng = range(self.cfg.num_hidden_layers) if layers is None else layers
        with exact_rows(ctxs[0].exact):
            if x is None:
                x = self.model.embed_tokens(ids)
            for i in rng:
                x = self.model.layers[i].forward_batch(x, ctxs, [None if c is None else c.layer_state(i)
                                                                 for c in caches], sizes)
            post = self.model.norm(x) if rng.stop == self.cfg.num_hidden_layers else None
        for cache, n in zip(caches, sizes):
            if cache is not None:
                cache.pos += n
        return x, post

    def forward_hidden(self, ids: torch.Tensor, cache: HybridCache | None, ctx: StepCtx) -> torch.Tensor:
        """ids [T] -> post-final-norm hidden [T, H] (see forward_states)."""
        return self.forward_states(ids, cache, ctx)[1]

    def logits(self, h: torch.Tensor, ctx: StepCtx | None = None) -> torch.Tensor:
        """h [T, H] -> logits [T, V] in fp32 (fp64 for fp64 models)."""
        from hyspec.model.ops import linear, upcast

        return upcast(linear(h, self.head_weight, ctx))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole-sequence logits [T, V] without a cache (scoring, tests, training)."""
        h = self.forward_hidden(ids, None, StepCtx(chunked=True))
        return self.logits(h)

    # -- drafter -----------------------------------------------------------------------
    def mtp_hidden(self, tokens: torch.Tensor, h_prev: torch.Tensor, ctx: StepCtx, kv: KVBuffer | None) -> torch.Tensor:
        """MTP rows for tokens [T] (at positions p..) paired with h_prev [T, H] -> [T, H].
        The draft KV row index is p - 1 (= the paired hidden's position), passed as ctx.start."""
        return self.mtp_batch(tokens, h_prev, [ctx], [kv], [tokens.shape[0]])

    def mtp_batch(self, tokens: torch.Tensor, h_prev: torch.Tensor, ctxs: list[StepCtx], kvs: list,
                  sizes: list[int]) -> torch.Tensor:
        """mtp_hidden for several sequences' rows stacked (each with its own draft KV)."""
        if self.mtp is None:
            raise no_mtp_error(": it cannot draft")
        with exact_rows(ctxs[0].exact):
            return self.mtp(self.model.embed_tokens(tokens), h_prev, ctxs, kvs, sizes)

    def new_draft_kv(self, max_len: int) -> KVBuffer:
        c = self.cfg
        return KVBuffer(c.num_key_value_heads, max_len, c.head_dim, self.device, self.dtype)
