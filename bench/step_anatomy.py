"""Where the time of one b2 decode step goes, and what each fast-path change buys.

Measures the BatchDecoder's one-lane step: hyspec.gpu.batch.BatchDecoder(model, max_len,
7, 1) (one sequence = lane 0, slots=1), the decoder every GPU request runs on.  The
result files bench/results/step_anatomy_h200*.json (and their _log.txt) were measured on
the single-sequence FastDecoder before this script was ported to the BatchDecoder: they
are historical (see "Since the FastDecoder" below for what a new run measures differently).

One run on the GPU (b2 preset, bf16, 512-token prompt):
  1. ablation, each row adding one change to the one above, every row a fresh decoder:
     base (reduce kernels, per-head attention, no PDL) -> fused split-K reduce -> grouped
     attention -> PDL (the PDL + L2 weight prefetch rows of bench/results/
     step_anatomy_h200_ablation.json came from commit e010fc1;
     the prefetch was removed after measuring slower); bv16 / bv64: the GDN scan's value
     columns per program (runner.gdn_block_v);
     per row: decode step (graph ("decode", 1, None)), verify t=1/4/8 (graphs ("verify",
     1, t)), draft step (see below), all graph replays; plain tok/s, and forced K=3
     speculative output == plain output (bitwise) on 256 tokens (both through
     hyspec.gpu.batch_loop.decode_one);
  2. for the best row: the step with every matmul replaced by a no-op ("no GEMM") and with
     every non-matmul kernel replaced by a no-op ("GEMM only");
  3. in-step tuning of the GEMM configs (hyspec.gpu.tune.tune_in_step, on the one-lane
     decode graph) for the best row, then the same figures again.  The tuned table is
     written in the bench JSON format (--tuned-from of hyspec bench reads it).

    python bench/step_anatomy.py --out anatomy.json
    (--tuned-from FILE starts from FILE's tuned_gemm table, e.g. bench/results/
    step_anatomy_h200_tuning.json; without it, the shipped hyspec.kernels.matmul.BUILTIN configs)

Since the FastDecoder (same rows, same JSON keys; "decoder" names the decoder measured):
  * draft_step_ms: the FastDecoder had a bench-only graph of one chained MTP step + LM
    head + argmax; the BatchDecoder has no single-step graph, so this is the closest one,
    the draft graph of k=1 (key ("draft", 1, 1, False, None), body _draft_body(1, 1, False,
    None)): the MTP forward over the lane's fill rows (k_max + 2 = 9 rows) + the head +
    argmax, i.e. the drafter part of a k=1 round, not the marginal cost of one more
    chained step.
  * plain_tok_s / spec_k3_tok_s: decode_one's rate (the BatchRunner's rounds, one small
    result read per step or round, pipelined one ahead; prefill and graph capture
    excluded); the FastDecoder's plain loop read its tokens once per run.
  * split_step_ms: timed from the prompt's end, like decode_step_ms (decode_one frees its
    lane, so the lane is started again after the speculative run); the FastDecoder version
    timed it where the speculative run had left the sequence, 256 tokens later.
  * the runner is the same TritonRunner, now always over lanes: at one row its matmuls
    use the shape's own config wherever that splits K as the batched tall tile does
    (TritonRunner._tile), so a shape's config can differ from the FastDecoder's.
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

K_MAX = 7  # drafts per round the decoder holds: verify graphs up to t = 8
SPEC_K = 3  # the speculative run's drafts per round (forced drafter)
FORCED_RATES = (0.9, 0.8, 0.7, 0.6)
DECODE_KEY = ("decode", 1, None)  # the one-lane greedy decode step's graph (BatchDecoder.decode(1))
DRAFT_KEY = ("draft", 1, 1, False, None)  # the one-lane draft graph of k=1 (the draft step's stand-in)


def decode_body(dec):
    return lambda: dec._decode_body(1, None)


def draft_body(dec):
    return lambda: dec._draft_body(1, 1, False, None)


def start_lane(dec, prompt, k: int) -> int:
    """Prefill lane 0 with prompt and start it (k drafts per round, 0: plain); returns the
    pending (first) token.  Timed graphs then run from the prompt's end."""
    return int(dec.prefill_start(0, prompt, k)[0].argmax())


def measure(model, prompt, flags, args, dev, roofline_ms, plain_ref=None):
    """One ablation row on a fresh one-lane BatchDecoder.  Returns (figures, the decoder
    with lane 0 started on the prompt again, the plain tokens)."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import decode_one
    from hyspec.kernels import pdl

    pdl.set_pdl(flags["pdl"])
    P, N = len(prompt), args.new_tokens
    dec = BatchDecoder(model, P + N + 16, K_MAX, 1, exact=True)
    # the step graphs' own PDL choice (hyspec.kernels.pdl.step_default) would win over
    # set_pdl inside them: the row's flag, on every kernel with its trigger at its start
    # (the form of the historical rows; main's dense default triggers the matmuls' late)
    dec.runner.pdl, dec.runner.pdl_skip, dec.runner.pdl_late = flags["pdl"], "", False
    dec.runner.fuse_reduce = flags["fuse_reduce"]
    dec.runner.attn_grouped = flags["attn_grouped"]
    if "block_v" in flags:
        dec.runner.gdn_block_v = flags["block_v"]
    decode_one(dec, prompt, 16)  # compile + capture
    r = decode_one(dec, prompt, N)
    plain = r.tokens
    out = {"flags": flags, "plain_tok_s": r.stats["decode_tok_s"]}
    # step costs as graph replays after a prefill (a drafting lane: the drafter rows are real).
    # verify and draft do not advance the lane (only a round's commit does); decode does
    start_lane(dec, prompt, SPEC_K)
    ensure = dec.step_graphs.ensure
    for t in (1, 4, 8):
        ensure(("verify", 1, t), lambda t=t: dec._verify_body(1, t))
    ensure(DRAFT_KEY, draft_body(dec))
    ensure(DECODE_KEY, decode_body(dec))
    out["verify_ms"] = {t: time_fn(lambda t=t: dec.verify(1, t), dev, args.reps) for t in (1, 4, 8)}
    out["draft_step_ms"] = time_fn(lambda: dec.step_graphs.run(DRAFT_KEY, draft_body(dec)), dev, args.reps)
    out["decode_step_ms"] = time_fn(lambda: dec.decode(1), dev, args.reps)  # pending = plain[0] already
    out["roofline_frac"] = roofline_ms / out["decode_step_ms"]
    out["verify4_rel"] = out["verify_ms"][4] / out["decode_step_ms"]
    out["verify8_rel"] = out["verify_ms"][8] / out["decode_step_ms"]
    spec = {"k": SPEC_K, "forced_rates": FORCED_RATES, "reference": plain}
    decode_one(dec, prompt, 24, **spec)  # capture the round's graphs
    s = decode_one(dec, prompt, N, **spec)
    out["spec_k3_tok_s"] = s.stats["decode_tok_s"]
    out["spec_k3_speedup"] = s.stats["decode_tok_s"] / out["plain_tok_s"]
    out["spec_equals_plain"] = s.tokens == plain
    out["plain_equals_base"] = None if plain_ref is None else plain == plain_ref
    start_lane(dec, prompt, 0)  # decode_one freed the lane: the caller's split_step times the step on it
    log(f"  {flags}: step {out['decode_step_ms']:.4f} ms ({100 * out['roofline_frac']:.1f}% roofline), plain "
        f"{out['plain_tok_s']:.1f} tok/s, verify t1/t4/t8 {out['verify_ms'][1]:.3f}/{out['verify_ms'][4]:.3f}/"
        f"{out['verify_ms'][8]:.3f} (t4 {out['verify4_rel']:.3f}x step), draft (k=1 graph) "
        f"{out['draft_step_ms']:.3f}, K=3 forced {out['spec_k3_tok_s']:.1f} tok/s x{out['spec_k3_speedup']:.2f}, "
        f"spec==plain {out['spec_equals_plain']}, plain==base {out['plain_equals_base']}")
    return out, dec, plain


def split_step(dec, dev, reps):
    """Decode-step time with the matmuls as no-ops, and with everything else as no-ops
    (the one-lane decode graph recaptured under each patch; lane 0 must be started)."""
    import hyspec.gpu.runner_triton as rt

    run = dec.runner
    graphs = dec.step_graphs
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
        snap, failed = graphs.snapshot(), graphs.failed
        graphs.graphs.pop(DECODE_KEY, None)
        try:
            if patch == "mm":
                run.mm = no_mm
            else:
                for n in saved:
                    setattr(rt, n, noop)
            graphs.ensure(DECODE_KEY, decode_body(dec))
            if DECODE_KEY not in graphs.graphs:  # not an eager timing of the patched step
                raise RuntimeError("the patched decode step's graph capture failed")
            res[name] = time_fn(lambda: dec.decode(1), dev, reps)
        except Exception as e:
            res[name] = f"{type(e).__name__}: {e}"
        finally:
            run.mm = real_mm
            for n, f in saved.items():
                setattr(rt, n, f)
            graphs.graphs.pop(DECODE_KEY, None)
            graphs.failed = failed  # a failed patched capture turned graphs off: the real step captures again
            graphs.restore(snap)
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
    ap.add_argument("--rows", default="base,fuse,grouped,pdl", help="ablation rows, of base,fuse,grouped,pdl,bv16,bv64")
    ap.add_argument("--best", default=None, help="tune this row instead of the fastest one")
    ap.add_argument("--after-rows", default="", help="rows measured again with the tuned table")
    ap.add_argument("--out", default="anatomy.json")
    args = ap.parse_args(argv)
    from hyspec.bench.timing import require_cuda

    require_cuda("bench/step_anatomy.py")
    dev = torch.device("cuda")
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.tune import model_shapes, tune_in_step
    from hyspec.kernels import pdl
    from hyspec.kernels.matmul import TUNED, set_tuned
    from hyspec.provenance import git_state

    res = {"command": "python bench/step_anatomy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "git": git_state(),
           "decoder": "BatchDecoder, one lane (slots=1)", "pdl_supported": None, "rows": {}}
    bw = copy_bandwidth(dev, 2 << 30)
    model = build_config_model(B2, dev, torch.bfloat16, 0)
    probe = BatchDecoder(model, 8, 1, 1, graphs=False)
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
        start_lane(dec, prompt, 0)  # tune_in_step times the one-lane decode graph on lane 0
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
