"""FP8 block-quantized checkpoints (the format of Qwen's published "-FP8" models).

Format (as transformers' FineGrainedFP8 integration and vLLM's block-FP8 ``Fp8LinearMethod``
read it):

* ``config.json`` announces it with ``quantization_config`` (top level; a multimodal
  wrapper may also nest it under ``text_config``)::

      {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
       "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

* a quantized linear stores ``X.weight`` as ``float8_e4m3fn`` [R, C] and
  ``X.weight_scale_inv`` as float32 [ceil(R / bR), ceil(C / bC)]; stacked MoE experts
  (``mlp.experts.gate_up_proj`` [E, R, C]) store ``mlp.experts.gate_up_proj_scale_inv``
  [E, ceil(R / bR), ceil(C / bC)]. Dequantized: ``w = fp8.float() * scale_inv`` broadcast
  over each bR x bC block; the last block of a row / column is partial when R or C is
  not a multiple of the block (those blocks take the same scale, cropped).
* what a checkpoint leaves unquantized stays in bf16 (no scale tensor). Qwen's FP8
  checkpoints keep in bf16: the embedding, ``lm_head``, every norm, ``A_log``,
  ``dt_bias``, ``linear_attn.conv1d``, the small linear-attention projections
  (``in_proj_a`` / ``in_proj_b``; Qwen3-Next's fused ``in_proj_ba``), the MoE router
  ``mlp.gate`` and ``mlp.shared_expert_gate``, and ``mtp.fc`` (see ``modules_to_not_convert``
  of Qwen3.5-122B-A10B-FP8, and docs/models.md for the sources).
* ``activation_scheme: dynamic`` means activations are quantized on the fly by the
  kernel: no ``input_scale`` / ``activation_scale`` tensors.

The CPU reference dequantizes at load (``dequantize_tensors``). The GPU fast path keeps
the fp8 weights and their scales instead (``load_model(fp8="keep")``, the default on CUDA):
``prepare_fp8`` validates and stacks the raw tensors, ``keep_fp8_params`` makes the modules
hold float8 weights + ``*_scale_inv`` buffers (their torch forward dequantizes on the fly,
``module_weight``), the Triton runner streams them (``Fp8Weight``,
``hyspec.kernels.matmul.skinny_matmul_fp8``, ``hyspec.kernels.moe.moe_grouped``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from hyspec.config import ConfigError
from hyspec.model.ops import acc_dtype

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv ; stacked X -> X_scale_inv


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights: its parameters and, for block-FP8 weights kept FP8, their
    scales and row maps (buffers, not parameters)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return n + sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                   if name.endswith((SCALE_SUFFIX, "_scale_rows")))


_OTHER_FP8_NAMES = ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
_OTHER_FP8 = tuple(d for d in (getattr(torch, n, None) for n in _OTHER_FP8_NAMES) if d is not None)

# Linear weights Qwen's FP8 checkpoints leave in bf16 (suffixes of the module name).
UNQUANTIZED_LINEARS = ("lm_head", "embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                       "linear_attn.in_proj_ba", "linear_attn.conv1d", "mlp.gate", "mlp.shared_expert_gate",
                       "mtp.fc")

QUANT_HOOK = ("GPU FP8 path: hyspec.loading.load_model(path, fp8='keep') (the default on CUDA) keeps the fp8 "
              "weights with their '<name>_scale_inv' block scales on the device; the Triton runner streams them "
              "(hyspec.kernels.matmul.skinny_matmul_fp8, hyspec.kernels.moe.moe_grouped)")


class QuantConfigError(ConfigError):
    """config.json's quantization_config describes a format we cannot load."""


@dataclass(frozen=True)
class Fp8BlockConfig:
    block: tuple[int, int]  # (rows, cols) of one scale block
    modules_to_not_convert: tuple[str, ...] = ()
    activation_scheme: str = "dynamic"

    def to_dict(self) -> dict:
        return {"quant_method": "fp8", "activation_scheme": self.activation_scheme, "fmt": "e4m3",
                "weight_block_size": list(self.block), "modules_to_not_convert": list(self.modules_to_not_convert)}


def parse_quantization_config(raw: dict) -> Fp8BlockConfig | None:
    """The checkpoint's quantization (None: unquantized). Raises QuantConfigError naming the
    field for anything but dynamic-activation, e4m3, block-scaled FP8."""
    q = raw.get("quantization_config")
    where = "quantization_config"
    if q is None and isinstance(raw.get("text_config"), dict):
        q = raw["text_config"].get("quantization_config")
        where = "text_config.quantization_config"
    if q is None:
        return None

    def bad(field: str, why: str) -> QuantConfigError:
        return QuantConfigError(f"config.json: field '{where}.{field}' {why}")

    if not isinstance(q, dict):
        raise QuantConfigError(f"config.json: field '{where}' must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method is None:
        raise bad("quant_method", "is missing")
    if str(method).lower() != "fp8":
        raise bad("quant_method", f"is {method!r}; only 'fp8' (block-scaled float8_e4m3fn, the format of "
                                  f"Qwen's -FP8 checkpoints) is supported")
    act = str(q.get("activation_scheme", "dynamic")).lower()
    if act != "dynamic":
        raise bad("activation_scheme", f"is {q.get('activation_scheme')!r}; only 'dynamic' is supported "
                                       f"(static activation scales are not)")
    fmt = q.get("fmt", "e4m3")
    if str(fmt).lower() != "e4m3":
        raise bad("fmt", f"is {fmt!r}; only 'e4m3' (float8_e4m3fn) is supported")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in (None, "float"):
        raise bad("scale_fmt", f"is {scale_fmt!r}; only float32 scales are supported")
    for k in ("weight_per_tensor", "act_per_tensor"):
        if q.get(k):
            raise bad(k, "is true; only per-block weight scales with dynamic activations are supported")
    if "weight_block_size" not in q or q["weight_block_size"] is None:
        raise bad("weight_block_size", "is missing; per-tensor FP8 is not supported (expected e.g. [128, 128])")
    blk = q["weight_block_size"]
    if (not isinstance(blk, (list, tuple)) or len(blk) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in blk)):
        raise bad("weight_block_size", f"must be two positive integers, got {blk!r}")
    skip_field = "modules_to_not_convert" if q.get("modules_to_not_convert") else "ignored_layers"
    skip = q.get(skip_field) or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
        raise bad(skip_field, "must be a list of module names")
    return Fp8BlockConfig(block=(blk[0], blk[1]), modules_to_not_convert=tuple(skip), activation_scheme=act)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight of `shape` ([..., R, C]): [..., ceil(R/bR), ceil(C/bC)]."""
    return tuple(shape[:-2]) + (math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def expand_scales(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int],
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per-element fp32 scales of `shape`: each block's scale repeated, edge blocks cropped.
    rows: optional int map [R] (weight row -> scale row) for weights whose rows were
    concatenated or reordered (row i takes scale row rows[i] instead of i // bR)."""
    # a block past the matrix's edge is the matrix (one block): each scale is repeated at most the
    # matrix's size (repeating it block-size times tried to allocate terabytes for a huge block)
    b_rows, b_cols = min(block[0], shape[-2]), min(block[1], shape[-1])
    if rows is not None:
        s = scale.float().index_select(-2, rows.to(device=scale.device, dtype=torch.long))
    else:
        s = scale.float().repeat_interleave(b_rows, dim=-2)[..., : shape[-2], :]
    return s.repeat_interleave(b_cols, dim=-1)[..., : shape[-1]]


def check_scale_signs(name: str, scale_inv: torch.Tensor) -> None:
    """A block scale is its block's amax / 448: never negative. A negative one (a damaged
    file) flipped its block's signs and decoded garbage without a word: CheckpointError."""
    from hyspec.loading import CheckpointError

    if bool((scale_inv < 0).any()):
        raise CheckpointError(f"tensor '{name}{SCALE_SUFFIX}' holds negative block scales (a block scale is the "
                              f"block's largest magnitude / 448, never negative): the checkpoint is damaged")


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *, name: str = "weight",
               dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float8_e4m3fn [..., R, C] and its scale grid -> `dtype` (the product is taken in fp32,
    fp64 for fp64, then cast). Raises CheckpointError naming `name` when the scale grid does
    not match the weight and block size. rows: the scale-row map of a weight whose rows
    were concatenated or reordered (see expand_scales; the grid is then not checked)."""
    from hyspec.loading import CheckpointError

    if w.dim() < 2:
        raise CheckpointError(f"tensor '{name}' is float8 but has shape {list(w.shape)}; block scales need a matrix")
    want = scale_shape(tuple(w.shape), block)
    if rows is None and tuple(scale_inv.shape) != want:
        raise CheckpointError(f"tensor '{name}{SCALE_SUFFIX}' has shape {list(scale_inv.shape)}, expected "
                              f"{list(want)} for weight shape "
                              f"{list(w.shape)} and weight_block_size {list(block)}")
    if not scale_inv.is_floating_point() or scale_inv.dtype == FP8_DTYPE:
        raise CheckpointError(f"tensor '{name}{SCALE_SUFFIX}' has dtype {scale_inv.dtype}; "
                              f"expected float32 (or bf16) scales")
    check_scale_signs(name, scale_inv)
    acc = acc_dtype(dtype)
    out = w.to(acc) * expand_scales(scale_inv, tuple(w.shape), block, rows).to(acc)
    if out.dtype == dtype:
        return out
    cast = out.to(dtype)
    if dtype == torch.float16 and not bool(torch.isfinite(cast).all()) and bool(torch.isfinite(out).all()):
        raise CheckpointError(f"tensor '{name}' dequantizes to values up to {float(out.abs().max()):.4g}, beyond the "
                              f"range of {dtype} it is loaded in: load it in bfloat16 or float32 (--dtype)")
    return cast


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32/bf16 [..., R, C] -> (float8_e4m3fn weight, fp32 scale_inv grid): per block,
    scale = amax / 448, so the block's largest entry maps to the fp8 maximum."""
    w = w.float()
    R, C = w.shape[-2:]
    block = (max(1, min(block[0], R)), max(1, min(block[1], C)))  # (a block past the matrix's edge is the matrix)
    gr, gc = math.ceil(R / block[0]), math.ceil(C / block[1])
    pad = torch.zeros(*w.shape[:-2], gr * block[0], gc * block[1])
    pad[..., :R, :C] = w
    blocks = pad.reshape(*w.shape[:-2], gr, block[0], gc, block[1])
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., gr, gc]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / expand_scales(scale, tuple(w.shape), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def weight_key_of_scale(scale_key: str) -> str:
    return scale_key[: -len(SCALE_SUFFIX)]


def scale_key_of(weight_key: str) -> str:
    return weight_key + SCALE_SUFFIX


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def dequantize_tensors(tensors: dict[str, torch.Tensor], qcfg: Fp8BlockConfig | None,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Replace every float8 weight and its ``*_scale_inv`` by the dequantized weight in
    `dtype` (in place, returns the dict; one tensor at a time, so a bf16 load of a large
    checkpoint never stages all of it in fp32). Unquantized tensors are untouched. Raises CheckpointError
    naming the key for a missing or mis-shaped scale, a scale without its weight, an fp8
    format other than e4m3fn, static activation scales, or fp8 weights without a
    quantization_config."""
    fp8 = check_fp8_tensors(tensors, qcfg)
    for k in fp8:
        tensors[k] = dequantize(tensors[k], tensors.pop(scale_key_of(k)), qcfg.block, name=k, dtype=dtype)
    return tensors


def check_fp8_tensors(tensors: dict[str, torch.Tensor], qcfg: Fp8BlockConfig | None) -> list[str]:
    """The float8 weight keys of a checkpoint's raw tensors, after checking them against the
    quantization config (the errors of dequantize_tensors; scale grids are checked where the
    weights are dequantized or kept)."""
    from hyspec.loading import CheckpointError

    fp8 = [k for k, v in tensors.items() if is_fp8(v)]
    other = [k for k, v in tensors.items() if v.dtype in _OTHER_FP8]
    if other:
        raise CheckpointError(f"tensor '{other[0]}' has dtype {tensors[other[0]].dtype}; only float8_e4m3fn "
                              f"weights are supported")
    if qcfg is None:
        if fp8:
            raise CheckpointError(f"tensor '{fp8[0]}' is float8_e4m3fn but config.json has no quantization_config "
                                  f"(expected quant_method 'fp8' with weight_block_size)")
        return []
    static = [k for k in tensors if k.endswith((".input_scale", ".activation_scale"))]
    if static:
        raise CheckpointError(f"tensor '{static[0]}' is a static activation scale; only activation_scheme "
                              f"'dynamic' checkpoints are supported")
    for k in [k for k in tensors if k.endswith(SCALE_SUFFIX)]:
        wk = weight_key_of_scale(k)
        if wk not in tensors:
            raise CheckpointError(f"tensor '{k}' is a block scale but its weight '{wk}' is missing")
        if not is_fp8(tensors[wk]):
            raise CheckpointError(f"tensor '{k}' scales '{wk}', which is {tensors[wk].dtype}, not float8_e4m3fn")
    for k in fp8:
        sk = scale_key_of(k)
        if sk not in tensors:
            raise CheckpointError(f"tensor '{k}' is float8_e4m3fn but its block scale '{sk}' is missing")
    return fp8


# -- FP8 weights kept as FP8 (the GPU fast path) ----------------------------------------
#
# A module that keeps a quantized weight holds the float8 parameter under its usual name
# (``weight``, ``gate_up_proj``, ...) plus the buffer ``<name>_scale_inv`` (the checkpoint's
# scale grid, fp32) and, only where the rows were concatenated from parts whose sizes are
# not multiples of the block (per-expert gate / up of a tiny model), ``<name>_scale_rows``
# (int32 [R]: weight row -> scale row). ``module.fp8_block`` is the (rows, cols) block.
# The reference forward dequantizes on the fly (``module_weight``), bitwise the weight a
# dequantizing load would have built; the Triton runner streams the fp8 tiles instead.

FP8_K_ALIGN = 16  # the kernels' K step divides the column block: the block needs a multiple of this


class Fp8Weight:
    """A block-FP8 weight as the kernels take it: ``w`` float8_e4m3fn [..., N, K], ``scale``
    fp32 [..., SN, ceil(K / bK)], ``block`` (bN, bK) and ``rows`` (None: row n takes scale
    row n // bN; else an int32 map [N], for rows concatenated or reordered off the block
    grid). Leading dims (experts) are shared by w and scale; rows is common to them."""

    __slots__ = ("w", "scale", "block", "rows")

    def __init__(self, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 rows: torch.Tensor | None = None) -> None:
        if not is_fp8(w):
            raise ValueError(f"Fp8Weight: weight is {w.dtype}, expected {FP8_DTYPE}")
        if scale.shape[:-2] != w.shape[:-2] or scale.shape[-1] != math.ceil(w.shape[-1] / block[1]):
            raise ValueError(f"Fp8Weight: scale grid {list(scale.shape)} does not fit weight {list(w.shape)} "
                             f"with block {list(block)}")
        if rows is None and scale.shape[-2] != math.ceil(w.shape[-2] / block[0]):
            raise ValueError(f"Fp8Weight: scale grid {list(scale.shape)} does not fit weight {list(w.shape)} "
                             f"with block {list(block)} (and no row map)")
        if rows is not None and (rows.dim() != 1 or rows.shape[0] != w.shape[-2]):
            raise ValueError(f"Fp8Weight: row map of shape {list(rows.shape)} for {w.shape[-2]} rows")
        self.w, self.scale, self.block, self.rows = w, scale, (int(block[0]), int(block[1])), rows

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    @property
    def device(self) -> torch.device:
        return self.w.device

    def dim(self) -> int:
        return self.w.dim()

    def nbytes(self) -> int:
        """Bytes a kernel reads to use all of it (weight + scales + row map)."""
        n = self.w.numel() + self.scale.numel() * self.scale.element_size()
        return n + (self.rows.numel() * self.rows.element_size() if self.rows is not None else 0)

    def __getitem__(self, e: int) -> "Fp8Weight":
        """Expert e of a stacked [E, N, K] weight."""
        return Fp8Weight(self.w[e], self.scale[e], self.block, self.rows)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.w, self.scale, self.block, dtype=dtype, rows=self.rows)

    def abs_max(self, piece: int = 1 << 24) -> float:
        """The largest |value| of the dequantized weight (fp32 products, as dequantize takes
        them), in pieces of about `piece` values: a float16 load checks it against 65504
        without building the whole dequantized weight."""
        K = self.w.shape[-1]
        N = self.w.shape[-2]
        step = max(1, piece // max(1, K))
        rows = self.rows
        if rows is None:
            rows = torch.arange(N, device=self.w.device) // self.block[0]
        w = self.w.reshape(-1, N, K)
        sc = self.scale.reshape(-1, *self.scale.shape[-2:])
        best = 0.0
        for e in range(w.shape[0]):
            for r0 in range(0, N, step):
                part = w[e, r0: r0 + step].float()
                s = expand_scales(sc[e], tuple(part.shape), self.block, rows[r0: r0 + step])
                best = max(best, float((part * s).abs().max()))
        return best


def module_fp8(mod: torch.nn.Module, name: str = "weight") -> Fp8Weight | None:
    """The Fp8Weight a module keeps under `name` (None: that weight is not quantized)."""
    scale = mod._buffers.get(name + SCALE_SUFFIX)
    if scale is None:
        return None
    return Fp8Weight(getattr(mod, name), scale, mod.fp8_block, mod._buffers.get(name + "_scale_rows"))


def module_weight(mod: torch.nn.Module, name: str, dtype: torch.dtype, index: int | None = None) -> torch.Tensor:
    """The weight `name` of `mod` for a torch forward in `dtype` (slice `index` of stacked
    experts): as stored, or dequantized from fp8 (fp32 product cast to dtype, exactly what
    a dequantizing load stores)."""
    q = module_fp8(mod, name)
    if q is None:
        w = getattr(mod, name)
        return w if index is None else w[index]
    if index is not None:
        q = q[index]
    return q.dequantize(dtype)


def keep_fp8_params(model: torch.nn.Module, specs: dict[str, tuple], block: tuple[int, int]) -> int:
    """Turn the named parameters into float8 ones (same shape, same device, contents
    undefined: the caller fills them) with their scale buffers: specs maps a parameter name
    to (scale grid shape, rows) where rows is None or the length of a row map. Returns the
    number converted."""
    n = 0
    for name, (grid, rows) in specs.items():
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        p = getattr(mod, attr)
        dev = p.device
        setattr(mod, attr, torch.nn.Parameter(torch.empty(p.shape, dtype=FP8_DTYPE, device=dev), requires_grad=False))
        mod.register_buffer(attr + SCALE_SUFFIX, torch.empty(tuple(grid), dtype=torch.float32, device=dev))
        if rows is not None:
            mod.register_buffer(attr + "_scale_rows", torch.empty(int(rows), dtype=torch.int32, device=dev))
        mod.fp8_block = (int(block[0]), int(block[1]))
        n += 1
    return n


def prepare_fp8(tensors: dict[str, torch.Tensor], qcfg: Fp8BlockConfig | None) -> dict[str, torch.Tensor]:
    """A checkpoint's raw tensors (read_tensors(dequantize=False)) for a model that keeps
    its FP8 weights: validated like dequantize_tensors, scale grids checked, per-expert
    keys stacked (fp8 weights and their scale grids; where gate's rows are not a multiple of
    the block the stacked gate | up gets a ``..._scale_rows`` map). A column block the
    kernels cannot step through (not a multiple of 16) dequantizes everything instead."""
    from hyspec.loading import CheckpointError, _stack_experts, check_experts

    fp8 = check_fp8_tensors(tensors, qcfg)
    if not fp8:
        return _stack_experts(tensors)
    block = qcfg.block
    for k in fp8:
        want = scale_shape(tuple(tensors[k].shape), block)
        scale = tensors[scale_key_of(k)]
        if tuple(scale.shape) != want:
            raise CheckpointError(f"tensor '{scale_key_of(k)}' has shape {list(scale.shape)}, expected {list(want)} "
                                  f"for weight shape {list(tensors[k].shape)} and weight_block_size {list(block)}")
        if not scale.is_floating_point() or scale.dtype == FP8_DTYPE:  # (as dequantize: an int grid would be
            # copied into the kept float scales, 0.0002 -> 0, and zero the weight without a word)
            raise CheckpointError(f"tensor '{scale_key_of(k)}' has dtype {scale.dtype}; expected float32 (or bf16) "
                                  f"scales")
    if block[1] % FP8_K_ALIGN:
        import warnings

        warnings.warn(f"weight_block_size {list(block)}: the FP8 kernels need a column block that is a multiple of "
                      f"{FP8_K_ALIGN}; dequantizing the weights instead", stacklevel=3)
        return _stack_experts(dequantize_tensors(tensors, qcfg, torch.float32))
    groups: dict[str, dict[int, dict[str, str]]] = {}
    for k in list(tensors):
        m = _EXPERT_KEY.match(k)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = k
    for prefix, experts in groups.items():
        keys = [k for e in experts.values() for k in e.values()]
        n = max(experts) + 1
        if len(keys) == 3 * n and all(is_fp8(tensors[k]) for k in keys):  # (else named by the stacking below)
            check_experts(prefix, {e: {part: tensors[k] for part, k in parts.items()} for e, parts in experts.items()})
        if len(keys) != 3 * n or not all(is_fp8(tensors[k]) for k in keys):
            for k in keys:  # incomplete (the stacking below names what is missing) or mixed: dequantize
                if is_fp8(tensors[k]):
                    tensors[k] = dequantize(tensors[k], tensors.pop(scale_key_of(k)), block, name=k)
            continue
        pop = lambda e, part: (tensors.pop(experts[e][part]), tensors.pop(scale_key_of(experts[e][part])))  # noqa: E731
        gu_w, gu_s, d_w, d_s = [], [], [], []
        inter = tensors[experts[0]["gate_proj"]].shape[0]
        for e in range(n):
            (gw, gs), (uw, us), (dw, ds) = pop(e, "gate_proj"), pop(e, "up_proj"), pop(e, "down_proj")
            gu_w.append(torch.cat([gw, uw])), gu_s.append(torch.cat([gs, us]))
            d_w.append(dw), d_s.append(ds)
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gu_w)
        tensors[f"{prefix}.gate_up_proj{SCALE_SUFFIX}"] = torch.stack(gu_s)
        if inter % block[0]:
            half = torch.arange(inter, dtype=torch.int32) // block[0]
            tensors[f"{prefix}.gate_up_proj_scale_rows"] = torch.cat([half, half + math.ceil(inter / block[0])])
        tensors[f"{prefix}.down_proj"] = torch.stack(d_w)
        tensors[f"{prefix}.down_proj{SCALE_SUFFIX}"] = torch.stack(d_s)
    return _stack_experts(tensors)


_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


__all__ = ["Fp8BlockConfig", "QuantConfigError", "parse_quantization_config", "dequantize", "quantize",
           "check_fp8_tensors", "prepare_fp8", "keep_fp8_params", "module_fp8", "module_weight", "Fp8Weight",
           "dequantize_tensors", "expand_scales", "scale_shape", "scale_key_of", "FP8_DTYPE", "UNQUANTIZED_LINEARS",
           "QUANT_HOOK"]
