"""BatchDecoder: the CUDA-graph round for many sequences at once (lanes).

A lane is one sequence's place in the decoder.  Its whole state lives in per-lane slabs
(leading axis S = the decoder's slots), so a round over the first ``nb`` lanes is one set
of kernel launches whatever ``nb`` is, and a graph captured for ``nb`` lanes replays for
any sequences sitting in them:

    target state   kv_k/kv_v [A][S, Hkv, L, D]; conv [G, S, W-1, C]; ssm [G, S, Hv, Dk, Dv]
    drafter        dkv_k/dkv_v [S, Hkv, L, D] (row i pairs the token at i+1 with hidden i)
    per lane       pos [S] tokens in the cache; pending [S] next token to verify; k_lane [S]
                   drafts this lane uses (0 = plain decoding); live [S] (padding lanes do
                   not advance); fill_tok [S, R] / fill_h [S, R, H] / fill_start [S] /
                   fill_m [S] the drafter rows the next round refills; h_last [S, H]
    round scratch  vtok [S, t_max] verify tokens (pending, d1..dk); argmax [S, t_max] the
                   target's choice per verify row; seed_buf [S, t_max, H] their hiddens;
                   result [S, 2 + k_max] = (accepted n, bonus, d1..dk) read by the host

Active sequences sit in lanes 0..n-1 (a leaving sequence's lane is filled by moving the
last one into it: a bitwise copy, so nothing a lane computes depends on where it sits).
A round pads n up to the next captured batch size; padding lanes compute on idle state
and are ignored.  Every kernel is row-invariant and launched over lanes with each lane's
own position and state (hyspec.kernels: the ``lanes`` argument), so a lane's numbers are
bitwise those of the same sequence decoded alone: *batch invariance*.

One round = three graphs keyed by (nb, k): draft (fill + k chained MTP steps), verify
(nb x (k+1) rows), commit (accept per lane, roll the linear layers back to the accepted
row, next fill).  Lanes may use fewer drafts than k (k_lane): their extra rows are
computed and ignored, so a lane's result is the same as in a round of its own k.
Sampled lanes (temperature, top-k, top-p, min-p; rejection or coupled mode) run in their
own graphs of the same rounds, keyed by (sampled, ...): the drafter's and the target's
rows become probabilities on the device and the accept test, residual and bonus draws use
the counter-based RNG there (hyspec.gpu.sampling), at the positions the engine core uses,
so no host step is added. Every per-row sampling op runs on fixed 16-row blocks (torch's
GPU softmax / cumsum pick their kernel from the tensor's shape; a fixed shape keeps a
lane's numbers independent of the batch). Penalties stay on the engine core's path.
"""
from __future__ import annotations

import sys
import warnings

import torch

from hyspec.config import FULL, no_mtp_error
from hyspec.gpu import sampling as dsamp
from hyspec.gpu.decoder import GraphFallbackWarning, prefill_into
from hyspec.model.attention import KVBuffer
from hyspec.model.gdn import state_dtype
from hyspec.model.ops import StepCtx
from hyspec.speculative.drafter import draft_vocab

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
SAMPLE_BLOCK = 16  # rows per sampling call (a fixed shape: batch invariance on the GPU)


def _table_rows(table, lanes: int, per_lane: int = 1):
    """A SamplingTable over the first `lanes` lanes, each repeated per_lane times (rows)."""
    view = dsamp.SamplingTable.__new__(dsamp.SamplingTable)
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "seed", "coupled", "greedy"):
        t = getattr(table, name)[:lanes]
        setattr(view, name, t.repeat_interleave(per_lane) if per_lane > 1 else t)
    view.batch = lanes * per_lane
    return view


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])


def _blocked(fn, n: int, *rows_args):
    """fn over row-aligned args in fixed SAMPLE_BLOCK-row calls (the last one padded with
    copies of its first row); tensors concatenated back to n rows."""
    outs = []
    for s in range(0, n, SAMPLE_BLOCK):
        e = min(n, s + SAMPLE_BLOCK)
        args = [_pad_rows(a[s:e], SAMPLE_BLOCK) if isinstance(a, torch.Tensor) else _table_block(a, s, e)
                for a in rows_args]
        out = fn(*args)
        outs.append(tuple(o[: e - s] for o in out) if isinstance(out, tuple) else out[: e - s])
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(x) for x in zip(*outs))
    return torch.cat(outs)


def _table_block(table, s: int, e: int):
    view = dsamp.SamplingTable.__new__(dsamp.SamplingTable)
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "seed", "coupled", "greedy"):
        setattr(view, name, _pad_rows(getattr(table, name)[s:e], SAMPLE_BLOCK))
    view.batch = SAMPLE_BLOCK
    return view


def padded_size(n: int, sizes=BATCH_SIZES) -> int:
    """The captured batch size a round of n lanes runs at (the smallest size >= n)."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} lanes > the largest captured batch size {max(sizes)}")


class BatchDecoder:
    batched = True

    def __init__(self, model, max_len: int, k_max: int, slots: int, *, exact: bool = True,
                 graphs: bool | None = None, use_fla: bool | None = None, sizes=BATCH_SIZES) -> None:
        if max_len <= 0 or k_max < 0 or slots <= 0:
            raise ValueError(f"BatchDecoder: need max_len > 0, k_max >= 0, slots > 0; got {max_len}, {k_max}, {slots}")
        from hyspec.kernels.common import triton_available

        if not triton_available():
            raise RuntimeError("BatchDecoder needs triton (pip install triton); the reference engine core runs without it")
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.dev, self.dtype = model.device, model.dtype
        cuda = self.dev.type == "cuda"
        self.exact = exact
        self.k_max, self.t_max = k_max, k_max + 1
        self.slots = slots
        self.sizes = tuple(s for s in sizes if s < slots) + (slots,)
        self.lane_rows = max(k_max + 2, 2)  # drafter fill rows per lane
        self.rows_cap = slots * self.lane_rows
        self.max_len = max_len
        self.capacity = max_len + 2 * (k_max + 2) + 8
        self.graphs = cuda if graphs is None else graphs
        if self.graphs and not cuda:
            raise ValueError("BatchDecoder: CUDA graphs need a CUDA model")
        self.use_fla = cuda if use_fla is None else use_fla
        self._fla_warned = False
        self.backend = "triton"

        dev, dt = self.dev, self.dtype
        S, L = slots, self.capacity
        self.gdn_index, self.attn_index = {}, {}
        for i, t in enumerate(cfg.layer_types):
            if t == FULL:
                self.attn_index[i] = len(self.attn_index)
            else:
                self.gdn_index[i] = len(self.gdn_index)
        G, A = len(self.gdn_index), len(self.attn_index)
        Hkv, D = cfg.num_key_value_heads, cfg.head_dim
        self.kv_k = [torch.zeros(S, Hkv, L, D, device=dev, dtype=dt) for _ in range(A)]
        self.kv_v = [torch.zeros(S, Hkv, L, D, device=dev, dtype=dt) for _ in range(A)]
        W, C = cfg.linear_conv_kernel_dim, cfg.conv_dim
        nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv = torch.zeros(G, S, W - 1, C, device=dev, dtype=dt)
        self.ssm = torch.zeros(G, S, nv, dk, dv, device=dev, dtype=state_dtype(dt))
        self.ssm_rows = None
        self.conv_in = torch.zeros(G, S * self.t_max, C, device=dev, dtype=dt)  # lane b's rows at b*t..
        self.win_idx = torch.arange(W - 1, device=dev)
        self.has_mtp = model.has_mtp
        if self.has_mtp:
            self.dkv_k = torch.zeros(S, Hkv, L, D, device=dev, dtype=dt)
            self.dkv_v = torch.zeros(S, Hkv, L, D, device=dev, dtype=dt)
        self.d2t = draft_vocab(model)

        long = dict(device=dev, dtype=torch.long)
        H = cfg.hidden_size
        R = self.lane_rows
        self.lane_ids = torch.arange(S, **long)
        self.pos = torch.zeros(S, **long)
        self.pending = torch.zeros(S, **long)
        self.k_lane = torch.zeros(S, **long)
        self.spec_lane = torch.zeros(S, **long)  # 1: a speculative request (its k may be 0 in a round)
        self.live = torch.zeros(S, **long)
        self.fill_start = torch.zeros(S, **long)
        self.fill_m = torch.ones(S, **long)
        self.fill_tok = torch.zeros(S, R, **long)
        self.fill_h = torch.zeros(S, R, H, device=dev, dtype=dt)
        self.h_last = torch.zeros(S, H, device=dev, dtype=dt)
        self.vtok = torch.zeros(S, self.t_max, **long)
        self.argmax = torch.zeros(S, self.t_max, **long)
        self.seed_buf = torch.zeros(S, self.t_max, H, device=dev, dtype=dt)
        self.result = torch.zeros(S, 2 + k_max, **long)
        self.forced = torch.zeros(S, L * max(k_max, 1), **long)
        self.hidden = "post"
        self.table = dsamp.SamplingTable(S, device=dev)  # per-lane sampling parameters
        self.q = None  # [S, k_max, V] float64: the drafter's distributions (sampled rounds; made on first use)

        from hyspec.gpu.runner_triton import TritonRunner

        self.runner = TritonRunner(self, exact=exact)
        self.records_states = False
        self._graphs: dict = {}
        self._graph_failed = False
        self.graph_bytes = 0

    # -- lane views for the model's own modules (prefill) ------------------------------
    def _kvbuf(self, k: torch.Tensor, v: torch.Tensor) -> KVBuffer:
        b = KVBuffer.__new__(KVBuffer)
        b.k, b.v = k, v
        return b

    def slot_bytes(self) -> int:
        """Device bytes of one lane's state (KV, draft KV, conv, SSM, fill rows)."""
        per = [t[0] for t in self.kv_k + self.kv_v] + [self.conv[:, 0], self.ssm[:, 0], self.fill_h[0]]
        if self.has_mtp:
            per += [self.dkv_k[0], self.dkv_v[0]]
        return sum(t.numel() * t.element_size() for t in per)

    # -- admission ---------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, lane: int, prompt: list[int]):
        """Run a prompt into lane's (reset) state, eagerly with the model's modules (fla's
        chunked kernel on CUDA when it imports). Returns (pre [P, H], post [P, H], logits [1, V])."""
        P = len(prompt)
        if P + 1 > self.max_len:
            raise ValueError(f"prompt of {P} tokens does not fit the decoder's max_len {self.max_len}")
        self.conv[:, lane].zero_()
        self.ssm[:, lane].zero_()
        kv = {i: self._kvbuf(self.kv_k[a][lane], self.kv_v[a][lane]) for i, a in self.attn_index.items()}
        pre, post, logits = prefill_into(self, prompt, kv, lambda g: self.conv[g, lane], lambda g: self.ssm[g, lane])
        self.pos[lane] = P
        return pre, post, logits

    @torch.no_grad()
    def start(self, lane: int, prompt: list[int], pre, post, pending: int, k: int) -> None:
        """After prefill: lane drafts k per round (0 = plain), pending is the first token.
        The drafter rows of the prompt are filled now; the pending pair is the first
        round's fill."""
        if k > self.k_max:
            raise ValueError(f"k={k} > the decoder's k_max {self.k_max}")
        if k > 0 and not self.has_mtp:
            raise no_mtp_error()
        seed = post if self.hidden == "post" else pre
        P = len(prompt)
        if k > 0 and P > 1:
            ids = torch.tensor(prompt[1:], device=self.dev)
            self.model.mtp_hidden(ids, seed[: P - 1], StepCtx(start=0), self._kvbuf(self.dkv_k[lane], self.dkv_v[lane]))
        self.fill_tok[lane].zero_()
        self.fill_tok[lane, 0] = pending
        self.fill_h[lane, 0] = seed[P - 1]
        self.fill_start[lane] = P - 1
        self.fill_m[lane] = 1
        self.h_last[lane] = seed[P - 1]
        self.pending[lane] = pending
        self.k_lane[lane] = k
        self.spec_lane[lane] = int(k > 0)
        self.live[lane] = 1

    def set_params(self, lane: int, params) -> None:
        """Lane's SamplingParams (None or greedy: argmax). Penalties are not on this path."""
        if params is not None and params.has_penalties:
            raise ValueError("penalties are not on the batched graph path (the engine core serves them)")
        self.table.set(lane, params)

    def set_forced(self, lane: int, table: torch.Tensor | None) -> None:
        """table [capacity, k_max] (the forced drafter's token at (position, depth)) for lane."""
        self.forced[lane].zero_()
        if table is not None:
            n = min(table.numel(), self.forced.shape[1])
            self.forced[lane, :n].copy_(table.reshape(-1)[:n].to(self.dev))

    def _lane_tensors(self):
        tb = self.table
        t = [self.pos, self.pending, self.k_lane, self.spec_lane, self.live, self.fill_start, self.fill_m, self.fill_tok, self.fill_h,
             self.h_last, self.forced, tb.temperature, tb.top_k, tb.top_p, tb.min_p, tb.repetition_penalty,
             tb.frequency_penalty, tb.presence_penalty, tb.seed, tb.coupled, tb.greedy] + self.kv_k + self.kv_v
        if self.has_mtp:
            t += [self.dkv_k, self.dkv_v]
        return t

    @torch.no_grad()
    def move(self, src: int, dst: int) -> None:
        """Lane src's whole state into lane dst (bitwise); src becomes idle."""
        if src == dst:
            return
        for t in self._lane_tensors():
            t[dst].copy_(t[src])
        self.conv[:, dst].copy_(self.conv[:, src])
        self.ssm[:, dst].copy_(self.ssm[:, src])
        self.table.params[dst] = self.table.params[src]
        self.free(src)

    def free(self, lane: int) -> None:
        """An idle lane: position 0, not live (padding rounds leave it there)."""
        self.live[lane] = 0
        self.pos[lane] = 0
        self.fill_start[lane] = 0
        self.fill_m[lane] = 1
        self.k_lane[lane] = 0
        self.spec_lane[lane] = 0
        self.table.set(lane, None)

    # -- the round bodies (graph-captured) ---------------------------------------------
    def _decode_body(self, nb: int, sampled: bool = False) -> None:
        """Plain step for lanes 0..nb-1: pending -> target -> argmax (or a draw) -> pending."""
        run = self.runner
        _, post = run.target(self.pending[:nb], nb, self.pos, False, nb)
        logits = run.logits(post)
        if sampled:  # the token at position pos + 1, stream PLAIN (hyspec.core.round.choose_token)
            tbl = _table_rows(self.table, nb)
            tok = _blocked(lambda lg, tb, ps: dsamp.plain_tokens(dsamp.probs_batch(lg, tb), tb, ps), nb,
                           logits, tbl, self.pos[:nb] + 1)
        else:
            tok = logits.argmax(-1)
        self.result[:nb, 0].zero_()
        self.result[:nb, 1].copy_(tok)
        self.pending[:nb].copy_(tok)
        self.pos[:nb].add_(self.live[:nb])

    def _draft_body(self, nb: int, k: int, forced: bool, sampled: bool = False) -> None:
        if k == 0:
            return
        if sampled and self.q is None:
            self.q = torch.zeros(self.slots, max(self.k_max, 1), self.cfg.vocab_size, device=self.dev,
                                 dtype=torch.float64)
        tbl = _table_rows(self.table, nb) if sampled else None
        run = self.runner
        R = self.lane_rows
        lanes = self.lane_ids[:nb]
        h = run.mtp(self.fill_tok[:nb].reshape(-1), self.fill_h[:nb].reshape(nb * R, -1), self.fill_start, 0, nb)
        hsel = h.view(nb, R, -1)[lanes, self.fill_m[:nb] - 1]  # [nb, H]
        chain = self.fill_start + self.fill_m  # draft-KV row of the first chained step, per lane
        K = max(self.k_max, 1)
        for i in range(k):
            logits = run.draft_logits(hsel)
            if sampled:  # draft i is the token at position pos + 1 + i (stream DRAFT)
                q, d = _blocked(lambda lg, tb, ps: _draft_sample(lg, tb, ps), nb, logits, tbl, self.pos[:nb] + 1 + i)
            else:
                d = logits.argmax(-1)
            if forced:
                idx = (self.pos[:nb] + (1 + i)) * K + i
                d = self.forced[:nb].gather(1, idx[:, None])[:, 0]
                if sampled:  # a deterministic proposal: q is one-hot at it
                    q = torch.zeros_like(q).scatter_(1, d[:, None], 1.0)
            if sampled:
                self.q[:nb, i].copy_(q)
            self.vtok[:nb, 1 + i].copy_(d)
            if i + 1 < k:
                hsel = run.mtp(d, hsel, chain, i, nb)

    def _verify_body(self, nb: int, t: int) -> None:
        self.vtok[:nb, 0].copy_(self.pending[:nb])
        pre, post = self.runner.target(self.vtok[:nb, :t].reshape(-1), nb * t, self.pos, True, nb)
        seed = post if self.hidden == "post" else pre
        self.seed_buf[:nb, :t].copy_(seed.view(nb, t, -1))
        self.argmax[:nb, :t].copy_(self.runner.logits(post).argmax(-1).view(nb, t))

    def _commit_body(self, nb: int, t: int, sampled: bool = False) -> None:
        k = t - 1
        lanes = self.lane_ids[:nb]
        am = self.argmax[:nb, :t]
        vt = self.vtok[:nb, :t]
        if sampled:
            n, bonus = self._accept_sampled(nb, t)
        else:
            if k > 0:
                match = (am[:, :k] == vt[:, 1:t]).to(torch.long)
                n = torch.minimum(torch.cumprod(match, 1).sum(1), self.k_lane[:nb])
            else:
                n = torch.zeros(nb, device=self.dev, dtype=torch.long)
            bonus = am[lanes, n]
        j = n + 1
        # linear layers: state after row n; conv window = rows j..j+W-2 of cat(window, new rows)
        self.runner.commit_linear(n, t, nb)
        G, C = self.conv.shape[0], self.conv.shape[-1]
        win = torch.cat([self.conv[:, :nb], self.conv_in[:, : nb * t].view(G, nb, t, C)], 2)
        idx = (j[:, None] + self.win_idx[None, :])[None, :, :, None].expand(G, nb, self.win_idx.numel(), C)
        self.conv[:, :nb].copy_(win.gather(2, idx))
        # next fill: tokens vtok[:j] + [bonus] with hiddens [h_last, seed[:j]] from row pos-1
        self.fill_tok[:nb, :t].copy_(vt)
        self.fill_tok[:nb].scatter_(1, j[:, None], bonus[:, None])
        self.fill_h[:nb, 0].copy_(self.h_last[:nb])
        self.fill_h[:nb, 1: t + 1].copy_(self.seed_buf[:nb, :t])
        self.h_last[:nb].copy_(self.seed_buf[lanes, n])
        live = self.live[:nb]
        self.fill_start[:nb].copy_((self.pos[:nb] - 1).clamp_min(0) * live)
        self.fill_m[:nb].copy_(torch.where(live > 0, j + 1, torch.ones_like(j)))
        self.pos[:nb].add_(j * live)
        self.pending[:nb].copy_(bonus)
        self.result[:nb, 0].copy_(n)
        self.result[:nb, 1].copy_(bonus)
        if k > 0:
            self.result[:nb, 2: 2 + k].copy_(vt[:, 1:t])

    def _accept_sampled(self, nb: int, t: int):
        """(n accepted, next token) per lane from the verify logits (still in the runner's
        logits buffer): target probabilities per row, then the rejection / coupled test
        (hyspec.gpu.sampling.speculative_accept) at the first draft's position pos + 1;
        plain lanes take their row-0 token as plain decoding does (stream PLAIN); a
        speculative lane drafting nothing this round (its last token) draws it as the
        bonus of an empty round, as the engine core does."""
        k = t - 1
        V = self.cfg.vocab_size
        logits = self.runner.b.logits[: nb * t]
        tbl_rows = _table_rows(self.table, nb, t)
        p = _blocked(dsamp.probs_batch, nb * t, logits, tbl_rows).view(nb, t, V)
        tbl = _table_rows(self.table, nb)
        pos1 = self.pos[:nb] + 1
        kl = self.k_lane[:nb]
        if k > 0:
            q = self.q[:nb, :k]
            n, nxt = _blocked(lambda pp, qq, dd, tb, ps, kk: dsamp.speculative_accept(pp, qq, dd, tb, ps, kk), nb,
                              p, q, self.vtok[:nb, 1:t], tbl, pos1, kl)
        else:
            n = torch.zeros(nb, device=self.dev, dtype=torch.long)
            nxt = torch.zeros(nb, device=self.dev, dtype=torch.long)
        plain = _blocked(dsamp.plain_tokens, nb, p[:, 0], tbl, pos1)
        if k == 0:
            nxt = _blocked(lambda pp, tb, ps: dsamp.speculative_accept(pp, pp[:, :0], pp.new_zeros(pp.shape[0], 0,
                                                                                               dtype=torch.long),
                                                                       tb, ps, torch.zeros_like(ps))[1],
                           nb, p, tbl, pos1)
        return n, torch.where(self.spec_lane[:nb] == 0, plain, nxt)

    # -- launching ---------------------------------------------------------------------
    def decode(self, nb: int, sampled: bool = False) -> None:
        self._run(("decode", nb, sampled), lambda: self._decode_body(nb, sampled))

    def round(self, nb: int, k: int, forced: bool = False, sampled: bool = False) -> None:
        """One speculative round (k drafts; lanes with k_lane < k use fewer) for lanes
        0..nb-1; sampled: some lane samples (the graphs with sampling on the device)."""
        if k > self.k_max:
            raise ValueError(f"k={k} > k_max {self.k_max}")
        if k > 0:
            self._run(("draft", nb, k, forced, sampled), lambda: self._draft_body(nb, k, forced, sampled))
        self._run(("verify", nb, k + 1), lambda: self._verify_body(nb, k + 1))
        self._run(("commit", nb, k + 1, sampled), lambda: self._commit_body(nb, k + 1, sampled))

    def _mutable(self):
        return [self.pos, self.pending, self.fill_start, self.fill_m, self.fill_tok, self.fill_h, self.h_last,
                self.vtok, self.argmax, self.seed_buf, self.result, self.conv, self.ssm]

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

        def restore():
            for t, v in zip(self._mutable(), saved):
                t.copy_(v)

        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.no_grad():
                fn()  # compile + warm up outside the capture
            torch.cuda.current_stream().wait_stream(s)
            restore()
            before = torch.cuda.memory_reserved(self.dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g), torch.no_grad():
                fn()
            torch.cuda.synchronize()
            self.graph_bytes += max(0, torch.cuda.memory_reserved(self.dev) - before)
        except Exception as e:  # noqa: BLE001 - a failed capture falls back loudly, once
            torch.cuda.synchronize()
            restore()
            self._graph_failed = True
            msg = f"hyspec.gpu: CUDA-graph capture of {key} failed ({type(e).__name__}: {e}); running eagerly"
            warnings.warn(msg, GraphFallbackWarning, stacklevel=3)
            print(msg, file=sys.stderr)
            return None
        restore()
        self._graphs[key] = g
        return g

    def capture(self, sizes, ks, forced=(False,), decode=True, sampled=(False,)) -> None:
        """Capture the graphs of these batch sizes and draft counts ahead of time."""
        if not self.graphs:
            return
        for nb in sizes:
            for sm in sampled:
                if decode:
                    self._ensure(("decode", nb, sm), lambda nb=nb, sm=sm: self._decode_body(nb, sm))
                for k in ks:
                    for f in forced:
                        if k > 0:
                            self._ensure(("draft", nb, k, f, sm),
                                         lambda nb=nb, k=k, f=f, sm=sm: self._draft_body(nb, k, f, sm))
                    self._ensure(("verify", nb, k + 1), lambda nb=nb, k=k: self._verify_body(nb, k + 1))
                    self._ensure(("commit", nb, k + 1, sm), lambda nb=nb, k=k, sm=sm: self._commit_body(nb, k + 1, sm))

    def _ensure(self, key, fn) -> None:
        if self.graphs and not self._graph_failed and key not in self._graphs:
            self._capture(key, fn)


def _draft_sample(logits, tbl, positions):
    q = dsamp.probs_batch(logits, tbl)
    return q, dsamp.draft_tokens(q, tbl, positions)


BatchDecoder._fla_fail = __import__("hyspec.gpu.decoder", fromlist=["FastDecoder"]).FastDecoder._fla_fail
