"""The Triton runner's weights, packed once at load: one matmul per projection group.

Per target layer a SimpleNamespace with the weights the runner's kernels read:

    ln1, ln2       [H] input / post-attention RMSNorm weights
    attention      w_in [(Hq + 2 Hkv) D, H] (q | k | v), w_out [H, Hq D], qn / kn [D]
    Gated DeltaNet w_in [2kd + 2vd + 2nv, H] (q | k | v | z | b | a), w_out [H, vd],
                   conv_w [C, W], A_log / dt_bias [Hv], norm_w [Dv]
    dense FFN      w_gu [2I, H] (gate | up), w_down [H, I]
    MoE FFN        moe (the module), w_gu None; router [E (+1), H] (the shared expert's gate
                   as row E), ex_gu [E, 2I, H] / ex_down [E, H, I] the routed experts;
                   shared expert sh_gu [2I, H], sh_down [H, I], fuse_shared (it runs as
                   expert E inside the grouped MoE kernels)

The packed tensors are the model's own storage where the layout allows (pack_views: the
parameters become views into them), so no second copy stays on the device.

Block-FP8 weights (a model loaded with fp8="keep", hyspec.quant) stay FP8: a packed weight
is then a ``hyspec.quant.Fp8Weight`` (the concatenated fp8 rows, the concatenated scale
grids, and a row map where a part's rows are not a multiple of the block); a group that
mixes fp8 and unquantized weights (the GDN input projections: q|k|v|z in fp8, b|a in
bf16) becomes ``Segments``, one matmul per run of the same kind into its output columns.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from hyspec.config import FULL
from hyspec.model.ffn import MoE
from hyspec.kernels.moe.grouped import can_fuse_shared
from hyspec.quant import SCALE_SUFFIX, Fp8Weight, module_fp8


class Segments:
    """Output columns computed by several weights [N_i, K] (tensors or Fp8Weight), in order:
    the runner runs one matmul per part into out[:, off_i : off_i + N_i]."""

    __slots__ = ("parts",)

    def __init__(self, parts) -> None:
        self.parts = list(parts)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))


def weight_nbytes(w) -> int:
    """Bytes a matmul reads to use all of w (tensor, Fp8Weight or Segments)."""
    if w is None:
        return 0
    if isinstance(w, Segments):
        return sum(weight_nbytes(p) for p in w.parts)
    if isinstance(w, Fp8Weight):
        return w.nbytes()
    return w.numel() * w.element_size()


def _plain_rows(q: Fp8Weight) -> torch.Tensor:
    """q's scale row of each weight row (its map, or n // bN)."""
    if q.rows is not None:
        return q.rows.long()
    return torch.arange(q.shape[-2], device=q.w.device) // q.block[0]


def _fp8_with_rows(w: torch.Tensor, scale: torch.Tensor, block, srow: torch.Tensor) -> Fp8Weight:
    """An Fp8Weight whose row n takes scale row srow[n]: no map when srow is n // bN; the
    scale rows reordered (a copy of the small grid, no map) when srow only permutes whole
    blocks; else the map."""
    N = w.shape[0]
    blocks = torch.arange(N, device=srow.device) // block[0]
    if torch.equal(srow, blocks) and scale.shape[0] == -(-N // block[0]):
        return Fp8Weight(w, scale, block)
    first = srow[:: block[0]]
    if torch.equal(srow, first[blocks]):
        return Fp8Weight(w, scale.index_select(0, first).contiguous(), block)
    return Fp8Weight(w, scale, block, srow.to(torch.int32))


def pack_fp8(items) -> Fp8Weight:
    """One Fp8Weight for block-FP8 weights [N_i, K] (items: (module, attribute name)) stacked
    by rows, held once: the parameters and their scale buffers become views into the packed
    tensors (as pack_views does), a later runner on the same model reuses them."""
    qs = [module_fp8(m, a) for m, a in items]
    if len(qs) == 1:
        return qs[0]
    block = qs[0].block
    if any(q.block != block for q in qs):
        raise ValueError(f"pack_fp8: parts with different blocks {[q.block for q in qs]}")
    mod0, attr0 = items[0]
    prev = getattr(getattr(mod0, attr0), "_hyspec_packed_fp8", None)
    if prev is not None:
        off = 0
        for q in qs:
            if q.w.data_ptr() != prev.w[off:].data_ptr():
                break
            off += q.shape[0]
        else:
            if off == prev.shape[0]:
                return prev
    w = torch.cat([q.w for q in qs], 0).contiguous()
    scale = torch.cat([q.scale for q in qs], 0).contiguous()
    srows, off_w, off_s = [], 0, 0
    for (mod, attr), q in zip(items, qs):
        n, sn = q.shape[0], q.scale.shape[0]
        srows.append(_plain_rows(q) + off_s)
        getattr(mod, attr).data = w[off_w: off_w + n]
        mod._buffers[attr + SCALE_SUFFIX] = scale[off_s: off_s + sn]
        off_w, off_s = off_w + n, off_s + sn
    packed = _fp8_with_rows(w, scale, block, torch.cat(srows))
    getattr(mod0, attr0)._hyspec_packed_fp8 = packed
    return packed


def pack_rows(items):
    """The weights of items ((module, attribute name), all [N_i, K]) stacked by rows for one
    matmul: a tensor (pack_views) when none is fp8, an Fp8Weight when all are (with one
    block), else Segments of the runs of each kind."""
    kinds = [module_fp8(m, a) is not None for m, a in items]
    runs, start = [], 0
    for i in range(1, len(items) + 1):
        if i == len(items) or kinds[i] != kinds[start]:
            runs.append((kinds[start], items[start:i]))
            start = i
    parts = []
    for fp8, run in runs:
        if fp8:
            parts.append(pack_fp8(run))
        elif len(run) == 1:
            parts.append(getattr(run[0][0], run[0][1]))
        else:
            parts.append(pack_views([getattr(m, a) for m, a in run]))
    return parts[0] if len(parts) == 1 else Segments(parts)


def matmul_weight(mod, attr: str = "weight"):
    """A module's weight for the runner's matmuls: its Fp8Weight when kept in fp8, else the tensor."""
    q = module_fp8(mod, attr)
    return q if q is not None else getattr(mod, attr)


def pack_gdn_in(mod) -> torch.Tensor:
    """The GDN input projections as one [2kd + 2vd + 2nv, H] weight with output columns
    [q (all key heads) | k | v | z | b | a] (Qwen3-Next's per-key-head groups unpacked)."""
    nk, nv, dk, dv = mod.nk, mod.nv, mod.dk, mod.dv
    if mod.family == "qwen3_next":
        cached = getattr(mod, "_hyspec_packed_in", None)
        if cached is not None:  # one re-ordered copy per model, shared by every runner
            return cached
        r = nv // nk
        q8 = module_fp8(mod.in_proj_qkvz)
        if q8 is not None or module_fp8(mod.in_proj_ba) is not None:
            mod._hyspec_packed_in = _pack_next_in_fp8(mod)
            return mod._hyspec_packed_in
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
    return pack_rows([(mod.in_proj_qkv, "weight"), (mod.in_proj_z, "weight"), (mod.in_proj_b, "weight"),
                      (mod.in_proj_a, "weight")])


def _next_in_order(mod) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's per-key-head rows -> [q | k | v | z] and [b | a]: the source row of each
    packed row, for in_proj_qkvz and in_proj_ba."""
    nk, nv, dk, dv = mod.nk, mod.nv, mod.dk, mod.dv
    r = nv // nk
    dev = mod.in_proj_qkvz.weight.device
    src = torch.arange(nk * (2 * dk + 2 * r * dv), device=dev).view(nk, -1)
    q, k, v, z = torch.split(src, [dk, dk, r * dv, r * dv], dim=1)
    qkvz = torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1), z.reshape(-1)])
    src = torch.arange(nk * 2 * r, device=dev).view(nk, 2 * r)
    ba = torch.cat([src[:, :r].reshape(-1), src[:, r:].reshape(-1)])
    return qkvz, ba


def _pack_next_in_fp8(mod):
    """Qwen3-Next's GDN input projections with in_proj_qkvz (and possibly in_proj_ba) kept in
    fp8: the rows re-ordered to [q | k | v | z] (a copy, as for bf16), the scale rows
    re-ordered with them (or a row map where the per-head parts are not whole blocks);
    Segments of the fp8 and the unquantized part."""
    order_qkvz, order_ba = _next_in_order(mod)
    parts = []
    for lin, order in ((mod.in_proj_qkvz, order_qkvz), (mod.in_proj_ba, order_ba)):
        q = module_fp8(lin)
        if q is None:
            parts.append(lin.weight.index_select(0, order).contiguous())
        else:
            parts.append(_fp8_with_rows(q.w.index_select(0, order).contiguous(), q.scale, q.block,
                                        _plain_rows(q)[order]))
    if all(isinstance(p, Fp8Weight) for p in parts) and parts[0].block == parts[1].block:
        a, b = parts
        srow = torch.cat([_plain_rows(a), _plain_rows(b) + a.scale.shape[0]])
        return _fp8_with_rows(torch.cat([a.w, b.w]), torch.cat([a.scale, b.scale]), a.block, srow)
    return Segments(parts)


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


def pack_layer(layer, gdn_index: int | None = None, layer_index: int | None = None) -> SimpleNamespace:
    """A decoder layer's packed weights (module docstring); gdn_index: its index among the
    Gated-DeltaNet layers (their state slot), layer_index: its index in the model."""
    packed = SimpleNamespace(ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight)
    if layer.layer_type == FULL:
        attn = layer.self_attn
        packed.kind = "attn"
        packed.index = layer_index
        packed.w_in = pack_rows([(attn.q_proj, "weight"), (attn.k_proj, "weight"), (attn.v_proj, "weight")])
        packed.w_out = matmul_weight(attn.o_proj)
        packed.qn, packed.kn = attn.q_norm.weight, attn.k_norm.weight
    else:
        gdn = layer.linear_attn
        packed.kind = "gdn"
        packed.g = gdn_index
        packed.w_in = pack_gdn_in(gdn)
        packed.w_out = matmul_weight(gdn.out_proj)
        packed.conv_w = gdn.conv1d.weight[:, 0, :].contiguous()
        packed.A_log, packed.dt_bias, packed.norm_w = gdn.A_log, gdn.dt_bias, gdn.norm.weight
    mlp = layer.mlp
    if isinstance(mlp, MoE):
        packed.moe = mlp
        packed.w_gu = None
        packed.ex_gu = matmul_weight(mlp.experts, "gate_up_proj")  # [E, 2I, H]
        packed.ex_down = matmul_weight(mlp.experts, "down_proj")  # [E, H, I]
        packed.fuse_shared = False
        if mlp.has_shared:
            se = mlp.shared_expert
            # router | shared gate: one matmul, the gate's logit in column E ([E + 1, H]; both
            # bf16 in Qwen's FP8 checkpoints)
            packed.router = pack_rows([(mlp.gate, "weight"), (mlp.shared_expert_gate, "weight")])
            packed.sh_gu = pack_rows([(se.gate_proj, "weight"), (se.up_proj, "weight")])
            packed.sh_down = matmul_weight(se.down_proj)
            # laid out like a routed expert: it runs inside the grouped gemms as expert E
            packed.fuse_shared = not isinstance(packed.sh_gu, Segments) and can_fuse_shared(
                packed.ex_gu, packed.ex_down, packed.sh_gu, packed.sh_down)
        else:
            packed.router = mlp.gate.weight  # [E, H]
    else:
        packed.moe = None
        packed.w_gu = pack_rows([(mlp.gate_proj, "weight"), (mlp.up_proj, "weight")])
        packed.w_down = matmul_weight(mlp.down_proj)
    return packed


def expert_bytes(packed: SimpleNamespace) -> float:
    """Bytes of one routed expert of a packed MoE layer (gate | up and down, with scales)."""
    if packed.moe is None:
        return 0.0
    E = packed.moe.experts.gate_up_proj.shape[0]
    return (weight_nbytes(packed.ex_gu) + weight_nbytes(packed.ex_down)) / E


def layer_weight_bytes(packed: SimpleNamespace, with_moe: bool = True, experts: float | None = None) -> float:
    """Bytes of a packed layer's matmul weights (fp8 ones with their scales). MoE layers
    (with_moe): the router, the shared expert and its gate, and `experts` routed experts
    (None: all of them; a decode step reads top_k, a verify the distinct ones its rows hit)."""
    n = 0
    for name in ("w_in", "w_out", "w_gu", "w_down"):
        n += weight_nbytes(getattr(packed, name, None))
    if with_moe and packed.moe is not None:
        n += weight_nbytes(packed.router)  # with the shared expert's gate
        for name in ("sh_gu", "sh_down"):
            n += weight_nbytes(getattr(packed, name, None))
        E = packed.moe.experts.gate_up_proj.shape[0]
        n += expert_bytes(packed) * (E if experts is None else experts)
    return n
