"""Pick the skinny-GEMM tile / split-K per weight shape on the running GPU (t = 1).

Configs are chosen from (N, K) only and installed before any decoding
(``hyspec.kernels.matmul.set_tuned``), so every row count keeps using the same config: the
row invariance that exact mode needs is untouched.  Each candidate is timed inside a
CUDA graph of the real decode step (``tune_in_step``): a matmul's best tile between the
step's small kernels is not the one it gets timed alone.
"""
from __future__ import annotations

import time

import torch

from hyspec.kernels.matmul import set_tuned, skinny_config


def model_shapes(runner) -> list[tuple[int, int]]:
    """The (N, K) of every matmul weight the Triton runner uses (target + MTP + head)."""
    shapes = {tuple(runner.head.shape)}
    layers = list(runner.layers) + ([runner.mtp_layer] if runner.mtp_layer is not None else [])
    for L in layers:
        for w in (L.w_in, L.w_out, L.w_gu, getattr(L, "w_down", None)):
            for part in getattr(w, "parts", [w]):  # Segments (fp8 | bf16 runs): each part is a matmul
                if part is not None:
                    shapes.add(tuple(part.shape))
    if runner.mtp_layer is not None:
        shapes.add(tuple(runner.mtp_fc.shape))
    return sorted(shapes)


def _candidates(N: int, K: int, cur: dict) -> list[dict]:
    """One-parameter moves around ``cur`` (block_n, block_k, split_k, num_warps, num_stages)."""
    base = skinny_config(N, K, **cur)
    c0 = dict(block_n=base.block_n, block_k=base.block_k, split_k=base.split_k, num_warps=base.num_warps,
              num_stages=base.num_stages, wt=base.wt)
    out = []

    def add(**kw):
        c = dict(c0, **kw)
        if c["block_n"] < 16 or c["block_k"] < 16 or c["split_k"] < 1 or K // c["split_k"] < c["block_k"]:
            return
        if c not in out and c != c0:
            out.append(c)

    for bn in (c0["block_n"] // 2, c0["block_n"] * 2):
        add(block_n=bn)
    for bk in (128, 256, 512):
        add(block_k=bk)
    for s in (c0["split_k"] // 2, c0["split_k"] * 2):
        add(split_k=s)
    for w in (2, 4, 8):
        add(num_warps=w)
    for st in (2, 3, 4, 5, 6):
        add(num_stages=st)
    add(wt=not c0["wt"])
    add(wt=not c0["wt"], num_stages=4)
    add(num_stages=c0["num_stages"] + 1, block_n=c0["block_n"] // 2)
    return [c0] + out


def tune_in_step(dec, shapes, *, budget_s: float = 120.0, reps: int = 30, log=print) -> dict:
    """Pick each weight shape's skinny-GEMM config by the time of the *whole decode step*
    (a CUDA graph of the real step, every other shape fixed), one shape at a time, largest
    total bytes first: the configs that stream best in isolation are not the ones that
    stream best between the step's small kernels.  ``dec`` is a FastDecoder (triton
    runner, graphs) after a prefill; its state is left unchanged.  Installs the table
    (``set_tuned``) and returns {(N, K): {"config", "step_ms", "start_step_ms", "tried"}}.
    Configs still depend on (N, K) only, so row invariance is untouched."""
    from hyspec.kernels.matmul import BUILTIN, TUNED

    table = {s: dict(TUNED.get(s) or BUILTIN.get(s, {})) for s in shapes}
    graphs = dec.step_graphs
    snap = graphs.snapshot()

    def step_ms() -> float:
        set_tuned(table)
        dec.runner._workspaces.clear()
        graphs.graphs.pop(("decode",), None)
        dec.decode_step_capture_only()
        g = graphs.graphs.get(("decode",))
        if g is None:  # the capture failed (e.g. a tile over the shared-memory limit)
            graphs.failed = False
            graphs.restore(snap)
            raise RuntimeError("decode-step capture failed for this config")
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(3):
            a.record()
            for _ in range(reps):
                g.replay()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / reps)
        graphs.restore(snap)
        return best

    t0 = time.perf_counter()
    start = cur_ms = step_ms()
    log(f"  in-step tune: start {start:.4f} ms/step")
    out = {}
    weights = {s: s[0] * s[1] for s in shapes}
    order = sorted(shapes, key=lambda s: -weights[s])
    seen = {s: [] for s in shapes}
    for s in order + order:  # two passes of one-parameter moves while the budget lasts
        tried = []
        for c in _candidates(s[0], s[1], table[s])[1:]:
            if c in seen[s]:
                continue
            seen[s].append(c)
            if time.perf_counter() - t0 > budget_s:
                break
            old = table[s]
            table[s] = c
            try:
                ms = step_ms()
            except Exception as e:  # e.g. out of shared memory for a large tile
                log(f"  in-step tune {s[0]}x{s[1]} {c}: {type(e).__name__}")
                table[s] = old
                continue
            tried.append((ms, c))
            if ms < cur_ms * 0.998:  # keep only a clear gain
                cur_ms = ms
            else:
                table[s] = old
        out[s] = {"config": table[s], "step_ms": cur_ms, "tried": len(seen[s])}
        log(f"  in-step tune {s[0]}x{s[1]}: {table[s]} -> step {cur_ms:.4f} ms ({len(tried)} tried)")
    set_tuned(table)
    dec.runner._workspaces.clear()
    graphs.graphs.clear()
    for v in out.values():
        v["start_step_ms"] = start
    return out
