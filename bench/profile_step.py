#!/usr/bin/env python
"""Where a b2 decode step and a t=4 verify spend their time (H200, exact variant).

Kernel-level profile (torch.profiler / CUPTI) of eager decode and verify steps, grouped
by kernel, plus CUDA-graph timings of the decode step and verify t=4 for the GDN scan
with one program per value head (default) and with each head's Dv split over 4 programs
(``block_v=32``), and a bitwise spec == plain check for the split variant.

    python bench/profile_step.py --out /tmp/profile.json
    (bench/results/b2_h200_profile.json is such a run; the shipped GEMM configs are used unless
    --tuned names a bench JSON with a "tuned_gemm" table, e.g. from `hyspec bench --tune step`)
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hyspec.bench import B2, build_config_model, time_fn  # noqa: E402
from hyspec.gpu import FastDecoder, generate_plain_fast, generate_speculative_fast  # noqa: E402
from hyspec.kernels.matmul import set_tuned  # noqa: E402
from hyspec.provenance import git_state
from hyspec.speculative.loop import SpecOptions  # noqa: E402


def kernel_table(fn, steps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    agg = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name.split("(")[0][:60]
            agg[name][0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            agg[name][1] += 1
    rows = sorted(((n, t / steps, c // steps) for n, (t, c) in agg.items()), key=lambda r: -r[1])
    return {"per_step_us": {n: t for n, t, _ in rows}, "launches_per_step": {n: c for n, _, c in rows},
            "kernel_sum_us": sum(t for _, t, _ in rows), "launches": sum(c for _, _, c in rows)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tuned", default=None, help="take the GEMM configs from this bench JSON's tuned_gemm")
    ap.add_argument("--out", default="/tmp/profile.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.tuned:
        tg = json.loads(Path(args.tuned).read_text()).get("tuned_gemm", {})
        set_tuned({tuple(int(v) for v in k.split("x")): e["config"] for k, e in tg.items()})
    model = build_config_model(B2, dev, torch.bfloat16)
    prompt = torch.randint(0, B2["vocab_size"], (512,), generator=torch.Generator().manual_seed(0)).tolist()
    dec = FastDecoder(model, 512 + 300, 3)
    res = {"git": git_state(), "tuned_from": args.tuned}
    ref = generate_plain_fast(model, prompt, max_new_tokens=256, decoder=dec).tokens
    for bv in (None, 32):
        dec.runner.gdn_block_v = bv
        dec.step_graphs.graphs.clear()
        pre, post, lg = dec.prefill(prompt)
        dec.start_spec(prompt, pre, post, int(torch.argmax(lg[0])))
        dec.start_plain(ref[0])
        r = {}
        with torch.no_grad():
            for name, fn in (("decode_eager", dec._decode_body), ("verify4_eager", lambda: dec._verify_body(4))):
                try:
                    r[name] = kernel_table(fn)
                except Exception as e:  # keep the graph timings even if the profiler API differs
                    print(f"profiler failed: {type(e).__name__}: {e}")
        dec.capture_all(verify_ts=(1, 4), decode=True)
        r["decode_graph_ms"] = time_fn(dec.decode_step, dev, 30)
        r["verify_graph_ms"] = {t: time_fn(lambda t=t: dec.verify(t), dev, 30) for t in (1, 4)}
        p = generate_plain_fast(model, prompt, max_new_tokens=256, decoder=dec)
        s = generate_speculative_fast(model, prompt, max_new_tokens=256, decoder=dec,
                                      opts=SpecOptions(k=3, forced_rates=(0.9, 0.8, 0.7, 0.6)), reference=p.tokens)
        r["plain_tok_s"] = p.stats["decode_tok_s"]
        r["spec_k3_forced_tok_s"] = s.stats["decode_tok_s"]
        r["spec_equals_plain"] = s.tokens == p.tokens
        r["plain_equals_default_variant"] = p.tokens == ref
        res[f"gdn_block_v={bv}"] = r
        print(f"\n### gdn_block_v={bv}: decode graph {r['decode_graph_ms']:.3f} ms, verify t1/t4 "
              f"{r['verify_graph_ms'][1]:.3f}/{r['verify_graph_ms'][4]:.3f} ms, plain {r['plain_tok_s']:.1f} tok/s, "
              f"spec K3 forced {r['spec_k3_forced_tok_s']:.1f} tok/s, spec==plain {r['spec_equals_plain']}")
        for name in ("decode_eager", "verify4_eager"):
            if name not in r:
                continue
            kt = r[name]
            print(f"  {name}: {kt['launches']} launches, kernel time {kt['kernel_sum_us']:.0f} us")
            for n, t in list(kt["per_step_us"].items())[:14]:
                print(f"    {t:8.1f} us  x{kt['launches_per_step'][n]:3d}  {n}")
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
