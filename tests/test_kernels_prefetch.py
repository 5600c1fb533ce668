"""hyspec.kernels.prefetch.l2_touch reads every word of a weight (Triton interpreter on the
CPU, the compiled kernel where CUDA is available): each program's xor of its words lands in
the sink, so a word skipped or read twice changes a program's xor.  Its effect on a decode
(none on any number) is tests/test_gpu_batch.py::test_l2_prefetch_changes_no_number."""
from __future__ import annotations

import functools

import pytest
import torch

from hyspec.kernels.common import triton_available
from kernel_grid import kernel_device

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _expected(words: torch.Tensor, per: int) -> list[int]:
    chunks = words.split(per)
    return [functools.reduce(lambda a, b: a ^ b, c.tolist(), 0) for c in chunks]


@pytest.mark.parametrize("extra", [0, 1, 4093])
def test_every_word_is_read_once(extra):
    from hyspec.kernels.prefetch import TOUCH_BLOCK, TOUCH_ITERS, flat_words, l2_touch

    dev = kernel_device()
    per = TOUCH_BLOCK * TOUCH_ITERS
    g = torch.Generator().manual_seed(extra)
    w = torch.randn(2 * per + extra, generator=g).to(torch.bfloat16)  # a bf16 "weight", viewed as int32 words
    w = torch.cat([w, w[:1]]) if w.numel() % 2 else w
    words = flat_words(w.to(dev))
    assert words is not None and words.numel() * 2 == w.numel()
    sink = torch.zeros(8, dtype=torch.int32, device=dev)
    l2_touch(words, sink)
    want = _expected(words.cpu(), per)
    assert sink.cpu().tolist()[: len(want)] == want


def test_flat_words_refuses_what_it_cannot_view():
    from hyspec.kernels.prefetch import flat_words

    assert flat_words(torch.zeros(4, 6, dtype=torch.bfloat16)[:, :3]) is None  # not contiguous
    assert flat_words(torch.zeros(3, dtype=torch.bfloat16)) is None  # 6 bytes
    assert flat_words(torch.zeros(10, dtype=torch.bfloat16)[1:9]) is None  # starts 2 bytes off a word
    assert flat_words(torch.zeros(2, 3, dtype=torch.float8_e4m3fn)[:, :2].contiguous()) is not None
