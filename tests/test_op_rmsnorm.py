"""hyspec.kernels.rmsnorm over a grid of odd shapes (Triton interpreter on CPU): plain,
residual add, embedding gather, split-K partials vs the torch reference, and bitwise row
invariance (a t-row call == t one-row calls).  fp32 only: the interpreter truncates fp32
to bf16 instead of rounding (bf16 is checked on the GPU, tests/test_gpu_fast.py)."""
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from kernel_grid import assert_rel, rnd  # noqa: E402

from hyspec.kernels.common import SplitPartials  # noqa: E402
from hyspec.kernels.rmsnorm import rmsnorm, rmsnorm_ref  # noqa: E402

SHAPES = [(1, 1), (2, 7), (3, 33), (5, 130)]  # (T, N): N below, at and past a power of two
TOL = 1e-6


@pytest.mark.parametrize("mode", ["plain", "add", "gather", "partials"])
@pytest.mark.parametrize("T,N", SHAPES)
def test_rmsnorm_grid(T, N, mode):
    dtype = torch.float32
    w = rnd(N, seed=1, scale=0.1, dtype=dtype)
    x = rnd(T, N, seed=2, dtype=dtype)
    kw, ref_kw = {}, {}
    if mode == "add":
        kw["delta"] = ref_kw["delta"] = rnd(T, N, seed=3, dtype=dtype)
    elif mode == "gather":
        x = rnd(11, N, seed=2, dtype=dtype)
        kw["ids"] = ref_kw["ids"] = torch.tensor([10, 0, 3, 3, 7][:T])
    elif mode == "partials":
        ws = rnd(3, T + 1, N, seed=3)  # fp32 partials, one spare row
        kw["delta"] = SplitPartials(ws, 3)
        ref_kw["delta"] = kw["delta"].value(T, dtype)
    out, res = torch.empty(T, N, dtype=dtype), torch.empty(T, N, dtype=dtype)
    rmsnorm(x, w, 1e-6, out=out, resid_out=res, **kw)
    want_res, want = rmsnorm_ref(x, w, 1e-6, **ref_kw)
    assert torch.equal(res, want_res)  # gather / add: the same rounding as the model
    assert_rel("rmsnorm", out, want, TOL)
    for r in range(T):
        one = {k: (v[r: r + 1] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        if mode == "partials":
            one["delta"] = SplitPartials(ws[:, r: r + 1], 3)
        o1 = torch.empty(1, N, dtype=dtype)
        rmsnorm(x if mode == "gather" else x[r: r + 1], w, 1e-6, out=o1, resid_out=torch.empty(1, N, dtype=dtype),
                **one)
        assert torch.equal(o1[0], out[r]), r


def test_rmsnorm_refuses_partials_it_cannot_read():
    """Partials the kernel would read out of bounds or as the wrong type are refused by name
    before the launch: split partials with fewer rows than the call, or not fp32; MoE
    outputs of another dtype or with fewer (row, slot) pairs than the call's rows."""
    from hyspec.kernels.common import MoePartials

    T, N = 3, 8
    x, w = rnd(T, N, seed=1), rnd(N, seed=2)
    out = torch.empty(T, N)
    with pytest.raises(ValueError, match="split partials must be fp32"):
        rmsnorm(x, w, 1e-6, out=out, delta=SplitPartials(rnd(2, T - 1, N, seed=3), 2))
    with pytest.raises(ValueError, match="split partials must be fp32"):
        rmsnorm(x, w, 1e-6, out=out, delta=SplitPartials(rnd(2, T, N, seed=3).double(), 2))
    slot = torch.arange(2 * T, dtype=torch.int32)
    with pytest.raises(ValueError, match="MoE partials must be"):
        rmsnorm(x, w, 1e-6, out=out, delta=MoePartials(rnd(2 * T, N, seed=4).double(), torch.ones(2 * T), slot, 2))
    with pytest.raises(ValueError, match="MoE partials must be"):
        rmsnorm(x, w, 1e-6, out=out, delta=MoePartials(rnd(2 * T, N, seed=4), torch.ones(2 * T - 1), slot, 2))
    with pytest.raises(ValueError, match="contiguous last dim"):
        rmsnorm(x.t().contiguous().t(), w, 1e-6, out=out)
