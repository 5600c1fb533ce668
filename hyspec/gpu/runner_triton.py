"""The fast runner: re-packed weights, static buffers and row-invariant Triton kernels.

Per target layer (t rows, positions read from a device scalar so every call can be
CUDA-graph captured):

    GDN layer:  in_proj (q|k|v|z|b|a packed, one matmul) -> gdn_conv -> gdn_step
                (l2norm, g, beta, scan, gated norm) -> out_proj
    attention:  qkv (one matmul) -> attn_prep (norms, RoPE, KV write) -> attn_decode
                (split keys, fixed-order combine, sigmoid gate) -> o_proj
    FFN:        gate|up (one matmul) -> down (SiLU*mul fused into its input load)
    residual adds are fused into the next RMSNorm; the embedding gather into the first.

exact=True: every matmul is ``skinny_matmul`` (fixed split-K per weight shape), so row r
of a t-row verify is bitwise what a 1-row decode step computes.  exact=False: matmuls go
through cuBLAS (``torch.matmul``), the fastest non-exact variant we measure against.
The original module weights stay the source: packed copies are made once at init.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from hyspec.config import FULL
from hyspec.kernels.attention import (
    ATTN_SPLITS,
    GROUPED_SPLITS,
    attn_decode,
    attn_decode_grouped,
    attn_prep,
    rope_inv_freq,
)
from hyspec.kernels.common import p2
from hyspec.kernels.gdn import gdn_conv, gdn_replay, gdn_step
from hyspec.kernels.matmul import skinny_matmul
from hyspec.kernels.matmul.config import _config_cached
from hyspec.kernels.moe import expert_gemv
from hyspec.kernels.rmsnorm import rmsnorm
from hyspec.model.ffn import MoE


def _pack_gdn_in(mod) -> torch.Tensor:
    """The GDN input projections as one [2kd + 2vd + 2nv, H] weight with output columns
    [q (all key heads) | k | v | z | b | a] (Qwen3-Next's per-key-head groups unpacked)."""
    nk, nv, dk, dv = mod.nk, mod.nv, mod.dk, mod.dv
    if mod.family == "qwen3_next":
        cached = getattr(mod, "_hyspec_packed_in", None)
        if cached is not None:  # one re-ordered copy per model, shared by every runner
            return cached
        r = nv // nk
        W = mod.in_proj_qkvz.weight  # [nk * (2dk + 2 r dv), H]
        H = W.shape[1]
        Wg = W.view(nk, 2 * dk + 2 * r * dv, H)
        q, k, v, z = torch.split(Wg, [dk, dk, r * dv, r * dv], dim=1)
        BA = mod.in_proj_ba.weight.view(nk, 2 * r, H)
        b, a = BA[:, :r], BA[:, r:]
        parts = [q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H), z.reshape(-1, H),
                 b.reshape(-1, H), a.reshape(-1, H)]
        # a re-ordered copy: Qwen3-Next's layout is per key head, and the model's modules keep
        # theirs (reading a packed layout would change the reference's matmul shapes)
        mod._hyspec_packed_in = torch.cat(parts, 0).contiguous()
        return mod._hyspec_packed_in
    return pack_views([mod.in_proj_qkv.weight, mod.in_proj_z.weight, mod.in_proj_b.weight, mod.in_proj_a.weight])


def pack_views(params) -> torch.Tensor:
    """One [sum N_i, K] weight for weights [N_i, K] stacked by rows, held once: the
    parameters become views into it (the model's modules then read the packed tensor),
    and a later runner on the same model finds and reuses it. Packed at load, once, like
    gpt-fast's load hook; no second copy of these weights stays on the device."""
    prev = getattr(params[0], "_hyspec_packed", None)
    if prev is not None:
        off = 0
        for p in params:
            if p.data.data_ptr() != prev[off: off + p.shape[0]].data_ptr():
                break
            off += p.shape[0]
        else:
            if off == prev.shape[0]:
                return prev
    packed = torch.cat([p.data for p in params], 0).contiguous()
    off = 0
    for p in params:
        n = p.shape[0]
        p.data = packed[off: off + n]
        off += n
    params[0]._hyspec_packed = packed
    return packed


class TritonRunner:
    """The compute of a FastDecoder (one sequence) or a BatchDecoder (lanes: several
    sequences per launch, their state in per-lane slabs; hyspec.gpu.batch)."""

    def __init__(self, dec, exact: bool = True) -> None:
        self.dec = dec
        # a BatchDecoder's state has a lane axis (slabs [S, ...]); the kernels get lane 0's
        # view and the lane stride, and every call says how many lanes it covers
        self.batched = bool(getattr(dec, "batched", False))
        self.exact = exact
        # commits replay the accepted rows (commit_linear) instead of copying a state saved
        # after every verify row; HYSPEC_REPLAY_COMMIT=0 keeps the per-row states instead
        self.records_states = os.environ.get("HYSPEC_REPLAY_COMMIT", "1") == "0"
        m = dec.model
        cfg = m.cfg
        self.cfg = cfg
        self.model = m
        dev, dt = m.device, m.dtype
        self.eps = cfg.rms_norm_eps
        self.layers = [self._pack_layer(i, layer) for i, layer in enumerate(m.model.layers)]
        self.final_norm = m.model.norm.weight
        self.embed = m.model.embed_tokens.weight
        self.head = m.head_weight
        self.inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, dev)
        self.mtp_l = None
        if m.mtp is not None:
            mt = m.mtp
            self.mtp_l = self._pack_layer(None, mt.layers[0])
            self.mtp_fc = mt.fc.weight
            self.mtp_ne, self.mtp_nh, self.mtp_norm = (mt.pre_fc_norm_embedding.weight,
                                                      mt.pre_fc_norm_hidden.weight, mt.norm.weight)
        # static buffers (rows_cap rows); calls with more rows (eager only) allocate
        R = dec.rows_cap
        H = cfg.hidden_size
        self.R = R
        widths = [lay.w_in.shape[0] for lay in self.layers] + ([self.mtp_l.w_in.shape[0]] if self.mtp_l else [])
        inter = [lay.w_gu.shape[0] for lay in self.layers + ([self.mtp_l] if self.mtp_l else []) if lay.w_gu is not None]
        self.b = SimpleNamespace(
            resid=torch.zeros(R, H, device=dev, dtype=dt), xn=torch.zeros(R, H, device=dev, dtype=dt),
            post=torch.zeros(R, H, device=dev, dtype=dt), h=torch.zeros(R, H, device=dev, dtype=dt),
            proj=torch.zeros(R, max(widths), device=dev, dtype=dt),
            gu=torch.zeros(R, max(inter) if inter else 1, device=dev, dtype=dt),
            y=torch.zeros(R, cfg.conv_dim, device=dev, dtype=dt),
            o=torch.zeros(R, max(cfg.linear_value_dim, cfg.num_attention_heads * cfg.head_dim), device=dev, dtype=dt),
            q=torch.zeros(R, cfg.num_attention_heads, cfg.head_dim, device=dev, dtype=dt),
            cat2=torch.zeros(R, 2 * H, device=dev, dtype=dt),
            mres=torch.zeros(R, H, device=dev, dtype=dt), mxn=torch.zeros(R, H, device=dev, dtype=dt),
            mout=torch.zeros(R, H, device=dev, dtype=dt),
            logits=torch.zeros(R, cfg.vocab_size, device=dev, dtype=dt),
        )
        self._ws = {}
        # rows per matmul program: 16 for one sequence; a batched decoder's calls have up to
        # lanes x rows each, and 64-row tiles read every weight tile once for 64 of them
        # (fixed per decoder, never chosen from a call's row count: row invariance)
        self.block_t = int(os.environ.get("HYSPEC_BATCH_BLOCK_T", "64")) if self.batched else 16
        self._ws_rows = -(-R // self.block_t) * self.block_t  # split-K workspace rows: every call fits
        # verify slabs for the commit replay: in_proj outputs and conv outputs per GDN layer
        self.gdn_layers = sorted((lay for lay in self.layers if lay.kind == "gdn"), key=lambda lay: lay.g)
        self.t_slab = dec.t_max
        if self.gdn_layers:
            G = len(self.gdn_layers)
            # batched: lane b's verify rows at b*t .. b*t + t-1 (the layout depends on t)
            slab = self.t_slab * (dec.slots if self.batched else 1)
            self.p_rows = torch.zeros(G, slab, self.gdn_layers[0].w_in.shape[0], device=dev, dtype=dt)
            self.y_rows = torch.zeros(G, slab, cfg.conv_dim, device=dev, dtype=dt)
            self.alog_all = torch.stack([lay.A_log for lay in self.gdn_layers]).contiguous()
            self.dtb_all = torch.stack([lay.dt_bias for lay in self.gdn_layers]).contiguous()
        # GDN scan: split each value head's Dv over programs of 32 columns (4x the parallelism
        # for Dv=128; gated norm in a second kernel). Measured on the H200 / b2: decode step
        # 2.676 -> 2.602 ms, verify t=4 3.156 -> 2.874 ms (bench/results/b2_h200_profile.json).
        # None: one program per head.
        self.gdn_block_v = 32 if cfg.linear_value_head_dim >= 64 else None
        if os.environ.get("HYSPEC_GDN_BLOCK_V"):  # ablation knob (bench/profile_batch.py)
            self.gdn_block_v = int(os.environ["HYSPEC_GDN_BLOCK_V"]) or None
        # split-K partials of the matmuls that feed a residual RMSNorm are reduced inside
        # that norm (no reduce kernel); attention: q heads of a kv head in one program
        self.fuse_reduce = True
        # grouped-head attention uses tensor-core dots: faster in bf16/fp16 on the H200 (b2
        # decode step -69 us, bench/results/step_anatomy_h200_ablation.json); with fp32's exact 'ieee' dots a
        # development microbenchmark there found it slower (not kept in bench/results), so
        # fp32 keeps the per-head kernel
        self.attn_grouped = dt != torch.float32

    # -- packing ----------------------------------------------------------------------
    def _pack_layer(self, i, layer):
        L = SimpleNamespace(ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight)
        if layer.layer_type == FULL:
            a = layer.self_attn
            L.kind = "attn"
            L.index = i
            L.w_in = pack_views([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            L.w_out = a.o_proj.weight
            L.qn, L.kn = a.q_norm.weight, a.k_norm.weight
        else:
            g = layer.linear_attn
            L.kind = "gdn"
            L.g = self.dec.gdn_index[i]
            L.w_in = _pack_gdn_in(g)
            L.w_out = g.out_proj.weight
            L.conv_w = g.conv1d.weight[:, 0, :].contiguous()
            L.A_log, L.dt_bias, L.norm_w = g.A_log, g.dt_bias, g.norm.weight
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            L.moe = mlp
            L.w_gu = None
            if mlp.has_shared:
                se = mlp.shared_expert
                L.sh_gu = pack_views([se.gate_proj.weight, se.up_proj.weight])
                L.sh_down = se.down_proj.weight
                L.sh_gate = mlp.shared_expert_gate.weight
        else:
            L.moe = None
            L.w_gu = pack_views([mlp.gate_proj.weight, mlp.up_proj.weight])
            L.w_down = mlp.down_proj.weight
        return L

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one target decode step reads (embedding table excluded: one
        row is gathered; routed experts counted as if all were read)."""
        n = self.head.numel() * self.head.element_size()
        for L in self.layers:
            for w in (L.w_in, L.w_out, L.w_gu, getattr(L, "w_down", None)):
                if w is not None:
                    n += w.numel() * w.element_size()
            if L.moe is not None:
                for p in L.moe.parameters():
                    n += p.numel() * p.element_size()
        return n

    def draft_bytes_per_step(self) -> int:
        if self.mtp_l is None:
            return 0
        n = self.head.numel() * self.head.element_size() + self.mtp_fc.numel() * self.mtp_fc.element_size()
        L = self.mtp_l
        for w in (L.w_in, L.w_out, L.w_gu, getattr(L, "w_down", None)):
            if w is not None:
                n += w.numel() * w.element_size()
        return n

    # -- primitives -------------------------------------------------------------------
    def _buf(self, name, rows, cols=None):
        b = getattr(self.b, name)
        if rows <= b.shape[0]:
            return b[:rows] if cols is None else b[:rows, :cols]
        shape = (rows,) + tuple(b.shape[1:]) if cols is None else (rows, cols)
        return torch.empty(shape, device=b.device, dtype=b.dtype)

    def mm(self, x, w, out, act=False, defer=False):
        """x [t, K] (act: [t, 2K] as gate | up) @ w [N, K].T -> out [t, N].  defer: the
        result only feeds ``rmsnorm``'s delta, which may then take the split-K
        partials and reduce them itself (exact mode, ``fuse_reduce``)."""
        if self.exact:
            N, K = w.shape
            ws = self._ws.get((N, K))
            if ws is None:  # one fixed-shape split-K workspace per weight shape
                c = _config_cached(N, K, None, None, None, None, None, None, act)
                if self.block_t > 16:
                    c = _config_cached(N, K, *self._tile(N, K, act).values())
                ws = torch.empty((c.split_k, self._ws_rows, N), device=w.device, dtype=torch.float32) if c.split_k > 1 else False
                self._ws[(N, K)] = ws
            use = ws if ws is not False and x.shape[0] <= ws.shape[1] else None
            return skinny_matmul(x, w, out=out, act=act, ws=use, defer=defer and self.fuse_reduce and use is not None,
                                 block_t=self.block_t, **self._tile(N, K, act))
        if act:
            K = w.shape[1]
            x = torch.nn.functional.silu(x[:, :K]) * x[:, K:]
        return torch.matmul(x, w.t(), out=out)

    def _tile(self, N, K, act) -> dict:
        """Tile overrides for the matmul of an [N, K] weight: none for one sequence; for
        64-row tiles the shape's config with BK <= 128 and <= 3 stages (shared memory)."""
        if self.block_t == 16:
            return {}
        c = _config_cached(N, K, None, None, None, None, None, None, act)
        return dict(split_k=c.split_k, block_n=c.block_n, block_k=min(c.block_k, 128), num_warps=max(c.num_warps, 4),
                    num_stages=min(c.num_stages, 3), wt=c.wt)

    # -- target ---------------------------------------------------------------------
    def _lane0(self, slab):
        """(lane 0's view, lane stride) of a per-lane slab; (tensor, 0) for one sequence."""
        return (slab[0], slab.stride(0)) if self.batched else (slab, 0)

    def target(self, ids, t, pos, record, lanes=1):
        """ids [t] (t = all rows: lanes x rows per lane, lane-major) at each lane's pos.."""
        dec = self.dec
        resid, xn = self._buf("resid", t), self._buf("xn", t)
        layers = self.layers
        rmsnorm(self.embed, layers[0].ln1, self.eps, out=xn, ids=ids, resid_out=resid, rows=t)
        post = self._buf("post", t)
        for li, L in enumerate(layers):
            if L.kind == "gdn":
                h = self._gdn(L, xn, t, record, lanes)
            else:
                h = self._attn(L, xn, t, pos, 0, dec.kv_k[dec.attn_index[L.index]], dec.kv_v[dec.attn_index[L.index]],
                               lanes)
            rmsnorm(resid, L.ln2, self.eps, out=xn, delta=h, resid_out=resid, rows=t)
            h = self._ffn(L, xn, t)
            last = li + 1 == len(layers)
            rmsnorm(resid, self.final_norm if last else layers[li + 1].ln1, self.eps,
                    out=post if last else xn, delta=h, resid_out=resid, rows=t)
        return resid, post

    def _gdn(self, L, xn, t, record, lanes=1):
        dec, cfg = self.dec, self.cfg
        g = L.g
        # a verify keeps its rows' projections and conv outputs per layer: the commit replays
        # the accepted ones (commit_linear) instead of saving a state after every row
        if record and t > self.t_slab * lanes:
            raise ValueError(f"verify of {t // lanes} rows > the decoder's t_max {self.t_slab}")
        rec = record and not self.records_states
        proj = self.p_rows[g, :t] if rec else self._buf("proj", t, L.w_in.shape[0])
        self.mm(xn, L.w_in, proj)
        y = self.y_rows[g, :t] if rec else self._buf("y", t)
        conv, conv_stride = self._lane0(dec.conv[g])
        ssm, ssm_stride = self._lane0(dec.ssm[g])
        xin = (dec.conv_in[g, :t] if self.batched else dec.conv_in[g]) if record else None
        gdn_conv(proj, conv, L.conv_w, y, rows=t, update=not record, xin=xin, lanes=lanes,
                 state_lane_stride=conv_stride, xin_lane_stride=(t // lanes) * cfg.conv_dim)
        o = self._buf("o", t, cfg.linear_value_dim)
        gdn_step(y, proj, L.A_log, L.dt_bias, L.norm_w, ssm, o,
                 nk=cfg.linear_num_key_heads, nv=cfg.linear_num_value_heads, dk=cfg.linear_key_head_dim,
                 dv=cfg.linear_value_head_dim, eps=self.eps, rows=t, keep_state=rec,
                 states=dec.ssm_rows[g] if record and self.records_states else None,
                 block_v=self.gdn_block_v, lanes=lanes, state_lane_stride=ssm_stride)
        return self.mm(o, L.w_out, self._buf("h", t), defer=True)

    def commit_linear(self, n, t=None, lanes=0) -> None:
        """After a verify of t rows with n accepted drafts: every GDN layer's state advances
        by rows 0..n (one kernel for all layers, the decode step's arithmetic).  Batched:
        t rows per lane, n [lanes] per lane."""
        dec, cfg = self.dec, self.cfg
        if not self.gdn_layers:
            return
        if self.records_states:
            dec.commit_recorded_states(n)
            return
        y_rows, p_rows = self.y_rows, self.p_rows
        if lanes:
            G = y_rows.shape[0]
            y_rows = y_rows[:, : lanes * t].view(G, lanes, t, y_rows.shape[-1])
            p_rows = p_rows[:, : lanes * t].view(G, lanes, t, p_rows.shape[-1])
        gdn_replay(y_rows, p_rows, self.alog_all, self.dtb_all, self.gdn_layers[0].norm_w,
                   dec.ssm, n, self.b.h, nk=cfg.linear_num_key_heads, nv=cfg.linear_num_value_heads,
                   dk=cfg.linear_key_head_dim, dv=cfg.linear_value_head_dim, eps=self.eps,
                   block_v=self.gdn_block_v, lanes=lanes)

    def _attn(self, L, xn, t, pos, off, kc, vc, lanes=1):
        cfg = self.cfg
        kc, kv_stride = self._lane0(kc)
        vc, _ = self._lane0(vc)
        proj = self.mm(xn, L.w_in, self._buf("proj", t, L.w_in.shape[0]))
        q = self._buf("q", t)
        attn_prep(proj, L.qn, L.kn, self.inv_freq, pos, off, q, kc, vc, n_heads=cfg.num_attention_heads,
                  n_kv=cfg.num_key_value_heads, head_dim=cfg.head_dim, eps=self.eps, rows=t, lanes=lanes,
                  kv_lane_stride=kv_stride)
        o = self._buf("o", t, cfg.num_attention_heads * cfg.head_dim)
        ws = self._ws.get("attn")
        need = self.R * cfg.num_attention_heads * max(ATTN_SPLITS, GROUPED_SPLITS) * (p2(cfg.head_dim) + 2)
        if ws is None:
            ws = self._ws["attn"] = torch.empty(need, device=xn.device, dtype=torch.float32)
        attn = attn_decode_grouped if self.attn_grouped else attn_decode
        attn(q, kc, vc, pos, off, proj, o, rows=t, ws=ws if t <= self.R else None, lanes=lanes,
             kv_lane_stride=kv_stride)
        return self.mm(o, L.w_out, self._buf("h", t), defer=True)

    def _ffn(self, L, xn, t):
        if L.moe is None:
            gu = self.mm(xn, L.w_gu, self._buf("gu", t, L.w_gu.shape[0]))
            return self.mm(gu, L.w_down, self._buf("h", t), act=True, defer=True)
        return self._moe(L, xn, t)

    def _moe(self, L, xn, t):
        """Routed experts, one row-invariant gemv per (token, slot), combined in slot order."""
        moe = L.moe
        x = xn[:t]
        logits = self.mm(x, moe.gate.weight, None)
        probs = torch.softmax(logits.float(), dim=-1)
        w, idx = torch.topk(probs, moe.gate.top_k, dim=-1)
        if moe.gate.renorm:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)
        k = moe.gate.top_k
        ids = idx.reshape(-1)
        ex = moe.experts
        I2 = ex.gate_up_proj.shape[1]
        gu = expert_gemv(x, ex.gate_up_proj, ids, k, torch.empty(t * k, I2, device=x.device, dtype=x.dtype))
        y = expert_gemv(gu, ex.down_proj, ids, 1, torch.empty(t * k, x.shape[1], device=x.device,
                                                              dtype=x.dtype), act=True)
        y = y.view(t, k, -1)
        out = y[:, 0] * w[:, 0:1]
        for s in range(1, k):  # elementwise, fixed slot order: row-invariant
            out = out + y[:, s] * w[:, s : s + 1]
        if moe.has_shared:
            sgu = self.mm(x, L.sh_gu, None)
            sh = self.mm(sgu, L.sh_down, None, act=True)
            out = out + torch.sigmoid(self.mm(x, L.sh_gate, None)) * sh
        h = self._buf("h", t)
        h.copy_(out)
        return h

    def logits(self, h):
        t = h.shape[0]
        return self.mm(h, self.head, self._buf("logits", t))

    # -- drafter --------------------------------------------------------------------
    def mtp(self, tokens, h_prev, start, off, lanes=1):
        """MTP rows for tokens [t] paired with h_prev [t, H] at draft-KV rows start+off..
        (batched: t // lanes rows per lane, lane b's at start[b] + off..)"""
        dec = self.dec
        t = tokens.shape[0]
        H = self.cfg.hidden_size
        cat2 = self._buf("cat2", t)
        rmsnorm(self.embed, self.mtp_ne, self.eps, out=cat2[:, :H], ids=tokens, rows=t)
        rmsnorm(h_prev, self.mtp_nh, self.eps, out=cat2[:, H:], rows=t)
        res, xn = self._buf("mres", t), self._buf("mxn", t)
        self.mm(cat2, self.mtp_fc, res)
        L = self.mtp_l
        rmsnorm(res, L.ln1, self.eps, out=xn, rows=t)
        h = self._attn(L, xn, t, start, off, dec.dkv_k, dec.dkv_v, lanes)
        rmsnorm(res, L.ln2, self.eps, out=xn, delta=h, resid_out=res, rows=t)
        h = self._ffn(L, xn, t)
        out = self._buf("mout", t)
        rmsnorm(res, self.mtp_norm, self.eps, out=out, delta=h, resid_out=res, rows=t)
        return out

    def draft_logits(self, h):
        d2t = self.dec.d2t
        if d2t is None:
            return self.logits(h)
        ids, w = d2t
        sub = self.mm(h, w, None)
        full = sub.new_full((h.shape[0], self.cfg.vocab_size), float("-inf"))
        full[:, ids] = sub
        return full
