"""hyspec.kernels.moe.expert_gemv over a grid of odd shapes (Triton interpreter on CPU):
plain and SiLU*mul input vs the torch reference, and bitwise row invariance (each
(token, expert) row alone gives the same bits).  fp32 only (see test_kernels_triton)."""
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from kernel_grid import assert_rel, rnd  # noqa: E402

from hyspec.kernels.moe import expert_gemv, expert_gemv_ref  # noqa: E402

# (E, N, K, T, k): experts, out / in features, tokens, experts per token
CASES = [
    (1, 1, 1, 1, 1),
    (3, 20, 24, 2, 2),
    (4, 33, 65, 3, 2),  # N past a 32-output block, K past a 64-wide step
    (2, 70, 130, 1, 2),  # both experts of the token the same row of x
]


@pytest.mark.parametrize("act", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("E,N,K,T,k", CASES)
def test_expert_gemv_grid(E, N, K, T, k, act):
    w = rnd(E, N, K, seed=1, scale=K ** -0.5)
    ids = torch.randint(0, E, (T * k,), generator=torch.Generator().manual_seed(2))
    # act: one [gate | up] row per (token, expert) pair (xdiv 1); else the token's row (xdiv k)
    x, xdiv = (rnd(T * k, 2 * K, seed=3), 1) if act else (rnd(T, K, seed=3), k)
    out = torch.empty(T * k, N)
    expert_gemv(x, w, ids, xdiv, out, act=act)
    assert_rel("expert_gemv", out, expert_gemv_ref(x, w, ids, xdiv, act=act), 1e-5)
    for q in range(T * k):
        o1 = torch.empty(1, N)
        expert_gemv(x[q // xdiv: q // xdiv + 1], w, ids[q: q + 1], 1, o1, act=act)
        assert torch.equal(o1[0], out[q]), q
