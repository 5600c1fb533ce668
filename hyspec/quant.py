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

The CPU reference dequantizes at load (``dequantize_tensors``). A GPU FP8 path can keep
the fp8 weights and their scales instead: ``hyspec.loading.read_tensors(path,
dequantize=False)`` returns them untouched (``QUANT_HOOK`` below says where to plug in).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hyspec.config import ConfigError
from hyspec.model.ops import acc_dtype

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv ; stacked X -> X_scale_inv
_OTHER_FP8_NAMES = ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
_OTHER_FP8 = tuple(d for d in (getattr(torch, n, None) for n in _OTHER_FP8_NAMES) if d is not None)

# Linear weights Qwen's FP8 checkpoints leave in bf16 (suffixes of the module name).
UNQUANTIZED_LINEARS = ("lm_head", "embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                       "linear_attn.in_proj_ba", "linear_attn.conv1d", "mlp.gate", "mlp.shared_expert_gate",
                       "mtp.fc")

QUANT_HOOK = ("GPU FP8 path: call hyspec.loading.read_tensors(path, dequantize=False) to get the fp8 weights "
              "with their '<name>_scale_inv' block scales, and hand them to FP8 matmul kernels; not implemented yet")


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
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
        raise bad("modules_to_not_convert", "must be a list of module names")
    return Fp8BlockConfig(block=(blk[0], blk[1]), modules_to_not_convert=tuple(skip), activation_scheme=act)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight of `shape` ([..., R, C]): [..., ceil(R/bR), ceil(C/bC)]."""
    return tuple(shape[:-2]) + (math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def expand_scales(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Per-element fp32 scales of `shape`: each block's scale repeated, edge blocks cropped."""
    s = scale.float().repeat_interleave(block[0], dim=-2)[..., : shape[-2], :]
    return s.repeat_interleave(block[1], dim=-1)[..., : shape[-1]]


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *, name: str = "weight",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e4m3fn [..., R, C] and its scale grid -> `dtype` (the product is taken in fp32,
    fp64 for fp64, then cast). Raises CheckpointError naming `name` when the scale grid does
    not match the weight and block size."""
    from hyspec.loading import CheckpointError

    if w.dim() < 2:
        raise CheckpointError(f"tensor '{name}' is float8 but has shape {list(w.shape)}; block scales need a matrix")
    want = scale_shape(tuple(w.shape), block)
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"tensor '{name}{SCALE_SUFFIX}' has shape {list(scale_inv.shape)}, expected "
                              f"{list(want)} for weight shape "
                              f"{list(w.shape)} and weight_block_size {list(block)}")
    if not scale_inv.is_floating_point() or scale_inv.dtype == FP8_DTYPE:
        raise CheckpointError(f"tensor '{name}{SCALE_SUFFIX}' has dtype {scale_inv.dtype}; "
                              f"expected float32 (or bf16) scales")
    acc = acc_dtype(dtype)
    out = w.to(acc) * expand_scales(scale_inv, tuple(w.shape), block).to(acc)
    return out if out.dtype == dtype else out.to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32/bf16 [..., R, C] -> (float8_e4m3fn weight, fp32 scale_inv grid): per block,
    scale = amax / 448, so the block's largest entry maps to the fp8 maximum."""
    w = w.float()
    R, C = w.shape[-2:]
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
        return tensors
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
        tensors[k] = dequantize(tensors[k], tensors.pop(sk), qcfg.block, name=k, dtype=dtype)
    return tensors


__all__ = ["Fp8BlockConfig", "QuantConfigError", "parse_quantization_config", "dequantize", "quantize",
           "dequantize_tensors", "expand_scales", "scale_shape", "scale_key_of", "FP8_DTYPE", "UNQUANTIZED_LINEARS",
           "QUANT_HOOK"]
