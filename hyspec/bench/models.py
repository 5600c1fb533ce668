"""The model a bench run measures: a checkpoint (--model), a published-shape preset, the
bench's own qwen3-next-2b-dense (old name b2), or a tiny one for the CPU."""

from __future__ import annotations

import torch

from hyspec.presets import BENCH_MODELS, PRESETS, QWEN3_NEXT_2B_DENSE, canonical_name

B2 = QWEN3_NEXT_2B_DENSE  # old name of the bench model's config dict (bench/*.py scripts import it)


def build_config_model(config: dict, device, dtype, seed: int = 0):
    """HybridLM with an MTP head from a config dict, random HF-like init, built on the device."""
    from hyspec.config import ModelConfig
    from hyspec.loading import cast_params
    from hyspec.model.hybrid import HybridLM
    from hyspec.tiny import init_weights

    cfg = ModelConfig.from_dict(config)
    with torch.device(device):
        model = HybridLM(cfg, with_mtp=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    init_weights(model, generator)
    model = cast_params(model, dtype)  # as hyspec.loading keeps them
    model.eval().requires_grad_(False)
    return model


def make_model(args, device, dtype):
    """The model of --model / --config (any name or alias of hyspec.presets), its Gated
    DeltaNet state stored in --ssm-dtype."""
    ssm = getattr(args, "ssm_dtype", None)
    if args.model:
        from hyspec.loading import load_model

        return load_model(args.model, dtype=dtype, device=device, ssm_dtype=ssm)
    name = canonical_name(args.config)
    fp8 = getattr(args, "fp8", False)
    if name in PRESETS:  # real sizes: built in `dtype` directly on the device (one copy of the weights)
        from hyspec.presets import build_preset_model

        return build_preset_model(name, device, dtype, args.seed, fp8=fp8, ssm_dtype=ssm)
    if name in BENCH_MODELS:
        config = BENCH_MODELS[name]
    else:
        from hyspec.tiny import tiny_config

        config = tiny_config("qwen3_next", vocab_size=512)
    from hyspec.config import dict_with_ssm_dtype

    config = dict_with_ssm_dtype(config, ssm)
    if fp8:  # block-FP8 weights kept as FP8, built on the device like the presets
        from hyspec.presets import build_on_device, with_fp8

        return build_on_device(with_fp8(config), device, dtype, args.seed)
    return build_config_model(config, device, dtype, args.seed)
