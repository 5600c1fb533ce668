"""hyspec.kernels.probs.argmax.argmax_rows against torch's argmax, bitwise (Triton
interpreter on the CPU, the compiled kernels where CUDA is available): ties inside and
across chunks, -inf rows, NaNs, a partial last chunk, each row alone equal to the batch."""
from __future__ import annotations

import pytest
import torch

from hyspec.kernels.common import triton_available
from kernel_grid import kernel_device

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _rows(V: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(V)
    x = torch.randn(8, V, generator=g).to(dtype)
    x[1] = torch.round(x[1])  # many ties of the maximum, across chunks
    x[2] = float("-inf")  # all -inf: index 0
    x[3, V - 1] = 50.0  # the maximum in the partial last chunk
    x[4, 5000 % V] = float("nan")
    x[4, 7 % V] = float("nan")  # the first NaN wins
    x[5, 0] = float("inf")
    x[5, V // 2] = float("inf")  # +inf ties: the first
    x[6] = 0.0  # all equal
    x[7, 4096 % V] = 9.0
    x[7, (4096 * 2 + 3) % V] = 9.0  # the same maximum in two chunks
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [300, 4096 * 2 + 17])
def test_argmax_rows_is_torch_argmax(V, dtype):
    from hyspec.kernels.probs.argmax import argmax_rows

    dev = kernel_device()
    x = _rows(V, dtype).to(dev)
    want = x.float().cpu().argmax(-1)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.cpu().tolist() == want.tolist()
    for b in range(x.shape[0]):  # a row alone
        assert argmax_rows(x[b: b + 1]).item() == want[b].item(), b
    big = torch.zeros(3, V + 5, dtype=dtype, device=dev)  # a row stride other than V
    big[:, :V] = x[:3]
    assert argmax_rows(big[:, :V]).cpu().tolist() == want[:3].tolist()
    with pytest.raises(ValueError, match="argmax_rows"):
        argmax_rows(x.t())
    with pytest.raises(ValueError, match="out must be"):
        argmax_rows(x, out=torch.empty(x.shape[0], dtype=torch.int32, device=dev))
    out = torch.full((x.shape[0],), -1, dtype=torch.int64, device=dev)
    assert argmax_rows(x, out=out) is out and out.cpu().tolist() == want.tolist()


def test_first_max_takes_the_kernel_where_it_fits():
    """first_max: argmax_rows for 16/32-bit rows when asked, torch's argmax otherwise (float64,
    kernel=False): the same ids in every case."""
    from hyspec.kernels.probs.argmax import first_max

    dev = kernel_device()
    x = _rows(300, torch.float32).to(dev)
    want = x.cpu().argmax(-1).tolist()
    for rows, kernel in ((x, True), (x, False), (x.double(), True), (x.to(torch.bfloat16), True)):
        assert first_max(rows, kernel).cpu().tolist() == rows.float().cpu().argmax(-1).tolist()
    assert first_max(x, True).cpu().tolist() == want
