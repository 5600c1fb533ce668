"""The L2 prefetch of the output projections (hyspec.kernels.prefetch), on and off, side by
side: two BatchDecoders on the same model and prompts, one with ``runner.l2_prefetch``
off, one with it on (every call of at most ``--rows`` rows prefetching), CUDA-graph replays
of a decode step and a K=3 round at each batch size, timed alternately (best of
``--trials``), then every lane's state (GDN conv and SSM state, KV cache, positions) and
the last logits compared bitwise between the two (the prefetch must change no number).
GPU only.

    python bench/prefetch_bench.py --config b2 --sizes 1,4,16,64 --out prefetch_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="b2")
    ap.add_argument("--sizes", default="1,4,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30, help="graph replays per timing")
    ap.add_argument("--trials", type=int, default=3, help="alternating timings per case (best kept)")
    ap.add_argument("--rows", type=int, default=256, help="the prefetching decoder's l2_prefetch_rows")
    ap.add_argument("--policy", default="evict_last", help="'' (normal), evict_last or evict_first")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hyspec.bench import make_model
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.provenance import git_state

    dev = torch.device("cuda")
    model = make_model(SimpleNamespace(model=None, config=args.config, seed=0), dev, torch.bfloat16)
    sizes = [int(s) for s in args.sizes.split(",")]
    S = max(sizes)
    steps = len(sizes) * 2 * args.trials * (args.reps + 4) * (args.k + 2)

    def decoder(prefetch: bool) -> BatchDecoder:
        d = BatchDecoder(model, args.prompt_len + steps + 64, args.k, S, graphs=True)
        d.runner.l2_prefetch = prefetch
        d.runner.l2_prefetch_rows = args.rows
        d.runner.l2_policy = args.policy
        g = torch.Generator().manual_seed(0)
        for lane in range(S):
            p = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
            d.prefill_start(lane, p, args.k)
        return d

    decs = {"off": decoder(False), "on": decoder(True)}
    out = {"git": git_state(), "command": "python bench/prefetch_bench.py " + " ".join(sys.argv[1:]),
           "config": args.config, "k": args.k, "device": torch.cuda.get_device_name(), "cases": {}}

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(args.reps):
            fn()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / args.reps

    for nb in sizes:
        for case in ("decode", f"round_k{args.k}"):
            best = {}
            for _ in range(args.trials):
                for name, d in decs.items():
                    fn = (lambda d=d: d.decode(nb)) if case == "decode" else (lambda d=d: d.round(nb, args.k))
                    best[name] = min(best.get(name, float("inf")), timed(fn))
            row = {"off_ms": best["off"], "on_ms": best["on"], "on_over_off": best["on"] / best["off"]}
            out["cases"][f"{case}_B{nb}"] = row
            print(f"{case:9s} B={nb:3d}: off {best['off']:.4f} ms  on {best['on']:.4f} ms  "
                  f"on/off {row['on_over_off']:.4f}", flush=True)
    a, b = decs["off"], decs["on"]
    same = {"ssm": torch.equal(a.ssm, b.ssm), "conv": torch.equal(a.conv, b.conv),
            "kv": all(torch.equal(x, y) for x, y in zip(a.kv_k + a.kv_v, b.kv_k + b.kv_v)),
            "pos": torch.equal(a.pos, b.pos),
            "logits": torch.equal(a.runner.bufs.logits, b.runner.bufs.logits)}
    out["bitwise_equal"] = same
    print("bitwise equal (off vs on):", same, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if not all(same.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
