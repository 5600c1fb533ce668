"""hyspec.kernels.matmul.skinny_matmul_fp8 (block-FP8 weights streamed as float8) under the
Triton interpreter: against the torch reference (dequantize in fp32, then matmul) over odd
shapes, block sizes, split-K, both tile forms, the SiLU*mul input and a row map; bitwise
row invariance; planted bugs (a transposed scale grid, a dropped row map) must fail."""
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from kernel_grid import assert_rel, rel_err, rnd  # noqa: E402

from hyspec.kernels.matmul import fp8_config, skinny_matmul_fp8, skinny_matmul_fp8_ref  # noqa: E402
from hyspec.quant import Fp8Weight, quantize  # noqa: E402

TOL = 1e-5  # fp32 activations: the kernel scales each BK step's partial product, the reference the weight


def fp8(N, K, block, seed=0):
    return Fp8Weight(*quantize(rnd(N, K, seed=seed, scale=K ** -0.5), block), block)


# (N, K, block, overrides): partial blocks on both axes; BK clamped to 16 by a 48-wide block
# with three uneven splits; Qwen's 128 x 128 with a 2-way split; weight-left tile form
CASES = [
    (40, 72, (32, 48), dict()),
    (96, 200, (16, 48), dict(split_k=3, block_n=32)),
    (64, 256, (128, 128), dict(split_k=2, block_n=32)),
    (40, 96, (32, 32), dict(split_k=2, block_n=16, wt=True)),
]


@pytest.mark.parametrize("N,K,block,cfg", CASES, ids=["partial", "s3_bk16", "qwen_block", "wt"])
def test_fp8_matmul_matches_ref_and_is_row_invariant(N, K, block, cfg):
    w, x = fp8(N, K, block), rnd(5, K, seed=1)
    y = skinny_matmul_fp8(x, w, **cfg)
    assert_rel("fp8 matmul", y, skinny_matmul_fp8_ref(x, w), TOL)
    for r in range(5):  # each row alone: the same bits
        assert torch.equal(skinny_matmul_fp8(x[r: r + 1], w, **cfg)[0], y[r]), r
    other = x.clone()
    other[1:] = rnd(4, K, seed=2)
    assert torch.equal(skinny_matmul_fp8(other, w, **cfg)[0], y[0])


def test_fp8_matmul_silu_mul_input_and_row_map():
    N, K, block = 36, 64, (16, 32)
    w = fp8(N, K, block)
    gu = rnd(3, 2 * K, seed=3)
    y = skinny_matmul_fp8(gu, w, act=True, split_k=2)
    assert_rel("fp8 act", y, skinny_matmul_fp8_ref(gu, w, act=True), TOL)
    assert torch.equal(skinny_matmul_fp8(gu[2:3], w, act=True, split_k=2)[0], y[2])
    # two weights of 20 and 16 rows concatenated: part 2's rows take their own grid's scales
    a, b = fp8(20, K, block, seed=4), fp8(16, K, block, seed=5)
    rows = torch.cat([torch.arange(20) // 16, 2 + torch.arange(16) // 16]).to(torch.int32)
    cat = Fp8Weight(torch.cat([a.w, b.w]), torch.cat([a.scale, b.scale]), block, rows)
    x = rnd(2, K, seed=6)
    y = skinny_matmul_fp8(x, cat)
    assert_rel("row map", y, torch.cat([skinny_matmul_fp8_ref(x, a), skinny_matmul_fp8_ref(x, b)], 1), TOL)
    # planted bug: the map dropped (rows 16..19 would read part 2's scale row) must fail
    wrong = Fp8Weight(cat.w, torch.cat([a.scale, b.scale])[:3], block)
    assert rel_err(skinny_matmul_fp8(x, wrong), y) > 100 * TOL


def test_fp8_matmul_planted_bug_transposed_scales_fails():
    N = K = 96
    block = (32, 32)  # a square 3 x 3 grid: the transposed grid has the right shape
    w, x = fp8(N, K, block), rnd(4, K, seed=7)
    g = torch.Generator().manual_seed(8)
    w.scale = w.scale * torch.rand(w.scale.shape, generator=g).add(0.5)  # blocks differ visibly
    ref = skinny_matmul_fp8_ref(x, w)
    assert_rel("fp8 matmul", skinny_matmul_fp8(x, w), ref, TOL)
    bad = Fp8Weight(w.w, w.scale.t().contiguous(), block)
    assert rel_err(skinny_matmul_fp8(x, bad), ref) > 100 * TOL


def test_fp8_config_is_the_shape_config_with_bk_clamped():
    c = fp8_config(2048, 4096, (128, 128))  # BUILTIN: block_k 256, split 4
    assert (c.block_n, c.block_k, c.split_k, c.k_per_split) == (32, 128, 4, 1024)
    assert fp8_config(96, 200, (16, 48)).block_k == 16
    # BK is the block's step whatever is asked: BK 64 on 128-wide blocks gave tile-height-dependent
    # bits on the H200 (tests/test_gpu_tile_heights.py, move split8_bk64)
    assert fp8_config(2048, 4096, (128, 128), block_k=64, split_k=8).block_k == 128
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_config(64, 64, (32, 40))


def test_tuner_starts_fp8_shapes_from_the_tile_they_run(monkeypatch):
    """The in-step tuner's first candidate is the config a shape runs untuned: for block-FP8
    weights FP8_TALL's entry over the bf16 one (a tune once started the 80B's FP8 attention
    in-projection from the bf16 128-column tile); a TUNED entry wins; bf16 shapes keep
    BUILTIN's."""
    from hyspec.gpu.runner_triton import FP8_TALL
    from hyspec.gpu.tune import start_config
    from hyspec.kernels import matmul

    monkeypatch.setattr(matmul, "TUNED", {})
    s = (9216, 2048)
    assert matmul.BUILTIN[s]["block_n"] == 128 and FP8_TALL[s + (False,)]["block_n"] == 32
    assert start_config(s, fp8=True)["block_n"] == 32
    assert start_config(s, fp8=False) == matmul.BUILTIN[s]
    assert start_config((2048, 4096), fp8=True) == dict(matmul.BUILTIN[(2048, 4096)], **FP8_TALL[(2048, 4096, False)])
    matmul.TUNED[s] = dict(block_n=64)
    assert start_config(s, fp8=True) == dict(block_n=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_every_e4m3_code_converts_exactly(dtype):
    """All 256 e4m3 codes through the kernel's conversion in the interpreter (Triton's; the
    GPU twin in tests/test_gpu_fp8_moe.py also runs the integer one, with bf16): each finite
    code's exact value. (Not bf16 here: the interpreter's fp8 -> bf16 cast gives wrong
    values, e.g. 2.5e8 for 0.002, which is why the CPU FP8 tests use fp32; nor the NaN
    codes, which the interpreter converts to +-480.)"""
    from kernel_grid import e4m3_codes_through_the_matmul

    got, want = e4m3_codes_through_the_matmul(torch.device("cpu"), dtype)
    finite = torch.tensor([c not in (0x7F, 0xFF) for c in range(256)])
    assert torch.equal(got[finite], want[finite])
