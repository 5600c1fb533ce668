"""Row-tile-16 matmul tiles for batches of 2..16 lanes: a search inside the batched decode
step.  Calls of up to 16 rows (one lane's decode up to a 16-lane decode step) use each
weight's one-sequence config, tuned at one row.  For each weight shape, largest first, this
tries one-parameter moves of that config that keep its K split (split-K and K per split:
the partial sums a row adds stay the same) in a CUDA graph of the BatchDecoder's decode step
at --lanes lanes, and keeps a move only if it is faster *and* the step's logits stay
bitwise the same.  It then times the kept table at 1 lane too.  GPU only.

    python bench/tile16_bench.py --lanes 16 --budget-s 150 --out bench/results/tile16_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="b2")
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hyspec.bench import make_model
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.graphs import replay_ms
    from hyspec.gpu.tune import model_shapes
    from hyspec.kernels.matmul.config import _config_cached
    from hyspec.provenance import git_state

    dev = torch.device("cuda")
    model = make_model(SimpleNamespace(model=None, config=args.config, seed=0), dev, torch.bfloat16)
    S = args.lanes
    dec = BatchDecoder(model, args.prompt_len + 512, 3, S)
    g = torch.Generator().manual_seed(0)
    for lane in range(S):
        p = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
        dec.prefill_start(lane, p, 3)
    runner = dec.runner
    graphs = dec.step_graphs
    snap = graphs.snapshot()
    own_tile = runner._tile
    table: dict = {}  # (N, K, act) -> overrides at height 16

    def tile(N, K, act, height, fp8_block=None):
        if height == 16 and fp8_block is None and (N, K, act) in table:
            return table[(N, K, act)]
        return own_tile(N, K, act, height, fp8_block)

    runner._tile = tile

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

    out = {"git": git_state(), "command": "python bench/tile16_bench.py " + " ".join(sys.argv[1:]),
           "lanes": S, "shapes": {}}
    base_ms, base_lg = step(S, True)
    base1, _ = step(1)
    out["start_ms"] = {"lanes": base_ms, "one": base1}
    print(f"start: decode step {base_ms:.4f} ms at {S} lanes, {base1:.4f} ms at 1", flush=True)
    acts = {}
    for lay in list(runner.layers) + ([runner.mtp_layer] if runner.mtp_layer is not None else []):
        w = getattr(lay, "w_down", None)
        if w is not None:
            acts[tuple(w.shape)] = True
    shapes = sorted(model_shapes(runner), key=lambda s: -s[0] * s[1])
    cur = base_ms
    t0 = time.perf_counter()
    for N, K in shapes:
        act = acts.get((N, K), False)
        c = _config_cached(N, K, None, None, None, None, None, None, act)
        c0 = dict(split_k=c.split_k, block_n=c.block_n, block_k=c.block_k, num_warps=c.num_warps,
                  num_stages=c.num_stages, wt=c.wt)
        moves = [dict(block_n=c0["block_n"] // 2), dict(block_n=c0["block_n"] * 2)]
        moves += [dict(num_warps=w) for w in (2, 4, 8)] + [dict(num_stages=s) for s in (2, 3, 4, 5, 6)]
        moves += [dict(block_k=bk) for bk in (64, 128, 256, 512)] + [dict(wt=not c0["wt"])]
        tried = []
        best_c = None
        for mv in moves:
            if time.perf_counter() - t0 > args.budget_s:
                break
            cand = dict(c0, **mv)
            if cand == c0 or cand["block_n"] < 16 or cand["block_k"] < 16:
                continue
            if c.k_per_split % cand["block_k"]:
                continue  # the K split must stay the same
            table[(N, K, act)] = dict(best_c or c0, **mv)
            try:
                ms, lg = step(S, True)
            except Exception as e:  # noqa: BLE001 - e.g. over the shared-memory limit
                tried.append({"move": mv, "error": type(e).__name__})
                table.pop((N, K, act))
                if best_c is not None:
                    table[(N, K, act)] = best_c
                continue
            same = bool(torch.equal(lg, base_lg))
            tried.append({"move": mv, "ms": ms, "same_bits": same})
            if same and ms < cur * 0.997:
                cur, best_c = ms, table[(N, K, act)]
            elif best_c is not None:
                table[(N, K, act)] = best_c
            else:
                table.pop((N, K, act))
        out["shapes"][f"{N}x{K}{'xact' if act else ''}"] = {"own": c0, "kept": best_c, "tried": tried}
        print(f"  {N}x{K}{' act' if act else ''}: own {c0} -> {best_c or 'kept own'}; step {cur:.4f} ms "
              f"({len(tried)} tried)", flush=True)
    end_ms, lg = step(S, True)
    end1, _ = step(1)
    out["end_ms"] = {"lanes": end_ms, "one": end1, "same_bits": bool(torch.equal(lg, base_lg))}
    out["table"] = {f"{N}x{K}{'xact' if a else ''}": v for (N, K, a), v in table.items()}
    print(f"end: decode step {end_ms:.4f} ms at {S} lanes (start {base_ms:.4f}), {end1:.4f} ms at 1 "
          f"(start {base1:.4f}); same bits {out['end_ms']['same_bits']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
