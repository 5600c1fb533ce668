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
