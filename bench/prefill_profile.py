"""Where a session turn's time to first token goes on a GPU: the graph lane's eager
prefill of [pending] + a message, host time against the device's kernel time.

    python bench/prefill_profile.py --config b2 --tokens 49 --context 512     (H200; prints a table)

Builds the preset's model (random weights), runs a session turn of `--context` tokens,
then times `--repeats` more turns of `--tokens` new tokens each (one reply token), and
profiles one of them with torch.profiler: wall time of the turn, of the lane's prefill
(BatchDecoder.prefill), the kernel time inside it, its launch count and the top kernels."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyspec.engine import Engine  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="b2")
    ap.add_argument("--tokens", type=int, default=49)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/prefill_profile.py")
    from hyspec.bench import build_config_model
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.presets import model_dict
    from hyspec.provenance import git_state

    dev = torch.device("cuda")
    eng = Engine(build_config_model(model_dict(args.config), dev, torch.bfloat16))
    V = eng.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(1, V, (n,), generator=g).tolist()  # noqa: E731
    s = eng.session(draft=3, max_new_tokens=1, ignore_eos=True, use_store=False)
    s.send(ids(args.context))
    times, pre = [], []
    orig = BatchDecoder.prefill

    def timed_prefill(self, *a, **kw):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = orig(self, *a, **kw)
        torch.cuda.synchronize()
        pre.append(time.perf_counter() - t0)
        return out

    BatchDecoder.prefill = timed_prefill
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = s.send(ids(args.tokens))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    BatchDecoder.prefill = orig
    assert out.stats["path"] == "batch-graphs"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        s.send(ids(args.tokens))
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kern = sum(e.device_time for e in ev) / 1e3
    by = {}
    for e in ev:
        n, t = by.get(e.name, (0, 0.0))
        by[e.name] = (n + 1, t + e.device_time / 1e3)
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:12]
    st = git_state(ROOT)
    res = {"git_commit": st["commit"], "dirty": st["dirty"], "config": args.config, "context": args.context,
           "tokens": args.tokens, "turn_s": sorted(times), "prefill_s": sorted(pre),
           "profiled_turn": {"kernel_ms": kern, "launches": len(ev),
                             "top": [{"name": k[:90], "calls": n, "ms": t} for k, (n, t) in top]}}
    print(f"commit {st['commit']} dirty={st['dirty']}; {args.config}: turns of {args.tokens} new tokens + 1 reply token "
          f"after {args.context}: median turn {sorted(times)[len(times) // 2] * 1e3:.1f} ms, "
          f"of it the lane's prefill {sorted(pre)[len(pre) // 2] * 1e3:.1f} ms (synchronised)")
    print(f"profiled turn: {kern:.2f} ms of kernels in {len(ev)} launches")
    for k, (n, t) in top:
        print(f"  {t:8.3f} ms x {n:4d}  {k[:90]}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
