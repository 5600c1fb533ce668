"""Pick the skinny-GEMM tile / split-K per weight shape on the running GPU (t = 1).

Configs are chosen from (N, K) only and installed before any decoding
(``hyspec.kernels.matmul.set_tuned``), so every row count keeps using the same K split:
the row invariance that exact mode needs is untouched (a batched decoder's row-tile
heights all split K as the tuned config does: ``hyspec.gpu.runner_triton``).  Each candidate is timed inside a
CUDA graph of the real decode step (``tune_in_step``): a matmul's best tile between the
step's small kernels is not the one it gets timed alone.
"""
from __future__ import annotations

import time


from hyspec.gpu.graphs import replay_ms
from hyspec.kernels.matmul import set_tuned, skinny_config


def _layer_matmuls(runner):
    """Each matmul weight of the runner's layers (target + MTP): a Segments weight (fp8 |
    bf16 runs) gives each of its parts, each a matmul of its own."""
    layers = list(runner.layers) + ([runner.mtp_layer] if runner.mtp_layer is not None else [])
    for L in layers:
        for w in (L.w_in, L.w_out, L.w_gu, getattr(L, "w_down", None)):
            for part in getattr(w, "parts", [w]):
                if part is not None:
                    yield part


def model_shapes(runner) -> list[tuple[int, int]]:
    """The (N, K) of every matmul weight the Triton runner uses (target + MTP + head)."""
    shapes = {tuple(runner.head.shape)} | {tuple(w.shape) for w in _layer_matmuls(runner)}
    if runner.mtp_layer is not None:
        shapes.add(tuple(runner.mtp_fc.shape))
    return sorted(shapes)


def fp8_shapes(runner) -> set[tuple[int, int]]:
    """The (N, K) of the runner's block-FP8 matmul weights (a subset of model_shapes)."""
    from hyspec.quant import Fp8Weight

    return {tuple(w.shape) for w in _layer_matmuls(runner) if isinstance(w, Fp8Weight)}


def moe_shapes(runner) -> list[tuple]:
    """The expert matmuls of the runner's MoE layers (hyspec.kernels.moe.grouped), as
    ("moe", N, K, act, FP8 block K or None): gate|up (act False) and down (act True)."""
    from hyspec.quant import Fp8Weight

    keys = set()
    layers = list(runner.layers) + ([runner.mtp_layer] if runner.mtp_layer is not None else [])
    for L in layers:
        if getattr(L, "moe", None) is None or getattr(L, "ex_gu", None) is None:
            continue
        for w, act in ((L.ex_gu, False), (L.ex_down, True)):
            fp8 = isinstance(w, Fp8Weight)
            w8 = w.w if fp8 else w
            keys.add(("moe", int(w8.shape[1]), int(w8.shape[2]), act, int(w.block[1]) if fp8 else None))
    return sorted(keys, key=str)


def moe_key_name(key: tuple) -> str:
    """("moe", N, K, act, qb_k) as text for a JSON key, e.g. "1024x2048xin" / "2048x512xactxfp8-128"."""
    _, N, K, act, qb = key
    return f"{N}x{K}x{'act' if act else 'in'}" + (f"xfp8-{qb}" if qb else "")


def parse_moe_key(name: str) -> tuple:
    parts = name.split("x")
    qb = int(parts[3].split("-")[1]) if len(parts) > 3 else None
    return int(parts[0]), int(parts[1]), parts[2] == "act", qb


def _moe_candidates(key: tuple, cur: dict) -> list[dict]:
    """One-parameter moves around an expert matmul's tile (BN, BK, WT, warps, stages)."""
    from hyspec.kernels.moe.grouped import gemm_config

    _, N, K, act, qb = key
    c0 = gemm_config(N, K, act, qb, tile=cur or None)  # {}: the shipped / default tile
    moves = [dict(BN=c0["BN"] // 2), dict(BN=c0["BN"] * 2)] + [dict(BK=bk) for bk in (64, 128, 256)]
    moves += [dict(num_warps=w) for w in (2, 4, 8)] + [dict(num_stages=st) for st in (2, 3, 4, 5)]
    moves += [dict(WT=not c0["WT"]), dict(BN=c0["BN"] * 2, num_warps=8)]
    return _moves(c0, moves, lambda c: 16 <= c["BN"] <= 256 and 16 <= c["BK"] <= K and not (qb and qb % c["BK"]))


def _moves(c0: dict, moves: list[dict], valid) -> list[dict]:
    """[c0] + each one-parameter move of c0 that is valid and new."""
    out = []
    for kw in moves:
        c = dict(c0, **kw)
        if valid(c) and c not in out and c != c0:
            out.append(c)
    return [c0] + out


def _candidates(N: int, K: int, cur: dict) -> list[dict]:
    """One-parameter moves around ``cur`` (block_n, block_k, split_k, num_warps, num_stages)."""
    base = skinny_config(N, K, **cur)
    c0 = dict(block_n=base.block_n, block_k=base.block_k, split_k=base.split_k, num_warps=base.num_warps,
              num_stages=base.num_stages, wt=base.wt)
    moves = [dict(block_n=c0["block_n"] // 2), dict(block_n=c0["block_n"] * 2)]
    moves += [dict(block_k=bk) for bk in (128, 256, 512)]
    moves += [dict(split_k=c0["split_k"] // 2), dict(split_k=c0["split_k"] * 2)]
    moves += [dict(num_warps=w) for w in (2, 4, 8)] + [dict(num_stages=st) for st in (2, 3, 4, 5, 6)]
    moves += [dict(wt=not c0["wt"]), dict(wt=not c0["wt"], num_stages=4),
              dict(num_stages=c0["num_stages"] + 1, block_n=c0["block_n"] // 2)]
    return _moves(c0, moves, lambda c: c["block_n"] >= 16 and c["block_k"] >= 16 and c["split_k"] >= 1
                  and K // c["split_k"] >= c["block_k"])


def _name(s: tuple) -> str:
    return "moe " + moe_key_name(s) if s[0] == "moe" else f"{s[0]}x{s[1]}"


def start_config(s: tuple, fp8: bool = False) -> dict:
    """The config a shape runs before tuning, the tuner's first candidate: TUNED's, else
    BUILTIN's; for block-FP8 weights (``fp8``) FP8_TALL's entry over it, as tall_tile runs
    them (a tune at e9b0339 started the 80B's FP8 attention in-projection from the bf16
    tile instead, and never tried the 32-column one it ran untuned)."""
    from hyspec.gpu.runner_triton import FP8_TALL
    from hyspec.kernels.matmul import BUILTIN, TUNED
    from hyspec.kernels.moe.grouped import MOE_BUILTIN, MOE_TUNED

    if s[0] == "moe":
        return dict(MOE_TUNED.get(s[1:]) or MOE_BUILTIN.get(s[1:], {}))
    if s in TUNED:
        return dict(TUNED[s])
    return dict(BUILTIN.get(s, {}), **(FP8_TALL.get((s[0], s[1], False), {}) if fp8 else {}))


def tune_in_step(dec, shapes, *, budget_s: float = 120.0, reps: int = 30, log=print, verify_rows: int = 0) -> dict:
    """Pick each weight shape's skinny-GEMM config by the time of the *whole decode step*
    (a CUDA graph of the real step, every other shape fixed), one shape at a time, largest
    total bytes first: the configs that stream best in isolation are not the ones that
    stream best between the step's small kernels.  ``dec`` is a BatchDecoder (graphs)
    whose lane 0 is started after a prefill; the timed step is its one-lane decode graph;
    its state is left unchanged.  Installs the table
    (``set_tuned``) and returns {(N, K): {"config", "step_ms", "start_step_ms", "tried"}}.
    Keys of the form ("moe", N, K, act, qb_k) (``moe_shapes``) tune the grouped MoE path's
    expert matmuls the same way (``set_moe_tuned``).
    Configs still depend on the shape only, so row invariance is untouched.
    verify_rows t > 1: the figure a candidate is judged by is the decode step's time plus
    the time of the lane's verify graph of t rows (its k_max must be >= t - 1): a tile that
    speeds up the step but slows the verify (whose MoE layers read ~t times the experts) is
    not kept. The logged "step" figures are then that sum."""
    from hyspec.kernels.moe.grouped import set_moe_tuned

    fp8 = fp8_shapes(dec.runner)
    table = {s: start_config(s, s in fp8) for s in shapes}
    graphs = dec.step_graphs
    snap = graphs.snapshot()

    def install():
        set_tuned({s: c for s, c in table.items() if s[0] != "moe"})
        set_moe_tuned({s[1:]: c for s, c in table.items() if s[0] == "moe"})

    bodies = [(("decode", 1, None), lambda: dec._decode_body(1, None))]
    if verify_rows > 1:
        if dec.k_max < verify_rows - 1:
            raise ValueError(f"tune_in_step: a verify of {verify_rows} rows needs a decoder with k_max >= "
                             f"{verify_rows - 1}, this one has {dec.k_max}")
        bodies.append((("verify", 1, verify_rows), lambda: dec._verify_body(1, verify_rows)))

    def step_ms() -> float:
        install()
        dec.runner._workspaces.clear()
        total = 0.0
        for key, body in bodies:
            graphs.graphs.pop(key, None)
            graphs.ensure(key, body)
            g = graphs.graphs.get(key)
            if g is None:  # the capture failed (e.g. a tile over the shared-memory limit)
                graphs.failed = False
                graphs.restore(snap)
                raise RuntimeError(f"{key[0]} capture failed for this config")
            total += replay_ms(g, reps)
            graphs.restore(snap)
        return total

    t0 = time.perf_counter()
    start = cur_ms = step_ms()
    what = "ms/step" if verify_rows <= 1 else f"ms per decode step + verify of {verify_rows} rows"
    log(f"  in-step tune: start {start:.4f} {what}")
    out = {}
    per_step = dec.runner.cfg.num_experts_per_tok + 1 if getattr(dec.runner.cfg, "num_experts", 0) else 1
    weights = {s: s[1] * s[2] * per_step if s[0] == "moe" else s[0] * s[1] for s in shapes}
    order = sorted(shapes, key=lambda s: -weights[s])
    seen = {s: [] for s in shapes}
    for s in order + order:  # two passes of one-parameter moves while the budget lasts
        tried = []
        cands = _moe_candidates(s, table[s]) if s[0] == "moe" else _candidates(s[0], s[1], table[s])
        for c in cands[1:]:
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
                log(f"  in-step tune {_name(s)} {c}: {type(e).__name__}")
                table[s] = old
                continue
            tried.append((ms, c))
            if ms < cur_ms * 0.998:  # keep only a clear gain
                cur_ms = ms
            else:
                table[s] = old
        out[s] = {"config": table[s], "step_ms": cur_ms, "tried": len(seen[s])}
        log(f"  in-step tune {_name(s)}: {table[s]} -> step {cur_ms:.4f} ms ({len(tried)} tried)")
    install()
    dec.runner._workspaces.clear()
    graphs.graphs.clear()
    for v in out.values():
        v["start_step_ms"] = start
        if verify_rows > 1:
            v["objective"] = f"decode step + verify of {verify_rows} rows"
    return out
