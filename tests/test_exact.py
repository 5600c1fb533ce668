"""Exact mode: a T-row verify forward computes every row bit for bit as T one-token
decode steps would (the property greedy speculative exactness rests on)."""

import pytest
import torch

from hyspec.loading import load_model
from hyspec.model.ops import StepCtx, exact_block_rows, linear
from hyspec.tiny import make_tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(96, 64), (300, 77), (1200, 1000), (2048, 1024)])
def test_exact_linear_rows_do_not_depend_on_batch(dtype, shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g, dtype=dtype)
    x = torch.randn(11, shape[1], generator=g, dtype=dtype)
    ctx = StepCtx(exact=True)
    full = linear(x, w, ctx)
    for t in (1, 2, 5, 11):
        part = linear(x[:t], w, ctx)
        assert torch.equal(part, full[:t]), (t, exact_block_rows(w))
    for i in range(11):  # each row alone, as a decode step computes it
        assert torch.equal(linear(x[i : i + 1], w, ctx), full[i : i + 1])
    assert torch.allclose(full, x @ w.T, rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, d, seed=3)
    return d


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_verify_rows_equal_decode_steps_bitwise(tiny, dtype):
    m = load_model(tiny, dtype=dtype)
    prompt = torch.arange(3, 20)
    new = torch.tensor([7, 300, 11, 42, 5])
    # a: prefill, then one forward over the 5 new tokens (a verify)
    a = m.new_cache(64)
    m.forward_hidden(prompt, a, StepCtx(start=0, chunked=True))
    ha = m.forward_hidden(new, a, StepCtx(start=a.pos, exact=True, record="states"))
    # b: prefill, then 5 one-token decode steps
    b = m.new_cache(64)
    m.forward_hidden(prompt, b, StepCtx(start=0, chunked=True))
    hb = torch.cat([m.forward_hidden(new[i : i + 1], b, StepCtx(start=b.pos, exact=True)) for i in range(5)])
    assert torch.equal(ha, hb)
    for sa, sb in zip(a.linear_states, b.linear_states):
        assert torch.equal(sa.ssm, sb.ssm) and torch.equal(sa.conv, sb.conv)
    for ka, kb in zip(a.kv_buffers, b.kv_buffers):
        assert torch.equal(ka.k[:, : a.pos], kb.k[:, : b.pos]) and torch.equal(ka.v[:, : a.pos], kb.v[:, : b.pos])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 3, 4, 12, 37, 48, 130])
def test_activations_are_row_invariant(dtype, width):
    from hyspec.model.ops import sigmoid, silu, softplus

    x = torch.randn(9, width, generator=torch.Generator().manual_seed(width), dtype=dtype) * 4
    for f in (sigmoid, silu, softplus):
        full = f(x)
        for t in range(1, 10):
            assert torch.equal(f(x[:t]), full[:t])
        for i in range(9):
            assert torch.equal(f(x[i : i + 1]), full[i : i + 1])
    ref = torch.nn.functional
    assert torch.allclose(silu(x), ref.silu(x)) and torch.allclose(sigmoid(x), torch.sigmoid(x))
    assert torch.allclose(softplus(x), ref.softplus(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softplus_is_linear_above_its_threshold(dtype):
    """softplus(x) = x above 20, as torch's (the DeltaNet's decay takes softplus(a + dt_bias));
    the inputs above are rarely past 20, where a threshold that does not match the clamp
    inside would give 20 instead of x."""
    from hyspec.model.ops import softplus

    x = torch.tensor([-30.0, -5.0, 0.0, 5.0, 19.9, 20.0, 20.1, 25.0, 35.0, 80.0], dtype=dtype)
    torch.testing.assert_close(softplus(x), torch.nn.functional.softplus(x))
