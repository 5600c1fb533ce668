"""Where a batched round's time goes: CUDA time per kernel name for the BatchDecoder's plain
step and speculative round at a few batch sizes (eager launches under torch.profiler; the
graphs replay the same kernels).  GPU only.

    python bench/profile_batch.py --config b2 --sizes 1,16,64 --out bench/results/profile_batch.json
    python bench/profile_batch.py --model default --sizes 1 --sampled --mode rejection --graph-time 200
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="b2")
    ap.add_argument("--model", default=None,
                    help="a checkpoint directory instead of --config's random weights ('default': the embedded model)")
    ap.add_argument("--mode", default="coupled", choices=["coupled", "rejection"],
                    help="the sampled lanes' mode (with --sampled)")
    ap.add_argument("--sizes", default="1,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sampled", action="store_true",
                    help="also the sampled rounds (T=0.8 / top-p 0.95 lanes, --mode coupled as batch_bench's sampled speed)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--per-call", default="_gdn_step_kernel",
                    help="kernel name whose calls are listed one by one (first repetition); '' for none")
    ap.add_argument("--graph-time", type=int, default=0,
                    help="also time N back-to-back CUDA-graph replays of each case")
    ap.add_argument("--top", type=int, default=16, help="kernel names listed per case")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hyspec.bench.report import write_json
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/profile_batch.py")
    from hyspec.bench.timing import time_fn
    from hyspec.gpu.batch_bench import preset_model, random_lanes, sampled_regime
    from hyspec.provenance import git_state

    if args.model:
        from hyspec.engine import default_model_dir
        from hyspec.loading import load_model

        path = default_model_dir() if args.model == "default" else args.model
        model = load_model(path, dtype=torch.bfloat16, device="cuda")
    else:
        model = preset_model(args.config)
    sizes = [int(s) for s in args.sizes.split(",")]
    S = max(sizes)

    def decoder(graphs: bool):
        """A decoder with S lanes, each started on its own random prompt (the same ones every call)."""
        return random_lanes(model, S, args.prompt_len, args.prompt_len + 512, args.k, graphs=graphs)

    dec = decoder(graphs=False)
    out = {"git": git_state(), "command": "python bench/profile_batch.py " + " ".join(sys.argv[1:]),
           "config": args.model or args.config, "k": args.k, "mode": args.mode if args.sampled else None, "runs": {}}
    cases = [("decode", False), (f"round_k{args.k}", False)]
    if args.sampled:
        from hyspec.gpu.batch_bench import SAMPLED
        from hyspec.sampling import SamplingParams

        regime = sampled_regime({"mode": args.mode})
        for lane in range(S):
            dec.set_params(lane, SamplingParams(seed=lane, mode=args.mode, **SAMPLED))
        cases += [("decode_sampled", regime), (f"round_k{args.k}_sampled", regime)]
    for nb in sizes:
        for name, sm in cases:
            fn = (lambda: dec.decode(nb, sampled=sm)) if name.startswith("decode") else \
                (lambda: dec.round(nb, args.k, sampled=sm))
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    fn()
                torch.cuda.synchronize()
            per, launches = defaultdict(float), defaultdict(int)
            for e in prof.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
                if t:
                    per[e.key[:60]] += t / args.reps / 1e3  # ms per call
                    launches[e.key[:60]] += e.count // args.reps
            total = sum(per.values())
            calls = []
            if args.per_call:
                for e in prof.events():
                    if e.name.startswith(args.per_call):
                        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
                        if t:
                            calls.append(round(t, 1))
                calls = calls[: len(calls) // args.reps]
            top = sorted(per.items(), key=lambda kv: -kv[1])[:args.top]
            out["runs"][f"{name}_B{nb}"] = {"total_ms": total, "launches": sum(launches.values()),
                                            "top_ms": top, "top_launches": {k: launches[k] for k, _ in top},
                                            "per_call_us": {args.per_call: calls} if args.per_call else {}}
            print(f"{name} B={nb}: {total:.3f} ms of kernels in {sum(launches.values())} launches")
            for k, v in top:
                print(f"   {v * 1e3:8.1f} us  x{launches[k]:4d}  {k}")
            if calls:
                print(f"   {args.per_call} per call (us): {calls}")
    if args.graph_time:  # the same steps as CUDA-graph replays, timed with events (no host work between)
        del dec
        gdec = decoder(graphs=True)
        if args.sampled:
            for lane in range(S):
                gdec.set_params(lane, SamplingParams(seed=lane, mode=args.mode, **SAMPLED))
        for nb in sizes:
            timed = [("decode", lambda: gdec.decode(nb)), (f"round_k{args.k}", lambda: gdec.round(nb, args.k))]
            if args.sampled:
                timed += [("decode_sampled", lambda: gdec.decode(nb, sampled=regime)),
                          (f"round_k{args.k}_sampled", lambda: gdec.round(nb, args.k, sampled=regime))]
            for name, fn in timed:
                ms = time_fn(fn, torch.device("cuda"), args.graph_time, warmup=1)  # median of 3 batches
                out["runs"].setdefault(f"{name}_B{nb}", {})["graph_ms"] = ms
                print(f"{name} B={nb}: {ms:.3f} ms per graph replay ({args.graph_time} back to back, median of "
                      f"three batches)", flush=True)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
