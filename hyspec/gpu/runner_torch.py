"""The reference runner: the FastDecoder's compute done by the model's own torch modules.

It computes exactly what ``HybridLM.forward_states`` / ``mtp_hidden`` / ``logits`` compute
(same calls, same shapes), but on the decoder's preallocated state, so on CPU a
FastDecoder with this runner is bitwise equal to ``generate_plain`` /
``generate_speculative``.  Positions are read from the device scalars with ``.item()``:
fine on CPU, not CUDA-graph capturable (the Triton runner is the graph path).
"""
from __future__ import annotations

import torch

from hyspec.config import FULL
from hyspec.model.gdn import recurrent_scan
from hyspec.model.ops import StepCtx


class TorchRunner:
    records_states = True  # a verify saves the state after every row into dec.ssm_rows

    def __init__(self, dec) -> None:
        self.dec = dec
        self.model = dec.model

    # -- target ---------------------------------------------------------------------
    def target(self, ids: torch.Tensor, t: int, pos: torch.Tensor, record: bool):
        """ids [t] at positions pos.. -> (pre-norm [t, H], post-norm [t, H]). KV rows are
        written; linear layers either advance in place (decode) or record the per-row
        states / conv inputs into the decoder's slabs (verify; state untouched)."""
        dec, model = self.dec, self.model
        ctx = StepCtx(start=int(pos.item()), exact=True)
        x = model.model.embed_tokens(ids[:t])
        for i, layer in enumerate(model.model.layers):
            h = layer.input_layernorm(x)
            if layer.layer_type == FULL:
                h = layer.self_attn(h, ctx, dec.kvbuf(i))
            else:
                h = self._gdn(layer.linear_attn, h, ctx, dec.gdn_index[i], record)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x), ctx)
        return x, model.model.norm(x)

    def _gdn(self, mod, x, ctx, g, record):
        """GatedDeltaNet.forward with the decoder's state (same calls, same order)."""
        dec = self.dec
        T = x.shape[0]
        qkv, z, b, a = mod.project(x, ctx)
        xcat = torch.cat([dec.conv[g].to(qkv.dtype), qkv])
        y = mod.conv(xcat)
        q, k, v, gg, beta = mod.prepare(y, b, a)
        o, s_final, states = recurrent_scan(q, k, v, gg, beta, dec.ssm[g], want_states=record)
        if record:
            dec.ssm_rows[g, :T] = states
            dec.conv_in[g, :T] = qkv
        else:
            dec.conv[g].copy_(xcat[T:])
            dec.ssm[g].copy_(s_final)
        o = mod.norm(o.to(x.dtype), z)
        return mod.out_proj(o.reshape(T, -1), ctx)

    def commit_linear(self, n: torch.Tensor) -> None:
        """Linear layers' state after the accepted rows: the recorded state of row n."""
        self.dec.commit_recorded_states(n)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.logits(h, StepCtx(exact=True))

    # -- drafter --------------------------------------------------------------------
    def mtp(self, tokens: torch.Tensor, h_prev: torch.Tensor, start: torch.Tensor, off: int) -> torch.Tensor:
        ctx = StepCtx(start=int(start.item()) + off)
        return self.model.mtp_hidden(tokens, h_prev, ctx, self.dec.draft_kvbuf())

    def draft_argmax(self, h: torch.Tensor) -> torch.Tensor:
        return self.draft_logits(h).argmax(-1)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.dec.draft_logits_ref(h)
