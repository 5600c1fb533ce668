"""Bench presets with the published shapes of the checkpoints users run, and what one
decode step of each must read (the memory-bandwidth roofline). Also the bench's own
in-memory model, ``qwen3-next-2b-dense`` (old name ``b2``, kept as an alias: ALIASES).

Shapes are the published ``config.json`` values (text model only; the vision tower of the
Qwen3.5 checkpoints is not part of decoding). Sources, as found with the project's search
tools (docs/models.md lists them too):

* Qwen3.5-27B: ``Qwen/Qwen3.5-27B/config.json`` as transcribed in a public architecture
  note ("verified 2026-05-15": hidden 5120, 64 layers, [3 linear : 1 full] x 16, 24 Q / 4 KV
  heads of 256, partial rotary 0.25, rope_theta 1e7, GDN 16 QK / 48 V heads of 128, conv 4,
  FFN 17408, vocab 248320, untied, 1 MTP layer); the same text_config appears verbatim in a
  public copy of Qwen/Qwen3.6-27B's config.json (same architecture).
* Qwen3.5-35B-A3B: ``hf_configs/qwen3.5-35B-A3B_config.json`` in github.com/alibaba/InferSim
  (commit 7ed3db76, "Support qwen3.5") and the text config in github.com/mlc-ai/pith-train
  ``examples/pretrain_lm/qwen3.5-35b-a3b/config.json``: hidden 2048, 40 layers, 16 Q / 2 KV
  heads of 256, GDN 16 / 32 heads of 128, 256 experts top-8 of 512 + shared expert 512,
  vocab 248320, untied, 1 MTP layer.
* Qwen3-Next-80B-A3B: ``hf_configs/qwen3-next-80B-A3B_config.json`` in alibaba/InferSim
  (commit 1201bedf): hidden 2048, 48 layers, 16 Q / 2 KV heads of 256, GDN 16 / 32 heads of
  128, 512 experts top-10 of 512 + shared expert 512, norm_topk_prob, vocab 151936,
  rope_theta 1e7, partial rotary 0.25, untied. That config.json has no MTP field; the preset
  assumes one MTP layer (``mtp.*`` weights, what vLLM's ``qwen3_next_mtp`` drafts with) --
  an assumption, not a published config value. The "-FP8" checkpoint adds
  ``quantization_config`` {quant_method fp8, activation_scheme dynamic, weight_block_size
  [128, 128]}; which modules it keeps in bf16 is taken from the published Qwen3.5 -FP8
  skip list (alibaba/InferSim ``hf_configs/qwen3.5-122B-A10B_config.json``: lm_head,
  embed_tokens, linear_attn.conv1d / in_proj_a / in_proj_b, mlp.gate,
  mlp.shared_expert_gate, mtp.fc) plus Qwen3-Next's fused ``in_proj_ba`` ("Qwen3-Next does
  not apply FP8 quantization for in_proj_ba", HabanaAI/vllm-fork PR 2071 citing vLLM PR
  25079). The exact Qwen3-Next-80B-A3B-Instruct-FP8 skip list was not found: stated as an
  assumption in docs/models.md.

Published totals (model cards): Qwen3.5-27B "27B"; Qwen3.5-35B-A3B "35B total, 3B active";
Qwen3-Next-80B-A3B "80B in total and 3B activated", "Non-Embedding: 79B".
"""

from __future__ import annotations

import math

import torch

from hyspec.config import keeps_fp32

H200_BW = 4.26e12  # bytes/s: the roofline figure the issue states for one H200 (copy bandwidth measured ~ this)
H200_MEM = 141e9  # bytes of HBM3e on one H200 (the device reports ~139.8 GiB)


def _layers(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


_ROPE = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}

QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
    "vocab_size": 248320, "hidden_size": 5120, "num_hidden_layers": 64, "layer_types": _layers(64),
    "full_attention_interval": 4, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 17408,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "rope_parameters": dict(_ROPE),
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1, "hidden_act": "silu", "eos_token_id": 248044,
}

QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "layer_types": _layers(40),
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "rope_parameters": dict(_ROPE),
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1, "hidden_act": "silu", "eos_token_id": 248044,
}

QWEN3_NEXT_80B_A3B_FP8 = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48, "full_attention_interval": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 5120,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1, "hidden_act": "silu", "eos_token_id": 151645,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["lm_head", "model.embed_tokens", "linear_attn.in_proj_ba",
                                                       "linear_attn.conv1d", "mlp.gate", "mlp.shared_expert_gate",
                                                       "mtp.fc"]},
}

# The bench's own model. Not a published checkpoint: the Qwen3-Next layout with a dense FFN
# (no experts), hidden 2048, 24 layers ([3 linear : 1 full] x 6), one MTP layer: ~2.3 B
# parameters, random weights, built in memory. `hyspec bench` measures it by default.
# Old name "b2" (an alias: commands, scripts and result files use it).
QWEN3_NEXT_2B_DENSE = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24, "full_attention_interval": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 6144,
    "num_experts": 0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1, "hidden_act": "silu",
}

# in-memory bench models that are not published shapes (no PUBLISHED totals to check against)
BENCH_MODELS: dict[str, dict] = {"qwen3-next-2b-dense": QWEN3_NEXT_2B_DENSE}

# old names -> descriptive names (old commands keep working: `hyspec bench --config b2`)
ALIASES: dict[str, str] = {"b2": "qwen3-next-2b-dense"}


def canonical_name(name: str) -> str:
    """The descriptive name of a preset or bench model given any of its names."""
    return ALIASES.get(name, name)


# Qwen's FP8 checkpoints' quantization_config (block 128 x 128; the bf16 modules as in the
# published Qwen3.5 -FP8 skip list, see the module docstring and hyspec.quant)
FP8_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [128, 128],
                    "modules_to_not_convert": ["lm_head", "model.embed_tokens", "linear_attn.in_proj_a",
                                               "linear_attn.in_proj_b", "linear_attn.in_proj_ba", "linear_attn.conv1d",
                                               "mlp.gate", "mlp.shared_expert_gate", "mtp.fc"]}


def with_fp8(d: dict) -> dict:
    """A config dict's block-FP8 form (what a published "-FP8" checkpoint adds to config.json);
    unchanged when it already is."""
    if (d.get("quantization_config") or {}).get("quant_method") == "fp8":
        return d
    return {**d, "quantization_config": dict(FP8_QUANTIZATION)}


def fp8_block_of(d_or_cfg) -> tuple[int, int] | None:
    """The (rows, cols) block of a block-FP8 config (dict or ModelConfig), else None."""
    raw = d_or_cfg if isinstance(d_or_cfg, dict) else (d_or_cfg.raw or {})
    q = raw.get("quantization_config") or {}
    return tuple(q["weight_block_size"]) if q.get("quant_method") == "fp8" else None


def model_dict(name: str, fp8: bool = False) -> dict:
    """The config dict of a preset or bench model, by any of its names (aliases too);
    fp8: its block-FP8 form (with_fp8)."""
    if fp8:
        return with_fp8(model_dict(name))
    full = canonical_name(name)
    if full in PRESETS:
        return PRESETS[full]
    if full in BENCH_MODELS:
        return BENCH_MODELS[full]
    known = [*PRESETS, *BENCH_MODELS, *ALIASES]
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(known)}")


PRESETS: dict[str, dict] = {
    "qwen3.5-27b": QWEN3_5_27B,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
    "qwen3-next-80b-a3b-fp8": QWEN3_NEXT_80B_A3B_FP8,
}

# model card figures: total parameters (text + MTP as published, vision tower excluded where stated)
PUBLISHED = {
    "qwen3.5-27b": {"total": 27e9, "source": "Qwen/Qwen3.5-27B model card: 27B"},
    "qwen3.5-35b-a3b": {"total": 35e9, "active": 3e9,
                        "source": "Qwen/Qwen3.5-35B-A3B model card: 35B total, 3B active"},
    "qwen3-next-80b-a3b-fp8": {"total": 80e9, "active": 3e9, "non_embedding": 79e9,
                               "source": "Qwen/Qwen3-Next-80B-A3B-Instruct model card: 80B total, 3B activated, "
                                         "79B non-embedding"},
}


def preset_config(name: str, fp8: bool = False):
    from hyspec.config import ModelConfig

    return ModelConfig.from_dict(model_dict(name, fp8))


def meta_model(cfg):
    """The model's parameter shapes without memory (meta device)."""
    from hyspec.model.hybrid import HybridLM

    with torch.device("meta"):
        return HybridLM(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0)


def _is_routed(name: str) -> bool:
    return ".mlp.experts." in name


def _fp8_quantized(name: str, shape) -> bool:
    """Would Qwen's FP8 checkpoint store this parameter in float8 (see hyspec.quant)?"""
    from hyspec.quant import UNQUANTIZED_LINEARS

    if len(shape) < 2 or name.endswith("conv1d.weight"):
        return False
    mod = name[: -len(".weight")] if name.endswith(".weight") else name
    return not any(mod == s or mod.endswith("." + s) for s in UNQUANTIZED_LINEARS)


def param_bytes(name: str, shape, dtype: torch.dtype, fp8_block: tuple[int, int] | None) -> int:
    """Bytes a parameter takes on the device: fp8 weights 1 byte + fp32 block scales; A_log /
    dt_bias fp32 (as the loader keeps them); everything else `dtype`."""
    n = math.prod(shape)
    if fp8_block is not None and _fp8_quantized(name, shape):
        lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
        return n + 4 * lead * math.ceil(shape[-2] / fp8_block[0]) * math.ceil(shape[-1] / fp8_block[1])
    if keeps_fp32(name):
        return 4 * n
    return torch.empty((), dtype=dtype).element_size() * n


def expected_distinct_experts(n_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts hit by `rows` tokens under uniformly random top-k routing:
    E * (1 - (1 - k/E)^t)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** rows)


def step_bytes(name_or_cfg, dtype: torch.dtype = torch.bfloat16, rows: int = 1) -> dict:
    """Weight bytes one forward of `rows` tokens reads (decode: rows=1; verify of K drafts:
    rows=K+1), target only, and one MTP draft step:

    * shared: every target weight except the embedding table and the routed experts (a
      gathered embedding row is negligible and counted in `embed_rows`);
    * routed experts, per MoE layer: top_k experts for one row; for `rows` rows the expected
      number of distinct experts E(1-(1-k/E)^t) (uniformly random routing) and the worst
      case min(E, t*k);
    * draft step: MTP block (its experts as one row) + mtp.fc + LM head.
    """
    cfg = preset_config(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    block = fp8_block_of(cfg)
    m = meta_model(cfg)
    elt = torch.empty((), dtype=dtype).element_size()
    shared = routed_total = embed = mtp = mtp_routed = 0
    for n, p in m.named_parameters():
        b = param_bytes(n, tuple(p.shape), dtype, block)
        if n == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            embed += b
        elif n.startswith("mtp."):
            if _is_routed(n):
                mtp_routed += b
            else:
                mtp += b
        elif _is_routed(n):
            routed_total += b
        else:
            shared += b
    # the head a draft step reads: lm_head, or the embedding table when tied (a target step
    # reads that table whole as its head: counted in shared)
    head = param_bytes("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), dtype, block)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    per_expert = routed_total / (n_moe * E) if n_moe else 0.0
    distinct = expected_distinct_experts(E, k, rows) if E else 0.0
    worst = min(E, rows * k) if E else 0
    routed_read = n_moe * per_expert * distinct
    out = {
        "params": sum(p.numel() for p in m.parameters()),
        "params_target": sum(p.numel() for n, p in m.named_parameters() if not n.startswith("mtp.")),
        "params_active": None,
        "weight_bytes_total": shared + routed_total + embed + mtp + mtp_routed,
        "rows": rows,
        "shared_bytes": shared,
        "embed_rows_bytes": rows * cfg.hidden_size * elt,
        "routed_bytes_total": routed_total,
        "expert_bytes": per_expert,
        "moe_layers": n_moe,
        "experts_per_layer_expected": distinct,
        "experts_per_layer_worst": worst,
        "step_bytes": shared + routed_read,
        "step_bytes_worst": shared + n_moe * per_expert * worst,
        "draft_bytes": mtp + head + (mtp_routed / E * k if E else 0),
    }
    if E:
        act = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("mtp.") and not _is_routed(n))
        act -= cfg.vocab_size * cfg.hidden_size  # one embedding row, not the table
        act += sum(p.numel() for n, p in m.named_parameters() if not n.startswith("mtp.") and _is_routed(n)) * k / E
        out["params_active"] = act
    return out


def roofline(nbytes: float, bandwidth: float = H200_BW) -> dict:
    ms = nbytes / bandwidth * 1e3
    return {"ms": ms, "tok_s": 1e3 / ms}


def slots_that_fit(cfg, dtype: torch.dtype, length: int, free_bytes: float, with_mtp: bool = True) -> dict:
    """How many sequence slots of `length` tokens fit in `free_bytes` beside the weights
    (hyspec.core.slots.slot_bytes: target KV + draft KV, when the model has an MTP head, +
    conv/SSM state per slot)."""
    from hyspec.core.slots import slot_bytes

    per = slot_bytes(cfg, dtype, length, with_mtp)
    return {"length": length, "slot_bytes": per["total"], "slots": max(0, int(free_bytes // per["total"]))}


def summary(name: str, dtype: torch.dtype = torch.bfloat16, *, bandwidth: float = H200_BW,
            verify_rows: tuple[int, ...] = (1, 2, 3, 4, 5), mem: float = H200_MEM,
            lengths: tuple[int, ...] = (4096, 32768, 131072), fp8: bool = False) -> dict:
    """Everything the bench prints for a preset before running it (no device needed);
    fp8: for its block-FP8 form (with_fp8)."""
    cfg = preset_config(name, fp8)
    rows = {t: step_bytes(cfg, dtype, t) for t in verify_rows}
    one = rows[verify_rows[0]]
    free = mem - one["weight_bytes_total"]
    return {
        "preset": name, "model_type": cfg.model_type, "dtype": str(dtype).replace("torch.", ""),
        "fp8": bool((cfg.raw.get("quantization_config") or {}).get("quant_method") == "fp8"),
        "params": one["params"], "params_target": one["params_target"], "params_active": one["params_active"],
        "published": PUBLISHED.get(name), "weight_bytes": one["weight_bytes_total"],
        "decode_bytes": one["step_bytes"], "draft_bytes": one["draft_bytes"],
        "roofline_decode": roofline(one["step_bytes"], bandwidth),
        "verify": {t: {"bytes_expected": r["step_bytes"], "bytes_worst": r["step_bytes_worst"],
                       "experts_per_layer_expected": r["experts_per_layer_expected"],
                       "experts_per_layer_worst": r["experts_per_layer_worst"],
                       "roofline_ms_expected": roofline(r["step_bytes"], bandwidth)["ms"],
                       "roofline_ms_worst": roofline(r["step_bytes_worst"], bandwidth)["ms"]}
                   for t, r in rows.items()},
        "bandwidth": bandwidth, "device_memory": mem, "free_after_weights": free,
        "slots": [slots_that_fit(cfg, dtype, L, free) for L in lengths],
    }


def format_summary(s: dict) -> str:
    gb = 1e9
    lines = [f"preset {s['preset']} ({s['model_type']}{', FP8 block-quantized' if s['fp8'] else ''}, "
             f"{s['dtype']} activations/unquantized weights)",
             f"  params {s['params'] / gb:.2f} B (target {s['params_target'] / gb:.2f} B"
             + (f", active per token {s['params_active'] / gb:.2f} B" if s["params_active"] else "") + ")"
             + (f"; published: {s['published']['source']}" if s.get("published") else ""),
             f"  weights on the device {s['weight_bytes'] / gb:.2f} GB; "
             f"a decode step reads {s['decode_bytes'] / gb:.3f} GB"
             f" -> roofline {s['roofline_decode']['ms']:.3f} ms = {s['roofline_decode']['tok_s']:.0f} tok/s at "
             f"{s['bandwidth'] / 1e12:.2f} TB/s; a draft step reads {s['draft_bytes'] / gb:.3f} GB"]
    for t, v in s["verify"].items():
        if s["params_active"] is None:
            lines.append(f"  dense: a forward of any number of rows reads the same {s['decode_bytes'] / gb:.3f} GB")
            break
        lines.append(f"  forward of {t} row(s): {v['bytes_expected'] / gb:.3f} GB expected "
                     f"({v['experts_per_layer_expected']:.2f} distinct experts/layer), {v['bytes_worst'] / gb:.3f} GB "
                     f"worst ({v['experts_per_layer_worst']}) -> {v['roofline_ms_expected']:.3f} / "
                     f"{v['roofline_ms_worst']:.3f} ms")
    lines.append(f"  beside the weights in {s['device_memory'] / gb:.0f} GB: " + ", ".join(
        f"{x['slots']} slots of {x['length']} tokens ({x['slot_bytes'] / 2**20:.0f} MiB each)" for x in s["slots"]))
    return "\n".join(lines)


def build_on_device(d: dict, device, dtype: torch.dtype, seed: int = 0):
    """HybridLM (with MTP head) of config dict `d`, random HF-like weights, built directly on
    `device` in `dtype`: meta -> empty on the device -> in-place init, so the device never
    holds a second (fp32 staging) copy of the weights. A block-FP8 config (quantization_config)
    keeps the weights Qwen's FP8 checkpoints quantize in float8 with their scale grids
    (hyspec.quant.keep_fp8_params), as load_model(fp8="keep") does."""
    from hyspec.config import ModelConfig
    from hyspec.loading import cast_params
    from hyspec.quant import keep_fp8_params, scale_shape
    from hyspec.tiny import init_weights

    cfg = ModelConfig.from_dict(d)
    m = cast_params(meta_model(cfg), dtype)  # as hyspec.loading keeps them
    block = fp8_block_of(d)
    if block is not None:
        specs = {n: (scale_shape(tuple(p.shape), block), None) for n, p in m.named_parameters()
                 if _fp8_quantized(n, tuple(p.shape))}
        keep_fp8_params(m, specs, block)
    m = m.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    init_weights(m, g)
    return m.eval().requires_grad_(False)


def build_preset_model(name: str, device, dtype: torch.dtype, seed: int = 0, fp8: bool = False,
                       ssm_dtype: str | None = None):
    """The preset's model with random weights on `device` (see build_on_device); FP8 presets
    (and any preset with fp8=True) keep block-FP8 weights. ssm_dtype: the Gated DeltaNet
    state's storage dtype (hyspec.config.with_ssm_dtype)."""
    from hyspec.config import dict_with_ssm_dtype

    return build_on_device(dict_with_ssm_dtype(model_dict(name, fp8), ssm_dtype), device, dtype, seed)


def check_runnable(name: str, dev: torch.device, dtype: torch.dtype, fp8: bool = False) -> str | None:
    """Why the preset cannot run here (None: it can)."""
    cfg = preset_config(name, fp8)
    s = step_bytes(cfg, dtype)
    if dev.type != "cuda":
        gb = step_bytes(cfg, torch.bfloat16)["weight_bytes_total"] / 1e9
        return (f"preset {name} is GPU-size ({gb:.0f} GB of weights in bf16/FP8): run it on a CUDA "
                f"device (one H200); on CPU use --config tiny. Its shape and byte figures are printed above.")
    free, _ = torch.cuda.mem_get_info(dev)
    if s["weight_bytes_total"] > free:
        return (f"preset {name} needs {s['weight_bytes_total'] / 1e9:.1f} GB for its weights; the device has "
                f"{free / 1e9:.1f} GB free")
    return None


__all__ = ["PRESETS", "PUBLISHED", "BENCH_MODELS", "ALIASES", "QWEN3_NEXT_2B_DENSE", "canonical_name", "model_dict",
           "preset_config", "step_bytes", "expected_distinct_experts", "roofline",
           "slots_that_fit", "summary", "format_summary", "build_preset_model", "build_on_device", "check_runnable",
           "with_fp8", "fp8_block_of", "FP8_QUANTIZATION",
           "H200_BW"]
