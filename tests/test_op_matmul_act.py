"""hyspec.kernels.matmul.silu_mul under the Triton interpreter: the SiLU*mul input computed
by itself, fed to the plain skinny matmul in the act shape's tile (as the batched decoder's
32- and 64-row down projections do), gives the bits of the fused ``act=True`` x-load, in
fp32 (the interpreter's dot sums in a fixed order here, tests/conftest.py; its bf16 dots
are not usable: the bf16 case is on the GPU, tests/test_gpu_tile_heights.py); a planted
bug (the activation written another way) must change them; the values against torch."""
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from kernel_grid import rnd  # noqa: E402

from hyspec.kernels.matmul import silu_mul, skinny_matmul, skinny_matmul_ref  # noqa: E402
from hyspec.kernels.matmul.config import _config_cached  # noqa: E402


def _act_tile(N, K, cfg):
    """cfg with the act shape's operand order unless given (the runner passes the act
    shape's whole tile to the plain matmul: the operand order changes the bits)."""
    return dict(cfg, wt=cfg.get("wt", _config_cached(N, K, None, None, None, None, None, None, True).wt))

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
def test_split_act_gives_the_fused_bits(T, I, N, cfg):
    x = rnd(T, 2 * I, seed=1)
    w = rnd(N, I, seed=2, scale=I ** -0.5)
    a = silu_mul(x)
    assert a.shape == (T, I) and a.dtype == x.dtype
    assert (a - _torch_act(x)).abs().max().item() < 1e-6
    tile = _act_tile(N, I, cfg)
    fused = skinny_matmul(x, w, act=True, **tile)
    split = skinny_matmul(a, w, **tile)
    assert torch.equal(split, fused)
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


def test_a_different_formula_changes_the_bits():
    """Planted bug: the activation as gate * sigmoid(gate) * up (equal in exact arithmetic)
    gives other matmul bits, so the equality above can fail."""
    T, I, N = 4, 256, 32
    x = rnd(T, 2 * I, seed=3, scale=3.0)
    w = rnd(N, I, seed=4, scale=I ** -0.5)
    tile = _act_tile(N, I, {})
    g, u = x[:, :I], x[:, I:]
    wrong = g * torch.sigmoid(g) * u
    fused = skinny_matmul(x, w, act=True, **tile)
    assert not torch.equal(skinny_matmul(wrong, w, **tile), fused)
    assert torch.equal(skinny_matmul(silu_mul(x), w, **tile), fused)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul(torch.zeros(2, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        silu_mul(torch.zeros(2, 8, dtype=torch.bfloat16), out=torch.zeros(2, 3, dtype=torch.bfloat16))
