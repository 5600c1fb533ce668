"""hyspec.kernels.matmul.silu_mul under the Triton interpreter: the SiLU*mul input computed
by itself, fed to the plain skinny matmul, against the fused ``act=True`` x-load and the
torch formula.  The bitwise claim (the batched decoder's 32- and 64-row down projections
rely on it) is checked on the GPU, with a planted bug (tests/test_gpu_tile_heights.py):
the interpreter's dots are numpy matmuls whose bits change with the operands' layout, and
its bf16 dots are not usable, so here fp32 and tolerances."""
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from kernel_grid import rnd  # noqa: E402

from hyspec.kernels.matmul import silu_mul, skinny_matmul, skinny_matmul_ref  # noqa: E402

# (rows, I, N, overrides): a masked last block (I not a multiple of the 1024-wide block),
# an exact one, split-K with the weight-left tile form, 64-row tiles
CASES = [
    (3, 72, 40, dict()),
    (2, 1024, 24, dict(split_k=2, block_n=16)),
    (5, 96, 48, dict(split_k=3, block_n=16, wt=True)),
    (7, 80, 32, dict(block_n=16, block_t=64)),
]


def _torch_act(x):
    I = x.shape[1] // 2
    g, u = x[:, :I].float(), x[:, I:].float()
    return ((g / (1.0 + torch.exp(-g))).to(x.dtype).float() * u).to(x.dtype)


@pytest.mark.parametrize("T,I,N,cfg", CASES, ids=["masked", "even_split2", "wt_split3", "tall"])
def test_split_act_matches_the_fused_load_in_fp32(T, I, N, cfg):
    x = rnd(T, 2 * I, seed=1)
    w = rnd(N, I, seed=2, scale=I ** -0.5)
    a = silu_mul(x)
    assert a.shape == (T, I) and a.dtype == x.dtype
    assert (a - _torch_act(x)).abs().max().item() < 1e-6
    fused = skinny_matmul(x, w, act=True, **cfg)
    split = skinny_matmul(a, w, **cfg)
    assert (split - fused).abs().max().item() < 1e-5
    ref = skinny_matmul_ref(_torch_act(x), w)
    assert (split - ref).abs().max().item() < 1e-5
    # a caller-given output slice (the runner's buffer) with a longer row stride
    buf = torch.zeros(T + 2, I + 8, dtype=x.dtype)
    assert torch.equal(silu_mul(x, out=buf[:T, :I]), a)


def test_bf16_activation_rounds_like_the_model():
    """bf16: silu(gate) rounded to bf16, times up, rounded again (the model's MLP); the
    interpreter rounds to bf16 its own way, so within a bf16 ulp or two here.  This bound
    would also pass a silu_mul without the rounding after the silu: that property is the
    GPU test's (bitwise against the fused load)."""
    x = rnd(4, 2 * 200, seed=5, scale=3.0, dtype=torch.bfloat16)
    a = silu_mul(x)
    ref = _torch_act(x)
    assert a.dtype == torch.bfloat16
    assert (a.float() - ref.float()).abs().max().item() <= 2 ** -5 * ref.float().abs().max().item()


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul(torch.zeros(2, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        silu_mul(torch.zeros(2, 8, dtype=torch.bfloat16), out=torch.zeros(2, 3, dtype=torch.bfloat16))
