"""Where the time of one b2 decode step goes, and what each fast-path change buys.

One run on the GPU (b2 preset, bf16, 512-token prompt):
  1. ablation, each row adding one change to the one above, every row a fresh decoder:
     base (reduce kernels, per-head attention, no PDL) -> fused split-K reduce -> grouped
     attention -> PDL (the PDL + L2 weight prefetch rows of bench/results/
     step_anatomy_h200_ablation.json came from commit e010fc1;
     the prefetch was removed after measuring slower);
     per row: decode step, verify t=1/4/8, draft step (graph replays), plain tok/s, and
     forced K=3 speculative output == plain output (bitwise) on 256 tokens;
  2. for the best row: the step with every matmul replaced by a no-op ("no GEMM") and with
     every non-matmul kernel replaced by a no-op ("GEMM only");
  3. in-step tuning of the GEMM configs (hyspec.gpu.tune.tune_in_step) for the best row,
     then the same figures again.  The tuned table is written in the bench JSON format
     (--tuned-from of hyspec bench reads it).

    python bench/step_anatomy.py --out anatomy.json
    (--tuned-from FILE starts from FILE's tuned_gemm table, e.g. bench/results/
    step_anatomy_h200_tuning.json; without it, the shipped hyspec.kernels.matmul.BUILTIN configs)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from hyspec.bench import B2, build_config_model, copy_bandwidth, log, time_fn


def measure(model, prompt, flags, args, dev, roofline_ms, plain_ref=None):
    from hyspec.gpu import FastDecoder, generate_plain_fast, generate_speculative_fast
    from hyspec.kernels import pdl
    from hyspec.speculative.loop import SpecOptions

    pdl.set_pdl(flags["pdl"])
    P, N = len(prompt), args.new_tokens
    dec = FastDecoder(model, P + N + 16, 7, exact=True)
    dec.runner.fuse_reduce = flags["fuse_reduce"]
    dec.runner.attn_grouped = flags["attn_grouped"]
    if "block_v" in flags:
        dec.runner.gdn_block_v = flags["block_v"]
    generate_plain_fast(model, prompt, max_new_tokens=16, decoder=dec)
    r = generate_plain_fast(model, prompt, max_new_tokens=N, decoder=dec)
    plain = r.tokens
    out = {"flags": flags, "plain_tok_s": r.stats["decode_tok_s"]}
    pre, post, lg = dec.prefill(prompt)
    dec.start_spec(prompt, pre, post, int(torch.argmax(lg[0])))
    dec.capture_all(verify_ts=(1, 4, 8), decode=True, draft_step=True)
    out["verify_ms"] = {t: time_fn(lambda t=t: dec.verify(t), dev, args.reps) for t in (1, 4, 8)}
    out["draft_step_ms"] = time_fn(dec.draft_step, dev, args.reps)
    dec.start_plain(plain[0])
    out["decode_step_ms"] = time_fn(dec.decode_step, dev, args.reps)
    out["roofline_frac"] = roofline_ms / out["decode_step_ms"]
    out["verify4_rel"] = out["verify_ms"][4] / out["decode_step_ms"]
    out["verify8_rel"] = out["verify_ms"][8] / out["decode_step_ms"]
    opts = SpecOptions(k=3, forced_rates=(0.9, 0.8, 0.7, 0.6))
    generate_speculative_fast(model, prompt, max_new_tokens=24, opts=opts, reference=plain, decoder=dec)
    s = generate_speculative_fast(model, prompt, max_new_tokens=N, opts=opts, reference=plain, decoder=dec)
    out["spec_k3_tok_s"] = s.stats["decode_tok_s"]
    out["spec_k3_speedup"] = s.stats["decode_tok_s"] / out["plain_tok_s"]
    out["spec_equals_plain"] = s.tokens == plain
    out["plain_equals_base"] = None if plain_ref is None else plain == plain_ref
    log(f"  {flags}: step {out['decode_step_ms']:.4f} ms ({100 * out['roofline_frac']:.1f}% roofline), plain "
        f"{out['plain_tok_s']:.1f} tok/s, verify t1/t4/t8 {out['verify_ms'][1]:.3f}/{out['verify_ms'][4]:.3f}/"
        f"{out['verify_ms'][8]:.3f} (t4 {out['verify4_rel']:.3f}x step), draft {out['draft_step_ms']:.3f}, "
        f"K=3 forced {out['spec_k3_tok_s']:.1f} tok/s x{out['spec_k3_speedup']:.2f}, spec==plain "
        f"{out['spec_equals_plain']}, plain==base {out['plain_equals_base']}")
    return out, dec, plain


def split_step(dec, dev, reps):
    """Decode-step time with the matmuls as no-ops, and with everything else as no-ops."""
    import hyspec.gpu.runner_triton as rt

    run = dec.runner
    res = {}
    real_mm = run.mm

    def no_mm(x, w, out, act=False, defer=False):
        return out if out is not None else torch.zeros(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)

    # the runner's own names for the kernels (it imports them from hyspec/kernels/<op>/)
    saved = {n: getattr(rt, n) for n in ("rmsnorm", "gdn_conv", "gdn_step", "attn_prep", "attn_decode",
                                         "attn_decode_grouped")}

    def noop(*a, **k):
        return k.get("out", a[-1] if a else None)

    for name, patch in (("no_gemm", "mm"), ("gemm_only", "other")):
        snap = dec.step_graphs.snapshot()
        dec.step_graphs.graphs.pop(("decode",), None)
        try:
            if patch == "mm":
                run.mm = no_mm
            else:
                for n in saved:
                    setattr(rt, n, noop)
            dec.decode_step_capture_only()
            res[name] = time_fn(dec.decode_step, dev, reps)
        except Exception as e:
            res[name] = f"{type(e).__name__}: {e}"
        finally:
            run.mm = real_mm
            for n, f in saved.items():
                setattr(rt, n, f)
            dec.step_graphs.graphs.pop(("decode",), None)
            dec.step_graphs.restore(snap)
        log(f"  {name}: {res[name] if isinstance(res[name], str) else f'{res[name]:.4f} ms'}")
    return res


def gemm_chain(dec, dev, reps):
    """The step's matmuls alone, in step order, as one CUDA graph: our kernel (the runner's
    mm, same configs) vs cuBLAS on the same weights; plus our kernel's per-shape time
    inside the chain (torch.profiler over eager replays of the chain)."""
    run = dec.runner
    calls = []
    for L in run.layers:
        calls += [(L.w_in, False), (L.w_out, False), (L.w_gu, False), (L.w_down, True)]
    calls.append((run.head, False))
    xs = {}
    for w, act in calls:
        K = w.shape[1] * (2 if act else 1)
        if K not in xs:
            xs[K] = torch.randn(1, K, device=dev).to(w.dtype) * 0.1
    outs = {w.shape[0]: torch.empty(1, w.shape[0], device=dev, dtype=w.dtype) for w, _ in calls}

    def ours():
        for w, act in calls:
            run.mm(xs[w.shape[1] * (2 if act else 1)], w, outs[w.shape[0]], act=act)

    def cublas():
        for w, act in calls:
            x = xs[w.shape[1] * (2 if act else 1)]
            if act:
                K = w.shape[1]
                x = torch.nn.functional.silu(x[:, :K]) * x[:, K:]
            torch.matmul(x, w.t(), out=outs[w.shape[0]])

    res = {}
    for name, fn in (("ours", ours), ("cublas", cublas)):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        res[name + "_ms"] = time_fn(g.replay, dev, reps)
    nbytes = sum(w.numel() * w.element_size() for w, _ in calls)
    res["bytes"] = nbytes
    res["ours_TBps"] = nbytes / res["ours_ms"] / 1e9
    res["cublas_TBps"] = nbytes / res["cublas_ms"] / 1e9
    try:
        from torch.profiler import ProfilerActivity, profile

        ours()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                ours()
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type.name == "CUDA" and "skinny" in e.name]
        per = {}
        n = len(calls)
        for i, e in enumerate(evs[: 3 * n]):
            w, act = calls[i % n]
            key = f"{w.shape[0]}x{w.shape[1]}"
            per.setdefault(key, []).append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
        res["per_shape_us_in_chain"] = {k: {"calls_per_step": len(v) / 3, "us_each": sum(v) / len(v),
                                            "us_per_step": sum(v) / 3} for k, v in per.items()}
    except Exception as e:
        res["profile_error"] = f"{type(e).__name__}: {e}"
    log(f"  GEMM chain: ours {res['ours_ms']:.4f} ms ({res['ours_TBps']:.2f} TB/s), cuBLAS {res['cublas_ms']:.4f} ms "
        f"({res['cublas_TBps']:.2f} TB/s); per shape in chain: {res.get('per_shape_us_in_chain')}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tuned-from", default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tune-s", type=float, default=150.0)
    ap.add_argument("--rows", default="base,fuse,grouped,pdl")
    ap.add_argument("--best", default=None, help="tune this row instead of the fastest one")
    ap.add_argument("--after-rows", default="", help="rows measured again with the tuned table")
    ap.add_argument("--out", default="anatomy.json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    from hyspec.gpu import FastDecoder
    from hyspec.gpu.tune import model_shapes, tune_in_step
    from hyspec.kernels import pdl
    from hyspec.kernels.matmul import TUNED, set_tuned
    from hyspec.provenance import git_state

    res = {"command": "python bench/step_anatomy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "git": git_state(),
           "pdl_supported": None, "rows": {}}
    bw = copy_bandwidth(dev, 2 << 30)
    model = build_config_model(B2, dev, torch.bfloat16, 0)
    probe = FastDecoder(model, 8, 1, graphs=False)
    wbytes = probe.runner.weight_bytes_per_step()
    shapes = model_shapes(probe.runner)
    del probe
    roofline_ms = wbytes / (bw * 1e9) * 1e3
    res.update(copy_bandwidth_GBps=bw, weight_bytes=wbytes, roofline_ms=roofline_ms)
    pdl.set_pdl(True)
    res["pdl_supported"] = pdl.pdl_enabled()
    log(f"copy {bw:.0f} GB/s, roofline {roofline_ms:.4f} ms, PDL supported: {res['pdl_supported']}")
    if args.tuned_from:
        tg = json.loads(Path(args.tuned_from).read_text()).get("tuned_gemm", {})
        set_tuned({tuple(int(v) for v in k.split("x")): e["config"] for k, e in tg.items()})
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    all_rows = {
        "base": dict(fuse_reduce=False, attn_grouped=False, pdl=False),
        "fuse": dict(fuse_reduce=True, attn_grouped=False, pdl=False),
        "grouped": dict(fuse_reduce=True, attn_grouped=True, pdl=False),
        "pdl": dict(fuse_reduce=True, attn_grouped=True, pdl=True),
        "bv16": dict(fuse_reduce=True, attn_grouped=True, pdl=False, block_v=16),
        "bv64": dict(fuse_reduce=True, attn_grouped=True, pdl=False, block_v=64),
    }
    base_plain = None
    best, best_dec = None, None

    def save():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))

    for name in args.rows.split(","):
        try:
            r, dec, plain = measure(model, prompt, all_rows[name], args, dev, roofline_ms, base_plain)
        except Exception as e:
            res["rows"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2500:]}
            log(f"!! row {name}: {type(e).__name__}: {e}")
            traceback.print_exc()
            save()
            continue
        if name == "base":
            base_plain = plain
        res["rows"][name] = r
        if best is None or r["decode_step_ms"] < res["rows"][best]["decode_step_ms"]:
            best, best_dec = name, dec
        else:
            del dec
        torch.cuda.empty_cache()
        save()
    if best is None:
        return 1
    if args.best and args.best in res["rows"] and "error" not in res["rows"][args.best]:
        if best != args.best:
            best_dec = None
            torch.cuda.empty_cache()
            _, best_dec, _ = measure(model, prompt, all_rows[args.best], args, dev, roofline_ms, None)
        best = args.best
    res["best_row"] = best
    log(f"best row: {best}")
    res["split_step_ms"] = split_step(best_dec, dev, args.reps)
    save()
    try:
        res["gemm_chain"] = gemm_chain(best_dec, dev, args.reps)
    except Exception as e:
        res["gemm_chain"] = {"error": f"{type(e).__name__}: {e}"}
        traceback.print_exc()
    save()
    if args.tune_s > 0:
        flags = all_rows[best]
        pdl.set_pdl(flags["pdl"])
        dec = best_dec
        pre, post, lg = dec.prefill(prompt)
        dec.start_plain(int(torch.argmax(lg[0])))
        try:
            tuned = tune_in_step(dec, shapes, budget_s=args.tune_s, log=log)
            res["tuned_gemm"] = {f"{n}x{k}": v for (n, k), v in tuned.items()}
            save()
            del dec, best_dec
            torch.cuda.empty_cache()
            r, dec, _ = measure(model, prompt, flags, args, dev, roofline_ms, None)
            res["rows"][best + "+tuned"] = r
            res["split_step_ms_tuned"] = split_step(dec, dev, args.reps)
            res["gemm_chain_tuned"] = gemm_chain(dec, dev, args.reps)
            save()
            del dec
            for name in [n for n in args.after_rows.split(",") if n and n != best]:
                torch.cuda.empty_cache()
                try:
                    r, dec, _ = measure(model, prompt, all_rows[name], args, dev, roofline_ms, None)
                    res["rows"][name + "+tuned"] = r
                    del dec
                except Exception as e:
                    res["rows"][name + "+tuned"] = {"error": f"{type(e).__name__}: {e}"}
                save()
        except Exception as e:
            res["tune_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
            log(f"!! tuning: {e}")
            traceback.print_exc()
        res["tuned_table_final"] = {f"{n}x{k}": c for (n, k), c in TUNED.items()}
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
