"""CUDA graphs of a decoder's step bodies: captured on first use, replayed after.

The BatchDecoder launches every step as
``step_graphs.run(key, body)``, ``key`` naming the body and its static shape (e.g.
``("verify", t)``, ``("commit", nb, t, sampled)``).  The first run of a key warms the
body up on a side stream (Triton compiles there), puts the owner's mutable state back,
captures the body into a graph and puts the state back again, so capturing never
advances a sequence; then it replays.  A capture that fails turns graphs off for the
owner, loudly and once (GraphFallbackWarning + a line on stderr): every body then runs
eagerly, with the same numbers, only slower.
"""
from __future__ import annotations

import gc
import sys
import time
import warnings
from collections.abc import Callable, Hashable

import torch

from hyspec.kernels.pdl import families, scoped


def graph_ms(fn, reps: int = 50) -> float:
    """ms per replay of fn captured in a CUDA graph (a warm-up call on a side stream first,
    then replay_ms: the best of three batches of replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return replay_ms(g, reps)


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 30, warmup: int = 3) -> float:
    """ms per replay of a captured graph: the best of three batches of back-to-back
    replays between two events (after warmup replays)."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / reps)
    return best


class GraphFallbackWarning(RuntimeWarning):
    """A CUDA-graph capture failed; that step runs eagerly from now on (slower, same result)."""


class StepGraphs:
    """The graphs of one decoder, by key.

    enabled   graphs were asked for (the decoder's ``graphs``); False: every run is eager
    mutable   () -> the owner's tensors a body writes (saved and put back around a capture)
    pdl       () -> (flag, skip[, late]): whether the bodies launch with programmatic
              dependent launch (True / False; None: the process-wide setting), the kernel
              families that do not and the skinny matmuls' form under it, read at each run
              and capture (hyspec.kernels.pdl.scoped); a graph keeps the launches it captured
    """

    def __init__(self, enabled: bool, device: torch.device, mutable: Callable[[], list[torch.Tensor]],
                 pdl: Callable[[], tuple] = lambda: (None, "")) -> None:
        self.enabled = enabled
        self.device = device
        self.mutable = mutable
        self.pdl = pdl
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.failed = False  # a capture failed: eager from then on
        self.pool_bytes = 0  # device memory the captures reserved (their graph pool), bytes
        self.captures = 0  # graphs captured so far (warm-up + capture each)
        self.capture_s = 0.0  # wall seconds those captures took

    @property
    def active(self) -> bool:
        """Steps replay graphs (asked for, and no capture has failed)."""
        return self.enabled and not self.failed

    def run(self, key: Hashable, body: Callable[[], None]) -> None:
        """Replay key's graph (capturing it first when new); eager when graphs are off."""
        if self.active:
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.capture(key, body)
            if graph is not None:
                graph.replay()
                return
        with torch.no_grad(), scoped(*self._launch()):
            body()

    def ensure(self, key: Hashable, body: Callable[[], None]) -> None:
        """Capture key's graph ahead of time (the owner's state is left unchanged)."""
        if self.active and key not in self.graphs:
            self.capture(key, body)

    def _launch(self) -> tuple:
        """The owner's PDL choice (flag, skip[, late]: hyspec.kernels.pdl.scoped's
        arguments), its kernel families checked (ValueError naming a bad one)."""
        choice = tuple(self.pdl())
        families(choice[1], "the decoder's pdl_skip")
        return choice

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the owner's mutable tensors (for restore)."""
        return [t.clone() for t in self.mutable()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, v in zip(self.mutable(), saved):
            t.copy_(v)

    def capture(self, key: Hashable, body: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        """Warm up, capture and store key's graph; None (and graphs off) if that fails."""
        t0 = time.perf_counter()
        launch = self._launch()  # before the try: a bad setting is an error, not a failed capture
        saved = self.snapshot()
        # no garbage collection while capturing: collecting an unreachable decoder would
        # destroy its graphs mid-capture ("operation not permitted when stream is capturing",
        # seen on the H200 between tests; torch.cuda.graph no longer collects first by default)
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad(), scoped(*launch):
                body()  # compile + warm up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            self.restore(saved)
            before = torch.cuda.memory_reserved(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.no_grad(), scoped(*launch):
                body()
            torch.cuda.synchronize()
            self.pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back loudly, once
            torch.cuda.synchronize()
            self.restore(saved)
            self.failed = True
            msg = (f"hyspec.gpu: CUDA-graph capture of {key} failed ({type(e).__name__}: {e}); "
                   f"running eagerly from now on")
            warnings.warn(msg, GraphFallbackWarning, stacklevel=3)
            print(msg, file=sys.stderr)
            return None
        finally:
            if gc_was_on:
                gc.enable()
        self.restore(saved)
        self.graphs[key] = graph
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return graph
