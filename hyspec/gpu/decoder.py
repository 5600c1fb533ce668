"""FastDecoder: a static-shape decoder for one sequence, built for CUDA graphs.

All state lives in preallocated buffers, and every position a step needs is a device
scalar, so the decode step, the draft chain and the verify/commit of a round can each be
captured once and replayed:

    target state   kv_k/kv_v [Hkv, L, D] per attention layer; conv [G, W-1, C] and
                   ssm [G, Hv, Dk, Dv] (fp32) for the G Gated-DeltaNet layers
    verify slabs   conv_in [G, t_max, C] (the verify's conv inputs): a commit of j rows takes
                   the window rows j..j+W-2 of cat(conv, conv_in); the SSM state advances by
                   the runner's commit_linear: the Triton runner replays the j accepted rows
                   from its saved projections (one kernel, the decode arithmetic), the torch
                   runner copies ssm_rows [G, t_max, Hv, Dk, Dv][:, j-1] (state after each row)
    draft KV       draft_k/draft_v [Hkv, L, D]: row i pairs (token at i+1, hidden at i)
    scalars        pos (tokens in the cache), pending, fill_start / fill_rows (drafter rows
                   the next round refills), out_count (plain decoding: tokens in out_buf)
    round scratch  verify_tokens [t_max] (pending, d1..dk); argmax [t_max] the target's
                   choice per verify row; seed_hidden [t_max, H] their hiddens (the
                   drafter's next seeds); result [2 + k_max] = (accepted n, bonus, d1..dk)

One speculative round with k drafts (t = k + 1) is three graphs, no host sync inside:
    draft[k]    MTP over the fill rows [(committed tokens, true target hiddens), (pending,
                hidden)] -> argmax -> chain k-1 more single-row MTP steps
    verify[t]   target over [pending, d1..dk] recording per-row states -> logits -> argmax
    commit[t]   n = leading matches (cumprod), bonus = argmax[n], j = n + 1; roll the
                linear layers to row j-1; set up the next fill; pos += j; -> `result`
and the host reads `result` (n, bonus, drafts) once per round.  The graphs themselves
(capture on first use, eager fallback) live in hyspec.gpu.graphs; the eager prefill in
hyspec.gpu.prefill.

The compute comes from a runner: ``TritonRunner`` (fused row-invariant kernels, graph
capturable) or ``TorchRunner`` (the model's own modules; on CPU it makes the decoder
bitwise equal to hyspec.decode / hyspec.speculative.loop).  Prefill is eager and uses the model's
modules, with flash-linear-attention's chunked kernel for Gated DeltaNet on CUDA when it
imports (else the torch chunked form).
"""
from __future__ import annotations

import torch

from hyspec.config import no_mtp_error
from hyspec.gpu.graphs import GraphFallbackWarning, StepGraphs
from hyspec.gpu.prefill import layer_indices, prefill_into
from hyspec.model.attention import KVBuffer
from hyspec.model.gdn import state_dtype
from hyspec.model.ops import StepCtx
from hyspec.speculative.drafter import draft_logits, draft_vocab

__all__ = ["FastDecoder", "GraphFallbackWarning", "prefill_into"]


class FastDecoder:
    def __init__(self, model, max_len: int, k_max: int = 4, *, exact: bool = True, backend: str = "auto",
                 graphs: bool | None = None, use_fla: bool | None = None) -> None:
        if max_len <= 0 or k_max < 0:
            raise ValueError(f"FastDecoder: need max_len > 0 and k_max >= 0, got {max_len}, {k_max}")
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.dev, self.dtype = model.device, model.dtype
        self.exact = exact
        self.k_max = k_max
        self.t_max = k_max + 1  # verify rows of a round: pending + k drafts
        self.rows_cap = max(k_max + 2, 2)  # drafter fill rows (static mode) and runner buffer rows
        self.max_len = max_len
        self.capacity = max_len + 2 * (k_max + 2) + 8  # verify / fill rows may run past the end
        cuda = self.dev.type == "cuda"
        if backend == "auto":
            from hyspec.kernels.common import triton_available

            backend = "triton" if cuda and triton_available() else "torch"
        if backend not in ("triton", "torch"):
            raise ValueError(f"FastDecoder: backend must be 'auto', 'triton' or 'torch', got {backend!r}")
        self.backend = backend
        self.graphs = (cuda and backend == "triton") if graphs is None else graphs
        if self.graphs and (not cuda or backend != "triton"):
            raise ValueError("FastDecoder: CUDA graphs need a CUDA model and the triton backend")
        self.static = self.graphs  # fixed row counts everywhere (required by graphs)
        self.use_fla = cuda if use_fla is None else use_fla

        dev, dt = self.dev, self.dtype
        L = self.capacity
        self.gdn_index, self.attn_index = layer_indices(cfg)
        G, A = len(self.gdn_index), len(self.attn_index)
        Hkv, D = cfg.num_key_value_heads, cfg.head_dim
        self.kv_k = [torch.zeros(Hkv, L, D, device=dev, dtype=dt) for _ in range(A)]  # A x [Hkv, L, D]
        self.kv_v = [torch.zeros(Hkv, L, D, device=dev, dtype=dt) for _ in range(A)]  # A x [Hkv, L, D]
        W, C = cfg.linear_conv_kernel_dim, cfg.conv_dim
        sd = state_dtype(dt)
        nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv = torch.zeros(G, W - 1, C, device=dev, dtype=dt)  # [G, W-1, C] conv windows
        self.ssm = torch.zeros(G, nv, dk, dv, device=dev, dtype=sd)  # [G, Hv, Dk, Dv] fp32 states
        self.ssm_rows = None  # [G, t_max, Hv, Dk, Dv] state after each verify row (runners that record them)
        self.conv_in = torch.zeros(G, self.t_max, C, device=dev, dtype=dt)  # [G, t_max, C] verify conv inputs
        self.window_offsets = torch.arange(W - 1, device=dev)  # [W-1] 0..W-2: a conv window's rows
        self.has_mtp = model.has_mtp
        if self.has_mtp:
            self.draft_k = torch.zeros(Hkv, L, D, device=dev, dtype=dt)  # [Hkv, L, D] drafter KV
            self.draft_v = torch.zeros(Hkv, L, D, device=dev, dtype=dt)  # [Hkv, L, D]
        self.d2t = draft_vocab(model)  # (ids [V'], head [V', H]) of a reduced draft vocabulary, or None

        long = dict(device=dev, dtype=torch.long)
        H = cfg.hidden_size
        self.pos = torch.zeros(1, **long)  # [1] tokens in the cache
        self.out_count = torch.zeros(1, **long)  # [1] plain decoding: tokens written to out_buf
        self.pending = torch.zeros(1, **long)  # [1] the next token to verify (not yet in the cache)
        self.fill_start = torch.zeros(1, **long)  # [1] draft-KV row of the first fill row
        self.fill_rows = torch.ones(1, **long)  # [1] fill rows the next draft runs (valid rows)
        self.fill_tokens = torch.zeros(self.rows_cap, **long)  # [rows_cap] the fill rows' tokens
        self.fill_h = torch.zeros(self.rows_cap, H, device=dev, dtype=dt)  # [rows_cap, H] their hiddens
        self.h_last = torch.zeros(1, H, device=dev, dtype=dt)  # [1, H] hidden of the last committed row
        self.verify_tokens = torch.zeros(self.t_max, **long)  # [t_max] pending, d1..dk
        self.argmax = torch.zeros(self.t_max, **long)  # [t_max] the target's choice per verify row
        self.seed_hidden = torch.zeros(self.t_max, H, device=dev, dtype=dt)  # [t_max, H] verify rows' hiddens
        self.result = torch.zeros(2 + k_max, **long)  # [2 + k_max] accepted n, bonus, d1..dk
        self.out_buf = torch.zeros(L, **long)  # [L] plain decoding's tokens
        self.forced_tokens = torch.zeros(L * max(k_max, 1), **long)  # [L * k_max] forced drafter: (pos, depth)
        self.hidden = "post"  # which target hidden seeds the drafter: "post" (final norm) or "pre"

        if backend == "triton":
            from hyspec.gpu.runner_triton import TritonRunner

            self.runner = TritonRunner(self, exact=exact)
        else:
            from hyspec.gpu.runner_torch import TorchRunner

            self.runner = TorchRunner(self)
        if self.runner.records_states:
            self.ssm_rows = torch.zeros(G, self.t_max, nv, dk, dv, device=dev, dtype=sd)
        self.step_graphs = StepGraphs(self.graphs, dev, self._mutable)

    # -- views of the state for the model's own modules ------------------------------
    def kvbuf(self, i: int) -> KVBuffer:
        buf = KVBuffer.__new__(KVBuffer)
        a = self.attn_index[i]
        buf.k, buf.v = self.kv_k[a], self.kv_v[a]
        return buf

    def draft_kvbuf(self) -> KVBuffer:
        buf = KVBuffer.__new__(KVBuffer)
        buf.k, buf.v = self.draft_k, self.draft_v
        return buf

    def draft_logits_ref(self, h: torch.Tensor) -> torch.Tensor:
        """The drafter's logits through the model's modules (hyspec.speculative.drafter.draft_logits)."""
        return draft_logits(self.model, h, self.d2t)

    # -- prefill ----------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompt: list[int]):
        """Reset the state and run the prompt (eager). Returns (pre [P, H], post [P, H],
        logits [1, V] of the last row)."""
        P = len(prompt)
        if P + 1 > self.max_len:
            raise ValueError(f"prompt of {P} tokens does not fit the decoder's max_len {self.max_len}")
        self.conv.zero_()
        self.ssm.zero_()
        self.pos.zero_()
        kv = {i: self.kvbuf(i) for i in self.attn_index}
        out = prefill_into(self, prompt, kv, lambda g: self.conv[g], lambda g: self.ssm[g])
        self.pos.fill_(P)
        return out

    @property
    def fla_used(self) -> bool:
        return self.use_fla

    # -- plain decoding -----------------------------------------------------------------
    def start_plain(self, first: int) -> None:
        self.out_buf[0] = first
        self.out_count.fill_(1)

    def _decode_body(self) -> None:
        token = self.out_buf.index_select(0, self.out_count - 1)
        _, post = self.runner.target(token, 1, self.pos, False)
        argmax = self.runner.logits(post).argmax(-1)
        self.out_buf.index_copy_(0, self.out_count, argmax)
        self.out_count.add_(1)
        self.pos.add_(1)

    def decode_step(self) -> None:
        """One plain greedy step: out_buf[out_count] = argmax(target(out_buf[out_count-1]))."""
        self.step_graphs.run(("decode",), self._decode_body)

    # -- speculative rounds ---------------------------------------------------------------
    def start_spec(self, prompt: list[int], pre, post, pending: int, hidden: str = "post") -> None:
        """Set up the draft fill after prefill: rows (prompt[1:] + [pending]) with the
        prompt's target hiddens. Static mode fills rows 0..P-2 now (model modules) and
        leaves the pending pair to the first round; otherwise the first round fills all P."""
        if not self.has_mtp:
            raise no_mtp_error()
        self.hidden = hidden
        seed = post if hidden == "post" else pre
        P = len(prompt)
        if self.static:
            if P > 1:
                ids = torch.tensor(prompt[1:], device=self.dev)
                self.model.mtp_hidden(ids, seed[: P - 1], StepCtx(start=0), self.draft_kvbuf())
            self.fill_tokens[0] = pending
            self.fill_h[0] = seed[P - 1]
            self.fill_start.fill_(P - 1)
            self.fill_rows.fill_(1)
        else:
            rows = max(P, self.rows_cap)
            if self.fill_tokens.shape[0] < rows:
                self.fill_tokens = torch.zeros(rows, device=self.dev, dtype=torch.long)
                self.fill_h = torch.zeros(rows, self.cfg.hidden_size, device=self.dev, dtype=self.dtype)
            self.fill_tokens[:P] = torch.tensor(list(prompt[1:]) + [pending], device=self.dev)
            self.fill_h[:P] = seed
            self.fill_start.fill_(0)
            self.fill_rows.fill_(P)
        self.h_last.copy_(seed[P - 1 : P])
        self.pending.fill_(pending)

    def set_forced(self, table: torch.Tensor | None) -> None:
        """table [capacity, k_max] int64 (token proposed at absolute position p, depth d)."""
        if table is not None:
            n = min(table.numel(), self.forced_tokens.numel())
            self.forced_tokens[:n].copy_(table.reshape(-1)[:n].to(self.dev))

    def _draft_body(self, k: int, forced: bool) -> None:
        if k == 0:
            return
        runner = self.runner
        rows = self.rows_cap if self.static else int(self.fill_rows.item())
        h = runner.mtp(self.fill_tokens[:rows], self.fill_h[:rows], self.fill_start, 0)
        hidden = h.index_select(0, self.fill_rows - 1)  # [1, H] the last fill row's
        chain = self.fill_start + self.fill_rows  # draft-KV row of the first chained step
        for i in range(k):
            draft = runner.draft_argmax(hidden)
            if forced:
                draft = self.forced_tokens.index_select(0, (self.pos + (1 + i)) * max(self.k_max, 1) + i)
            self.verify_tokens[1 + i : 2 + i].copy_(draft)
            if i + 1 < k:
                hidden = runner.mtp(draft, hidden, chain, i)

    def _verify_body(self, t: int) -> None:
        self.verify_tokens[0:1].copy_(self.pending)
        pre, post = self.runner.target(self.verify_tokens[:t], t, self.pos, True)
        self.seed_hidden[:t].copy_(post if self.hidden == "post" else pre)
        self.argmax[:t].copy_(self.runner.logits(post).argmax(-1))

    def _commit_body(self, t: int) -> None:
        k = t - 1
        argmax = self.argmax[:t]
        if k > 0:
            match = (argmax[:k] == self.verify_tokens[1:t]).to(torch.long)
            n = torch.cumprod(match, 0).sum(0, keepdim=True)
        else:
            n = torch.zeros(1, device=self.dev, dtype=torch.long)
        bonus = argmax.index_select(0, n)
        j = n + 1
        # linear layers: state after row j-1, conv window = rows j..j+W-2 of cat(conv, new rows)
        self.runner.commit_linear(n)
        window = torch.cat([self.conv, self.conv_in[:, :t]], 1)
        self.conv.copy_(window.index_select(1, j + self.window_offsets))
        # next fill: tokens verify_tokens[:j] + [bonus] with hiddens [h_last, seed[:j]] from row pos-1
        self.fill_tokens[:t].copy_(self.verify_tokens[:t])
        self.fill_tokens.index_copy_(0, j, bonus)
        self.fill_h[0:1].copy_(self.h_last)
        self.fill_h[1 : t + 1].copy_(self.seed_hidden[:t])
        self.h_last.copy_(self.seed_hidden.index_select(0, n))
        self.fill_start.copy_(self.pos - 1)
        self.fill_rows.copy_(j + 1)
        self.pos.add_(j)
        self.pending.copy_(bonus)
        self.result[0:1].copy_(n)
        self.result[1:2].copy_(bonus)
        if k > 0:
            self.result[2 : 2 + k].copy_(self.verify_tokens[1:t])

    def commit_recorded_states(self, n: torch.Tensor) -> None:
        """SSM states after the accepted rows, from a verify that recorded every row's state."""
        self.ssm.copy_(self.ssm_rows.index_select(1, n).squeeze(1))

    def draft(self, k: int, forced: bool = False) -> None:
        if k > 0:
            self.step_graphs.run(("draft", k, forced), lambda: self._draft_body(k, forced))

    def verify(self, t: int) -> None:
        self.step_graphs.run(("verify", t, self.hidden), lambda: self._verify_body(t))

    def commit(self, t: int) -> None:
        self.step_graphs.run(("commit", t), lambda: self._commit_body(t))

    def _draft_step_body(self) -> None:
        h = self.runner.mtp(self.pending, self.h_last, self.fill_start + self.fill_rows, 0)
        self.result[1:2].copy_(self.runner.draft_argmax(h))

    def draft_step(self) -> None:
        """One chained MTP step + LM head + argmax on scratch draft rows (bench only)."""
        self.step_graphs.run(("draft_step",), self._draft_step_body)

    # -- graphs ---------------------------------------------------------------------------
    def _mutable(self) -> list[torch.Tensor]:
        """What a step writes besides the caches (saved and put back around a capture)."""
        return [self.pos, self.out_count, self.pending, self.fill_start, self.fill_rows, self.fill_tokens,
                self.fill_h, self.h_last, self.verify_tokens, self.argmax, self.seed_hidden, self.result,
                self.conv, self.ssm, self.out_buf]

    def capture_all(self, ks=(), verify_ts=(), forced=(False,), decode=False, draft_step=False) -> None:
        """Capture graphs ahead of time (the state is left unchanged)."""
        if not self.graphs:
            return
        ensure = self.step_graphs.ensure
        if decode:
            self.decode_step_capture_only()
        if draft_step:
            ensure(("draft_step",), self._draft_step_body)
        for k in ks:
            for f in forced:
                if k > 0:
                    ensure(("draft", k, f), lambda k=k, f=f: self._draft_body(k, f))
            ensure(("verify", k + 1, self.hidden), lambda t=k + 1: self._verify_body(t))
            ensure(("commit", k + 1), lambda t=k + 1: self._commit_body(t))
        for t in verify_ts:
            ensure(("verify", t, self.hidden), lambda t=t: self._verify_body(t))

    def decode_step_capture_only(self) -> None:
        self.step_graphs.ensure(("decode",), self._decode_body)
