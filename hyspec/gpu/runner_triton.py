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
The original module weights stay the source: packed once at init (hyspec.gpu.packing).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from hyspec.envknobs import choice, number, switch
from hyspec.gpu.packing import Segments, layer_weight_bytes, pack_layer, pack_views
from hyspec.kernels.attention import (
    ATTN_SPLITS,
    attn_decode,
    attn_decode_grouped,
    attn_prep,
)
from hyspec.kernels.attention.grouped import grouped_partials
from hyspec.kernels.common import p2
from hyspec.kernels.gdn import gdn_conv, gdn_replay, gdn_step
from hyspec.kernels.matmul import fp8_config, silu_mul, skinny_matmul, skinny_matmul_fp8
from hyspec.kernels.matmul.config import TUNED, _config_cached
from hyspec.kernels.moe import MoeBuffers, moe_grouped
from hyspec.kernels.pdl import interpreting, step_default
from hyspec.model.ops import rope_frequencies
from hyspec.kernels.probs.argmax import first_max
from hyspec.kernels.rmsnorm import rmsnorm
from hyspec.quant import FP8_DTYPE, Fp8Weight

__all__ = ["TritonRunner", "pack_views"]


def _fixed_height(v: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> int | None:
    """HYSPEC_BATCH_BLOCK_T: 16, 32, 64 or 128 (one row-tile height for every call), or
    auto (None: by the call's rows, for bf16 models on a compute-capability 9.x GPU, the
    H200's, where a row's bits were measured not to depend on the height; 64 elsewhere)."""
    if v == "auto":
        dev = torch.device(device)
        measured = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] == 9
        return None if measured and dtype == torch.bfloat16 else 64
    return int(v)


# Measured overrides of the tall (32- and 64-row) tiles of bf16 weights, by (N, K, act):
# column tile, BK, warps, stages and operand order, found inside a 64-lane decode step
# (`bench/tile_bench.py --height 64`: a move is kept only if the step is faster and its
# logits stay bitwise the same).  They never change the K split (split_k and the K columns
# per split), so a row adds the same partial sums in the same order at every height.
# HYSPEC_TALL_TUNED=0 ignores the table (ablation).
TALL: dict[tuple[int, int, bool], dict] = {
    # b2 (bench/results/tile64_h200.json, at 06b9d80: a 64-lane decode step 4.46 -> 4.13 ms;
    # the down projection's stages re-searched with the split activation at 6620f2a,
    # tile64_act_h200.json: 3.872 -> 3.843 ms)
    (2048, 4096, False): dict(block_n=32, block_k=128, num_warps=4, num_stages=4, wt=False),
    (2048, 6144, True): dict(block_n=64, block_k=128, num_warps=8, num_stages=4, wt=True),
    (9216, 2048, False): dict(block_n=128, block_k=128, num_warps=4, num_stages=4, wt=False),
}

_TALL_KEYS = ("block_n", "block_k", "num_warps", "num_stages", "wt")

# Measured configs of block-FP8 weights by (N, K, act), every height alike (their K split
# included: FP8 weights never run another config, so any split keeps the row invariance).
# Used when TUNED has no entry for the shape; other shapes take their bf16 config (TUNED,
# BUILTIN or the defaults) with BK the quant block's step (fp8_config).  From the in-step tune of the
# qwen3-next-80b-a3b-fp8 preset on the H200 (bench/results/qwen3-next-80b-a3b-fp8_h200_tuning.json,
# at e5a8d31: decode step 4.128 -> 4.009 ms with the two MoE entries of MOE_BUILTIN):
# the attention in-projection's 72 programs of 128 columns -> 288 of 32. With the integer
# e4m3 conversion (hyspec.kernels.matmul.fp8.int_cvt), the tune at e9b0339 (same file)
# took the GDN in-projection and the out-projection to 5 stages: 3.911 -> 3.874 ms (that
# tune ran the attention in-projection in the bf16 tile, a tuner slip since mended:
# hyspec.gpu.tune.start_config).
FP8_TALL: dict[tuple[int, int, bool], dict] = {
    (9216, 2048, False): dict(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=3, wt=False),
    (12288, 2048, False): dict(num_stages=5),
    (2048, 4096, False): dict(num_stages=5),
}
_FP8_SMEM = 160 * 1024  # shared-memory bytes a 64-row FP8 tile's stages may take


def tall_tile(N: int, K: int, act: bool = False, fp8: bool = False, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config overrides of an [N, K] weight's matmul in a batched decoder's 32- or
    64-row tiles: the shape's own config with BK <= 128 and <= 3 stages (shared memory),
    then, for bf16 weights (``fp8`` False, ``dtype`` bfloat16: where it was measured),
    the entry of :data:`TALL`, refused if it would change the K split."""
    c = _config_cached(N, K, None, None, None, None, None, None, act)
    if fp8:
        # Block-FP8 weights take this config at every height (a row's bits then match across
        # heights: tests/test_gpu_tile_heights.py).  BK: fp8_config sets it to the quant
        # block's step (128 for 128-wide blocks; the per-step scale makes BK part of the
        # arithmetic, and BK 64 measured other bits at other heights); the stages are the shape's own (TUNED, e.g. from `hyspec bench --tune
        # step`, or FP8_TALL's), as many as a 64-row tile's shared memory holds -- the stage
        # count only pipelines the loads, it changes no bit.
        t = dict(split_k=c.split_k, block_n=c.block_n, block_k=128 if K >= 128 else min(c.block_k, 128),
                 num_warps=max(c.num_warps, 4), num_stages=c.num_stages, wt=c.wt)
        if (N, K) not in TUNED and (N, K, bool(act)) in FP8_TALL:
            t.update(FP8_TALL[(N, K, bool(act))])
        per_stage = 64 * t["block_k"] * 2 + t["block_n"] * t["block_k"]  # bf16 x rows + one-byte weights
        t["num_stages"] = max(2, min(t["num_stages"], _FP8_SMEM // per_stage))
        return t
    t = dict(split_k=c.split_k, block_n=c.block_n, block_k=min(c.block_k, 128), num_warps=max(c.num_warps, 4),
             num_stages=min(c.num_stages, 3), wt=c.wt)
    use = not fp8 and dtype == torch.bfloat16 and switch("HYSPEC_TALL_TUNED")
    entry = TALL.get((N, K, bool(act))) if use else None
    if entry:
        bad = set(entry) - set(_TALL_KEYS)
        if bad:
            raise ValueError(f"TALL[{(N, K, act)}]: only {_TALL_KEYS} may be tuned, got {sorted(bad)}")
        t.update(entry)
        new = _config_cached(N, K, *t.values())
        if (new.split_k, new.k_per_split) != (c.split_k, c.k_per_split):
            raise ValueError(f"TALL[{(N, K, act)}]: {entry} would change the K split ({c.split_k} x "
                             f"{c.k_per_split} columns -> {new.split_k} x {new.k_per_split})")
    return t


class TritonRunner:
    """The compute of a BatchDecoder (lanes: several sequences per launch, their state in
    per-lane slabs; hyspec.gpu.batch)."""

    def __init__(self, dec, exact: bool = True) -> None:
        self.dec = dec
        # a BatchDecoder's state has a lane axis (slabs [S, ...]); the kernels get lane 0's
        # view and the lane stride, and every call says how many lanes it covers
        self.exact = exact
        self.lane_base = 0  # the lane _lane0 views (a one-lane forward of lane L: BatchDecoder.prefill)
        # commits replay the accepted rows (commit_linear): no state is saved per verify row
        if not switch("HYSPEC_REPLAY_COMMIT"):
            raise ValueError("HYSPEC_REPLAY_COMMIT=0 (a state saved after every verify row) is gone with the "
                             "single-sequence decoder: the batched commit replays the accepted rows; unset it")
        model = dec.model
        cfg = model.cfg
        self.cfg = cfg
        self.model = model
        dev, dt = model.device, model.dtype
        self.eps = cfg.rms_norm_eps
        # the target layers packed once (hyspec.gpu.packing: one matmul per projection group)
        self.layers = [pack_layer(layer, dec.gdn_index.get(i), i) for i, layer in enumerate(model.model.layers)]
        self.final_norm = model.model.norm.weight  # [H]
        self.embed = model.model.embed_tokens.weight  # [V, H]
        self.head = model.head_weight  # [V, H]
        d2t = getattr(dec, "d2t", None)  # a reduced draft vocabulary (ids, head rows), set before the runner
        self.d2t_ascending = d2t is not None and bool((d2t[0][1:] > d2t[0][:-1]).all())
        self.inv_freq, self.rope_scale = rope_frequencies(cfg, dev)  # [rotary_dim / 2], YaRN's cos/sin scale
        self.mtp_layer = None  # the drafter's (MTP) decoder layer, packed
        if model.mtp is not None:
            mtp = model.mtp
            self.mtp_layer = pack_layer(mtp.layers[0])
            self.mtp_fc = mtp.fc.weight  # [H, 2H]: [norm(embed) | norm(hidden)] -> H
            self.mtp_norm_embed = mtp.pre_fc_norm_embedding.weight  # [H]
            self.mtp_norm_hidden = mtp.pre_fc_norm_hidden.weight  # [H]
            self.mtp_norm = mtp.norm.weight  # [H]
        # static scratch buffers (rows_cap rows); calls with more rows (eager only) allocate
        R = dec.rows_cap
        H = cfg.hidden_size
        self.rows_cap = R
        packed = self.layers + ([self.mtp_layer] if self.mtp_layer else [])
        widths = [lay.w_in.shape[0] for lay in packed]
        inter = [lay.w_gu.shape[0] for lay in packed if lay.w_gu is not None]
        act_k = [1] + [(w.parts[0] if isinstance(w, Segments) else w).shape[1]
                       for lay in packed for w in (getattr(lay, "w_down", None), getattr(lay, "sh_down", None))
                       if w is not None]  # the K of every matmul fed silu(gate) * up

        def rows(*shape):
            return torch.zeros(R, *shape, device=dev, dtype=dt)

        self.bufs = SimpleNamespace(
            resid=rows(H),  # [R, H] the residual stream
            normed=rows(H),  # [R, H] RMSNorm output: the next block's input
            post=rows(H),  # [R, H] final-norm output (the target's hidden for the LM head)
            delta=rows(H),  # [R, H] a block's output, added to the residual by the next norm
            proj=rows(max(widths)),  # [R, max w_in rows] a layer's input projection
            gate_up=rows(max(inter) if inter else 1),  # [R, 2I] the FFN's gate | up
            act=rows(max(act_k)),  # [R, I] silu(gate) * up: the input of a tall down projection
            conv_out=rows(cfg.conv_dim),  # [R, C] the GDN's causal-conv output
            mixer_out=rows(max(cfg.linear_value_dim, cfg.num_attention_heads * cfg.head_dim)),  # [R, vd | Hq D]
            query=rows(cfg.num_attention_heads, cfg.head_dim),  # [R, Hq, D] normed, rotated queries
            mtp_concat=rows(2 * H),  # [R, 2H] MTP input: norm(embed(token)) | norm(hidden)
            mtp_resid=rows(H),  # [R, H] the MTP layer's residual stream
            mtp_normed=rows(H),  # [R, H] its RMSNorm outputs
            mtp_out=rows(H),  # [R, H] the MTP hidden (final norm)
            logits=rows(cfg.vocab_size),  # [R, V]
        )
        # MoE layers (hyspec.kernels.moe.moe_grouped): router logits, shared expert, the
        # grouped path's scratch, and per row count t the distinct experts read
        # (moe_counts[0] target, [1] drafter; [t] = (sum of distinct experts, layer calls))
        self.moe_buf = None
        moe_layers = [lay for lay in packed if lay.moe is not None]
        if moe_layers:
            E, k = cfg.num_experts, cfg.num_experts_per_tok
            self.bufs.router = rows(max(lay.router.shape[0] for lay in moe_layers))  # [R, E (+1: shared gate)]
            sh = [lay.sh_gu.shape[0] for lay in moe_layers if lay.moe.has_shared and not lay.fuse_shared]
            self.bufs.sh_gu = rows(max(sh) if sh else 1)  # [R, 2 Is] (a shared expert not fused)
            self.bufs.sh_out = rows(H)  # [R, H]
            fused = any(lay.fuse_shared for lay in moe_layers)  # the shared expert as expert E, slot k
            self.moe_buf = MoeBuffers(R, E + fused, k + fused, H, cfg.moe_intermediate_size, dev, dt)
            self.moe_counts = torch.zeros(2, R + 1, 2, device=dev, dtype=torch.int64)
        self._workspaces = {}  # split-K workspaces by weight shape (N, K); "attn": the attention combine
        # rows per matmul program (the row-tile height). A call has up to lanes x rows:
        # by default (HYSPEC_BATCH_BLOCK_T=auto)
        # the height follows the call's row count (16 up to 16 rows, with the one-sequence
        # config; 32 up to 32; else 64, where each weight tile is read once for 64 rows).
        # On the H200 a row's bits do not depend on the height at a fixed split-K (the
        # MMAs chain their fp32 accumulator through K alike; measured for every b2 shape,
        # bf16 and FP8: tests/test_gpu_tile_heights.py), so the batch invariance holds.
        # The Triton interpreter's dots are numpy matmuls whose bits change with the
        # tile's width, so off CUDA auto means 64 always, and so it does for fp32 models
        # and GPUs other than compute capability 9.x (not measured).
        # HYSPEC_BATCH_BLOCK_T=16/32/64/128 fixes one height.
        self.block_t = _fixed_height(choice("HYSPEC_BATCH_BLOCK_T"), dev, dt)
        top = self.block_t or 64
        self._workspace_rows = -(-R // top) * top  # split-K workspace rows: every call fits
        # verify slabs for the commit replay: in_proj outputs and conv outputs per GDN layer
        self.gdn_layers = sorted((lay for lay in self.layers if lay.kind == "gdn"), key=lambda lay: lay.g)
        self.t_max = dec.t_max  # verify rows per lane the slabs hold
        if self.gdn_layers:
            G = len(self.gdn_layers)
            # lane b's verify rows at b*t .. b*t + t-1 (the layout depends on t)
            slab = self.t_max * dec.slots
            self.verify_proj = torch.zeros(G, slab, self.gdn_layers[0].w_in.shape[0], device=dev,
                                           dtype=dt)  # [G, slab, w_in rows] the verify rows' in_proj
            self.verify_conv_out = torch.zeros(G, slab, cfg.conv_dim, device=dev, dtype=dt)  # [G, slab, C]
            self.A_log_all = torch.stack([lay.A_log for lay in self.gdn_layers]).contiguous()  # [G, Hv]
            self.dt_bias_all = torch.stack([lay.dt_bias for lay in self.gdn_layers]).contiguous()  # [G, Hv]
        # GDN scan: split each value head's Dv over programs (gated norm in a second kernel).
        # 32 columns first (H200 / b2: decode step 2.676 -> 2.602 ms, verify t=4 3.156 ->
        # 2.874 ms, bench/results/b2_h200_profile.json); then 16 columns on four warps with one
        # state reduction per row, the fastest plain decode step of the ways bench/gdn_bench.py
        # tried at b2's shapes (hyspec.kernels.gdn.kernel.STEP_LAUNCH; 2 warps run a
        # speculative round's verifies and replay ~1 % faster, 8 columns on one warp verify
        # faster and decode slower); 32 columns on four warps again since Dv is compiled into
        # the kernel (STEP_LAUNCH const_dv: 126 registers instead of 233), per layer at 1 / 16
        # / 64 lanes 5.5 / 21.9 / 72.4 us against 16 columns' 5.0 / 22.5 / 77.4, a 4-row
        # verify of 16 lanes 31.7 against 38.6 us (bench/results/gdn_const_parts_h200.json,
        # at 6121b06).  None: one program per head.
        self.gdn_block_v = 32 if cfg.linear_value_head_dim >= 64 else None
        if number("HYSPEC_GDN_BLOCK_V"):  # ablation knob (bench/profile_batch.py)
            self.gdn_block_v = number("HYSPEC_GDN_BLOCK_V")
        # split-K partials of the matmuls that feed a residual RMSNorm are reduced inside
        # that norm (no reduce kernel); attention: q heads of a kv head in one program
        self.fuse_reduce = True
        # grouped-head attention uses tensor-core dots: faster in bf16/fp16 on the H200 (b2
        # decode step -69 us, bench/results/step_anatomy_h200_ablation.json); with fp32's exact 'ieee' dots a
        # development microbenchmark there found it slower (not kept in bench/results), so
        # fp32 keeps the per-head kernel
        self.attn_grouped = dt != torch.float32
        # the fused SiLU*mul input of the down projections: in 32- and 64-row tiles every
        # column tile would recompute the activation of all its rows, so those calls run
        # silu_mul once and a plain matmul instead (the same bits: same expression, same
        # tile and K split); HYSPEC_TALL_ACT=fused keeps the fused load (ablation)
        self.split_act = choice("HYSPEC_TALL_ACT") == "split"
        # RMSNorm: the weight's load issued before the row's reduction (HYSPEC_NORM_W_FIRST=0: after)
        self.norm_w_first = switch("HYSPEC_NORM_W_FIRST")
        # MoE: the slot combine done by the next RMSNorm (one launch fewer per MoE layer;
        # HYSPEC_MOE_DEFER=0: the combine kernel, the ablation's other arm)
        self.moe_defer = switch("HYSPEC_MOE_DEFER")
        # greedy choices through hyspec.kernels.probs.argmax on CUDA (HYSPEC_ARGMAX_KERNEL=0: torch's)
        self.fast_argmax = switch("HYSPEC_ARGMAX_KERNEL")
        # a round's commit bookkeeping (accept test, stop cut, next fill) as one kernel,
        # hyspec.kernels.commit (HYSPEC_COMMIT_KERNEL=0: its torch reference, ~30 launches)
        self.commit_kernel = switch("HYSPEC_COMMIT_KERNEL")
        # the step graphs' programmatic dependent launch (hyspec.kernels.pdl.step_default: dense
        # models put the matmuls under it, triggering late; MoE or block-FP8 models leave them
        # out; pdl None: the process-wide setting), the kernel families launched without it and
        # the matmuls' trigger (A/B knobs: bench/runner_ab.py --a pdl=False, --b pdl_skip=, --b pdl_late=0)
        dense = not cfg.has_moe and not any(p.dtype == FP8_DTYPE for p in model.parameters())
        self.pdl, self.pdl_skip, self.pdl_late = step_default(dense=dense)

    # -- weights read per step (bench roofline) -------------------------------------
    def weight_bytes_per_step(self, experts: float | None = None) -> float:
        """Bytes of weights one target step reads (embedding table excluded: one row is
        gathered; fp8 weights with their scales). MoE layers: everything shared plus
        `experts` routed experts per layer (None: top_k, what a one-row decode step reads;
        a verify reads the distinct experts its rows hit, see moe_experts_read)."""
        k = self.cfg.num_experts_per_tok if experts is None else experts
        return self.head.numel() * self.head.element_size() + sum(layer_weight_bytes(lay, experts=k)
                                                                  for lay in self.layers)

    def draft_bytes_per_step(self) -> float:
        if self.mtp_layer is None:
            return 0
        head = self.head if self.dec.d2t is None else self.dec.d2t[1]  # a reduced draft vocabulary reads its rows
        return (head.numel() * head.element_size() + self.mtp_fc.numel() * self.mtp_fc.element_size()
                + layer_weight_bytes(self.mtp_layer, experts=self.cfg.num_experts_per_tok))

    def moe_experts_read(self, drafter: bool = False) -> dict[int, dict]:
        """Distinct routed experts per MoE layer call, counted on the device since the last
        reset_moe_counts(), by the call's row count t (lanes x rows in a batched decoder):
        {t: {"calls": layer calls, "experts_per_layer": mean distinct experts}}."""
        if self.moe_buf is None:
            return {}
        c = self.moe_counts[int(drafter)].cpu()
        return {t: {"calls": int(c[t, 1]), "experts_per_layer": float(c[t, 0]) / int(c[t, 1])}
                for t in range(c.shape[0]) if int(c[t, 1])}

    def reset_moe_counts(self) -> None:
        if self.moe_buf is not None:
            self.moe_counts.zero_()

    # -- primitives -------------------------------------------------------------------
    def _buf(self, name, rows, cols=None):
        b = getattr(self.bufs, name)
        if rows <= b.shape[0]:
            return b[:rows] if cols is None else b[:rows, :cols]
        shape = (rows,) + tuple(b.shape[1:]) if cols is None else (rows, cols)
        return torch.empty(shape, device=b.device, dtype=b.dtype)

    def mm(self, x, w, out, act=False, defer=False):
        """x [t, K] (act: [t, 2K] as gate | up) @ w [N, K].T -> out [t, N].  defer: the
        result only feeds ``rmsnorm``'s delta, which may then take the split-K
        partials and reduce them itself (exact mode, ``fuse_reduce``).  w: a tensor, a
        block-FP8 ``Fp8Weight`` (the FP8 kernel, exact or not: there is no cuBLAS
        weight-only FP8 path) or ``Segments`` (one matmul per part into its columns)."""
        if isinstance(w, Segments):
            off = 0
            for part in w.parts:
                n = part.shape[0]
                self.mm(x, part, out[:, off: off + n], act=act)
                off += n
            return out
        if isinstance(w, Fp8Weight):
            N, K = w.shape
            height = self.height(x.shape[0])
            tile = self._tile(N, K, act, height, w.block)
            key = (N, K, w.block, act)
            ws = self._workspaces.get(key)
            if ws is None:
                c = fp8_config(N, K, w.block, act, **tile)
                ws = torch.empty((c.split_k, self._workspace_rows, N), device=w.device, dtype=torch.float32) \
                    if c.split_k > 1 else False
                self._workspaces[key] = ws
            use = ws if ws is not False and x.shape[0] <= ws.shape[1] else None
            return skinny_matmul_fp8(x, w, out=out, act=act, ws=use,
                                     defer=defer and self.exact and self.fuse_reduce and use is not None,
                                     block_t=height, **tile)
        if self.exact:
            N, K = w.shape
            height = self.height(x.shape[0])
            tile = self._tile(N, K, act, height)
            if act and height >= 32 and self.split_act:
                # tall calls: the activation once (silu_mul, the fused x-load's very bits),
                # then the plain matmul with the act shape's tile (same K split, same bits)
                x = silu_mul(x, out=self._buf("act", x.shape[0], K))
                act = False  # (tile: the act shape's tall tile, _tile never gives {} at these heights)
            ws = self._workspaces.get((N, K))
            if ws is None:  # one fixed-shape split-K workspace per weight shape (every height splits alike)
                c = _config_cached(N, K, None, None, None, None, None, None, act)
                ws = torch.empty((c.split_k, self._workspace_rows, N), device=w.device, dtype=torch.float32) \
                    if c.split_k > 1 else False
                self._workspaces[(N, K)] = ws
            use = ws if ws is not False and x.shape[0] <= ws.shape[1] else None
            return skinny_matmul(x, w, out=out, act=act, ws=use, defer=defer and self.fuse_reduce and use is not None,
                                 block_t=height, **tile)
        if act:
            K = w.shape[1]
            x = torch.nn.functional.silu(x[:, :K]) * x[:, K:]
        return torch.matmul(x, w.t(), out=out)

    def _rmsnorm(self, *args, **kw):
        return rmsnorm(*args, w_first=self.norm_w_first, **kw)

    def height(self, rows: int) -> int:
        """The row-tile height of a matmul call with `rows` rows (see __init__)."""
        if self.block_t:
            return self.block_t
        return 16 if rows <= 16 else 32 if rows <= 32 else 64

    def _tile(self, N, K, act, height, fp8_block=None) -> dict:
        """Tile overrides for the matmul of an [N, K] weight in row tiles of `height`:
        :func:`tall_tile`, or none (the shape's own config, as one sequence runs it) for
        16-row tiles of a bf16 shape whose own config splits K exactly as the tall one (a
        row's bits then match across heights, measured; a different split would sum other
        partials). Block-FP8 weights keep the tall config at every height (measured at 16,
        32 and 64 rows; their own config at 16 rows was not)."""
        if self.block_t == 16:
            return {}
        tall = tall_tile(N, K, act, fp8=fp8_block is not None, dtype=self.model.dtype)
        if height != 16 or fp8_block is not None:
            return tall
        own = _config_cached(N, K, None, None, None, None, None, None, act)  # (cached; set_tuned clears it)
        alt = _config_cached(N, K, *tall.values())
        return {} if (own.split_k, own.k_per_split) == (alt.split_k, alt.k_per_split) else tall

    # -- target ---------------------------------------------------------------------
    def _lane0(self, slab):
        """(lane 0's view, lane stride) of a per-lane slab (lane lane_base's: a one-lane
        prefill of another lane, BatchDecoder.prefill)."""
        return slab[self.lane_base], slab.stride(0)

    def target(self, ids, t, pos, record, lanes=1):
        """ids [t] (t = all rows: lanes x rows per lane, lane-major) at each lane's pos.."""
        dec = self.dec
        resid, normed = self._buf("resid", t), self._buf("normed", t)
        layers = self.layers
        self._rmsnorm(self.embed, layers[0].ln1, self.eps, out=normed, ids=ids, resid_out=resid, rows=t)
        post = self._buf("post", t)
        for li, layer in enumerate(layers):
            if layer.kind == "gdn":
                h = self._gdn(layer, normed, t, record, lanes)
            else:
                a = dec.attn_index[layer.index]
                h = self._attn(layer, normed, t, pos, 0, dec.kv_k[a], dec.kv_v[a], lanes)
            self._rmsnorm(resid, layer.ln2, self.eps, out=normed, delta=h, resid_out=resid, rows=t)
            h = self._ffn(layer, normed, t)
            last = li + 1 == len(layers)
            self._rmsnorm(resid, self.final_norm if last else layers[li + 1].ln1, self.eps,
                    out=post if last else normed, delta=h, resid_out=resid, rows=t)
        return resid, post

    def _gdn(self, layer, normed, t, record, lanes=1):
        dec, cfg = self.dec, self.cfg
        g = layer.g
        # a verify keeps its rows' projections and conv outputs per layer: the commit replays
        # the accepted ones (commit_linear) instead of saving a state after every row
        if record and t > self.t_max * lanes:
            raise ValueError(f"verify of {t // lanes} rows > the decoder's t_max {self.t_max}")
        rec = record
        # decode steps use the verify slabs too: the conv kernel then sees the same row
        # strides in a decode and in a verify.  Triton specialises a kernel on a stride's
        # divisibility by 16; with the runner's own buffers (another row stride) the decode
        # ran a second binary whose bf16 conv output differed by an ulp from the verify's
        # (tiny models on the H200: speculative != plain; b2's strides happened to agree)
        slab = t <= self.verify_proj.shape[1]
        proj = self.verify_proj[g, :t] if slab else self._buf("proj", t, layer.w_in.shape[0])
        self.mm(normed, layer.w_in, proj)
        conv_out = self.verify_conv_out[g, :t] if slab else self._buf("conv_out", t)
        conv, conv_stride = self._lane0(dec.conv[g])
        ssm, ssm_stride = self._lane0(dec.ssm[g])
        xin = dec.conv_in[g, :t] if record else None
        gdn_conv(proj, conv, layer.conv_w, conv_out, rows=t, update=not record, xin=xin, lanes=lanes,
                 state_lane_stride=conv_stride, xin_lane_stride=(t // lanes) * cfg.conv_dim)
        o = self._buf("mixer_out", t, cfg.linear_value_dim)
        gdn_step(conv_out, proj, layer.A_log, layer.dt_bias, layer.norm_w, ssm, o,
                 nk=cfg.linear_num_key_heads, nv=cfg.linear_num_value_heads, dk=cfg.linear_key_head_dim,
                 dv=cfg.linear_value_head_dim, eps=self.eps, rows=t, keep_state=rec,
                 states=None,
                 block_v=self.gdn_block_v, lanes=lanes, state_lane_stride=ssm_stride)
        return self.mm(o, layer.w_out, self._buf("delta", t), defer=True)

    def commit_linear(self, n, t: int, lanes: int) -> None:
        """After a verify of t rows per lane with n [lanes] accepted drafts per lane: every
        GDN layer's state of the first `lanes` lanes advances by its rows 0..n (one kernel
        for all layers and lanes, the decode step's arithmetic)."""
        dec, cfg = self.dec, self.cfg
        if not self.gdn_layers:
            return
        G = self.verify_conv_out.shape[0]
        conv_out = self.verify_conv_out[:, : lanes * t].view(G, lanes, t, -1)
        proj = self.verify_proj[:, : lanes * t].view(G, lanes, t, -1)
        gdn_replay(conv_out, proj, self.A_log_all, self.dt_bias_all, self.gdn_layers[0].norm_w,
                   dec.ssm, n, self.bufs.delta, nk=cfg.linear_num_key_heads, nv=cfg.linear_num_value_heads,
                   dk=cfg.linear_key_head_dim, dv=cfg.linear_value_head_dim, eps=self.eps,
                   block_v=self.gdn_block_v, lanes=lanes)

    def _attn(self, layer, normed, t, pos, off, kc, vc, lanes=1):
        cfg = self.cfg
        kc, kv_stride = self._lane0(kc)
        vc, _ = self._lane0(vc)
        proj = self.mm(normed, layer.w_in, self._buf("proj", t, layer.w_in.shape[0]))
        q = self._buf("query", t)
        attn_prep(proj, layer.qn, layer.kn, self.inv_freq, pos, off, q, kc, vc, n_heads=cfg.num_attention_heads,
                  n_kv=cfg.num_key_value_heads, head_dim=cfg.head_dim, eps=self.eps, rows=t, lanes=lanes,
                  kv_lane_stride=kv_stride, rope_scale=self.rope_scale)
        o = self._buf("mixer_out", t, cfg.num_attention_heads * cfg.head_dim)
        ws = self._workspaces.get("attn")
        need = self.rows_cap * cfg.num_attention_heads * max(ATTN_SPLITS, grouped_partials(kc.shape[1])) \
            * (p2(cfg.head_dim) + 2)
        if ws is None:
            ws = self._workspaces["attn"] = torch.empty(need, device=normed.device, dtype=torch.float32)
        attn = attn_decode_grouped if self.attn_grouped else attn_decode
        attn(q, kc, vc, pos, off, proj, o, rows=t, ws=ws if t <= self.rows_cap else None, lanes=lanes,
             kv_lane_stride=kv_stride)
        return self.mm(o, layer.w_out, self._buf("delta", t), defer=True)

    def _ffn(self, layer, normed, t):
        if layer.moe is None:
            gate_up = self.mm(normed, layer.w_gu, self._buf("gate_up", t, layer.w_gu.shape[0]))
            return self.mm(gate_up, layer.w_down, self._buf("delta", t), act=True, defer=True)
        return self._moe(layer, normed, t)

    def _moe(self, layer, normed, t):
        """Routed experts through the grouped path (hyspec.kernels.moe.moe_grouped): router
        top-k on the device, each routed expert's weights read once for all the rows routed
        to it, the row's slots combined in slot order with the shared expert."""
        moe, cfg = layer.moe, self.cfg
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        x = normed[:t]
        # no separately computed shared expert: the shared expert fused as expert E of the
        # grouped kernels, or none
        whole = layer.fuse_shared or not moe.has_shared
        # [t, E (+1)]; exact mode: possibly the split-K partials, which the route kernel sums
        # (one launch fewer), unless the shared gate's column is needed by itself below
        logits = self.mm(x, layer.router, self._buf("router", t, layer.router.shape[0]), defer=whole)
        buf = self.moe_buf
        if t > buf.rows:  # an eager call past the static rows
            buf = MoeBuffers(t, buf.n_experts, buf.top_k, cfg.hidden_size, cfg.moe_intermediate_size, x.device,
                             x.dtype)
        kw = dict(top_k=k, renorm=moe.gate.renorm, stats=self.moe_counts[1 if layer is self.mtp_layer else 0])
        out = self._buf("delta", t)
        if whole:  # the combine deferred to the next RMSNorm (MoePartials) unless HYSPEC_MOE_DEFER=0
            sh = (layer.sh_gu, layer.sh_down) if layer.fuse_shared else None
            return moe_grouped(x, logits, layer.ex_gu, layer.ex_down, buf, out, shared_experts=sh,
                               defer=self.moe_defer, **kw)
        sgu = self.mm(x, layer.sh_gu, self._buf("sh_gu", t, layer.sh_gu.shape[0]))
        shared = self.mm(sgu, layer.sh_down, self._buf("sh_out", t), act=True)
        return moe_grouped(x, logits[:, :E], layer.ex_gu, layer.ex_down, buf, out, shared=shared,
                           shared_gate=logits[:, E:E + 1], **kw)

    def logits(self, h):
        t = h.shape[0]
        return self.mm(h, self.head, self._buf("logits", t))

    def argmax(self, x):
        """x.argmax(-1) of logit rows [r, V]: on CUDA the two-launch Triton form
        (hyspec.kernels.probs.argmax, the same ids; torch's one-block-per-row reduce took
        ~9 us per call at b2's vocabulary), elsewhere torch's."""
        return first_max(x, self.fast_argmax and x.is_cuda and not interpreting())

    # -- drafter --------------------------------------------------------------------
    def mtp(self, tokens, h_prev, start, off, lanes=1):
        """MTP rows for tokens [t] paired with h_prev [t, H] at draft-KV rows start+off..
        (batched: t // lanes rows per lane, lane b's at start[b] + off..)"""
        dec = self.dec
        t = tokens.shape[0]
        H = self.cfg.hidden_size
        concat = self._buf("mtp_concat", t)
        self._rmsnorm(self.embed, self.mtp_norm_embed, self.eps, out=concat[:, :H], ids=tokens, rows=t)
        self._rmsnorm(h_prev, self.mtp_norm_hidden, self.eps, out=concat[:, H:], rows=t)
        resid, normed = self._buf("mtp_resid", t), self._buf("mtp_normed", t)
        self.mm(concat, self.mtp_fc, resid)
        layer = self.mtp_layer
        self._rmsnorm(resid, layer.ln1, self.eps, out=normed, rows=t)
        h = self._attn(layer, normed, t, start, off, dec.draft_k, dec.draft_v, lanes)
        self._rmsnorm(resid, layer.ln2, self.eps, out=normed, delta=h, resid_out=resid, rows=t)
        h = self._ffn(layer, normed, t)
        out = self._buf("mtp_out", t)
        self._rmsnorm(resid, self.mtp_norm, self.eps, out=out, delta=h, resid_out=resid, rows=t)
        return out

    def draft_argmax(self, h):
        """The drafter's greedy choice per row, as target ids.  With a reduced draft
        vocabulary whose ids ascend, the argmax over its Vd scores mapped through the ids
        (the same id as the argmax of draft_logits, first maximum included) without
        writing and scanning a [t, V] row of -inf."""
        d2t = self.dec.d2t
        if d2t is None or not self.d2t_ascending:
            return self.argmax(self.draft_logits(h))
        ids, w = d2t
        return ids.index_select(0, self.argmax(self.mm(h, w, None)))

    def draft_logits(self, h):
        d2t = self.dec.d2t
        if d2t is None:
            return self.logits(h)
        ids, w = d2t
        sub = self.mm(h, w, None)
        full = sub.new_full((h.shape[0], self.cfg.vocab_size), float("-inf"))
        full[:, ids] = sub
        return full
