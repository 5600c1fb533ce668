"""Small shared ops: norms, RoPE, and the row-invariant linear used on the decode path.

Glossary of shape letters used across hyspec: T tokens in a forward, H hidden size,
Hq/Hkv attention heads, D attention head dim, Hk/Hv linear-attention key/value heads,
Dk/Dv their head dims, C conv channels (q|k|v), W conv width, E experts, V vocab,
K draft length.
"""

from __future__ import annotations

import contextvars
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class StepCtx:
    """How one forward over T tokens should run.

    start:   absolute position of the first token (its RoPE position and KV row).
    exact:   make row r's result independent of T (a T-row verify then equals T one-token
             decode steps bit for bit). On CPU this runs the matmuls row by row; on GPU the
             fixed-split kernels do it without the loop.
    record:  what Gated-DeltaNet layers keep for rolling back part of this forward:
             "none", "states" (state after every row) or "inputs" (stash the recurrence
             inputs to re-scan later).
    chunked: use the chunked Gated-DeltaNet form (prefill) instead of the row-by-row scan.
    """

    start: int = 0
    exact: bool = False
    record: str = "none"
    chunked: bool = False


def linear(x: torch.Tensor, weight: torch.Tensor, ctx: StepCtx | None = None) -> torch.Tensor:
    """x [T, In] @ weight[Out, In]^T -> [T, Out].

    In exact mode a row's result never depends on how many rows were batched with it: on
    GPU through the fixed-split Triton kernel; on CPU every call has the same shape
    [B, In] (rows padded with zeros, B a function of the weight's size only), and BLAS
    computes each row of a fixed-shape GEMM with the same reduction order whatever the
    other rows hold (tests/test_exact.py checks this on the machine it runs on)."""
    if ctx is None or not ctx.exact or x.dim() != 2:
        return F.linear(x, weight)
    fast = _fast_linear(x, weight)
    if fast is not None:
        return fast
    B = exact_block_rows(weight)
    T = x.shape[0]
    if B == 1:
        if T == 1:
            return F.linear(x, weight)
        return torch.cat([F.linear(x[i : i + 1], weight) for i in range(T)])
    pad = (-T) % B
    xp = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
    out = torch.cat([F.linear(xp[i : i + B], weight) for i in range(0, T + pad, B)])
    return out[:T]


def exact_block_rows(weight: torch.Tensor) -> int:
    """Rows per fixed-shape GEMM in exact mode on CPU: small weights are launch-bound, so
    a block of 8 rows costs about what one row costs (a whole K=7 verify in one call);
    large weights are bandwidth/compute-bound on CPU, where one row at a time is cheapest."""
    return 8 if weight.numel() <= (1 << 20) else 1


def _fast_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """Row-invariant GPU matmul (Triton fixed split-K) when available, else None. Rows go
    through the kernel 16 at a time, so every row of any batch takes the same kernel."""
    if not x.is_cuda:
        return None
    try:
        from hyspec.kernels import matmul
    except Exception:  # pragma: no cover - GPU-only path
        return None
    if not matmul.triton_available():
        return None
    if x.shape[0] <= 16:
        return matmul.skinny_matmul(x, weight)
    return torch.cat([matmul.skinny_matmul(x[i: i + 16], weight) for i in range(0, x.shape[0], 16)])


# Elementwise activations written with exp / log1p / division only. torch's CPU kernels
# for silu, sigmoid and softplus take a different code path for the vector body and the
# tail of a buffer, so the same element can round differently depending on how many rows
# share the tensor; these formulations are identical per element whatever the size
# (checked in tests/test_exact.py), which exact mode needs.
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), linear above 20 like torch.nn.functional.softplus."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def fp8_linear(x: torch.Tensor, w, ctx: StepCtx | None = None) -> torch.Tensor:
    """x [T, In] @ dequant(w)^T for a block-FP8 weight (hyspec.quant.Fp8Weight). On CUDA, for
    an exact forward or a decode-sized one (<= 16 rows), the row-invariant FP8 kernel
    streams the fp8 tiles; otherwise (CPU reference, prefill) the weight is dequantized to
    x's dtype for this call (fp32 product cast: bitwise the weight a dequantizing load
    stores) and multiplied as `linear` does."""
    if x.is_cuda and x.dim() == 2 and ((ctx is not None and ctx.exact) or x.shape[0] <= 16):
        try:
            from hyspec.kernels import matmul
        except Exception:  # pragma: no cover - GPU-only path
            matmul = None
        if matmul is not None and matmul.triton_available():
            return torch.cat([matmul.skinny_matmul_fp8(x[i: i + 16], w) for i in range(0, x.shape[0], 16)])
    return linear(x, w.dequantize(x.dtype), ctx)


class Linear(nn.Module):
    """A bias-free projection whose forward can run in exact (row-invariant) mode. Its
    weight may be kept block-FP8 (hyspec.quant.keep_fp8_params: float8 ``weight`` +
    ``weight_scale_inv``), which the forward dequantizes on the fly."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [Out, In]

    def forward(self, x: torch.Tensor, ctx: StepCtx | None = None) -> torch.Tensor:
        if "weight_scale_inv" in self._buffers:
            from hyspec.quant import module_fp8

            return fp8_linear(x, module_fp8(self), ctx)
        return linear(x, self.weight, ctx)


# Row reductions (norms) in exact mode. torch's CUDA reduction kernels choose how to split
# a row's sum from the tensor's whole shape, so on a GPU the same row can round differently
# when 1 or 4 or 64 rows share the call (seen on the H200: a bf16 verify of 4 rows != 4
# decode steps for some prompts). Inside an exact forward (HybridLM.forward_batch with
# exact ctxs) row reductions on CUDA therefore run in fixed blocks of 16 rows (zero-padded):
# every call has the same shape, so a row's result depends on that row alone. On the CPU a
# row's reduction does not depend on the row count (tests/test_exact.py, test_batch.py).
_EXACT_ROWS = contextvars.ContextVar("hyspec_exact_rows", default=False)
ROW_BLOCK = 16


@contextmanager
def exact_rows(on: bool = True):
    """Within this block, row_reduce runs row-invariantly on CUDA (see above)."""
    token = _EXACT_ROWS.set(on)
    try:
        yield
    finally:
        _EXACT_ROWS.reset(token)


def row_reduce(x: torch.Tensor, fn) -> torch.Tensor:
    """fn(x) for a per-row reduction over the last dim (e.g. the mean of squares, keepdim),
    row-invariant inside exact_rows() on CUDA."""
    if not (x.is_cuda and _EXACT_ROWS.get()) or x.dim() < 2:
        return fn(x)
    lead, D = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, D)
    n = flat.shape[0]
    pad = (-n) % ROW_BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, D)])
    out = torch.cat([fn(flat[i: i + ROW_BLOCK]) for i in range(0, n + pad, ROW_BLOCK)])[:n]
    return out.reshape(*lead, out.shape[-1])


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The one precision rule: norms, softmaxes, logits, dequantisation and the DeltaNet state
    are computed in fp32 whatever the model's dtype, except fp64 models, which stay fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in acc_dtype(x.dtype) (x itself when it already is)."""
    return x.to(acc_dtype(x.dtype))


def _mean_square(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1, keepdim=True)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm used by Qwen3-Next/3.5: x̂ · (1 + w), computed in fp32.

    Weights are stored centred on zero (a fresh layer is the identity)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        xhat = xf * torch.rsqrt(row_reduce(xf, _mean_square) + self.eps)
        return (xhat * (1.0 + self.weight.to(xhat.dtype))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head norm of the DeltaNet output, gated by z: w · x̂ · silu(z) (w stored as-is)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = upcast(x)
        xhat = xf * torch.rsqrt(row_reduce(xf, _mean_square) + self.eps)
        y = self.weight * xhat.to(dtype)
        zf = upcast(z)
        return (y * silu(zf)).to(dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32, attention scaling of cos / sin) of cfg's RoPE:
    default, linear (frequencies / factor) or YaRN (interpolated and extrapolated frequencies
    blended over a ramp of dimensions, cos / sin scaled by 0.1 ln(factor) + 1), computed as
    transformers computes them (modeling_rope_utils), so the same checkpoint gives the same
    tables."""
    rot, base = cfg.rotary_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot)
    inv_freq = 1.0 / pos_freqs
    p = dict(cfg.rope_scaling)
    if cfg.rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if cfg.rope_type != "yarn":
        return inv_freq, 1.0
    factor, orig = p["factor"], p["original_max_position_embeddings"]
    scale = p.get("attention_factor")
    if scale is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        scale = _yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all else _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over orig
        return rot * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rot // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: keep the dimension's frequency, 0: interpolate it by the factor
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(scale)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
    """cos/sin tables [T, rot_dim] for neox-style RoPE over the first rot_dim = 2 x
    len(inv_freq) dims (inv_freq on the positions' device; scale: YaRN's attention scaling,
    applied before the rounding)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, rot/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, rot]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; rotate the first rot dims (neox halves), pass the rest through."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    xr = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([xr, xp], dim=-1)
