"""Read a weight into the GPU's L2 cache ahead of the matmul that needs it.

A batch-1 decode step alternates bandwidth-bound matmuls with short latency-bound
kernels (conv, scan, gated norm, attention) during which HBM sits nearly idle.  With
``HYSPEC_L2_PREFETCH=1`` (off by default: on the H200 every b2 step got slower with it,
x1.021 at batch 1, ``bench/results/prefetch_h200.json``) the runner
(``hyspec.gpu.runner_triton``, ``TritonRunner.l2_prefetch``) launches :func:`l2_touch` on
a side stream right after a layer's input projection, so the output projection's weight
streams into L2 while the mixer kernels run, and joins the side stream before that
projection.  Nothing here computes a value the model uses: every byte is
read, xor-folded into one int32 per program and written to a scratch ``sink`` (so the
loads are not optimised away).  The numbers of a step do not change (the matmul reads the
same bytes, from L2 instead of HBM), only its time.

The PDL prefetch that an early commit (e010fc1, removed in 2d0d188) measured slower ran
inside the dependent matmul itself, before its dependency wait; this one runs beside the
idle-bandwidth kernels, on its own stream.
"""
from __future__ import annotations

import torch

from hyspec.kernels.pdl import kernels_per_mode

__all__ = ["l2_touch", "flat_words", "TOUCH_BLOCK", "TOUCH_ITERS"]

TOUCH_BLOCK = 2048  # int32 words per load of a program (8 KB: 16 words = four 16-byte loads per thread)
TOUCH_ITERS = 4  # unrolled loads per program (32 KB in flight per program)


@kernels_per_mode
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _touch_kernel(ptr, n, sink_ptr, n_sink, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                      POLICY: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * (BLOCK * ITERS)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in tl.static_range(ITERS):  # independent loads, all issued before the xors wait
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc ^= tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy=POLICY)
        tl.store(sink_ptr + pid % n_sink, tl.xor_sum(acc, axis=0))

    return _touch_kernel


def flat_words(t: torch.Tensor) -> torch.Tensor | None:
    """t's bytes as a flat int32 tensor (a view), or None when t is not contiguous, starts
    off a 4-byte boundary or its byte count is not a multiple of 4 (then it is not
    prefetched)."""
    es = t.element_size()
    if not t.is_contiguous() or (t.numel() * es) % 4 or (t.storage_offset() * es) % 4:
        return None
    return t.reshape(-1).view(torch.uint8).view(torch.int32)


def l2_touch(words: torch.Tensor, sink: torch.Tensor, policy: str = "evict_last") -> None:
    """Read every int32 of ``words`` (flat, contiguous) once, on the current stream; write
    one xor per program into ``sink`` (int32, any length >= 1).  ``policy``: the loads'
    L2 eviction hint (``evict_last`` keeps the lines ahead of streaming data)."""
    n = words.numel()
    if n == 0:
        return
    per = TOUCH_BLOCK * TOUCH_ITERS
    _kernels()[(-(-n // per),)](words, n, sink, sink.numel(), BLOCK=TOUCH_BLOCK, ITERS=TOUCH_ITERS,
                                POLICY=policy, num_warps=4)
