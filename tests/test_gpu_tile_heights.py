"""GPU (CUDA) check: does a matmul row's value depend on the height of the row tile it
runs in?  The batched decoder runs every matmul in 64-row tiles (``block_t=64``), fixed
per decoder so that a lane's rows are bitwise the same whatever the batch.  A round with
few rows wastes most of such a tile (b2 at one lane: 415 vs 588 tok/s with 16-row tiles,
docs/gpu.md).  Choosing the tile height from a call's row count keeps the batch
invariance only if a row's bits are the same in a 16-, 32- or 64-row tile with the same
split-K and column tile; these tests measure that on the device for the b2 shapes (bf16
and block-FP8; the runner relies on it for bf16 models: hyspec.gpu.runner_triton).  Skipped without CUDA."""
import functools

import kernel_grid
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from hyspec.gpu.runner_triton import tall_tile  # noqa: E402
from hyspec.kernels.matmul import silu_mul, skinny_matmul, skinny_matmul_fp8  # noqa: E402
from hyspec.kernels.matmul.config import BUILTIN  # noqa: E402
from hyspec.quant import Fp8Weight, quantize  # noqa: E402

DEV = torch.device("cuda")
rnd = functools.partial(kernel_grid.rnd, device=DEV)

# b2's weight shapes (the in-step tuner's table) and the down projection's fused SiLU*mul input
SHAPES = [(N, K, False) for (N, K) in sorted(BUILTIN)] + [(2048, 6144, True)]
VARIANTS = {  # name -> (block_t, whether the config is the tall tile's)
    "t16_tall": (16, True),
    "t32_tall": (32, True),
    "t16_own": (16, False),  # the one-sequence decoder's own config (BK up to 256, more stages)
}


def _ids(s):
    return f"{s[0]}x{s[1]}{'_act' if s[2] else ''}"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_row_bits_do_not_depend_on_tile_height(shape, variant):
    _check(shape, variant, torch.bfloat16)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=_ids)
def test_fp32_row_bits_across_tile_heights(shape):
    """fp32 (ieee dots) too (passed on the H200 at 4e23a8a; fp32 models still keep 64-row
    tiles in the runner: their end-to-end case is measured on a tiny model only)."""
    _check(shape, "t16_tall", torch.float32)


def _check(shape, variant, dtype):
    N, K, act = shape
    w = rnd(N, K, dtype=dtype, seed=0, scale=K ** -0.5)
    x = rnd(64, 2 * K if act else K, dtype=dtype, seed=1)
    tall = tall_tile(N, K, act, dtype=dtype)
    ref = skinny_matmul(x, w, act=act, block_t=64, **tall)  # [64, N] the batched decoder's rows
    block_t, same = VARIANTS[variant]
    cfg = tall if same else {}
    for T in (1, 3, 16, 40):
        if T > 16 and block_t == 16 and not same:
            continue
        y = skinny_matmul(x[:T], w, act=act, block_t=block_t, **cfg)
        diff = (y.float() - ref[:T].float()).abs().max().item()
        assert torch.equal(y, ref[:T]), f"T={T}: max |diff| {diff:.3g}"


@pytest.mark.parametrize("height", [32, 64])
def test_split_activation_gives_the_fused_bits(height):
    """The runner's tall down projection (silu_mul, then the plain matmul in the act shape's
    tall tile) against a one-sequence decode's fused SiLU*mul load in its own 16-row config:
    bitwise, for every row count; a planted bug (the activation as gate * sigmoid(gate) * up,
    equal in exact arithmetic) must give other bits."""
    N, K = 2048, 6144
    w = rnd(N, K, dtype=torch.bfloat16, seed=0, scale=K ** -0.5)
    x = rnd(64, 2 * K, dtype=torch.bfloat16, seed=1)
    tall = tall_tile(N, K, True)
    for T in (1, 3, 16, 40, 64):
        own = skinny_matmul(x[:T], w, act=True, block_t=16)
        split = skinny_matmul(silu_mul(x[:T]), w, block_t=height, **tall)
        assert torch.equal(split, own), f"T={T}: max |diff| {(split.float() - own.float()).abs().max().item():.3g}"
    g, u = x[:, :K].float(), x[:, K:].float()
    wrong = (g * torch.sigmoid(g) * u).to(torch.bfloat16)
    assert not torch.equal(skinny_matmul(wrong, w, block_t=64, **tall), skinny_matmul(x, w, act=True, block_t=16))


# block-FP8 tiles: the shape's tall config, and moves a tuner may pick (more stages, other
# column tiles, warps, split) -- each config runs at every height, so each must keep a row's bits
FP8_MOVES = {"tall": {}, "stages5": dict(num_stages=5), "bn64_w8": dict(block_n=64, num_warps=8),
             "split8": dict(split_k=8), "split8_bk64": dict(split_k=8, block_k=64)}


@pytest.mark.parametrize("move", list(FP8_MOVES))
@pytest.mark.parametrize("block_t", [16, 32])
def test_fp8_row_bits_do_not_depend_on_tile_height(block_t, move):
    N, K = 2048, 4096
    q, s = quantize(rnd(N, K, seed=0, scale=K ** -0.5).cpu(), (128, 128))
    w = Fp8Weight(q.to(DEV), s.to(DEV), (128, 128))
    x = rnd(64, K, dtype=torch.bfloat16, seed=1)
    tall = dict(tall_tile(N, K, fp8=True), **FP8_MOVES[move])
    ref = skinny_matmul_fp8(x, w, block_t=64, **tall)
    for T in (1, 5, 16):
        assert torch.equal(skinny_matmul_fp8(x[:T], w, block_t=block_t, **tall), ref[:T]), T
