"""Helpers of the kernel tests (tests/test_op_*.py, test_gpu_*.py, test_kernels_*.py): seeded
inputs, the relative error they assert (flash-linear-attention style: ||a - b|| / ||b|| over
the whole tensor), the device a kernel test runs on, and edge-case probability rows."""
import pytest
import torch

GPU_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # relative error of a GPU kernel vs its reference


def kernel_device() -> torch.device:
    """The CPU under the Triton interpreter, else CUDA (the test skips without either)."""
    from hyspec.kernels.pdl import interpreting

    if interpreting():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA or the Triton interpreter")
    return torch.device("cuda")


def mass_edge_rows(V: int, chunk: int, gen: torch.Generator) -> torch.Tensor:
    """float64 [6, V] probability rows for inverse-CDF tests over `chunk`-token chunks: every
    other token without mass, then row 1 with whole chunks without mass, row 2 with all its
    mass in the last (partial) chunk, row 3 without mass, row 4 one-hot at token 5, row 5 as drawn."""
    p = torch.softmax(torch.randn(6, V, generator=gen, dtype=torch.float64) * 3, -1)
    p[:, ::2] = 0.0
    p[1, chunk: 3 * chunk] = 0.0
    p[2, :-5] = 0.0
    p[3] = 0.0
    p[4, 5] = 1.0
    p[4, 6:] = 0.0
    return p


def rnd(*shape, seed=0, scale=1.0, dtype=torch.float32, device=None):
    """Seeded normal values; on `device` (e.g. cuda) drawn by that device's generator."""
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)


def rel_err(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def assert_rel(name, got, want, tol):
    assert got.shape == want.shape, (name, tuple(got.shape), tuple(want.shape))
    err = rel_err(got, want)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol:.3g}"


def e4m3_codes_through_the_matmul(device, act_dtype=torch.bfloat16):
    """Every float8_e4m3fn code through skinny_matmul_fp8: a [256, 128] weight whose row i
    holds code i in column 0 (zeros elsewhere, block scales 1) times a one-hot row x, so
    output column i is code i's value converted by the kernel (exact: e4m3 values are bf16
    values, the products and sums exact). Returns (got [256], want [256]: torch's
    conversion of each code, NaN for e4m3fn's two NaN codes 0x7F and 0xFF)."""
    from hyspec.kernels.matmul import skinny_matmul_fp8
    from hyspec.quant import FP8_DTYPE, Fp8Weight

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w = torch.zeros(256, 128, dtype=torch.uint8)
    w[:, 0] = codes
    w8 = w.view(FP8_DTYPE).to(device)
    scale = torch.ones(2, 1, dtype=torch.float32, device=device)
    x = torch.zeros(1, 128, dtype=act_dtype, device=device)
    x[0, 0] = 1.0
    got = skinny_matmul_fp8(x, Fp8Weight(w8, scale, (128, 128)), block_t=16)[0].float().cpu()
    want = codes.view(FP8_DTYPE).to(torch.float32)
    return got, want
