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
    draft KV       dkv_k/dkv_v [Hkv, L, D]: row i pairs (token at i+1, hidden at i)
    scalars        pos (tokens in the cache), pending, fill_start / fill_m (draft rows the
                   next round refills), cnt (plain decode output count)

One speculative round with k drafts (t = k + 1) is three graphs, no host sync inside:
    draft[k]    MTP over the fill rows [(committed tokens, true target hiddens), (pending,
                hidden)] -> argmax -> chain k-1 more single-row MTP steps
    verify[t]   target over [pending, d1..dk] recording per-row states -> logits -> argmax
    commit[t]   n = leading matches (cumprod), bonus = argmax[n], j = n + 1; roll the
                linear layers to row j-1; set up the next fill; pos += j; results -> `res`
and the host reads `res` (n, bonus, drafts) once per round.

The compute comes from a runner: ``TritonRunner`` (fused row-invariant kernels, graph
capturable) or ``TorchRunner`` (the model's own modules; on CPU it makes the decoder
bitwise equal to hyspec.decode / hyspec.speculative.loop).  Prefill is eager and uses the model's
modules, with flash-linear-attention's chunked kernel for Gated DeltaNet on CUDA when it
imports (else the torch chunked form).
"""
from __future__ import annotations

import sys
import warnings

import torch

from hyspec.config import FULL, no_mtp_error
from hyspec.model.attention import KVBuffer
from hyspec.model.gdn import chunked_scan, state_dtype
from hyspec.model.ops import StepCtx
from hyspec.speculative.drafter import draft_logits, draft_vocab


class GraphFallbackWarning(RuntimeWarning):
    """A CUDA-graph capture failed; that step runs eagerly from now on (slower, same result)."""


def _fla_chunk():
    """flash-linear-attention's chunked gated delta rule, or None (imported lazily)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    return chunk_gated_delta_rule


def prefill_into(dec, prompt: list[int], kv: dict, conv_of, ssm_of):
    """Run a prompt from position 0 through dec.model's own modules into one sequence's
    state: kv {layer index: KVBuffer}, conv_of(g) / ssm_of(g) the g-th Gated-DeltaNet
    layer's conv window [W-1, C] and state [Hv, Dk, Dv] (zeroed by the caller). Uses
    flash-linear-attention's chunked kernel on CUDA when dec.use_fla and it imports
    (dec._fla_fail(why) turns it off loudly), else the torch chunked scan.
    Returns (pre [P, H], post [P, H], logits [1, V] of the last row)."""
    m = dec.model
    ids = torch.tensor(prompt, device=dec.dev)
    ctx = StepCtx(start=0, chunked=True)
    x = m.model.embed_tokens(ids)
    for i, layer in enumerate(m.model.layers):
        h = layer.input_layernorm(x)
        if layer.layer_type == FULL:
            h = layer.self_attn(h, ctx, kv[i])
        else:
            g = dec.gdn_index[i]
            h = _gdn_prefill(dec, layer.linear_attn, h, ctx, conv_of(g), ssm_of(g))
        x = x + h
        x = x + layer.mlp(layer.post_attention_layernorm(x), ctx)
    post = m.model.norm(x)
    return x, post, m.logits(post[-1:])


def _gdn_prefill(dec, mod, x, ctx, conv, ssm):
    """GatedDeltaNet.forward (chunked) on one sequence's conv window / state; fla on CUDA."""
    T = x.shape[0]
    qkv, z, b, a = mod.project(x, ctx)
    xcat = torch.cat([conv.to(qkv.dtype), qkv])
    y = mod.conv(xcat)
    o = None
    if dec.use_fla and y.is_cuda:
        o = _fla_prefill(dec, mod, y, b, a, ssm)
    if o is None:
        q, k, v, gg, beta = mod.prepare(y, b, a)
        o, s_final = chunked_scan(q, k, v, gg, beta, ssm)
        ssm.copy_(s_final)
    conv.copy_(xcat[T:])
    o = mod.norm(o.to(x.dtype), z)
    return mod.out_proj(o.reshape(T, -1), ctx)


def _fla_prefill(dec, mod, y, b, a, ssm):
    fn = _fla_chunk()
    if fn is None:
        dec._fla_fail("flash-linear-attention (fla) is not importable")
        return None
    T = y.shape[0]
    nk, nv, dk, dv = mod.nk, mod.nv, mod.dk, mod.dv
    kd = nk * dk
    try:
        q = y[:, :kd].reshape(1, T, nk, dk)
        k = y[:, kd : 2 * kd].reshape(1, T, nk, dk)
        v = y[:, 2 * kd :].reshape(1, T, nv, dv)
        beta = torch.sigmoid(b.float()).to(y.dtype).reshape(1, T, nv)
        gg = (-mod.A_log.float().exp() * torch.nn.functional.softplus(a.float() + mod.dt_bias.float()))
        o, fs = fn(q.contiguous(), k.contiguous(), v.contiguous(), g=gg.reshape(1, T, nv).contiguous(),
                   beta=beta.contiguous(), scale=dk ** -0.5, initial_state=ssm[None].clone(),
                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    except Exception as e:  # pragma: no cover - GPU only
        dec._fla_fail(f"fla chunk_gated_delta_rule failed: {type(e).__name__}: {e}")
        return None
    ssm.copy_(fs[0].to(ssm.dtype))
    return o[0].float()


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
        self.t_max = k_max + 1
        self.rows_cap = max(k_max + 2, 2)
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
        self._fla_warned = False

        dev, dt = self.dev, self.dtype
        L = self.capacity
        self.gdn_index, self.attn_index = {}, {}
        for i, t in enumerate(cfg.layer_types):
            if t == FULL:
                self.attn_index[i] = len(self.attn_index)
            else:
                self.gdn_index[i] = len(self.gdn_index)
        G, A = len(self.gdn_index), len(self.attn_index)
        Hkv, D = cfg.num_key_value_heads, cfg.head_dim
        self.kv_k = [torch.zeros(Hkv, L, D, device=dev, dtype=dt) for _ in range(A)]
        self.kv_v = [torch.zeros(Hkv, L, D, device=dev, dtype=dt) for _ in range(A)]
        W, C = cfg.linear_conv_kernel_dim, cfg.conv_dim
        sd = state_dtype(dt)
        nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv = torch.zeros(G, W - 1, C, device=dev, dtype=dt)
        self.ssm = torch.zeros(G, nv, dk, dv, device=dev, dtype=sd)
        self.ssm_rows = None  # per-row verify states, for runners that record them (below)
        self.conv_in = torch.zeros(G, self.t_max, C, device=dev, dtype=dt)
        self.win_idx = torch.arange(W - 1, device=dev)
        self.has_mtp = model.has_mtp
        if self.has_mtp:
            self.dkv_k = torch.zeros(Hkv, L, D, device=dev, dtype=dt)
            self.dkv_v = torch.zeros(Hkv, L, D, device=dev, dtype=dt)
        self.d2t = draft_vocab(model)

        long = dict(device=dev, dtype=torch.long)
        H = cfg.hidden_size
        self.pos = torch.zeros(1, **long)
        self.cnt = torch.zeros(1, **long)
        self.pending = torch.zeros(1, **long)
        self.fill_start = torch.zeros(1, **long)
        self.fill_m = torch.ones(1, **long)
        self.fill_tok = torch.zeros(self.rows_cap, **long)
        self.fill_h = torch.zeros(self.rows_cap, H, device=dev, dtype=dt)
        self.h_last = torch.zeros(1, H, device=dev, dtype=dt)
        self.vtok = torch.zeros(self.t_max, **long)
        self.am = torch.zeros(self.t_max, **long)
        self.seed_buf = torch.zeros(self.t_max, H, device=dev, dtype=dt)
        self.res = torch.zeros(2 + k_max, **long)
        self.out_buf = torch.zeros(L, **long)
        self.forced = torch.zeros(L * max(k_max, 1), **long)
        self.hidden = "post"

        if backend == "triton":
            from hyspec.gpu.runner_triton import TritonRunner

            self.runner = TritonRunner(self, exact=exact)
        else:
            from hyspec.gpu.runner_torch import TorchRunner

            self.runner = TorchRunner(self)
        if self.runner.records_states:
            self.ssm_rows = torch.zeros(G, self.t_max, nv, dk, dv, device=dev, dtype=sd)
        self._graphs: dict = {}
        self._graph_failed = False

    # -- views of the state for the model's own modules ------------------------------
    def kvbuf(self, i: int) -> KVBuffer:
        b = KVBuffer.__new__(KVBuffer)
        a = self.attn_index[i]
        b.k, b.v = self.kv_k[a], self.kv_v[a]
        return b

    def draft_kvbuf(self) -> KVBuffer:
        b = KVBuffer.__new__(KVBuffer)
        b.k, b.v = self.dkv_k, self.dkv_v
        return b

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

    def _fla_fail(self, why: str) -> None:
        self.use_fla = False
        if not self._fla_warned:
            self._fla_warned = True
            print(f"hyspec.gpu: prefill falls back to the torch chunked Gated-DeltaNet scan ({why})",
                  file=sys.stderr)

    @property
    def fla_used(self) -> bool:
        return self.use_fla

    # -- plain decoding -----------------------------------------------------------------
    def start_plain(self, first: int) -> None:
        self.out_buf[0] = first
        self.cnt.fill_(1)

    def _decode_body(self) -> None:
        tok = self.out_buf.index_select(0, self.cnt - 1)
        _, post = self.runner.target(tok, 1, self.pos, False)
        am = self.runner.logits(post).argmax(-1)
        self.out_buf.index_copy_(0, self.cnt, am)
        self.cnt.add_(1)
        self.pos.add_(1)

    def decode_step(self) -> None:
        """One plain greedy step: out_buf[cnt] = argmax(target(out_buf[cnt-1]))."""
        self._run(("decode",), self._decode_body)

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
            self.fill_tok[0] = pending
            self.fill_h[0] = seed[P - 1]
            self.fill_start.fill_(P - 1)
            self.fill_m.fill_(1)
        else:
            rows = max(P, self.rows_cap)
            if self.fill_tok.shape[0] < rows:
                self.fill_tok = torch.zeros(rows, device=self.dev, dtype=torch.long)
                self.fill_h = torch.zeros(rows, self.cfg.hidden_size, device=self.dev, dtype=self.dtype)
            self.fill_tok[:P] = torch.tensor(list(prompt[1:]) + [pending], device=self.dev)
            self.fill_h[:P] = seed
            self.fill_start.fill_(0)
            self.fill_m.fill_(P)
        self.h_last.copy_(seed[P - 1 : P])
        self.pending.fill_(pending)

    def set_forced(self, table: torch.Tensor | None) -> None:
        """table [capacity, k_max] int64 (token proposed at absolute position p, depth d)."""
        if table is not None:
            n = min(table.numel(), self.forced.numel())
            self.forced[:n].copy_(table.reshape(-1)[:n].to(self.dev))

    def _draft_body(self, k: int, forced: bool) -> None:
        if k == 0:
            return
        run = self.runner
        R = self.rows_cap if self.static else int(self.fill_m.item())
        h = run.mtp(self.fill_tok[:R], self.fill_h[:R], self.fill_start, 0)
        hsel = h.index_select(0, self.fill_m - 1)
        chain = self.fill_start + self.fill_m  # draft-KV row of the first chained step
        for i in range(k):
            d = run.draft_logits(hsel).argmax(-1)
            if forced:
                d = self.forced.index_select(0, (self.pos + (1 + i)) * max(self.k_max, 1) + i)
            self.vtok[1 + i : 2 + i].copy_(d)
            if i + 1 < k:
                hsel = run.mtp(d, hsel, chain, i)

    def _verify_body(self, t: int) -> None:
        self.vtok[0:1].copy_(self.pending)
        pre, post = self.runner.target(self.vtok[:t], t, self.pos, True)
        self.seed_buf[:t].copy_(post if self.hidden == "post" else pre)
        self.am[:t].copy_(self.runner.logits(post).argmax(-1))

    def _commit_body(self, t: int) -> None:
        k = t - 1
        am = self.am[:t]
        if k > 0:
            match = (am[:k] == self.vtok[1:t]).to(torch.long)
            n = torch.cumprod(match, 0).sum(0, keepdim=True)
        else:
            n = torch.zeros(1, device=self.dev, dtype=torch.long)
        bonus = am.index_select(0, n)
        j = n + 1
        # linear layers: state after row j-1, conv window = rows j..j+W-2 of cat(conv, new rows)
        self.runner.commit_linear(n)
        win = torch.cat([self.conv, self.conv_in[:, :t]], 1)
        self.conv.copy_(win.index_select(1, j + self.win_idx))
        # next fill: tokens vtok[:j] + [bonus] with hiddens [h_last, seed[:j]] from row pos-1
        self.fill_tok[:t].copy_(self.vtok[:t])
        self.fill_tok.index_copy_(0, j, bonus)
        self.fill_h[0:1].copy_(self.h_last)
        self.fill_h[1 : t + 1].copy_(self.seed_buf[:t])
        self.h_last.copy_(self.seed_buf.index_select(0, n))
        self.fill_start.copy_(self.pos - 1)
        self.fill_m.copy_(j + 1)
        self.pos.add_(j)
        self.pending.copy_(bonus)
        self.res[0:1].copy_(n)
        self.res[1:2].copy_(bonus)
        if k > 0:
            self.res[2 : 2 + k].copy_(self.vtok[1:t])

    def commit_recorded_states(self, n: torch.Tensor) -> None:
        """SSM states after the accepted rows, from a verify that recorded every row's state."""
        self.ssm.copy_(self.ssm_rows.index_select(1, n).squeeze(1))

    def draft(self, k: int, forced: bool = False) -> None:
        if k > 0:
            self._run(("draft", k, forced), lambda: self._draft_body(k, forced))

    def verify(self, t: int) -> None:
        self._run(("verify", t, self.hidden), lambda: self._verify_body(t))

    def commit(self, t: int) -> None:
        self._run(("commit", t), lambda: self._commit_body(t))

    def _draft_step_body(self) -> None:
        h = self.runner.mtp(self.pending, self.h_last, self.fill_start + self.fill_m, 0)
        self.res[1:2].copy_(self.runner.draft_logits(h).argmax(-1))

    def draft_step(self) -> None:
        """One chained MTP step + LM head + argmax on scratch draft rows (bench only)."""
        self._run(("draft_step",), self._draft_step_body)

    # -- graphs ---------------------------------------------------------------------------
    def _mutable(self):
        return [self.pos, self.cnt, self.pending, self.fill_start, self.fill_m, self.fill_tok, self.fill_h,
                self.h_last, self.vtok, self.am, self.seed_buf, self.res, self.conv, self.ssm]

    def _run(self, key, fn) -> None:
        if not self.graphs or self._graph_failed:
            with torch.no_grad():
                fn()
            return
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(key, fn)
            if g is None:
                with torch.no_grad():
                    fn()
                return
        g.replay()

    def _capture(self, key, fn):
        saved = [t.clone() for t in self._mutable()]
        out = self.out_buf.clone()
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.no_grad():
                fn()  # compile + warm up outside the capture
            torch.cuda.current_stream().wait_stream(s)
            for t, v in zip(self._mutable(), saved):
                t.copy_(v)
            self.out_buf.copy_(out)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g), torch.no_grad():
                fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - any capture failure falls back loudly once
            torch.cuda.synchronize()
            for t, v in zip(self._mutable(), saved):
                t.copy_(v)
            self.out_buf.copy_(out)
            self._graph_failed = True
            msg = (f"hyspec.gpu: CUDA-graph capture of {key} failed ({type(e).__name__}: {e}); "
                   f"running eagerly from now on")
            warnings.warn(msg, GraphFallbackWarning, stacklevel=3)
            print(msg, file=sys.stderr)
            return None
        for t, v in zip(self._mutable(), saved):
            t.copy_(v)
        self.out_buf.copy_(out)
        self._graphs[key] = g
        return g

    def capture_all(self, ks=(), verify_ts=(), forced=(False,), decode=False, draft_step=False) -> None:
        """Capture graphs ahead of time (the state is left unchanged)."""
        if not self.graphs:
            return
        if decode:
            self.decode_step_capture_only()
        if draft_step:
            self._ensure(("draft_step",), self._draft_step_body)
        for k in ks:
            for f in forced:
                if k > 0:
                    self._ensure(("draft", k, f), lambda k=k, f=f: self._draft_body(k, f))
            self._ensure(("verify", k + 1, self.hidden), lambda t=k + 1: self._verify_body(t))
            self._ensure(("commit", k + 1), lambda t=k + 1: self._commit_body(t))
        for t in verify_ts:
            self._ensure(("verify", t, self.hidden), lambda t=t: self._verify_body(t))

    def decode_step_capture_only(self) -> None:
        self._ensure(("decode",), self._decode_body)

    def _ensure(self, key, fn) -> None:
        if self.graphs and not self._graph_failed and key not in self._graphs:
            self._capture(key, fn)
