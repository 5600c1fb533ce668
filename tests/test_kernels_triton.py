"""Triton kernels vs their torch references, run on CPU through the Triton interpreter.

The `triton_interpreter` fixture (conftest.py) sets TRITON_INTERPRET=1 for these modules
only; hyspec builds its kernels once per mode, so GPU tests in the same run get real ones.  Everything is float32: the interpreter's ``tl.dot`` mis-handles bf16 (it
multiplies the raw uint16 bit patterns), so bf16 row-invariance is checked on the GPU by
``bench/kernels_gpu.py``.  The interpreter runs ``tl.dot`` as a numpy matmul of the fixed
[16, BK] x [BK, BN] tiles, so bitwise row-invariance is meaningful here too.
"""


import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from hyspec.kernels.gemm import skinny_matmul, skinny_matmul_ref

GEMM_ATOL = 1e-4  # fp32, K=200, |x|,|w| ~ N(0,1): sums ~ 14, ieee dot
GEMM_RTOL = 1e-5


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- gemm
# (N, K, overrides): default heuristic; every tile full (mask-free loads, split in two);
# no split; two splits; three uneven splits [0,96) [96,192) [192,200)
GEMM_CASES = [
    (96, 200, dict()),
    (96, 256, dict(block_n=32, block_k=64, split_k=2)),
    (96, 200, dict(split_k=1)),
    (96, 200, dict(split_k=2, block_n=64)),
    (96, 200, dict(split_k=3, block_k=32, block_n=16)),
    (96, 200, dict(split_k=2, block_n=32, wt=True)),
    (64, 256, dict(split_k=1, block_n=64, block_k=128, wt=True)),
]


@pytest.mark.parametrize("N,K,cfg", GEMM_CASES, ids=["default", "even", "s1", "s2", "s3", "wt_s2", "wt_even"])
def test_skinny_matmul_matches_ref_and_is_row_invariant(N, K, cfg):
    w = _randn(N, K, seed=0)
    x = _randn(5, K, seed=1)
    y5 = skinny_matmul(x, w, **cfg)
    assert y5.shape == (5, N) and y5.dtype == torch.float32
    torch.testing.assert_close(y5, skinny_matmul_ref(x, w), atol=GEMM_ATOL, rtol=GEMM_RTOL)
    # row r depends on x[r] only: any prefix, and every single row alone, give the same bits
    for T in range(1, 5):
        assert torch.equal(skinny_matmul(x[:T], w, **cfg), y5[:T])
    for r in range(5):
        assert torch.equal(skinny_matmul(x[r : r + 1], w, **cfg)[0], y5[r])
    # other rows' values do not matter either
    x_other = x.clone()
    x_other[1:] = _randn(4, K, seed=2)
    assert torch.equal(skinny_matmul(x_other, w, **cfg)[0], y5[0])


def test_skinny_matmul_more_than_16_rows_and_strided_inputs():
    N, K = 40, 72
    w_big = _randn(N, K + 8, seed=3)
    w = w_big[:, 4 : 4 + K]  # strided weight view
    x_big = _randn(20, K + 5, seed=4)
    x = x_big[:, :K]  # strided rows
    y = skinny_matmul(x, w, split_k=2, block_k=32, block_n=16)
    torch.testing.assert_close(y, skinny_matmul_ref(x, w), atol=GEMM_ATOL, rtol=GEMM_RTOL)
    assert torch.equal(skinny_matmul(x[17:18], w, split_k=2, block_k=32, block_n=16)[0], y[17])
    out = torch.empty(20, N)
    assert skinny_matmul(x, w, split_k=2, block_k=32, block_n=16, out=out) is out
    assert torch.equal(out, y)


def test_skinny_matmul_rejects_bad_shapes():
    with pytest.raises(ValueError):
        skinny_matmul(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError):
        skinny_matmul(torch.randn(2, 8), torch.randn(4, 8).double())


def test_skinny_matmul_uses_a_caller_workspace_only_when_it_fits():
    """A caller's split-K workspace (the runner's, reused across calls) is written when it
    is fp32 [>= S, >= 16, N] with contiguous rows; one of another dtype or too few splits or
    rows is not used (the kernel writes fp32 partials at the padded tile's strides): the
    same bits either way, the caller's tensor untouched."""
    N, K, cfg = 40, 96, dict(split_k=2, block_k=32, block_n=16)
    w, x = _randn(N, K, seed=5), _randn(3, K, seed=6)
    want = skinny_matmul(x, w, **cfg)
    ws = torch.full((2, 16, N), float("nan"))
    assert torch.equal(skinny_matmul(x, w, ws=ws, **cfg), want)
    assert not ws[:, :3].isnan().any()  # used: the partials of the call's rows
    for bad in (torch.zeros(2, 16, N, dtype=torch.float64), torch.zeros(1, 16, N), torch.zeros(2, 2, N)):
        before = bad.clone()
        assert torch.equal(skinny_matmul(x, w, ws=bad, **cfg), want)
        assert torch.equal(bad, before)
