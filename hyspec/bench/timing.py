"""Timing on the device: milliseconds per call (CUDA events on a GPU, wall clock on the
CPU) and the device's copy bandwidth (the roofline's denominator)."""

from __future__ import annotations

import statistics
import time

import torch


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_fn(fn, dev, reps: int, warmup: int = 2) -> float:
    """ms per call: back-to-back calls between two events (CUDA) or wall clock (CPU)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        per_call = []
        for _ in range(3):
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / reps)
        return statistics.median(per_call)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def copy_bandwidth(dev, nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = nbytes // 2
    src = torch.randn(n, device=dev, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), dev, reps=10 if dev.type == "cuda" else 2)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def require_cuda(script: str, device: str = "cuda") -> None:
    """Exit with one line naming `script` when `device` is a CUDA device and none is here (the
    bench/ scripts time GPU kernels: without a GPU they ended in a torch traceback)."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU (torch.cuda.is_available() is False)")
