"""Helpers of the per-op kernel tests (tests/test_op_*.py): seeded inputs and the relative
error they assert, flash-linear-attention style (||a - b|| / ||b|| over the whole tensor)."""
import torch


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
