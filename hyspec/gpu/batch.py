"""BatchDecoder: the CUDA-graph round for many sequences at once (lanes).

A lane is one sequence's place in the decoder.  Its whole state lives in per-lane slabs
(leading axis S = the decoder's slots), so a round over the first ``nb`` lanes is one set
of kernel launches whatever ``nb`` is, and a graph captured for ``nb`` lanes replays for
any sequences sitting in them:

    target state   kv_k/kv_v [A][S, Hkv, L, D]; conv [G, S, W-1, C]; ssm [G, S, Hv, Dk, Dv]
    drafter        draft_k/draft_v [S, Hkv, L, D] (row i pairs the token at i+1 with hidden i)
    per lane       pos [S] tokens in the cache; pending [S] next token to verify; k_lane [S]
                   drafts this lane uses (0 = plain decoding); live [S] (padding lanes do
                   not advance); fill_tokens [S, R] / fill_h [S, R, H] / fill_start [S] /
                   fill_rows [S] the drafter rows the next round refills; h_last [S, H];
                   stop_ids [S, STOP_SLOTS] (the commit keeps no row past an accepted stop draft)
    round scratch  verify_tokens [S, t_max] (pending, d1..dk); argmax [S, t_max] the
                   target's choice per verify row; seed_hidden [S, t_max, H] their hiddens;
                   result [S, 3 + k_max] = (accepted n, bonus, d1..dk, bad row) read by
                   the host (bad row: the lane's first verify row whose logits hold NaN or
                   +inf, NO_BAD_ROW if none; the host ends a lane whose bad row <= n in error)

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
Sampled lanes (temperature, top-k, top-p, min-p, penalties; rejection or coupled mode)
run in their own graphs of the same rounds, keyed by the batch's sampling regime (a
hyspec.gpu.sampling.SampledGraphKey: the stages and draws some lane needs; a new regime
captures once): the drafter's and the target's rows become probabilities on the device
and the accept test, residual and bonus draws use the counter-based RNG there
(hyspec.gpu.sampling), at the positions the engine core uses, so no host step is added;
hyspec.gpu.batch_sampling holds those draws (float row reductions in the row kernels of
hyspec.kernels.probs: batch invariance on the GPU without padding the rows). Penalties: each lane's token window (a PenaltyWindow,
loaded from the prompt at start, advanced by the commit and decode graphs) plus the
round's earlier drafts for every draft and verify row.
The graphs (capture on first use, eager fallback) live in hyspec.gpu.graphs; the
continuous-batching loop over this decoder in hyspec.gpu.batch_loop.

Sequence states (the prefix store, docs/sessions.md "On the batched CUDA graphs"): export()
copies a lane's state between rounds into a hyspec.core.state.SeqState in the engine
core's layout; load() writes one into a lane, which then prefills only [pending] + new
tokens from the state's position (prefill(start=pos), start(carry=...)) or, a plain lane
with nothing new, goes on from it directly (resume(); a drafting lane prefills its pending
token, as the engine core resumes).
"""
from __future__ import annotations

import torch

from hyspec.config import no_mtp_error
from hyspec.core.state import Carry
from hyspec.envknobs import number
from hyspec.gpu import sampling as dsamp
from hyspec.gpu.batch_sampling import (accept_sampled, draft_draws, plain_draws, softmax_of_rows, sums_of_rows,
                                       table_rows)
from hyspec.gpu.graphs import StepGraphs
from hyspec.gpu.penalties import PenaltyWindow, row_counts
from hyspec.gpu.prefill import layer_indices, prefill_into
from hyspec.kernels.commit import bad_rows, bad_rows_ref, commit_round, commit_round_ref, first_flagged
from hyspec.kernels.gdn import gdn_window_commit
from hyspec.model.attention import KVBuffer
from hyspec.model.gdn import ssm_store_dtype
from hyspec.model.ops import StepCtx
from hyspec.speculative.drafter import draft_vocab

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
NO_BAD_ROW = 2**31 - 1  # result[:, -1] of a lane none of whose rows held NaN / +inf (past any accepted n)
STOP_SLOTS = 8  # stop ids per lane the device's commit knows (hyspec.gpu.batch_loop ends lanes on all of them)


def drafter_cut(regime) -> bool:
    """Whether a round's drafts end at a drafter row holding NaN / +inf (k_round: the
    drafts each lane keeps): rounds with a sampled lane. The engine core drafts nothing
    from such a row (hyspec.core.round._draft_one: NonFiniteLogits); a sampled lane's
    accept test would read a distribution q of NaN for it and emit tokens the target
    never gave (a damaged MTP head). A greedy round's output does not depend on its
    drafts (any proposal is verified against the target's argmax): it keeps them."""
    return regime is not None and regime.sampled


def padded_size(n: int, sizes=BATCH_SIZES) -> int:
    """The captured batch size a round of n lanes runs at (the smallest size >= n)."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} lanes > the largest captured batch size {max(sizes)}")


def _pm(pmin: bool) -> tuple:
    """The graph-key suffix of a round with the lanes' p_min (none without: the keys of the
    rounds without it are unchanged)."""
    return ("pmin",) if pmin else ()


class BatchDecoder:

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
        self.sizes = tuple(s for s in sizes if s < slots) + (slots,)  # the batch sizes rounds run at
        self.lane_rows = max(k_max + 2, 2)  # drafter fill rows per lane
        self.rows_cap = slots * self.lane_rows  # runner buffer rows
        self.max_len = max_len
        self.capacity = max_len + 2 * (k_max + 2) + 8
        self.graphs = cuda if graphs is None else graphs
        if self.graphs and not cuda:
            raise ValueError("BatchDecoder: CUDA graphs need a CUDA model")
        self.use_fla = cuda if use_fla is None else use_fla
        # prompts (or resumed feeds) of at most this many tokens prefill through the runner's
        # kernels (one eager forward of T rows, BatchDecoder.prefill) instead of the model's
        # modules: on a GPU the modules' ~2,700 launches take ~60 ms of host time at b2 for
        # ~7 ms of kernels (bench/results/prefill_profile_h200.json); 0 = always the modules.
        # Half-precision models on a GPU only: fp32 / fp64 models (parity checks, tests) keep
        # the chunked prefill, the reference's own algorithm (T recurrent steps leave a state
        # ~1e-4 further from it in fp32 log-probs: tests/test_batch_decoder.py)
        half = self.dtype in (torch.float16, torch.bfloat16)
        self.fast_prefill_max = number("HYSPEC_FAST_PREFILL") if cuda and half else 0
        self.backend = "triton"

        dev, dt = self.dev, self.dtype
        S, L = slots, self.capacity
        self.gdn_index, self.attn_index = layer_indices(cfg)
        G, A = len(self.gdn_index), len(self.attn_index)
        Hkv, D = cfg.num_key_value_heads, cfg.head_dim
        self.kv_k = [torch.zeros(S, Hkv, L, D, device=dev, dtype=dt) for _ in range(A)]  # A x [S, Hkv, L, D]
        self.kv_v = [torch.zeros(S, Hkv, L, D, device=dev, dtype=dt) for _ in range(A)]  # A x [S, Hkv, L, D]
        W, C = cfg.linear_conv_kernel_dim, cfg.conv_dim
        nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv = torch.zeros(G, S, W - 1, C, device=dev, dtype=dt)  # [G, S, W-1, C]
        self.ssm = torch.zeros(G, S, nv, dk, dv, device=dev, dtype=ssm_store_dtype(cfg, dt))  # [G, S, Hv, Dk, Dv]
        self.conv_in = torch.zeros(G, S * self.t_max, C, device=dev, dtype=dt)  # [G, S*t_max, C] lane b's rows at b*t..
        self.has_mtp = model.has_mtp
        if self.has_mtp:
            self.draft_k = torch.zeros(S, Hkv, L, D, device=dev, dtype=dt)  # [S, Hkv, L, D] drafter KV
            self.draft_v = torch.zeros(S, Hkv, L, D, device=dev, dtype=dt)  # [S, Hkv, L, D]
        self.d2t = draft_vocab(model)  # (ids [V'], head [V', H]) of a reduced draft vocabulary, or None

        long = dict(device=dev, dtype=torch.long)
        H = cfg.hidden_size
        R = self.lane_rows
        self.lane_ids = torch.arange(S, **long)  # [S] 0..S-1
        self.pos = torch.zeros(S, **long)  # [S] tokens in each lane's cache
        self.pending = torch.zeros(S, **long)  # [S] the next token to verify
        self.k_lane = torch.zeros(S, **long)  # [S] drafts the lane uses this round (0: plain)
        self.spec_lane = torch.zeros(S, **long)  # [S] 1: a speculative request (its k may be 0 in a round)
        self.live = torch.zeros(S, **long)  # [S] 1: a sequence sits here (padding lanes do not advance)
        self.fill_start = torch.zeros(S, **long)  # [S] draft-KV row of the lane's first fill row
        self.fill_rows = torch.ones(S, **long)  # [S] valid fill rows per lane
        self.fill_tokens = torch.zeros(S, R, **long)  # [S, R] the fill rows' tokens
        self.fill_h = torch.zeros(S, R, H, device=dev, dtype=dt)  # [S, R, H] their hiddens
        self.h_last = torch.zeros(S, H, device=dev, dtype=dt)  # [S, H] hidden of the last committed row
        self.verify_tokens = torch.zeros(S, self.t_max, **long)  # [S, t_max] pending, d1..dk
        self.argmax = torch.zeros(S, self.t_max, **long)  # [S, t_max] the target's choice per verify row
        self.seed_hidden = torch.zeros(S, self.t_max, H, device=dev, dtype=dt)  # [S, t_max, H] verify hiddens
        self.result = torch.zeros(S, 3 + k_max, **long)  # [S, 3 + k_max] accepted n, bonus, d1..dk, bad row
        self.n_keep = torch.zeros(S, **long)  # [S] the round's kept drafts per lane (commit scratch)
        self.j_keep = torch.zeros(S, **long)  # [S] n_keep + 1: the verify rows the lane keeps
        self.forced_tokens = torch.zeros(S, L * max(k_max, 1), **long)  # [S, L * k_max] forced drafter
        self.hidden = "post"  # the target hidden that seeds the drafter (the graph round: post only)
        self.sampling_table = dsamp.SamplingTable(S, device=dev)  # per-lane sampling parameters [S]
        self.draft_probs = None  # [S, k_max, V] float64: the drafter's distributions (sampled rounds; made on first use)
        self.window = None  # PenaltyWindow [S]: each lane's penalty window (made when a lane first has penalties)
        self.window_scratch = None  # PenaltyWindow [S]: the window advanced over a round's drafts
        self.row_counts = None  # [S * t_max, V] int32: the verify rows' counts (penalised rounds)
        self.bias = None  # [S, V] float32: each lane's logit_bias row, -0.0 off its ids (made when first needed)
        # constrained lanes (docs/constraints.md, "On the CUDA-graph path"): the allowed-token
        # bits of every verify row, llguidance's layout (token v = bit v % 32 of word v // 32);
        # row j is the constraint's state after the round's drafts d1..dj, so it masks draft
        # j+1 and verify row j. An unconstrained lane's rows are all ones.
        V = cfg.vocab_size
        self.mask_words = (V + 31) // 32
        self.mask = torch.full((self.t_max, S, self.mask_words), -1, device=dev, dtype=torch.int32)  # [t_max, S, W]
        # the host's copy the rows are written into and uploaded from (pinned: asynchronous copies)
        self.mask_host = torch.full((self.t_max, S, self.mask_words), -1, dtype=torch.int32,
                                    pin_memory=True) if cuda else self.mask  # [t_max, S, W]
        self.mask_host_ones = [True] * S  # per lane: its host rows are all ones (kept by the round driver)
        cols = torch.arange(V, device=dev)
        self.bit_word = cols >> 5  # [V] the word holding token v's bit
        self.bit_shift = (cols & 31).to(torch.int32)  # [V] its bit
        # each lane's stop ids (-1: none; a lane with more keeps the first STOP_SLOTS): the
        # commit ends at a stop token among the accepted drafts, as the engine core's does
        self.stop_ids = torch.full((S, STOP_SLOTS), -1, **long)  # [S, STOP_SLOTS]
        # [S, k_max] a sampled round's drafter rows: 0 where depth i's row held NaN / +inf, else
        # NO_BAD_ROW (hyspec.kernels.commit.bad_rows, one launch a draft; _cut_bad_drafts)
        self.draft_bad = torch.full((S, max(k_max, 1)), NO_BAD_ROW, **long)
        self.depths = torch.arange(max(k_max, 1), **long)
        self.k_round = torch.zeros(S, **long)  # [S] masked / p_min rounds: drafts the lane really has (a dead
        # mask or a draft below the lane's p_min ends them)
        self.p_min = torch.zeros(S, device=dev, dtype=torch.float64)  # [S] SpecOptions.p_min per lane (0: off)
        self.draft_h = torch.zeros(S, H, device=dev, dtype=dt)  # [S, H] masked rounds: the MTP hidden between graphs
        self.draft_lg = torch.zeros(S, V, device=dev, dtype=dt)  # [S, V] ... and its draft logits

        from hyspec.gpu.runner_triton import TritonRunner

        self.runner = TritonRunner(self, exact=exact)
        self.step_graphs = StepGraphs(self.graphs, dev, self._mutable, pdl=lambda: (
            self.runner.pdl, self.runner.pdl_skip, self.runner.pdl_late))

    # -- lane views for the model's own modules (prefill) ------------------------------
    def _kvbuf(self, k: torch.Tensor, v: torch.Tensor) -> KVBuffer:
        buf = KVBuffer.__new__(KVBuffer)
        buf.k, buf.v = k, v
        return buf

    def slot_bytes(self) -> int:
        """Device bytes of one lane's state (KV, draft KV, conv, SSM, fill rows)."""
        per = [t[0] for t in self.kv_k + self.kv_v] + [self.conv[:, 0], self.ssm[:, 0], self.fill_h[0]]
        if self.has_mtp:
            per += [self.draft_k[0], self.draft_v[0]]
        return sum(t.numel() * t.element_size() for t in per)

    # -- admission ---------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, lane: int, prompt: list[int], start: int = 0):
        """Run prompt tokens into lane's state at positions start.., eagerly with the model's
        modules (fla's chunked kernel on CUDA when it imports): from a reset state (start = 0),
        or continuing a stored state that load() wrote (start = its pos: the tokens are then
        the state's pending token and the new ones). Returns (pre [T, H], post [T, H],
        logits [1, V]) of the T tokens run."""
        P = start + len(prompt)
        if P + 1 > self.max_len:
            raise ValueError(f"prompt of {P} tokens does not fit the decoder's max_len {self.max_len}")
        if start == 0:
            self.conv[:, lane].zero_()
            self.ssm[:, lane].zero_()
        elif int(self.pos[lane]) != start:
            raise ValueError(f"lane {lane} holds {int(self.pos[lane])} positions, not the {start} a resumed prefill "
                             "continues from (load the state first)")
        if 0 < len(prompt) <= self.fast_prefill_max:
            return self._prefill_rows(lane, prompt, start)
        kv = {i: self._kvbuf(self.kv_k[a][lane], self.kv_v[a][lane]) for i, a in self.attn_index.items()}
        pre, post, logits = prefill_into(self, prompt, kv, lambda g: self.conv[g, lane], lambda g: self.ssm[g, lane],
                                         start=start)
        self.pos[lane] = P
        return pre, post, logits

    def _prefill_rows(self, lane: int, prompt: list[int], start: int):
        """prefill() through the runner: the T tokens as T rows of one lane in one eager
        target forward (the decode step's kernels: each Gated-DeltaNet layer runs the rows
        one after another into the state, the attention writes and reads the lane's KV rows
        causally), then the last row's logits. A few hundred launches instead of the
        model modules' thousands; the state is that of T decode steps' kernels (not the
        chunked prefill's bits: the prefix store's and a session's resumed states, and a
        short prompt's, come from here)."""
        from hyspec.model.ops import upcast

        T = len(prompt)
        self.pos[lane] = start
        r = self.runner
        r.lane_base = lane
        try:
            pre, post = r.target(torch.tensor(prompt, device=self.dev), T, self.pos[lane: lane + 1], False, 1)
            logits = upcast(r.logits(post[-1:]))
            pre, post = pre[:T].clone(), post[:T].clone()  # (the runner's buffers: the next forward reuses them)
        finally:
            r.lane_base = 0
        self.pos[lane] = start + T
        return pre, post, logits

    @torch.no_grad()
    def start(self, lane: int, prompt: list[int], pre, post, pending: int, k: int, carry=None) -> None:
        """After prefill: lane drafts k per round (0 = plain), pending is the first token;
        prompt is the whole history before it. The drafter rows of the prefilled tokens are
        filled now (the engine core's Scheduler._start, one MTP prefill), after the queued
        rows of a resumed state (carry: hyspec.core.state.Carry; None: a fresh prompt from
        row 0); the last pair (pending, its hidden) is the first round's fill."""
        if k > self.k_max:
            raise ValueError(f"k={k} > the decoder's k_max {self.k_max}")
        if k > 0 and not self.has_mtp:
            raise no_mtp_error()
        seed = post if self.hidden == "post" else pre  # [T, H] the prefilled tokens' hiddens
        P = len(prompt)
        if k > 0:
            fed = list(prompt[P - seed.shape[0]:])  # the tokens this prefill ran
            if carry is None:
                carry = Carry([], seed[:0], 0, seed[:0], True)
            # pairs (token r+1, hidden r): the queued ones, the fed tokens with their hiddens
            # (the first pairs with h_last when it was not queued), then (pending, last hidden)
            toks = list(carry.tokens) + (fed[1:] if carry.first_queued else fed) + [pending]
            hs = torch.cat([carry.h] + ([] if carry.first_queued else [carry.h_last]) + [seed])
            m = len(toks)
            if m > 1:
                self.model.mtp_hidden(torch.tensor(toks[:-1], device=self.dev), hs[:-1], StepCtx(start=carry.start),
                                      self._kvbuf(self.draft_k[lane], self.draft_v[lane]))
            fill_start = carry.start + m - 1
        else:
            fill_start = P - 1
        self.fill_tokens[lane].zero_()
        self.fill_tokens[lane, 0] = pending
        self.fill_h[lane, 0] = seed[-1]
        self.fill_start[lane] = fill_start
        self.fill_rows[lane] = 1
        self.h_last[lane] = seed[-1]
        self._go(lane, pending, k, list(prompt) + [pending])

    def prefill_start(self, lane: int, prompt: list[int], k: int, pending: int | None = None) -> torch.Tensor:
        """Prefill lane with prompt and start it with `pending` as its next token (None:
        greedily, the argmax of the last row), k drafts per round: the set-up of the bench's
        and tuning's graph timings, and of a transcript's state (batch_loop.state_of).
        -> the last row's logits [1, V]."""
        pre, post, logits = self.prefill(lane, prompt)
        self.start(lane, prompt, pre, post, int(torch.argmax(logits[0])) if pending is None else int(pending), k)
        return logits

    def _go(self, lane: int, pending: int, k: int, history: list[int]) -> None:
        self.pending[lane] = pending
        self.k_lane[lane] = k
        self.spec_lane[lane] = int(k > 0)
        self.live[lane] = 1
        self._load_window(lane, history)

    # -- sequence states (hyspec.core.state.SeqState: the prefix store's entries) --------
    @torch.no_grad()
    def load(self, lane: int, st, drafter: bool) -> None:
        """Write a stored state into lane: every linear layer's conv window and SSM state,
        the attention KV rows below st.pos, and (drafter: the lane will draft) the draft KV
        rows below st.fill_start; pos = st.pos. Every row above is written before it is read
        (by the prefill, the verify, the drafter's fill). Then prefill(lane, feed, st.pos)
        and start(..., carry), or resume()."""
        P = st.pos
        if P + 1 > self.max_len:
            raise ValueError(f"a state of {P} positions does not fit the decoder's max_len {self.max_len}")
        if len(st.conv) != self.conv.shape[0] or len(st.kv_k) != len(self.kv_k):
            raise ValueError("the state is not of this model (its layer counts differ)")
        for g, (cv, sm) in enumerate(zip(st.conv, st.ssm)):
            self.conv[g, lane].copy_(cv)
            self.ssm[g, lane].copy_(sm)
        for a, (k, v) in enumerate(zip(st.kv_k, st.kv_v)):
            self.kv_k[a][lane, :, :P].copy_(k)
            self.kv_v[a][lane, :, :P].copy_(v)
        if drafter:
            if st.drafter != self.hidden or st.draft_k is None:
                raise ValueError(f"the state has no drafter rows built with hidden={self.hidden!r}")
            n = st.draft_k.shape[1]
            self.draft_k[lane, :, :n].copy_(st.draft_k)
            self.draft_v[lane, :, :n].copy_(st.draft_v)
        self.pos[lane] = P

    @torch.no_grad()
    def resume(self, lane: int, st) -> None:
        """After load(): a plain lane (k = 0) goes on from a state whose pending token is the
        next to run, with no prefill (a request whose prompt is exactly the stored
        transcript): the lane is then what the lane that made the state was between two
        steps. (A drafting lane prefills the pending token instead, as the engine core
        resumes: hyspec.gpu.batch_loop.BatchRunner._admit.)"""
        if st.pending is None:
            raise ValueError("a state without a pending token has nothing to run: prefill the new tokens")
        self.fill_tokens[lane].zero_()  # a plain lane's fill rows are never read
        self.fill_tokens[lane, 0] = st.pending
        self.fill_h[lane].zero_()
        self.fill_start[lane] = max(st.pos - 1, 0)
        self.fill_rows[lane] = 1
        self.h_last[lane].zero_()
        self._go(lane, st.pending, 0, list(st.tokens))

    @torch.no_grad()
    def export(self, lane: int, tokens: list[int], k: int):
        """Lane's state between rounds as a SeqState (copies), in the engine core's layout
        (hyspec.core.state.capture): tokens is the transcript (prompt + emitted tokens, the
        last one pending). None when the lane's state is not that transcript's: the device
        committed past the last emitted token (a stop token among accepted drafts, or a
        pipelined round after the stop).

        Same as the core: conv / SSM state, KV rows below pos, the pending token, and for a
        drafting lane (k > 0) the draft KV rows below fill_start, h_last and the queued
        drafter rows (the lane's fill rows). Not kept: last_logits (None; the row that chose
        the pending token: a state with a pending token never reads it, its next turn runs
        the pending token first). The queue can be shorter than the core's for the same
        sequence (after a round that drafted nothing the core keeps its rows queued; the
        lane's fill ran them): the same pairs, written to the draft KV rows one step earlier."""
        from hyspec.core.state import SeqState

        P, pending = int(self.pos[lane]), int(self.pending[lane])
        if P != len(tokens) - 1 or pending != tokens[-1]:
            return None
        G = self.conv.shape[0]
        st = SeqState(tuple(int(t) for t in tokens), P, [self.conv[g, lane].clone() for g in range(G)],
                      [self.ssm[g, lane].clone() for g in range(G)],
                      [kk[lane, :, :P].clone() for kk in self.kv_k], [vv[lane, :, :P].clone() for vv in self.kv_v],
                      pending, k_next=k)
        if k > 0:
            fs, n = int(self.fill_start[lane]), int(self.fill_rows[lane])
            st.drafter = self.hidden
            st.draft_k, st.draft_v = self.draft_k[lane, :, :fs].clone(), self.draft_v[lane, :, :fs].clone()
            st.h_last = self.h_last[lane: lane + 1].clone()
            st.fill_tokens, st.fill_h, st.fill_start = self.fill_tokens[lane, :n].tolist(), self.fill_h[lane, :n].clone(), fs
        return st

    def set_stops(self, lane: int, stop_ids) -> None:
        """Lane's stop ids for the commit's cut (the first STOP_SLOTS of them, in sorted order)."""
        ids = sorted(int(t) for t in stop_ids)[:STOP_SLOTS]
        self.stop_ids[lane].fill_(-1)
        if ids:
            self.stop_ids[lane, : len(ids)] = torch.tensor(ids, device=self.dev)

    def set_p_min(self, lane: int, p_min: float) -> None:
        """Lane's SpecOptions.p_min (0: off): a round run with p_min=True ends the lane's
        drafts at the first whose drafter probability is below it (_pmin_cut)."""
        self.p_min[lane].fill_(float(p_min))

    def set_params(self, lane: int, params) -> None:
        """Lane's SamplingParams (None or greedy without penalties: argmax). Call before
        start(), which loads a penalised lane's window from its prompt."""
        if params is not None and params.has_penalties and self.window is None:
            V = self.cfg.vocab_size
            self.window = PenaltyWindow(self.slots, V, capacity=self.max_len, device=self.dev)
            self.window_scratch = PenaltyWindow(self.slots, V, capacity=self.max_len, device=self.dev)
            self.row_counts = torch.zeros(self.slots * self.t_max, V, dtype=torch.int32, device=self.dev)
        if getattr(params, "logit_bias", ()) or self.bias is not None:  # (a lane's row is written at its
            dsamp.fill_bias_row(self._bias_buffer()[lane], params)  # admission: free leaves it)
        self.sampling_table.set(lane, params)

    def _bias_buffer(self) -> torch.Tensor:
        if self.bias is None:
            self.bias = torch.full((self.slots, self.cfg.vocab_size), -0.0, device=self.dev, dtype=torch.float32)
        return self.bias

    def bias_rows(self, nb: int, t: int, regime) -> torch.Tensor | None:
        """The lanes' logit_bias rows for their nb * t rows (lane i's row repeated t times),
        [nb * t, V]; None where no lane of the round has a bias (regime.bias false)."""
        if regime is None or not regime.bias:
            return None
        b = self._bias_buffer()[:nb]
        return b if t == 1 else b[:, None].expand(nb, t, b.shape[1]).reshape(nb * t, b.shape[1])

    def _load_window(self, lane: int, history: list[int]) -> None:
        """The lane's penalty window over its history (prompt + the pending token). A window
        at least max_len long holds every token a lane can have: it is the whole history (-1)."""
        if self.window is None:
            return
        p = self.sampling_table.params[lane]
        n = p.penalty_last_n if p.has_penalties else 0
        self.window.load(lane, history, -1 if n >= self.max_len else n)

    def verify_counts(self, nb: int, t: int) -> torch.Tensor:
        """int32 [nb, t, V]: the counts each verify row is penalised with (the lane's window
        plus the drafts before the row)."""
        out = self.row_counts[: nb * t].view(nb, t, -1)
        return row_counts(self.window.head(nb), self.verify_tokens[:nb, 1:t], self.window_scratch.head(nb), out)

    def set_forced(self, lane: int, table: torch.Tensor | None) -> None:
        """table [capacity, k_max] (the forced drafter's token at (position, depth)) for lane."""
        self.forced_tokens[lane].zero_()
        if table is not None:
            n = min(table.numel(), self.forced_tokens.shape[1])
            self.forced_tokens[lane, :n].copy_(table.reshape(-1)[:n].to(self.dev))

    def _lane_tensors(self) -> list[torch.Tensor]:
        """The per-lane tensors with the lane axis first (a lane move copies row src to dst)."""
        tb = self.sampling_table
        tensors = [self.pos, self.pending, self.k_lane, self.spec_lane, self.live, self.fill_start, self.fill_rows,
                   self.fill_tokens, self.fill_h, self.h_last, self.forced_tokens, self.stop_ids,
                   self.p_min] + tb.fields() + self.kv_k + self.kv_v
        if self.has_mtp:
            tensors += [self.draft_k, self.draft_v]
        if self.window is not None:
            tensors += [self.window.last_n, self.window.length, self.window.ring, self.window.counts]
        if self.bias is not None:
            tensors.append(self.bias)
        return tensors

    @torch.no_grad()
    def move(self, src: int, dst: int) -> None:
        """Lane src's whole state into lane dst (bitwise); src becomes idle."""
        if src == dst:
            return
        for t in self._lane_tensors():
            t[dst].copy_(t[src])
        self.conv[:, dst].copy_(self.conv[:, src])
        self.ssm[:, dst].copy_(self.ssm[:, src])
        self.sampling_table.params[dst] = self.sampling_table.params[src]
        self.mask_host_ones[dst] = False  # the driver rewrites dst's host mask rows before they are used
        self.free(src)

    def free(self, lane: int) -> None:
        """An idle lane: position 0, not live (padding rounds leave it there)."""
        self.live[lane] = 0
        self.pos[lane] = 0
        self.fill_start[lane] = 0
        self.fill_rows[lane] = 1
        self.k_lane[lane] = 0
        self.spec_lane[lane] = 0
        self.p_min[lane] = 0.0
        self.stop_ids[lane].fill_(-1)
        self.sampling_table.set(lane, None)
        if self.window is not None:
            self.window.last_n[lane] = 0

    # -- the round bodies (graph-captured) ---------------------------------------------
    def _masked(self, logits: torch.Tensor, words: torch.Tensor, bad: bool = False):
        """Rows of logits [r, V] with the tokens their mask words [r, W] do not allow at -inf.
        Returns (masked logits, allowed [r, V] bool, dead [r] bool), and with bad=True also
        bad [r] bool: an allowed token's logit is NaN or +inf (the engine core masks, then
        checks: hyspec.core.round.masked, NonFiniteLogits). A dead row (no allowed token
        with a finite logit: an empty mask, a reduced draft vocabulary scoring none of the
        allowed tokens, or a bad row) keeps its unmasked logits, so nothing downstream sees
        a row without mass; the round driver / commit treat its choice as no token."""
        allowed = ((words.index_select(1, self.bit_word) >> self.bit_shift) & 1).bool()
        m = logits.masked_fill(~allowed, float("-inf"))
        dead = ~torch.isfinite(m).any(-1)
        out = (torch.where(dead[:, None], logits, m), allowed, dead)
        return out + (~(m < float("inf")).all(-1),) if bad else out

    def _decode_forward(self, nb: int):
        """The plain step's target forward for lanes 0..nb-1: logits [nb, V] (the runner's buffer)."""
        _, post = self.runner.target(self.pending[:nb], nb, self.pos, False, nb)
        return self.runner.logits(post)

    def _penalised(self, regime) -> bool:
        return regime is not None and regime.penalties

    def _decode_pick(self, nb: int, logits: torch.Tensor, regime, masked: bool) -> None:
        """The plain step's token per lane from logits [nb, V] -> result, pending, pos.
        regime (a SampledGraphKey; None: argmax only): the sampling work on the device."""
        bad = None
        if masked:  # mask row 0: the constraint's state now
            logits, _, dead, bad = self._masked(logits, self.mask[0, :nb], bad=True)
        if regime is not None:  # the token at position pos + 1, stream PLAIN (hyspec.core.round.choose_token)
            counts = self.window.head(nb).counts if self._penalised(regime) else None
            token, best = plain_draws(logits, table_rows(self.sampling_table, nb), self.pos[:nb] + 1, regime, counts,
                                      with_best=True, bias=self.bias_rows(nb, 1, regime))
            self._bad_rows(nb, 1, logits, best, bad)
        else:
            token = self.runner.argmax(logits)
            self._bad_rows(nb, 1, logits, token, bad)
        self.result[:nb, 0].zero_()
        self.result[:nb, 1].copy_(torch.where(dead, -1, token) if masked else token)  # -1: no token allowed
        self.pending[:nb].copy_(token)
        if self._penalised(regime):
            self.window.head(nb).push(token, self.live[:nb] > 0)
        self.pos[:nb].add_(self.live[:nb])

    def _bad_rows(self, nb: int, t: int, logits: torch.Tensor, argmax: torch.Tensor | None, bad=None,
                  out: torch.Tensor | None = None) -> None:
        """out (default result[:, -1]) [:nb] = each lane's first row (of t, logits [nb * t, V]) that holds NaN
        or +inf, else NO_BAD_ROW: the row's value at its argmax [nb, t] is NaN (torch's and
        argmax_rows' pick the first NaN) or +inf exactly when the row holds one -- a gather,
        no pass over the vocabulary (hyspec.kernels.commit.bad_rows: one launch). The engine
        core's rule (hyspec.sampling.greedy_token / filter_probs: NonFiniteLogits), which
        penalties do not change (finite factors keep NaN and +inf). bad [nb * t] (a masked
        round's, from _masked): the rows' flags as the constraint's masks leave them.
        argmax None (t = 1; the torch ops' draws made none): made here."""
        out = self.result[:, -1] if out is None else out
        if bad is not None:
            first_flagged(bad.view(nb, t), out, NO_BAD_ROW)
            return
        if argmax is None:
            argmax = self.runner.argmax(logits)
        check = bad_rows if self.runner.commit_kernel else bad_rows_ref
        check(logits, argmax if argmax.dim() == 2 else argmax[:, None], out, nb, t, NO_BAD_ROW)

    def _decode_body(self, nb: int, regime=None) -> None:
        """Plain step for lanes 0..nb-1: pending -> target -> argmax (or a draw) -> pending."""
        self._decode_pick(nb, self._decode_forward(nb), regime, False)

    def _draft_fill(self, nb: int) -> torch.Tensor:
        """The drafter over each lane's fill rows: the hidden [nb, H] of its last fill row."""
        R = self.lane_rows
        h = self.runner.mtp(self.fill_tokens[:nb].reshape(-1), self.fill_h[:nb].reshape(nb * R, -1),
                            self.fill_start, 0, nb)
        return h.view(nb, R, -1)[self.lane_ids[:nb], self.fill_rows[:nb] - 1]  # [nb, H]

    def _draft_choose(self, nb: int, i: int, forced: bool, regime, hidden: torch.Tensor | None = None,
                      masked: bool = False, pmin: bool = False) -> torch.Tensor:
        """Draft i (the token at position pos + 1 + i) of every lane: from the MTP hidden
        [nb, H] (unmasked), or masked: from the draft logits kept in draft_lg under mask row
        i. Into verify_tokens[:, 1 + i] (and, for the rejection test, its distribution into
        draft_probs). A penalised regime penalises it with the lane's window plus drafts
        0..i-1 (window_scratch: copied from the window at draft 0, each draft pushed).
        pmin: the lanes' p_min applies (_pmin_cut; k_round holds the drafts each lane keeps)."""
        runner = self.runner
        sampled = regime is not None
        keep_q = sampled and regime.sampled and regime.rejection  # only the rejection test reads q
        scratch = self.window_scratch.head(nb) if self._penalised(regime) else None
        if scratch is not None and i == 0:
            scratch.copy_(self.window.head(nb))
        if masked:  # mask row i: the constraint after drafts d1..di; a dead row ends the lane's drafts,
            # and so does a row whose allowed logits hold NaN / +inf (drafter_cut)
            logits, allowed, dead, bad = self._masked(self.draft_lg[:nb], self.mask[i, :nb], bad=True)
            kr = self.k_round[:nb]
            kr.masked_fill_((dead | bad) & (kr > i), i)
        pmin = pmin and not forced  # (the forced drafter's proposal is certain: it never stops, as on the core)
        if not masked and (sampled or pmin):
            logits = runner.draft_logits(hidden)
        counts = scratch.counts if scratch is not None else None
        q = None
        if sampled:  # draft i is the token at position pos + 1 + i (stream DRAFT)
            q, draft, best = draft_draws(logits, table_rows(self.sampling_table, nb), self.pos[:nb] + 1 + i, regime,
                                         counts, with_best=True, bias=self.bias_rows(nb, 1, regime))
            if not masked and drafter_cut(regime):  # (the cut itself: _cut_bad_drafts, once a round)
                self._bad_rows(nb, 1, logits, best, out=self.draft_bad[:, i])
        elif masked:
            draft = logits.argmax(-1)
        elif pmin:  # the logits are here for the p_min test: their argmax is draft_argmax's id, without a
            draft = runner.argmax(logits)  # second drafter head
        else:  # (draft_argmax: the argmax of draft_logits without a [nb, V] row for a reduced draft vocabulary)
            draft = runner.draft_argmax(hidden)
        if pmin:
            q = self._pmin_cut(nb, i, logits, draft, q, keep_q, counts, self.bias_rows(nb, 1, regime))
        if forced:
            K = max(self.k_max, 1)
            idx = (self.pos[:nb] + (1 + i)) * K + i
            draft = self.forced_tokens[:nb].gather(1, idx[:, None])[:, 0]
            if masked:  # a forced token the constraint forbids: the masked argmax (hyspec.core.round)
                draft = torch.where(allowed.gather(1, draft[:, None])[:, 0], draft, logits.argmax(-1))
            if keep_q:  # a deterministic proposal: q is one-hot at it
                q = torch.zeros_like(q).scatter_(1, draft[:, None], 1.0)
        if keep_q:
            self.draft_probs[:nb, i].copy_(q)
        self.verify_tokens[:nb, 1 + i].copy_(draft)
        if scratch is not None:
            scratch.push(draft)
        return draft

    def _cut_bad_drafts(self, nb: int, k: int) -> None:
        """k_round = min(k_round, the first depth whose drafter row held NaN / +inf) per
        lane, from draft_bad[:, :k] (each draft's row checked at the argmax its draws made,
        which holds NaN / +inf exactly where the row holds one, penalties keeping both
        where they are: hyspec.kernels.commit.bad_rows): four launches a round."""
        first = torch.where(self.draft_bad[:nb, :k] == 0, self.depths[:k], k).amin(1)  # [nb]
        torch.minimum(self.k_round[:nb], first, out=self.k_round[:nb])

    def _pmin_cut(self, nb: int, i: int, logits: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None,
                  keep_q: bool, counts: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """The lanes' p_min at draft i, as the engine core's _draft_one applies it: the
        drafter's probability of its draft (a greedy lane: the softmax of its draft logits,
        penalised as its choice was, at the draft; a sampled lane: q at the draft) below the
        lane's p_min ends its drafts here (k_round = i: the accept test and the commit see
        the drafts before it only). A kept sampled draft is distributed as q restricted to
        {q >= p_min}, so the rejection test gets that row, renormalised. Lanes with p_min 0
        are untouched. logits [nb, V] the draft logits (masked ones in a masked round);
        q [nb, V] float64 or None (no sampling regime). -> q with those rows changed."""
        pm = self.p_min[:nb]  # [nb]
        on = pm > 0
        table = table_rows(self.sampling_table, nb)
        # greedy lanes' values (biased, penalised)
        x0 = dsamp._penalised(logits, table, counts, bias) if counts is not None or bias is not None else logits
        prob = softmax_of_rows(x0).gather(1, draft[:, None])[:, 0]  # [nb] float64
        if q is not None:
            prob = torch.where(table.greedy, prob, q.gather(1, draft[:, None])[:, 0])
        kr = self.k_round[:nb]
        kr.masked_fill_(on & (prob < pm) & (kr > i), i)
        if q is None or not keep_q:
            return q
        kept = q * (q >= pm[:, None])  # [nb, V]
        z = sums_of_rows(kept)  # [nb] (0 only where the draft itself was cut: that row is never read)
        use = on & ~table.greedy & (z > 0)
        return torch.where(use[:, None], kept / torch.where(use, z, 1.0)[:, None], q)

    def _ensure_draft_probs(self, regime) -> None:
        if regime is not None and self.draft_probs is None:
            self.draft_probs = torch.zeros(self.slots, max(self.k_max, 1), self.cfg.vocab_size, device=self.dev,
                                           dtype=torch.float64)

    def _draft_body(self, nb: int, k: int, forced: bool, regime=None, pmin: bool = False) -> None:
        if k == 0:
            return
        self._ensure_draft_probs(regime)
        runner = self.runner
        if pmin or drafter_cut(regime):  # the drafts each lane keeps: k_lane, cut at a draft
            self.k_round[:nb].copy_(self.k_lane[:nb])  # below the lane's p_min or at a bad drafter row
        hidden = self._draft_fill(nb)  # [nb, H] each lane's last fill row
        chain = self.fill_start + self.fill_rows  # draft-KV row of the first chained step, per lane
        for i in range(k):
            draft = self._draft_choose(nb, i, forced, regime, hidden=hidden, pmin=pmin)
            if i + 1 < k:
                hidden = runner.mtp(draft, hidden, chain, i, nb)
        if drafter_cut(regime):
            self._cut_bad_drafts(nb, k)

    # masked rounds: the same draft as three kinds of graphs, so the host can compute each
    # depth's mask from the drafts before it while the device runs the drafter
    def _cfill_body(self, nb: int) -> None:
        """Fill rows -> hidden and draft logits of depth 0 (kept in draft_h / draft_lg)."""
        self.draft_h[:nb].copy_(self._draft_fill(nb))
        self.draft_lg[:nb].copy_(self.runner.draft_logits(self.draft_h[:nb]))
        self.k_round[:nb].copy_(self.k_lane[:nb])

    def _cpick_body(self, nb: int, i: int, forced: bool, regime, pmin: bool = False) -> None:
        """Draft i under mask row i."""
        self._draft_choose(nb, i, forced, regime, masked=True, pmin=pmin)

    def _cadv_body(self, nb: int, i: int) -> None:
        """One chained drafter step on draft i -> hidden and draft logits of depth i + 1."""
        chain = self.fill_start + self.fill_rows
        h = self.runner.mtp(self.verify_tokens[:nb, 1 + i].contiguous(), self.draft_h[:nb], chain, i, nb)
        self.draft_h[:nb].copy_(h)
        self.draft_lg[:nb].copy_(self.runner.draft_logits(self.draft_h[:nb]))

    def _verify_body(self, nb: int, t: int) -> None:
        self.verify_tokens[:nb, 0].copy_(self.pending[:nb])
        pre, post = self.runner.target(self.verify_tokens[:nb, :t].reshape(-1), nb * t, self.pos, True, nb)
        seed = post if self.hidden == "post" else pre
        self.seed_hidden[:nb, :t].copy_(seed.view(nb, t, -1))
        self.argmax[:nb, :t].copy_(self.runner.argmax(self.runner.logits(post)).view(nb, t))

    def _commit_body(self, nb: int, t: int, regime=None, plain: bool = True, masked: bool = False,
                     pmin: bool = False) -> None:
        argmax = self.argmax[:nb, :t]
        # (p_min, a sampled round: the drafts each lane kept)
        k_lane = self.k_round[:nb] if pmin or (t > 1 and drafter_cut(regime)) else self.k_lane[:nb]
        if masked:  # verify row j under mask row j (in place: the sampled accept reads the buffer)
            logits = self.runner.bufs.logits[: nb * t]
            m, _, dead, bad = self._masked(logits, self.mask[:t, :nb].transpose(0, 1).reshape(nb * t, -1), bad=True)
            logits.copy_(m)
            argmax.copy_(m.argmax(-1).view(nb, t))
            k_lane = self.k_round[:nb]
        self._bad_rows(nb, t, self.runner.bufs.logits, argmax, bad if masked else None)  # (before the
        # sampled accept, which may work in the logits buffer)
        accepted = accept_sampled(self, nb, t, regime, plain, k_lane) if regime is not None else None
        # the accept test (greedy: the drafts the target's argmax agrees with, up to k_lane),
        # the stop cut and the next round's buffers, one launch (hyspec.kernels.commit: the
        # state keeps pending + the accepted drafts up to a stop token among them, which then
        # stays pending, as the engine core's run_round does; the result row (n, bonus, drafts)
        # is the round's own: the host cuts the emitted tokens at the stop itself)
        commit = commit_round if self.runner.commit_kernel else commit_round_ref
        commit(self.argmax, self.verify_tokens, k_lane, self.stop_ids, self.live, self.pos, self.pending,
               self.n_keep, self.j_keep, self.result, self.fill_tokens, self.fill_start, self.fill_rows,
               self.fill_h, self.h_last, self.seed_hidden, nb, t, accepted)
        n_keep, j = self.n_keep[:nb], self.j_keep[:nb]
        # linear layers: state after row n_keep; conv window = rows j..j+W-2 of cat(window, new rows)
        self.runner.commit_linear(n_keep, t, nb)
        gdn_window_commit(self.conv, self.conv_in, j, nb, t)  # (gdn_window_commit_ref: the torch form)
        if self._penalised(regime):  # the emitted tokens into the window: drafts 1..n, then the kept token
            keep = self.pending[:nb]
            emitted = torch.cat([self.verify_tokens[:nb, 1:t], torch.zeros_like(keep)[:, None]], 1).scatter(
                1, n_keep[:, None], keep[:, None])
            self.window.head(nb).push_many(emitted, j * self.live[:nb])
        if masked:  # -1 when the bonus row allows nothing (the drafts are emitted, the lane ends)
            n = self.result[:nb, 0]
            self.result[:nb, 1].copy_(torch.where(dead.view(nb, t)[self.lane_ids[:nb], n], -1, self.result[:nb, 1]))

    # -- launching ---------------------------------------------------------------------
    @staticmethod
    def regime(sampled):
        """A round's sampling regime: a SampledGraphKey, or True (every stage), False / None
        (greedy lanes without penalties: argmax only)."""
        if sampled is True:
            return dsamp.ALL_STAGES
        return sampled or None

    def _regime_of(self, sampled):
        regime = self.regime(sampled)
        if self._penalised(regime) and self.window is None:
            raise ValueError("a penalised round before any lane was given penalties (set_params)")
        if regime is not None and regime.bias:
            self._bias_buffer()  # (before a graph that reads it is captured)
        return regime

    def decode(self, nb: int, sampled=False) -> None:
        regime = self._regime_of(sampled)
        self.step_graphs.run(("decode", nb, regime), lambda: self._decode_body(nb, regime))

    def round(self, nb: int, k: int, forced: bool = False, sampled=False, plain: bool = True,
              pmin: bool = False) -> None:
        """One speculative round (k drafts; lanes with k_lane < k use fewer) for lanes
        0..nb-1; sampled: the lanes' sampling regime (a SampledGraphKey, or True for every
        stage: the graphs with sampling on the device); plain: some lane decodes plainly (k = 0);
        pmin: some lane has a p_min (set_p_min): its drafts end at the first below it, and
        k_round holds the drafts each lane kept."""
        if k > self.k_max:
            raise ValueError(f"k={k} > k_max {self.k_max}")
        regime = self._regime_of(sampled)
        plain = bool(plain) and regime is not None  # the argmax commit serves plain lanes either way
        pmin = bool(pmin) and k > 0
        run = self.step_graphs.run
        if k > 0:
            run(("draft", nb, k, forced, regime) + _pm(pmin), lambda: self._draft_body(nb, k, forced, regime, pmin))
        run(("verify", nb, k + 1), lambda: self._verify_body(nb, k + 1))
        run(("commit", nb, k + 1, regime, plain) + _pm(pmin),
            lambda: self._commit_body(nb, k + 1, regime, plain, pmin=pmin))

    def draft(self, nb: int, k: int, forced: bool = False, sampled=False, pmin: bool = False) -> None:
        """The drafter part of a round alone (its graph: fill + k chained steps; the bench
        times it; a round runs it through round())."""
        regime = self._regime_of(sampled)
        self.step_graphs.run(("draft", nb, k, forced, regime) + _pm(pmin),
                             lambda: self._draft_body(nb, k, forced, regime, pmin))

    # masked rounds (some lane constrained): the host runs these in order, writing mask rows
    # between them (hyspec.gpu.batch_loop): plain: decode_forward, [row 0], decode_pick;
    # speculative: draft_fill, [row 0], (draft_pick i, draft_advance i, [row i + 1]) for
    # i < k - 1, draft_pick k-1, verify, [row k], commit. Each graph is keyed without the
    # constraint: the masks are data.
    def upload_mask(self, nb: int, row: int) -> None:
        """mask_host[row, :nb] -> the device (asynchronous from pinned memory)."""
        if self.mask_host is not self.mask:
            self.mask[row, :nb].copy_(self.mask_host[row, :nb], non_blocking=True)

    def masked_decode_forward(self, nb: int) -> None:
        self.step_graphs.run(("mdecode_fwd", nb), lambda: self._decode_forward(nb))

    def masked_decode_pick(self, nb: int, sampled=False) -> None:
        regime = self._regime_of(sampled)
        self.step_graphs.run(("mdecode_pick", nb, regime),
                             lambda: self._decode_pick(nb, self.runner.bufs.logits[:nb], regime, True))

    def masked_draft_fill(self, nb: int) -> None:
        self.step_graphs.run(("mdraft_fill", nb), lambda: self._cfill_body(nb))

    def masked_draft_pick(self, nb: int, i: int, forced: bool = False, sampled=False, pmin: bool = False) -> None:
        regime = self._regime_of(sampled)
        self._ensure_draft_probs(regime)
        self.step_graphs.run(("mdraft_pick", nb, i, forced, regime) + _pm(pmin),
                             lambda: self._cpick_body(nb, i, forced, regime, pmin))

    def masked_draft_advance(self, nb: int, i: int) -> None:
        self.step_graphs.run(("mdraft_adv", nb, i), lambda: self._cadv_body(nb, i))

    def verify(self, nb: int, t: int) -> None:
        self.step_graphs.run(("verify", nb, t), lambda: self._verify_body(nb, t))

    def masked_commit(self, nb: int, t: int, sampled=False, plain: bool = True) -> None:
        regime = self._regime_of(sampled)
        plain = bool(plain) and regime is not None
        self.step_graphs.run(("commit", nb, t, regime, plain, True),
                             lambda: self._commit_body(nb, t, regime, plain, True))

    def _mutable(self) -> list[torch.Tensor]:
        """What a round writes besides the caches (saved and put back around a capture)."""
        out = [self.pos, self.pending, self.fill_start, self.fill_rows, self.fill_tokens, self.fill_h, self.h_last,
               self.verify_tokens, self.argmax, self.seed_hidden, self.result, self.conv, self.ssm,
               self.k_round, self.draft_h, self.draft_lg]
        if self.window is not None:
            out += [self.window.length, self.window.ring, self.window.counts]
        return out

    def capture(self, sizes, ks, forced=(False,), decode=True, sampled=(False,), masked=(False,),
                plain=(True,)) -> None:
        """Capture the graphs of these batch sizes, draft counts and sampling regimes (False,
        True = every stage, or SampledGraphKeys; plain: with / without plain lanes in the
        speculative rounds) ahead of time (masked=(True,): the constrained rounds' graphs;
        (False, True): both). Rounds with p_min capture their graphs on first use."""
        if not self.graphs:
            return
        regimes = [self._regime_of(sm) for sm in sampled]
        if True in masked:
            self._capture_masked(sizes, ks, forced, decode, regimes, plain)
        if False not in masked:
            return
        ensure = self.step_graphs.ensure
        for nb in sizes:
            for rg in regimes:
                if decode:
                    ensure(("decode", nb, rg), lambda nb=nb, rg=rg: self._decode_body(nb, rg))
                for k in ks:
                    for f in forced:
                        if k > 0:
                            ensure(("draft", nb, k, f, rg), lambda nb=nb, k=k, f=f, rg=rg: self._draft_body(nb, k, f, rg))
                    ensure(("verify", nb, k + 1), lambda nb=nb, k=k: self._verify_body(nb, k + 1))
                    for pl in {bool(p) and rg is not None for p in plain}:
                        ensure(("commit", nb, k + 1, rg, pl),
                               lambda nb=nb, k=k, rg=rg, pl=pl: self._commit_body(nb, k + 1, rg, pl))

    def _capture_masked(self, sizes, ks, forced, decode, regimes, plain) -> None:
        ensure = self.step_graphs.ensure
        for nb in sizes:
            if decode:
                ensure(("mdecode_fwd", nb), lambda nb=nb: self._decode_forward(nb))
            for rg in regimes:
                self._ensure_draft_probs(rg)
                if decode:
                    ensure(("mdecode_pick", nb, rg),
                           lambda nb=nb, rg=rg: self._decode_pick(nb, self.runner.bufs.logits[:nb], rg, True))
                for k in ks:
                    if k > 0:
                        ensure(("mdraft_fill", nb), lambda nb=nb: self._cfill_body(nb))
                    for i in range(k):
                        for f in forced:
                            ensure(("mdraft_pick", nb, i, f, rg),
                                   lambda nb=nb, i=i, f=f, rg=rg: self._cpick_body(nb, i, f, rg))
                        if i + 1 < k:
                            ensure(("mdraft_adv", nb, i), lambda nb=nb, i=i: self._cadv_body(nb, i))
                    ensure(("verify", nb, k + 1), lambda nb=nb, k=k: self._verify_body(nb, k + 1))
                    for pl in {bool(p) and rg is not None for p in plain}:
                        ensure(("commit", nb, k + 1, rg, pl, True),
                               lambda nb=nb, k=k, rg=rg, pl=pl: self._commit_body(nb, k + 1, rg, pl, True))
