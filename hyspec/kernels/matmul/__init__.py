"""Skinny matrix multiply ``y = x @ w.T`` for decode / verify (T <= 16 rows).

Why a custom kernel: in a speculative *verify* forward the target processes
t = k+1 rows at once, and for the greedy output to equal plain decoding, row r of
that forward must be **bitwise** equal to what a 1-row decode step computes.  cuBLAS
picks a different algorithm (and K-reduction order) for every row count, so it
cannot promise that; it is also slow on skinny shapes.

How row-invariance is obtained here (the contract every path in this folder keeps):

* the rows are always padded to a 16-row tile (``BLOCK_T = 16``); a ``tl.dot`` of a
  ``[16, BK]`` x-tile by a ``[BK, BN]`` tile of ``w.T`` computes every output row
  from its own x-row only (the MMA never mixes rows), padded rows are zeros;
* the tile shape, the split-K count ``S`` and the K range of each split are chosen
  from ``(N, K)`` only (:func:`skinny_config`), never from T;
* partial sums of the ``S`` K-splits are written in fp32 to a workspace
  ``[S, Tpad, N]`` and summed by a second kernel in the fixed order s = 0..S-1;
* the row count ``T`` is passed with ``do_not_specialize`` so T=1 and T=5 run the
  very same compiled binary for one row-tile height (``block_t``); the batched decoder
  picks the height from T on the H200, where a row's bits were measured not to depend on
  it (``tests/test_gpu_tile_heights.py``).

Glossary: T rows (tokens), K input features, N output features, S K-splits.

Contract::

    skinny_matmul(x [T, K] (act: [T, 2K] = [gate | up]), w [N, K], out=None, ws=None,
                  defer=False, act=False, <config overrides>) -> [T, N] in x.dtype
    linear(x, w)    the kernel for CUDA inputs of <= 16 rows, F.linear otherwise
    silu_mul(x [T, 2I]) -> [T, I]   the act input by itself, the same bits (for tall calls)
    skinny_matmul_fp8(x, w: Fp8Weight, ...)   the same with a block-FP8 weight (fp8.py)

FP8 weights (``hyspec.quant.Fp8Weight``: float8_e4m3fn [N, K], fp32 scale grid
[ceil(N/bN), ceil(K/bK)], optional row map): the weight tile is converted to x's dtype in
registers (exact), each BK step (BK divides bK) is a fresh fp32 ``tl.dot`` added to the
accumulator times its block scale per output column. Same config (BK set to the quant
block's step, 128 for 128-wide blocks), same row invariance; the reference dequantizes in fp32 and multiplies in fp32.

fp32 accumulation; fp32 inputs use ``ieee`` dot products (no TF32).  ``act``: the input
fed is silu(gate) * up rounded like the torch MLP.  ``defer``: the fp32 split-K partials
come back as a :class:`SplitPartials` for the RMSNorm to reduce.

Files: ``kernel.py`` (Triton kernels, launcher, ``linear``), ``config.py`` (the per-shape
config: defaults, the ``BUILTIN`` table tuned on the H200, the ``TUNED`` table set at run
time), ``reference.py`` (torch).
"""
from hyspec.kernels.common import SplitPartials, triton_available
from hyspec.kernels.matmul.config import (
    BUILTIN,
    TUNED,
    SkinnyConfig,
    set_tuned,
    skinny_config,
)
from hyspec.kernels.matmul.fp8 import fp8_config, skinny_matmul_fp8
from hyspec.kernels.matmul.kernel import BLOCK_T, MAX_SKINNY_ROWS, linear, silu_mul, skinny_matmul
from hyspec.kernels.matmul.reference import skinny_matmul_fp8_ref, skinny_matmul_ref

__all__ = [
    "skinny_matmul", "skinny_matmul_ref", "silu_mul", "skinny_config", "SkinnyConfig", "linear", "triton_available",
    "MAX_SKINNY_ROWS", "BLOCK_T", "TUNED", "BUILTIN", "set_tuned", "SplitPartials",
    "skinny_matmul_fp8", "skinny_matmul_fp8_ref", "fp8_config",
]
