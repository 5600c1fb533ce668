"""`hyspec bench` flags and the run itself: main calls the steps below in order and keeps
going past a failing variant (partial results are still worth writing)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from hyspec.bench.hf import hf_generate
from hyspec.bench.models import make_model
from hyspec.config import SSM_CHOICES
from hyspec.bench.report import format_memory, log, memory_report, print_table, si, targets, write_json
from hyspec.bench.timing import copy_bandwidth
from hyspec.bench.variants import VARIANT_ALIASES, VARIANTS, bench_variant, exactness_check, variant_names
from hyspec.provenance import git_state

# flags whose default depends on the device: (flag, type, GPU default, CPU default, help)
DEVICE_DEFAULTS = (
    ("--prompt-len", int, 512, 32, "prompt tokens"),
    ("--new-tokens", int, 256, 32, "tokens per timed generation"),
    ("--ks", str, "1,2,3,4", "1,2,3", "draft lengths K measured"),
    ("--verify-max", int, 8, 4, "verify cost measured for t = 1..N rows"),
    ("--variants", str, "exact,cublas", "exact",
     "exact (row-invariant kernels), cublas (cuBLAS matmuls, not exact; old name: fast)"),
    ("--exact-tokens", int, 2000, 64, "tokens per prompt in the exactness check"),
    ("--exact-prompts", int, 4, 1, "prompts in the exactness check"),
    ("--hf-tokens", int, 32, 0, "tokens for the transformers comparison (0: skip it)"),
    ("--reps", int, 30, 2, "repetitions of each timed step"),
)
_DEVICE_DEFAULTS = DEVICE_DEFAULTS  # old name


def build_parser() -> argparse.ArgumentParser:
    import hyspec.bench
    from hyspec.cli.common import HelpFormatter, OneLineParser
    from hyspec.presets import ALIASES, BENCH_MODELS, PRESETS

    ap = OneLineParser(prog="hyspec bench", description=hyspec.bench.__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--config", default=None, choices=[*BENCH_MODELS, *ALIASES, "tiny", *PRESETS, "default"],
                    help="in-memory random model (default: qwen3-next-2b-dense on a GPU, tiny on the CPU): "
                         "qwen3-next-2b-dense (old name b2: the bench's own ~2.3 B model), "
                         "tiny, or a preset with published shapes (qwen3.5-27b, qwen3.5-35b-a3b, "
                         "qwen3-next-80b-a3b-fp8; GPU only; hyspec/presets.py); or default: the embedded "
                         "default model (trained, so its drafts are accepted; the same as --model with its directory)")
    ap.add_argument("--fp8", action="store_true",
                    help="in-memory models (presets, bench model, tiny): build the block-FP8 form (Qwen's -FP8 "
                         "checkpoints: float8 weights + 128x128 block scales, kept FP8 on the device); the "
                         "qwen3-next-80b-a3b-fp8 preset is FP8 anyway")
    ap.add_argument("--slot-lengths", default="4096,32768,131072",
                    help="context lengths for the 'sequence slots that fit beside the weights' report")
    ap.add_argument("--model", default=None, type=os.path.expanduser, help="checkpoint directory or Hugging Face model id (overrides --config)")
    ap.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--ssm-dtype", default=None, choices=SSM_CHOICES,
                    help="storage dtype of the Gated DeltaNet state (default: the model's, float32 for the bench "
                         "models; bfloat16 halves the state's bytes per sequence)")
    for flag, typ, gpu, cpu, what in DEVICE_DEFAULTS:
        ap.add_argument(flag, type=typ, default=None, help=f"{what} (default: {gpu} on a GPU, {cpu} on the CPU)")
    ap.add_argument("--forced", default="0.9,0.8,0.7,0.6", help="forced drafter acceptance rate by depth")
    ap.add_argument("--exact-coupled", action=argparse.BooleanOptionalAction, default=True,
                    help="the exactness check also compares speculative with plain coupled sampling (T=0.8, "
                         "top-p 0.95, a seed per prompt), token for token")
    ap.add_argument("--tune", default="none", choices=["none", "step", "step+verify"],
                    help="GEMM config search before measuring: none (the shipped configs: "
                         "hyspec.kernels.matmul.BUILTIN, picked in the step on the H200, else shape defaults), "
                         "step (each shape's candidates timed inside the real decode step), step+verify (judged "
                         "by the decode step plus a verify of K+1 rows, K the largest of --ks)")
    ap.add_argument("--tune-only", default="all", choices=["all", "moe", "dense"],
                    help="which shapes --tune searches: all, the MoE expert matmuls only, or the other matmuls only")
    ap.add_argument("--tune-s", type=float, default=150.0, help="seconds for the GEMM config search")
    ap.add_argument("--tuned-from", default=None, type=os.path.expanduser, help="take the GEMM configs from an earlier bench JSON")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    ap.add_argument("--copy-bytes", type=int, default=2 << 30, help="bytes copied to measure bandwidth "
                    "(at most 64 MiB on the CPU)")
    ap.add_argument("--out", default=None, type=os.path.expanduser, help="write the JSON here (after each part; an interrupted run keeps what it measured, with \"interrupted\": true)")
    ap.add_argument("--batch", default=None,
                    help="comma-separated batch sizes (e.g. 1,4,16): aggregate throughput through the engine core")
    ap.add_argument("--batch-inv-prompts", type=int, default=64,
                    help="GPU --batch: prompts in the batch-invariance check (each x 500 tokens; 0: skip)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="also measure the exact variant with a reduced draft vocabulary of N ids (mtp.d2t; the "
                         "first N ids on random weights): draft step and forced K=3 speed-up (issue target x2.2 "
                         "at 32000)")
    return ap


def _int_list(flag: str, text: str, lo: int, hi: int | None = None) -> list[int]:
    what = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
    try:
        vals = [int(x) for x in text.split(",")]  # (an empty item is an error: it failed after the run)
    except ValueError:
        vals = []
    if not vals or any(v < lo or (hi is not None and v > hi) for v in vals):
        raise ValueError(f"--{flag}: expected comma-separated integers {what}, got {text!r}")
    return vals


def check_args(args) -> None:
    """The numeric flags, checked (and the lists parsed) before any work: a bad value is one
    error line naming the flag, not a failed phase minutes later."""
    from hyspec.speculative.loop import MAX_DRAFT

    args.ks = _int_list("ks", args.ks, 1, MAX_DRAFT)
    for flag, lo in (("prompt-len", 1), ("new-tokens", 1), ("verify-max", 1), ("reps", 1), ("exact-tokens", 1),
                     ("exact-prompts", 0), ("hf-tokens", 0), ("draft-vocab", 0), ("batch-inv-prompts", 0),
                     ("copy-bytes", 1 << 20)):  # (a few bytes timed the call, not the bandwidth: rooflines of
                                                # 15,000 %)
        v = getattr(args, flag.replace("-", "_"))
        if v is not None and v < lo:
            raise ValueError(f"--{flag}: must be >= {lo}, got {v}")
    from hyspec.cli.common import parse_rates

    try:
        parse_rates(args.forced)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--forced: {e}") from None
    if args.batch is not None:
        _int_list("batch", args.batch, 1)
    args.slot_lengths = ",".join(str(n) for n in _int_list("slot-lengths", args.slot_lengths, 1))
    from hyspec.sampling import SEED_MAX

    if not 0 <= args.seed <= SEED_MAX:  # (as generate's --seed; -1 was taken)
        raise ValueError(f"--seed: must be in 0..2**64-1, got {args.seed}")
    if args.tune != "none" and args.tuned_from:  # (the search was skipped in silence)
        raise ValueError("--tune searches the GEMM configs and --tuned-from takes an earlier run's: give one of them")
    from hyspec.cli.common import check_out_file

    check_out_file(args.out)  # before the run whose results it holds
    args.tuned_data = read_tuned(args.tuned_from) if args.tuned_from else None


def read_tuned(path: str) -> dict:
    """--tuned-from FILE: an earlier bench JSON's GEMM configs, read before the model is built."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--tuned-from: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--tuned-from: cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--tuned-from: {path} is not JSON ({e}); it takes a JSON written by hyspec bench --out") \
            from None
    tuned, moe = (data.get("tuned_gemm", {}), data.get("tuned_moe_gemm", {})) if isinstance(data, dict) else (0, 0)
    if not (isinstance(tuned, dict) and isinstance(moe, dict)) or not (tuned or moe):
        raise ValueError(f"--tuned-from: {path} holds no GEMM configs (tuned_gemm / tuned_moe_gemm of a "
                         f"hyspec bench --tune run)")
    try:
        from hyspec.gpu.tune import parse_moe_key

        for k, e in tuned.items():
            tuple(int(v) for v in k.split("x")), e["config"]
        for k, e in moe.items():
            parse_moe_key(k), e["config"]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"--tuned-from: {path}: a GEMM config entry is malformed ({type(e).__name__}: {e})") from None
    return data


def resolve_device(args) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of --device / --dtype ('auto' resolved), with the
    device-dependent defaults and list flags filled in on `args`."""
    if args.device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        from hyspec.engine import check_device

        dev = check_device(args.device)
    if args.config == "default":  # the embedded default model: a trained MTP head (random weights draft noise)
        from hyspec.engine import default_model_dir

        for flag, given in (("--model", args.model is not None), ("--fp8", args.fp8)):
            if given:  # (the one would have replaced the model in silence, the other been ignored)
                raise ValueError(f"--config default is the embedded model's checkpoint: {flag} does not go with it")
        args.model = str(default_model_dir())
    elif args.model is not None and args.fp8:  # (ignored in silence: the checkpoint loaded as it is stored)
        raise ValueError("--fp8 builds the in-memory models (presets, the bench model, tiny) in block-FP8; --model "
                         "loads a checkpoint as it is stored (an -FP8 checkpoint's weights stay FP8): drop --fp8")
    if args.model is not None:  # (before the header and the bandwidth measurement)
        from hyspec.config import ModelConfig
        from hyspec.loading import check_model_dir

        args.model_given = args.model  # (what the results name: the id, not its snapshot folder)
        args.model = str(check_model_dir(args.model))  # (a Hugging Face id: its snapshot, fetched once)
        ModelConfig.from_dir(args.model)  # (a missing or malformed config.json too)
    if args.config is None:  # the 2.3 B bench model takes ~10 GB and minutes per figure on a CPU
        args.config = "qwen3-next-2b-dense" if dev.type == "cuda" else "tiny"
    elif dev.type != "cuda" and args.model is None and args.config in ("qwen3-next-2b-dense", "b2"):
        from hyspec.bench.report import log

        log("note: qwen3-next-2b-dense is the GPU bench model: on the CPU it takes ~10 GB and minutes per figure "
            "(the CPU bench is --config tiny, or --model DIR)")
    hf_default = args.hf_tokens is None
    for flag, _, gpu, cpu, _ in DEVICE_DEFAULTS:
        name = flag[2:].replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, gpu if dev.type == "cuda" else cpu)
    check_args(args)
    if args.hf_tokens > 0:
        import importlib.util

        if importlib.util.find_spec("transformers") is None:  # no user extra installs it (the test extra does)
            if not hf_default:  # (the run failed at its end, after every other figure)
                raise ValueError(f"--hf-tokens {args.hf_tokens}: the comparison runs transformers, which is not "
                                 "installed (pip install transformers, or --hf-tokens 0)")
            from hyspec.bench.report import log

            log("note: transformers is not installed: the transformers comparison is skipped (pip install "
                "transformers to run it)")
            args.hf_tokens = 0
    args.variant_list = variant_names(args.variants)
    # (--variants '' with --batch: the batched runs alone; with nothing else it ran nothing and exited 0,
    # a results file without a figure)
    if not args.variant_list and not args.batch and not args.draft_vocab:
        raise ValueError(f"--variants {args.variants!r} runs no variant and nothing else is asked for: give one "
                         f"of {', '.join(VARIANTS)}, or --batch for the batched runs alone")
    if dev.type != "cuda" and "cublas" in args.variant_list:
        raise ValueError("--variants cublas needs a GPU (cuBLAS matmuls); the CPU bench runs the reference backend: "
                         "--variants exact")
    from hyspec.loading import parse_dtype

    dtype = parse_dtype(args.dtype, dev)
    if dev.type != "cuda":
        args.copy_bytes = min(args.copy_bytes, 64 << 20)
    return dev, dtype


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def run_meta(args, argv, dev, dtype) -> dict:
    """Where and what: device, library versions, the command, the model, the git state."""
    from hyspec.presets import canonical_name

    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
            "python": platform.python_version(), "dtype": str(dtype).replace("torch.", ""),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "command": "hyspec bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "config": (getattr(args, "model_given", None) or args.model
                       or canonical_name(args.config) + (" (fp8)" if args.fp8 else "")),
            **({"model_dir": args.model} if args.model else {}),
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "git": git_state()}


def preset_figures(args, dev, dtype, result: dict) -> bool:
    """A published-shape preset: its byte / roofline / slot figures first (no device
    needed); False when it cannot run here (the reason is in result["errors"])."""
    from hyspec.presets import canonical_name, check_runnable, format_summary, summary

    name = canonical_name(args.config)
    lengths = tuple(int(x) for x in args.slot_lengths.split(",") if x)
    result["preset"] = summary(name, torch.bfloat16 if dtype == torch.float32 else dtype, lengths=lengths,
                               fp8=args.fp8)
    log(format_summary(result["preset"]))
    why = check_runnable(name, dev, dtype, fp8=args.fp8)
    if why:
        log(f"!! {why}")
        result["errors"]["preset"] = why
        return False
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    return True


def step_bytes_and_gemm_configs(model, args, dev, result: dict) -> tuple[int, int]:
    """Weight bytes a decode step and a draft step read (from the Triton runner's packing),
    and the skinny-GEMM configs: from --tuned-from, tuned in the step (--tune step), or the
    shipped ones (recorded in result)."""
    from hyspec.gpu.tune import moe_key_name, parse_moe_key

    probe = None
    if dev.type == "cuda":  # the Triton runner's own count of what its matmuls read
        from hyspec.gpu.batch import BatchDecoder

        probe = BatchDecoder(model, 8, 1, 1, graphs=False)
        step_bytes, draft_bytes = probe.runner.weight_bytes_per_step(), probe.runner.draft_bytes_per_step()
    else:  # the CPU runs the reference backend: the count from the model's parameters
        from hyspec.presets import step_bytes as count

        c = count(model.cfg, dtype=model.dtype)
        step_bytes, draft_bytes = c["step_bytes"], c["draft_bytes"]
    if args.tuned_from and dev.type == "cuda":
        from hyspec.kernels.matmul import set_tuned
        from hyspec.kernels.moe.grouped import set_moe_tuned

        earlier = args.tuned_data
        tuned = earlier.get("tuned_gemm", {})
        set_tuned({tuple(int(v) for v in k.split("x")): e["config"] for k, e in tuned.items()})
        result["tuned_gemm"] = tuned
        tuned_moe = earlier.get("tuned_moe_gemm", {})
        set_moe_tuned({parse_moe_key(k): e["config"] for k, e in tuned_moe.items()})
        if tuned_moe:
            result["tuned_moe_gemm"] = tuned_moe
        log(f"GEMM configs from {args.tuned_from}")
    shapes = None
    if dev.type == "cuda" and args.tune != "none" and not args.tuned_from:
        from hyspec.gpu.tune import model_shapes, moe_shapes

        shapes = (model_shapes(probe.runner) if args.tune_only != "moe" else []) + \
            (moe_shapes(probe.runner) if args.tune_only != "dense" else [])
        if not shapes:
            log(f"--tune-only {args.tune_only}: the model has no such matmul; nothing to tune")
    choice = (probe.runner.pdl, probe.runner.pdl_skip, probe.runner.pdl_late) if probe is not None else None
    del probe  # before tuning: its buffers are not needed
    if shapes:
        from hyspec.gpu.tune import tune_in_step

        log("tuning skinny-GEMM (and MoE expert-matmul) configs inside the decode step (chosen by shape only)")
        generator = torch.Generator().manual_seed(args.seed)
        from hyspec.gpu.batch import BatchDecoder

        vrows = max(args.ks or [1]) + 1 if args.tune == "step+verify" else 0
        # (a timing replays the step 93 times from the same start; a verify writes t rows past it)
        tune_decoder = BatchDecoder(model, args.prompt_len + 160, max(1, vrows - 1), 1)
        prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=generator).tolist()
        tune_decoder.prefill_start(0, prompt, 0)
        if vrows:  # the verify's draft rows: random tokens (zeros would route alike in MoE layers)
            drafts = torch.randint(0, model.cfg.vocab_size, (vrows - 1,), generator=generator)
            tune_decoder.verify_tokens[0, 1:vrows].copy_(drafts)
        tuned = tune_in_step(tune_decoder, shapes, budget_s=args.tune_s, log=log, verify_rows=vrows)
        result["tuned_gemm"] = {f"{s[0]}x{s[1]}": v for s, v in tuned.items() if s[0] != "moe"}
        if any(s[0] == "moe" for s in tuned):
            result["tuned_moe_gemm"] = {moe_key_name(s): v for s, v in tuned.items() if s[0] == "moe"}
        del tune_decoder
    if "tuned_gemm" not in result and dev.type == "cuda":
        from hyspec.kernels.matmul import BUILTIN, TUNED
        from hyspec.kernels.moe.grouped import MOE_BUILTIN

        result["gemm_configs"] = {"source": "TUNED" if TUNED else "BUILTIN/defaults",
                                  "builtin": {f"{n}x{k}": c for (n, k), c in BUILTIN.items()},
                                  "moe_builtin": {moe_key_name(("moe",) + k): c for k, c in MOE_BUILTIN.items()}}
    if dev.type == "cuda" and choice is not None:  # the decoders' PDL choice (hyspec.kernels.pdl.step_default)
        import os

        flag, skip, late = choice
        result["pdl"] = {"step_graphs": flag, "skip": skip, "matmul_late": late, "HYSPEC_PDL": os.environ.get("HYSPEC_PDL")}
    return step_bytes, draft_bytes


def fp8_block(model) -> list[int] | None:
    """The block of the model's kept FP8 weights (None: no weight is kept in FP8)."""
    for m in model.modules():
        if getattr(m, "fp8_block", None) is not None:
            return list(m.fp8_block)
    return None


def failure(e: Exception) -> str:
    return f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"


def run_variants(model, prompt, args, dev, roofline_ms: float, result: dict, save):
    """Each --variants entry in turn; returns the exact variant's decoder (or None)."""
    result["variants"] = {}
    exact_decoder = None
    for variant in args.variant_list:
        try:
            figures = bench_variant(model, prompt, args, VARIANTS[variant], dev, roofline_ms)
            decoder = figures.pop("_decoder")
            if variant == "exact":
                exact_decoder = decoder
            else:
                del decoder
            result["variants"][variant] = figures
        except Exception as e:  # keep going: partial results are still worth writing
            result["errors"][variant] = failure(e)
            log(f"!! variant {variant} failed: {type(e).__name__}: {e} (traceback in the JSON's errors)")
        save()
    return exact_decoder


def draft_vocab_figures(model, prompt, args, dev, roofline_ms: float) -> dict:
    """The exact variant again with a reduced draft vocabulary (--draft-vocab N): the
    drafter scores N ids (a view of the head's first N rows on random weights: no corpus to
    rank by), plain and forced / MTP K=3 measured side by side in this run."""
    import copy

    from hyspec.speculative.drafter import first_ids_draft_vocab

    if not model.has_mtp:
        raise ValueError("--draft-vocab needs a model with an MTP head")
    size = args.draft_vocab
    log(f"reduced draft vocabulary: {size} of {model.cfg.vocab_size} ids (the first {size}; random weights)")
    sub = copy.copy(args)
    sub.ks = [3]
    with first_ids_draft_vocab(model, size):
        figures = bench_variant(model, prompt, sub, True, dev, roofline_ms)
    del figures["_decoder"]
    figures["size"] = size
    figures["ids"] = f"first {size} (random weights)"
    return figures


def check_batch_memory(model, args, dev) -> None:
    """ValueError naming --batch when the largest batch's sequence state does not fit in the
    memory free on `dev` now: on the CPU the engine core's slots (prompt + new tokens), on a
    GPU the BatchDecoder's lanes as hyspec.gpu.batch_bench sizes them (at least the
    invariance check's 16, each long enough for its 500 tokens). A slot's bytes are
    hyspec.core.slots.slot_bytes (attention KV, draft KV, linear-attention state): a lower
    bound of what the run holds."""
    from hyspec.core.slots import slot_bytes
    from hyspec.train.memory import available_memory_bytes

    batch = max(int(b) for b in args.batch.split(","))
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # (memory the caching allocator holds unused counts as free)
        free = torch.cuda.mem_get_info(dev)[0]
        from hyspec.gpu.batch_bench import lane_shape

        slots, length = lane_shape(batch, args.prompt_len, args.new_tokens)  # (the decoder gpu_batch_bench builds)
    else:
        free, slots, length = available_memory_bytes(), batch, args.prompt_len + args.new_tokens + 8
    per = slot_bytes(model.cfg, model.dtype, length, model.has_mtp)["total"]
    if free is not None and slots * per > free:
        raise ValueError(f"--batch {batch}: {slots} sequences of {length} tokens need {slots * per / 2**30:.1f} GiB "
                         f"of state ({per / 2**20:.2f} MiB each), more than the {free / 2**30:.1f} GiB free on "
                         f"{dev.type}: at most {free // per} fit")


def run_batches(model, args, dev, weight_bytes: int | None = None, bandwidth_gbps: float | None = None) -> dict:
    """--batch: aggregate throughput per batch size; on a GPU the BatchDecoder (CUDA graphs
    per batch size, with a batch-invariance check, and each plain step's bandwidth floor
    from weight_bytes and bandwidth_gbps), on the CPU the engine core."""
    sizes = [int(b) for b in args.batch.split(",")]
    forced = [float(x) for x in args.forced.split(",")]
    if dev.type == "cuda":
        from hyspec.gpu.batch_bench import gpu_batch_bench

        log("batched decoding on the GPU: BatchDecoder, CUDA graphs per batch size (prefill excluded)")
        return gpu_batch_bench(model, sizes, prompt_len=args.prompt_len, new_tokens=args.new_tokens, forced=forced,
                               seed=args.seed, inv_prompts=args.batch_inv_prompts, draft_vocab=args.draft_vocab or 0,
                               weight_bytes=weight_bytes, bandwidth_gbps=bandwidth_gbps, log=log)
    from hyspec.core.batch_bench import batch_bench

    log("batched decoding through the engine core (prefill excluded)")
    return batch_bench(model, sizes, prompt_len=args.prompt_len, new_tokens=args.new_tokens, forced=forced,
                       seed=args.seed, log=log)


def main(argv=None) -> int:
    if any(a == "--pp" or a.startswith("--pp=") for a in (argv if argv is not None else sys.argv[1:])):
        from hyspec.parallel.bench import main as pp_main  # pipeline stages: its own flags and report

        return pp_main(argv)
    from hyspec.presets import PRESETS, canonical_name

    args = build_parser().parse_args(argv)
    dev, dtype = resolve_device(args)
    result: dict = {"meta": run_meta(args, argv, dev, dtype), "errors": {}}
    log(f"# {result['meta']}")
    if args.tune != "none" and dev.type != "cuda":  # (ignored in silence)
        log(f"note: --tune {args.tune} searches the GPU kernels' GEMM configs: nothing to tune on the {dev.type}")
    if args.tuned_from and dev.type != "cuda":  # (were recorded in the results as if they had been used)
        log(f"note: --tuned-from sets the GPU kernels' GEMM configs: the {dev.type} runs the reference backend, "
            "they are not used (nor recorded)")
    t_start = time.perf_counter()

    def save():
        write_json(args.out, result)

    def run() -> int:
        if canonical_name(args.config) in PRESETS and not args.model:  # published shapes: figures, then run if it can
            if not preset_figures(args, dev, dtype, result):
                save()
                return 2

        bandwidth = copy_bandwidth(dev, args.copy_bytes)
        result["copy_bandwidth_GBps"] = bandwidth
        log(f"copy bandwidth {bandwidth:.0f} GB/s (read + write)")
        model = make_model(args, dev, dtype)
        if not model.has_mtp:
            from hyspec.config import NO_MTP_HEAD

            raise ValueError(f"{args.model or args.config}: {NO_MTP_HEAD}; the bench measures speculative decoding against plain "
                             f"(for plain speed alone: hyspec generate --draft 0 --json prints tok/s)")
        context = model.cfg.max_position_embeddings
        longest = max(args.new_tokens, args.exact_tokens if args.exact_prompts else 0)
        if args.prompt_len + longest > context:
            flag = "--new-tokens" if longest == args.new_tokens else "--exact-tokens"
            raise ValueError(f"--prompt-len {args.prompt_len} + {flag} {longest} exceed the model's context of "
                             f"{context} tokens (max_position_embeddings)")
        if args.batch:  # before any timing run
            check_batch_memory(model, args, dev)
        if args.draft_vocab and not model.has_mtp:
            raise ValueError("--draft-vocab: the model has no MTP head (nothing drafts)")
        if args.draft_vocab and not 1 <= args.draft_vocab <= model.cfg.vocab_size:  # (it failed after the whole run)
            raise ValueError(f"--draft-vocab: must be in 1..{model.cfg.vocab_size} (the model's vocabulary), "
                             f"got {args.draft_vocab}")
        n_params = sum(p.numel() for p in model.parameters())
        from hyspec.model.gdn import ssm_store_dtype

        result["meta"]["ssm_dtype"] = str(ssm_store_dtype(model.cfg, model.dtype)).replace("torch.", "")
        log(f"Gated DeltaNet state stored in {result['meta']['ssm_dtype']}")
        if dev.type == "cuda":  # memory: weights resident, peak while building, slots that fit beside them
            result["memory"] = memory_report(model, dev, [int(x) for x in args.slot_lengths.split(",") if x])
            log(format_memory(result["memory"]))
        if dev.type == "cpu" and n_params < 50_000_000:
            torch.set_num_threads(1)  # small matrices: extra threads only add synchronisation cost (as the CLI)
        step_bytes, draft_bytes = step_bytes_and_gemm_configs(model, args, dev, result)
        roofline_ms = step_bytes / (bandwidth * 1e9) * 1e3
        result["model"] = {"config": model.cfg.to_dict(), "params": n_params, "weight_bytes_per_step": step_bytes,
                           "draft_bytes_per_step": draft_bytes, "fp8_block": fp8_block(model)}
        result["roofline_ms"] = roofline_ms
        result["roofline_tok_s"] = 1e3 / roofline_ms
        cfg = model.cfg
        moe = (f" (MoE: everything shared + top-{cfg.num_experts_per_tok} of {cfg.num_experts} routed experts per "
               f"layer)" if cfg.has_moe else "")
        log(f"model: {si(n_params)} params{', block-FP8 weights' if fp8_block(model) else ''}; a decode step reads "
            f"{si(step_bytes)}B{moe} -> roofline {roofline_ms:.3f} ms ({1e3 / roofline_ms:.0f} tok/s) at "
            f"{bandwidth:.0f} GB/s; a draft step reads {si(draft_bytes)}B")
        generator = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=generator).tolist()

        exact_decoder = run_variants(model, prompt, args, dev, roofline_ms, result, save)
        if exact_decoder is not None and args.exact_prompts > 0:
            try:
                log("exactness check (exact variant): speculative K=3 vs plain, bitwise"
                    + (", greedy and coupled sampling" if args.exact_coupled else ""))
                result["exactness"] = exactness_check(model, args, dev, exact_decoder)
            except Exception as e:
                result["errors"]["exactness"] = failure(e)
                log(f"!! exactness check failed: {e}")
            save()
        del exact_decoder
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if args.draft_vocab:
            try:
                result["draft_vocab"] = draft_vocab_figures(model, prompt, args, dev, roofline_ms)
            except Exception as e:
                result["errors"]["draft_vocab"] = failure(e)
                log(f"!! draft-vocabulary run failed: {type(e).__name__}: {e}")
            save()
        if args.batch:
            try:
                result["batch"] = run_batches(model, args, dev, step_bytes, bandwidth)
                for part, why in result["batch"].get("errors", {}).items():  # (a failed part of the batched run:
                    result["errors"][f"batch/{part}"] = why                   # the exit status says so, was 0)
            except Exception as e:  # (an out-of-memory the check above could not foresee: the figures so far stay)
                result["errors"]["batch"] = failure(e)
                log(f"!! batched run failed: {type(e).__name__}: {e}")
            save()
        if args.hf_tokens > 0:
            try:
                log("transformers generate (same weights)")
                result["hf"] = hf = hf_generate(model, prompt, args.hf_tokens, dev, dtype, model_dir=args.model)
                ours = ((result.get("variants") or {}).get("exact") or {}).get("plain", {}).get("tok_s")
                if hf.get("decode_tok_s") and ours:
                    hf["hyspec_plain_vs_hf"] = ours / hf["decode_tok_s"]  # the baseline ratio
                if "skipped" in hf:
                    log(f"  HF comparison skipped: {hf['skipped']}")
                else:
                    log(f"  HF: {hf.get('decode_tok_s', 0):.1f} tok/s (fla importable: {hf.get('fla_importable')})"
                        + (f"; hyspec plain x{hf['hyspec_plain_vs_hf']:.1f} of it" if "hyspec_plain_vs_hf" in hf else ""))
            except Exception as e:
                result["errors"]["hf"] = failure(e)
                log(f"!! HF comparison failed: {e}")
        result["targets"] = targets(result) if dev.type == "cuda" else {}  # GPU goals: not judged on a CPU
        result["wall_s"] = time.perf_counter() - t_start
        save()
        print_table(result)
        if result["errors"]:  # partial results were written and printed; the run still failed
            where = f" (tracebacks in {args.out})" if args.out else " (--out FILE keeps their tracebacks)"
            causes = "; ".join(f"{part}: {str(why).splitlines()[0] if str(why) else '?'}"
                               for part, why in result["errors"].items())
            print(f"hyspec bench: error: {len(result['errors'])} part(s) failed ({causes}){where}", file=sys.stderr,
                  flush=True)
            return 1
        return 0

    try:
        return run()
    except (KeyboardInterrupt, BrokenPipeError):  # the figures measured so far are still worth keeping (a Ctrl-C,
        if set(result) - {"meta", "errors"}:     # or the reader of its output gone: `| head`)
            result["interrupted"] = True
            try:
                save()
            except OSError:
                pass
        raise


__all__ = ["main", "build_parser", "DEVICE_DEFAULTS", "VARIANTS", "VARIANT_ALIASES"]
