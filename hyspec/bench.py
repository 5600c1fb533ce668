"""hyspec bench: decode / verify / draft / speculative throughput of the fast path, in one run.

    hyspec bench --config b2 --prompt-len 512 --new-tokens 256 --out bench.json
    hyspec bench --config tiny --device cpu             # CPU smoke (torch runner), ~10 s
    hyspec bench --model DIR                            # a checkpoint
    hyspec bench --config qwen3.5-27b                   # published shapes (hyspec/presets.py), GPU only
    hyspec bench --model DIR --batch 1,4,16             # aggregate throughput through the engine core

On the CPU the defaults are small (a quick run: short prompt, few tokens, K = 1..3, the
exact variant only, no transformers comparison), the per-phase times are wall-clock
times, and the GPU targets (roofline fraction, speed-ups) are not judged.

Measures, on one device, batch 1, greedy:
  * device copy bandwidth (device-to-device copy, bytes read + written) and the roofline
    of one decode step = weight bytes a step reads / that bandwidth;
  * plain decode tok/s (FastDecoder, CUDA graphs) and its fraction of the roofline;
  * verify cost for t = 1..8 rows relative to t = 1, and one draft (MTP) step;
  * speculative tok/s and speed-up over plain at K = 1..4 with the forced-acceptance
    drafter (rates by depth, default 0.9/0.8/0.7/0.6) and with the real MTP head, the
    per-phase split (draft / verify / commit per round), and the cost-model ceiling
    L * t_decode / (t_verify(K+1) + K * t_draft);
  * all of it for the exact (row-invariant) variant and the fastest non-exact one (cuBLAS);
  * GPU greedy exactness: speculative output == plain output, bitwise, for several prompts;
  * the same checkpoint through transformers' generate, side by side.
Prints a table and writes everything as JSON (--out).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from hyspec.provenance import git_state

B2 = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24, "full_attention_interval": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 6144,
    "num_experts": 0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1, "hidden_act": "silu",
}


def log(*a) -> None:
    print(*a, flush=True)


def _si(x: float) -> str:
    """3 significant figures with a k / M / G prefix (a 10 M model is not '0.000 B')."""
    for div, unit in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g} "


# ----------------------------------------------------------------------------- model
def build_config_model(d: dict, device, dtype, seed: int = 0):
    """HybridLM with an MTP head from a config dict, random HF-like init, built on the device."""
    from hyspec.config import ModelConfig
    from hyspec.loading import cast_params
    from hyspec.model.hybrid import HybridLM
    from hyspec.tiny import init_weights

    cfg = ModelConfig.from_dict(d)
    with torch.device(device):
        model = HybridLM(cfg, with_mtp=True)
    g = torch.Generator(device=device).manual_seed(seed)
    init_weights(model, g)
    model = cast_params(model, dtype)  # as hyspec.loading keeps them
    model.eval().requires_grad_(False)
    return model


def make_model(args, device, dtype):
    if args.model:
        from hyspec.loading import load_model

        return load_model(args.model, dtype=dtype, device=device)
    if args.config == "b2":
        return build_config_model(B2, device, dtype, args.seed)
    from hyspec.presets import PRESETS, build_preset_model

    if args.config in PRESETS:  # real sizes: built in `dtype` directly on the device (one copy of the weights)
        return build_preset_model(args.config, device, dtype, args.seed)
    from hyspec.tiny import tiny_config

    return build_config_model(tiny_config("qwen3_next", vocab_size=512), device, dtype, args.seed)


# ----------------------------------------------------------------------------- timing
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_fn(fn, dev, reps: int, warmup: int = 2) -> float:
    """ms per call: back-to-back calls between two events (CUDA) or wall clock (CPU)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    if dev.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        per = []
        for _ in range(3):
            s.record()
            for _ in range(reps):
                fn()
            e.record()
            e.synchronize()
            per.append(s.elapsed_time(e) / reps)
        return statistics.median(per)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def copy_bandwidth(dev, nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = nbytes // 2
    x = torch.randn(n, device=dev, dtype=torch.float32).to(torch.bfloat16)
    y = torch.empty_like(x)
    ms = time_fn(lambda: y.copy_(x), dev, reps=10 if dev.type == "cuda" else 2)
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- HF
def hf_generate(model, prompt, n_tokens, dev, dtype, model_dir=None) -> dict:
    """transformers' generate on the same weights (target only), greedy, side by side."""
    import transformers as tf

    cfg = model.cfg
    missing = unexpected = ()
    if model_dir is not None:  # a checkpoint on disk: transformers loads it itself (any family)
        hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev)
    else:  # the in-memory b2 preset (qwen3_next layout): same config, our weights
        d = dict(cfg.raw)
        d.pop("architectures", None)
        mt = d.pop("model_type", None)
        if mt != "qwen3_next":
            return {"skipped": f"in-memory HF comparison only wired for qwen3_next (got {mt})"}
        d.pop("full_attention_interval", None)
        d["layer_types"] = list(cfg.layer_types)
        hcfg = tf.Qwen3NextConfig(**d)
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(dev):
                hf = tf.Qwen3NextForCausalLM(hcfg)
        finally:
            torch.set_default_dtype(old)
        sd = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
        missing, unexpected = hf.load_state_dict(sd, strict=False)
    hf.eval()
    try:
        import fla.ops.gated_delta_rule  # noqa: F401

        has_fla = True
    except Exception:
        has_fla = False
    ids = torch.tensor([prompt], device=dev)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(n):
        _sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(dev)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    run(2)  # warm-up
    t1, _ = run(1)
    tn, toks = run(n_tokens)
    hf = None  # free it before the caller goes on
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": n_tokens, "total_s": tn, "prefill_s": t1,
            "decode_tok_s": (n_tokens - 1) / max(tn - t1, 1e-9), "fla_importable": has_fla,
            "missing_keys": len(missing), "unexpected_keys": len(unexpected), "greedy_tokens": toks}


# ----------------------------------------------------------------------------- one variant
def bench_variant(model, prompt, args, exact: bool, dev, roofline_ms: float) -> dict:
    from hyspec.gpu import FastDecoder, generate_plain_fast, generate_speculative_fast
    from hyspec.speculative.loop import SpecOptions

    P, N = len(prompt), args.new_tokens
    k_max = max(max(args.ks), args.verify_max - 1, 3)  # 3: the exactness check drafts K=3
    dec = FastDecoder(model, P + max(N, args.exact_tokens) + k_max + 4, k_max, exact=exact)
    out: dict = {"backend": dec.backend, "graphs": dec.graphs}
    reps = args.reps

    generate_plain_fast(model, prompt, max_new_tokens=min(N, 16), decoder=dec)  # compile + capture
    r = generate_plain_fast(model, prompt, max_new_tokens=N, decoder=dec)
    plain = r.tokens
    tok_s = r.stats["decode_tok_s"]
    out["plain"] = {"tok_s": tok_s, "ms_per_token": 1e3 / tok_s, "roofline_frac": roofline_ms / (1e3 / tok_s),
                    "prefill_s": r.stats["prefill_s"], "fla_prefill": dec.fla_used}
    log(f"[{'exact' if exact else 'fast'}] plain decode {tok_s:.1f} tok/s ({1e3 / tok_s:.3f} ms/token, "
        f"{100 * out['plain']['roofline_frac']:.1f}% of roofline)")

    # per-step costs (graph replays; state after a prefill so every position is valid)
    pre, post, lg = dec.prefill(prompt)
    dec.start_spec(prompt, pre, post, int(torch.argmax(lg[0])))
    ts = list(range(1, args.verify_max + 1))
    dec.capture_all(verify_ts=ts, decode=True, draft_step=True)
    verify = {t: time_fn(lambda t=t: dec.verify(t), dev, reps) for t in ts}
    draft = time_fn(dec.draft_step, dev, reps)
    dec.start_plain(plain[0])
    step = time_fn(dec.decode_step, dev, reps)
    out["decode_step_ms"] = step
    out["decode_step_roofline_frac"] = roofline_ms / step
    out["verify_ms"] = verify
    out["verify_rel"] = {t: verify[t] / verify[1] for t in ts}
    out["draft_step_ms"] = draft
    log(f"  step {step:.3f} ms; verify " + " ".join(f"t{t}={verify[t]:.3f}({verify[t] / verify[1]:.2f}x)" for t in ts)
        + f"; draft step {draft:.3f} ms")

    out["spec"] = {}
    rates = tuple(float(x) for x in args.forced.split(","))
    for kind in ("forced", "mtp"):
        out["spec"][kind] = {}
        for K in args.ks:
            opts = SpecOptions(k=K, forced_rates=rates if kind == "forced" else None)
            generate_speculative_fast(model, prompt, max_new_tokens=min(N, 24), opts=opts, reference=plain,
                                      decoder=dec)  # capture
            rs = generate_speculative_fast(model, prompt, max_new_tokens=N, opts=opts, reference=plain, decoder=dec)
            rp = generate_speculative_fast(model, prompt, max_new_tokens=N, opts=opts, reference=plain, decoder=dec,
                                           profile=True)
            sp = rs.stats["spec"]
            L = sp["acceptance_length"]
            tv = verify.get(K + 1)
            ceiling = L * step / (tv + K * draft) if tv else None
            speed = rs.stats["decode_tok_s"] / tok_s
            e = {"tok_s": rs.stats["decode_tok_s"], "speedup": speed, "acceptance_length": L, "tau": sp["tau"],
                 "per_depth_rate": sp["per_depth_rate"], "rounds": sp["rounds"],
                 "ceiling": ceiling, "ceiling_frac": speed / ceiling if ceiling else None,
                 "phases_ms_per_round": rp.stats.get("phases_ms", {}).get("per_round"),
                 "tokens_equal_plain": rs.tokens == plain,
                 "first_mismatch": next((i for i, (a, b) in enumerate(zip(rs.tokens, plain)) if a != b), None)}
            out["spec"][kind][K] = e
            ph = e["phases_ms_per_round"] or {}
            log(f"  {kind:6s} K={K}: {e['tok_s']:.1f} tok/s x{speed:.2f} (L={L:.2f}, ceiling x{ceiling or 0:.2f}, "
                f"{100 * (e['ceiling_frac'] or 0):.0f}% of it) phases/round draft {ph.get('draft', 0):.3f} "
                f"verify {ph.get('verify', 0):.3f} commit {ph.get('commit', 0):.3f} ms; equal plain: "
                f"{e['tokens_equal_plain']}")
    out["_decoder"] = dec
    return out


def exactness_check(model, args, dev, dec) -> dict:
    """Greedy speculative (K=3; forced 0.9/0.8/0.7/0.6 and the real MTP) vs plain, bitwise."""
    from hyspec.gpu import generate_plain_fast, generate_speculative_fast
    from hyspec.speculative.loop import SpecOptions

    V = model.cfg.vocab_size
    res = {"tokens": args.exact_tokens, "prompts": [], "k": 3}
    rates = tuple(float(x) for x in args.forced.split(","))
    for i in range(args.exact_prompts):
        g = torch.Generator().manual_seed(1000 + i)
        prompt = torch.randint(0, V, (args.prompt_len,), generator=g).tolist()
        p = generate_plain_fast(model, prompt, max_new_tokens=args.exact_tokens, decoder=dec)
        row = {"prompt_seed": 1000 + i, "plain_tok_s": p.stats["decode_tok_s"]}
        for kind in ("forced", "mtp"):
            opts = SpecOptions(k=3, forced_rates=rates if kind == "forced" else None)
            s = generate_speculative_fast(model, prompt, max_new_tokens=args.exact_tokens, opts=opts,
                                          reference=p.tokens, decoder=dec)
            mm = next((j for j, (a, b) in enumerate(zip(s.tokens, p.tokens)) if a != b), None)
            row[kind] = {"equal": s.tokens == p.tokens, "first_mismatch": mm, "tok_s": s.stats["decode_tok_s"],
                         "acceptance_length": s.stats["spec"]["acceptance_length"], "n": len(s.tokens)}
        row["distinct_tokens_in_plain"] = len(set(p.tokens))
        res["prompts"].append(row)
        log(f"  exactness prompt {i}: forced equal={row['forced']['equal']} (L={row['forced']['acceptance_length']:.2f})"
            f" mtp equal={row['mtp']['equal']}; {row['distinct_tokens_in_plain']} distinct tokens")
    res["all_equal"] = all(r["forced"]["equal"] and r["mtp"]["equal"] for r in res["prompts"])
    return res


# ----------------------------------------------------------------------------- main
# flags whose default depends on the device: (flag, type, GPU default, CPU default, help)
_DEVICE_DEFAULTS = (
    ("--prompt-len", int, 512, 32, "prompt tokens"),
    ("--new-tokens", int, 256, 32, "tokens per timed generation"),
    ("--ks", str, "1,2,3,4", "1,2,3", "draft lengths K measured"),
    ("--verify-max", int, 8, 4, "verify cost measured for t = 1..N rows"),
    ("--variants", str, "exact,fast", "exact", "exact (row-invariant kernels), fast (cuBLAS)"),
    ("--exact-tokens", int, 2000, 64, "tokens per prompt in the exactness check"),
    ("--exact-prompts", int, 4, 1, "prompts in the exactness check"),
    ("--hf-tokens", int, 32, 0, "tokens for the transformers comparison (0: skip it)"),
    ("--reps", int, 30, 2, "repetitions of each timed step"),
)


def main(argv=None) -> int:
    from hyspec.cli import HelpFormatter

    if "--pp" in (argv if argv is not None else sys.argv[1:]):
        from hyspec.parallel.bench import main as pp_main  # pipeline stages: its own flags and report

        return pp_main(argv)
    from hyspec.presets import PRESETS

    ap = argparse.ArgumentParser(prog="hyspec bench", description=__doc__, formatter_class=HelpFormatter)

    ap.add_argument("--config", default="b2", choices=["b2", "tiny", *PRESETS],
                    help="in-memory random model preset (qwen3.5-27b, qwen3.5-35b-a3b, qwen3-next-80b-a3b-fp8: the "
                         "published shapes, GPU only; hyspec/presets.py)")
    ap.add_argument("--slot-lengths", default="4096,32768,131072",
                    help="context lengths for the 'sequence slots that fit beside the weights' report")
    ap.add_argument("--model", default=None, help="checkpoint directory (overrides --config)")
    ap.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    for flag, typ, gpu, cpu, what in _DEVICE_DEFAULTS:
        ap.add_argument(flag, type=typ, default=None, help=f"{what} (default: {gpu} on a GPU, {cpu} on the CPU)")
    ap.add_argument("--forced", default="0.9,0.8,0.7,0.6", help="forced drafter acceptance rate by depth")
    ap.add_argument("--tune", default="none", choices=["none", "step"],
                    help="GEMM config search before measuring: none (the shipped configs: "
                         "hyspec.kernels.gemm.BUILTIN, picked in the step on the H200, else shape defaults), "
                         "step (each shape's candidates timed inside the real decode step)")
    ap.add_argument("--tune-s", type=float, default=150.0, help="seconds for the GEMM config search")
    ap.add_argument("--tuned-from", default=None, help="take the GEMM configs from an earlier bench JSON")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    ap.add_argument("--copy-bytes", type=int, default=2 << 30, help="bytes copied to measure bandwidth "
                    "(at most 64 MiB on the CPU)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--batch", default=None,
                    help="comma-separated batch sizes (e.g. 1,4,16): aggregate throughput through the engine core")
    ap.add_argument("--batch-inv-prompts", type=int, default=64,
                    help="GPU --batch: prompts in the batch-invariance check (each x 500 tokens; 0: skip)")
    args = ap.parse_args(argv)
    if args.device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        from hyspec.engine import check_device

        dev = check_device(args.device)
    for flag, _, gpu, cpu, _ in _DEVICE_DEFAULTS:
        name = flag[2:].replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, gpu if dev.type == "cuda" else cpu)
    try:
        args.ks = [int(x) for x in args.ks.split(",") if x]
    except ValueError:
        raise ValueError(f"--ks: expected comma-separated draft lengths like 1,2,3, got {args.ks!r}") from None
    if args.dtype == "auto":
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        from hyspec.loading import parse_dtype

        dtype = parse_dtype(args.dtype)
    if dev.type != "cuda":
        args.copy_bytes = min(args.copy_bytes, 64 << 20)

    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = None
    try:
        import transformers

        trv = transformers.__version__
    except Exception:
        trv = None
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": tv, "transformers": trv, "python": platform.python_version(),
            "dtype": str(dtype).replace("torch.", ""),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "command": "hyspec bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "config": args.model or args.config, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "git": git_state()}
    log(f"# {meta}")
    result: dict = {"meta": meta, "errors": {}}
    t_start = time.perf_counter()
    if args.config in PRESETS and not args.model:  # the published shapes: figures first, then run only where it can
        from hyspec.presets import check_runnable, format_summary, summary

        lengths = tuple(int(x) for x in args.slot_lengths.split(",") if x)
        result["preset"] = summary(args.config, torch.bfloat16 if dtype == torch.float32 else dtype, lengths=lengths)
        log(format_summary(result["preset"]))
        why = check_runnable(args.config, dev, dtype)
        if why:
            log(f"!! {why}")
            result["errors"]["preset"] = why
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=1, default=str))
            return 2
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)

    def save():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    bw = copy_bandwidth(dev, args.copy_bytes)
    result["copy_bandwidth_GBps"] = bw
    log(f"copy bandwidth {bw:.0f} GB/s (read + write)")
    model = make_model(args, dev, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    if dev.type == "cuda":  # memory: weights resident, peak while building, slots that fit beside them
        result["memory"] = memory_report(model, dev, [int(x) for x in args.slot_lengths.split(",") if x])
        log(format_memory(result["memory"]))
    if dev.type == "cpu" and n_params < 50_000_000:
        torch.set_num_threads(1)  # small matrices: extra threads only add synchronisation cost (as the CLI)
    from hyspec.gpu import FastDecoder

    probe = FastDecoder(model, 8, 1, backend="triton" if dev.type == "cuda" else "torch", graphs=False)
    if dev.type == "cuda":
        wbytes, dbytes = probe.runner.weight_bytes_per_step(), probe.runner.draft_bytes_per_step()
    else:  # same count without packing
        from hyspec.gpu.runner_triton import TritonRunner

        tr = TritonRunner(probe, exact=True)
        wbytes, dbytes = tr.weight_bytes_per_step(), tr.draft_bytes_per_step()
    if args.tuned_from:
        from hyspec.kernels.gemm import set_tuned

        tg = json.loads(Path(args.tuned_from).read_text()).get("tuned_gemm", {})
        set_tuned({tuple(int(v) for v in k.split("x")): e["config"] for k, e in tg.items()})
        result["tuned_gemm"] = tg
        log(f"GEMM configs from {args.tuned_from}")
    shapes = None
    if dev.type == "cuda" and args.tune == "step" and not args.tuned_from:
        from hyspec.gpu.tune import model_shapes

        shapes = model_shapes(probe.runner)
    del probe
    if shapes:
        from hyspec.gpu.tune import tune_in_step

        log("tuning skinny-GEMM configs inside the decode step (chosen by shape only)")
        g0 = torch.Generator().manual_seed(args.seed)
        tdec = FastDecoder(model, args.prompt_len + 64, 1)
        _, _, lg = tdec.prefill(torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=g0).tolist())
        tdec.start_plain(int(torch.argmax(lg[0])))
        tuned = tune_in_step(tdec, shapes, budget_s=args.tune_s, log=log)
        result["tuned_gemm"] = {f"{n}x{k}": v for (n, k), v in tuned.items()}
        del tdec
    if "tuned_gemm" not in result and dev.type == "cuda":
        from hyspec.kernels.gemm import BUILTIN, TUNED

        result["gemm_configs"] = {"source": "TUNED" if TUNED else "BUILTIN/defaults",
                                  "builtin": {f"{n}x{k}": c for (n, k), c in BUILTIN.items()}}
    roofline_ms = wbytes / (bw * 1e9) * 1e3
    result["model"] = {"config": model.cfg.to_dict(), "params": n_params, "weight_bytes_per_step": wbytes,
                       "draft_bytes_per_step": dbytes}
    result["roofline_ms"] = roofline_ms
    result["roofline_tok_s"] = 1e3 / roofline_ms
    log(f"model: {_si(n_params)} params; a decode step reads {_si(wbytes)}B -> roofline "
        f"{roofline_ms:.3f} ms ({1e3 / roofline_ms:.0f} tok/s); a draft step reads {_si(dbytes)}B")
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=g).tolist()

    result["variants"] = {}
    exact_dec = None
    for variant in [v for v in args.variants.split(",") if v]:
        try:
            r = bench_variant(model, prompt, args, variant == "exact", dev, roofline_ms)
            dec = r.pop("_decoder")
            if variant == "exact":
                exact_dec = dec
            else:
                del dec
            result["variants"][variant] = r
        except Exception as e:  # keep going: partial results are still worth writing
            result["errors"][variant] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            log(f"!! variant {variant} failed: {type(e).__name__}: {e}")
            traceback.print_exc()
        save()
    if exact_dec is not None and args.exact_prompts > 0:
        try:
            log("exactness check (exact variant): speculative K=3 vs plain, bitwise")
            result["exactness"] = exactness_check(model, args, dev, exact_dec)
        except Exception as e:
            result["errors"]["exactness"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            log(f"!! exactness check failed: {e}")
        save()
    del exact_dec
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if args.batch and dev.type == "cuda":
        from hyspec.gpu.batch_bench import gpu_batch_bench

        log("batched decoding on the GPU: BatchDecoder, CUDA graphs per batch size (prefill excluded)")
        result["batch"] = gpu_batch_bench(model, [int(b) for b in args.batch.split(",")], prompt_len=args.prompt_len,
                                          new_tokens=args.new_tokens, forced=[float(x) for x in args.forced.split(",")],
                                          seed=args.seed, inv_prompts=args.batch_inv_prompts, log=log)
        save()
    elif args.batch:
        from hyspec.core.batch_bench import batch_bench

        log("batched decoding through the engine core (prefill excluded)")
        result["batch"] = batch_bench(model, [int(b) for b in args.batch.split(",")], prompt_len=args.prompt_len,
                                      new_tokens=args.new_tokens, forced=[float(x) for x in args.forced.split(",")],
                                      seed=args.seed, log=log)
        save()
    if args.hf_tokens > 0:
        try:
            log("transformers generate (same weights)")
            result["hf"] = hf_generate(model, prompt, args.hf_tokens, dev, dtype, model_dir=args.model)
            log(f"  HF: {result['hf'].get('decode_tok_s', 0):.1f} tok/s (fla importable: "
                f"{result['hf'].get('fla_importable')})")
        except Exception as e:
            result["errors"]["hf"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            log(f"!! HF comparison failed: {e}")
    result["targets"] = targets(result) if dev.type == "cuda" else {}  # GPU goals: not judged on a CPU
    result["wall_s"] = time.perf_counter() - t_start
    save()
    print_table(result)
    return 0


def memory_report(model, dev, lengths) -> dict:
    """Peak GPU memory so far, bytes of the weights, and how many sequence slots of each
    length fit in what is free (hyspec.core.slots.slot_bytes per slot)."""
    from hyspec.presets import slots_that_fit

    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    free, total = torch.cuda.mem_get_info(dev)
    return {"weights_bytes": wbytes, "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev),
            "allocated_bytes": torch.cuda.memory_allocated(dev), "free_bytes": free, "total_bytes": total,
            "slots": [slots_that_fit(model.cfg, model.dtype, L, free) for L in lengths]}


def format_memory(m: dict) -> str:
    gb = 1e9
    return (f"memory: weights {m['weights_bytes'] / gb:.2f} GB, "
            f"peak allocated {m['peak_allocated_bytes'] / gb:.2f} GB, "
            f"free {m['free_bytes'] / gb:.2f} of {m['total_bytes'] / gb:.2f} GB -> " + ", ".join(
                f"{s['slots']} slots of {s['length']} tokens" for s in m["slots"]))


def targets(r: dict) -> dict:
    ex = r.get("variants", {}).get("exact")
    if not ex:
        return {}
    t = {}
    t["plain_roofline_frac"] = {"value": ex["plain"]["roofline_frac"], "target": 0.75, "stretch": 0.85,
                                "met": ex["plain"]["roofline_frac"] >= 0.75}
    v4 = ex["verify_rel"].get(4)
    t["verify_t4_rel"] = {"value": v4, "target": 1.10, "met": v4 is not None and v4 <= 1.10}
    k3 = ex["spec"].get("forced", {}).get(3)
    if k3:
        t["forced_k3_speedup"] = {"value": k3["speedup"], "target": 1.9, "met": k3["speedup"] >= 1.9}
        t["forced_k3_ceiling_frac"] = {"value": k3["ceiling_frac"], "ceiling": k3["ceiling"], "target": 0.9,
                                       "met": (k3["ceiling_frac"] or 0) >= 0.9}
    exa = r.get("exactness")
    if exa:
        t["exactness"] = {"value": exa["all_equal"], "tokens": exa["tokens"], "prompts": len(exa["prompts"]),
                          "met": exa["all_equal"]}
    return t


def print_table(r: dict) -> None:
    m = r["meta"]
    log("\n" + "=" * 78)
    log(f"hyspec bench  {m['device']}  {m['config']}  {m['dtype']}  prompt {m['prompt_len']} new {m['new_tokens']}")
    log(f"copy bandwidth {r['copy_bandwidth_GBps']:.0f} GB/s; step reads {_si(r['model']['weight_bytes_per_step'])}B"
        f"; roofline {r['roofline_ms']:.3f} ms = {r['roofline_tok_s']:.0f} tok/s")
    for name, v in r.get("variants", {}).items():
        log(f"-- {name}: plain {v['plain']['tok_s']:.1f} tok/s ({100 * v['plain']['roofline_frac']:.1f}% roofline); "
            f"step graph {v['decode_step_ms']:.3f} ms ({100 * v['decode_step_roofline_frac']:.1f}%); "
            f"draft step {v['draft_step_ms']:.3f} ms")
        log("   verify/t1: " + " ".join(f"t{t}={x:.2f}" for t, x in v["verify_rel"].items()))
        for kind, ks in v["spec"].items():
            log(f"   {kind:6s}: " + "  ".join(
                f"K{K} {e['tok_s']:.0f} tok/s x{e['speedup']:.2f} (L {e['acceptance_length']:.2f}, ceil "
                f"x{e['ceiling'] or 0:.2f}){'' if e['tokens_equal_plain'] else ' !='}" for K, e in ks.items()))
    if "exactness" in r:
        e = r["exactness"]
        log(f"-- exactness: {len(e['prompts'])} prompts x {e['tokens']} tokens, K=3 forced + MTP == plain: "
            f"{e['all_equal']}")
    if "hf" in r:
        h = r["hf"]
        log(f"-- transformers generate: {h.get('decode_tok_s', 0):.1f} tok/s (fla: {h.get('fla_importable')})")
    if "memory" in r:
        log("-- " + format_memory(r["memory"]))
    for k, t in r.get("targets", {}).items():
        log(f"   target {k}: {t['value']} (target {t.get('target')}) {'MET' if t['met'] else 'missed'}")
    if r.get("errors"):
        log(f"errors: {list(r['errors'])}")
    log("=" * 78)


if __name__ == "__main__":
    sys.exit(main())
