"""Matmul tiles searched inside the batched decode step, for one row-tile height.

--height 16 (batches of 2..16 lanes): calls of up to 16 rows use each weight's
one-sequence config, tuned at one row; the search tries one-parameter moves of it.
--height 64 (calls of 33 or more rows: a 64-lane decode step, a 16-lane verify of 4 rows):
the tall tiles (``hyspec.gpu.runner_triton.tall_tile``, bf16 weights); the search tries
moves of the tall config, and its result is the ``TALL`` table of that module.
Every move keeps the K split (split-K and K per split: the partial sums a row adds stay
the same).  For each weight shape, largest first, a move is timed in a CUDA graph of the
BatchDecoder's decode step at --lanes lanes and kept only if it is faster *and* the step's
logits stay bitwise the same; a second pass runs while the budget lasts.  The kept table is
then timed at 1 lane too.  GPU only.

    python bench/tile_bench.py --height 16 --lanes 16 --budget-s 150 --out bench/results/tile16_h200.json
    python bench/tile_bench.py --height 64 --lanes 64 --budget-s 200 --out bench/results/tile64_h200.json
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from hyspec.bench.report import write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="b2")
    ap.add_argument("--height", type=int, default=16, choices=(16, 64))
    ap.add_argument("--lanes", type=int, default=None, help="lanes of the timed decode step (default: the height)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--only", default="", help="comma list of shapes to search (NxK or NxKxact; default all)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/tile_bench.py")
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu import runner_triton
    from hyspec.gpu.graphs import replay_ms
    from hyspec.gpu.tune import model_shapes
    from hyspec.kernels.matmul.config import _config_cached
    from hyspec.gpu.batch_bench import preset_model
    from hyspec.provenance import git_state

    model = preset_model(args.config)
    S = args.lanes or args.height
    if args.height == 64 and S <= 32:
        raise SystemExit("--height 64 needs --lanes > 32 (a decode step of <= 32 rows runs in shorter tiles)")
    dec = BatchDecoder(model, args.prompt_len + 512, 3, S)
    g = torch.Generator().manual_seed(0)
    for lane in range(S):
        p = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
        dec.prefill_start(lane, p, 3)
    runner = dec.runner
    graphs = dec.step_graphs
    snap = graphs.snapshot()
    own_tile = runner._tile
    table: dict = {}  # (N, K, act) -> overrides at the searched height

    if args.height == 16:
        def tile(N, K, act, height, fp8_block=None):
            if height == 16 and fp8_block is None and (N, K, act) in table:
                return table[(N, K, act)]
            return own_tile(N, K, act, height, fp8_block)

        runner._tile = tile
    else:  # the tall tiles read runner_triton.TALL at every capture
        table = runner_triton.TALL

    def step(nb: int, want_logits: bool = False):
        """(ms per replay of the decode graph for nb lanes, its logits after one replay)."""
        runner._workspaces.clear()
        graphs.graphs.clear()
        graphs.restore(snap)
        key = ("decode", nb, None)
        graphs.ensure(key, lambda: dec._decode_body(nb, None))
        gr = graphs.graphs.get(key)
        if gr is None:
            graphs.failed = False
            raise RuntimeError("capture failed")
        graphs.restore(snap)
        gr.replay()
        torch.cuda.synchronize()
        lg = runner.bufs.logits[:nb].clone() if want_logits else None
        best = replay_ms(gr, args.reps)
        graphs.restore(snap)
        return best, lg

    out = {"git": git_state(), "command": "python bench/tile_bench.py " + " ".join(sys.argv[1:]),
           "height": args.height, "lanes": S, "shapes": {}, "table_at_start": {
               f"{N}x{K}{'xact' if a else ''}": dict(v) for (N, K, a), v in table.items()}}
    base_ms, base_lg = step(S, True)
    base1, _ = step(1)
    out["start_ms"] = {"lanes": base_ms, "one": base1}
    print(f"start: decode step {base_ms:.4f} ms at {S} lanes, {base1:.4f} ms at 1", flush=True)
    acts = {}
    for lay in list(runner.layers) + ([runner.mtp_layer] if runner.mtp_layer is not None else []):
        for name in ("w_down", "sh_down"):  # the matmuls fed silu(gate) * up
            w = getattr(lay, name, None)
            if w is not None and hasattr(w, "shape"):
                acts[tuple(w.shape)] = True
    shapes = sorted(model_shapes(runner), key=lambda s: -s[0] * s[1])
    if args.only:
        want = set(args.only.split(","))
        shapes = [(N, K) for N, K in shapes if f"{N}x{K}{'xact' if acts.get((N, K)) else ''}" in want]
    cur = base_ms
    t0 = time.perf_counter()
    for pass_no in range(args.passes):
        moved = False
        for N, K in shapes:
            if time.perf_counter() - t0 > args.budget_s:
                break
            act = acts.get((N, K), False)
            c = _config_cached(N, K, None, None, None, None, None, None, act)
            if args.height == 16:
                c0 = dict(split_k=c.split_k, block_n=c.block_n, block_k=c.block_k, num_warps=c.num_warps,
                          num_stages=c.num_stages, wt=c.wt)
                c0 = dict(c0, **table.get((N, K, act), {}))
                warps, stages, bks = (2, 4, 8), (2, 3, 4, 5, 6), (64, 128, 256, 512)
                bns = (c0["block_n"] // 2, c0["block_n"] * 2)
            else:
                c0 = runner_triton.tall_tile(N, K, act)
                warps, stages, bks = (4, 8), (2, 3, 4, 5), (64, 128, 256)
                bns = (c0["block_n"] // 2, c0["block_n"] * 2, c0["block_n"] * 4)
            moves = [dict(block_n=b) for b in bns] + [dict(num_warps=w) for w in warps]
            moves += [dict(num_stages=st) for st in stages] + [dict(block_k=bk) for bk in bks]
            moves += [dict(wt=not c0["wt"])]
            tried = []
            best_c = None  # the overrides kept so far for this shape (beyond c0)
            prev = table.get((N, K, act))
            for mv in moves:
                if time.perf_counter() - t0 > args.budget_s:
                    break
                base_c = dict(c0, **(best_c or {}))
                cand = dict(base_c, **mv)
                if cand == base_c or cand["block_n"] < 16 or cand["block_k"] < 16:
                    continue
                alt = _config_cached(N, K, *cand.values())
                if (alt.split_k, alt.k_per_split) != (c.split_k, c.k_per_split):
                    continue  # the K split must stay the same
                entry = dict(cand)
                if args.height == 64:
                    entry.pop("split_k")
                table[(N, K, act)] = entry
                try:
                    ms, lg = step(S, True)
                except Exception as e:  # noqa: BLE001 - e.g. over the shared-memory limit
                    tried.append({"move": mv, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    ok = False
                else:
                    same = bool(torch.equal(lg, base_lg))
                    tried.append({"move": mv, "ms": ms, "same_bits": same})
                    ok = same and ms < cur * 0.997
                if ok:
                    cur, best_c, prev, moved = ms, dict(best_c or {}, **mv), entry, True
                elif prev is not None:
                    table[(N, K, act)] = prev
                else:
                    table.pop((N, K, act), None)
            name = f"{N}x{K}{'xact' if act else ''}"
            out["shapes"].setdefault(name, {"start": c0, "passes": []})["passes"].append(
                {"kept": best_c, "tried": tried})
            print(f"  pass {pass_no + 1} {name}: {c0} -> {best_c or 'no move kept'}; step {cur:.4f} ms "
                  f"({len(tried)} tried, {time.perf_counter() - t0:.0f} s)", flush=True)
        if not moved:
            break
    end_ms, lg = step(S, True)
    end1, _ = step(1)
    out["end_ms"] = {"lanes": end_ms, "one": end1, "same_bits": bool(torch.equal(lg, base_lg))}
    out["table"] = {f"{N}x{K}{'xact' if a else ''}": v for (N, K, a), v in table.items()}
    print(f"end: decode step {end_ms:.4f} ms at {S} lanes (start {base_ms:.4f}), {end1:.4f} ms at 1 "
          f"(start {base1:.4f}); same bits {out['end_ms']['same_bits']}", flush=True)
    print("table: {" + ", ".join(f"({N}, {K}, {a}): {v!r}" for (N, K, a), v in sorted(table.items())) + "}",
          flush=True)
    if args.out:
        write_json(args.out, out)  # (whole or not at all)


if __name__ == "__main__":
    main()
