"""transformers' generate on the same weights (target only), greedy, side by side with ours."""

from __future__ import annotations

import time

import torch

from hyspec.bench.timing import sync


# model_type of an in-memory bench model -> transformers' (config class, causal-LM class) names
HF_CLASSES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}


def hf_model_sharing_weights(model, dev):
    """transformers' causal LM of the model's family built around the model's own weight
    tensors (no copy: built on the meta device, then our tensors assigned; the MTP head is
    ours alone). Our state dict uses the checkpoint names transformers loads, so the keys
    match; anything transformers still lacks afterwards is an error naming it. Block-FP8
    weights are not wired (transformers would need its own quantized model): ValueError."""
    import transformers as tf

    cfg = model.cfg
    state = model.state_dict()
    if any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in state.values()):
        raise ValueError("block-FP8 weights: transformers computes them through DeepGEMM or a Triton kernel it "
                         "downloads from the Hugging Face Hub (kernels-community/finegrained-fp8), and their "
                         "dequantized copy would double the memory; the in-memory comparison runs unquantized "
                         "weights only")
    hf_config = dict(cfg.raw)
    hf_config.pop("architectures", None)
    model_type = hf_config.pop("model_type", None)
    if model_type not in HF_CLASSES:
        raise ValueError(f"no transformers class wired for model_type {model_type!r} "
                         f"(known: {', '.join(HF_CLASSES)})")
    cfg_name, lm_name = HF_CLASSES[model_type]
    hf_config.pop("full_attention_interval", None)
    hf_config.pop("quantization_config", None)
    hf_config["layer_types"] = list(cfg.layer_types)
    ours = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    dtype = next(iter(ours.values())).dtype
    hf_cfg = getattr(tf, cfg_name)(**hf_config)
    hf_cfg.dtype = dtype
    old_default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            hf = getattr(tf, lm_name)(hf_cfg)
    finally:
        torch.set_default_dtype(old_default)
    missing, unexpected = hf.load_state_dict(ours, strict=False, assign=True)
    # buffers made in __init__ (rotary frequencies) are rebuilt on the device
    for name, mod in list(hf.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            parent, _, attr = name.rpartition(".")
            owner = hf.get_submodule(parent) if parent else hf
            if "rotary" not in type(mod).__name__.lower():
                raise ValueError(f"transformers module {name} ({type(mod).__name__}) has buffers that are not "
                                 "in the model's weights")
            with torch.device(dev):
                setattr(owner, attr, type(mod)(config=hf_cfg))
    still = [n for n, t in (*hf.named_parameters(), *hf.named_buffers()) if t.is_meta]
    if still:
        raise ValueError(f"transformers' {lm_name} wants weights the model does not have: {still[:4]}"
                         f"{' ...' if len(still) > 4 else ''} ({len(still)} in all)")
    return hf, list(missing), list(unexpected)


def hf_generate(model, prompt, n_tokens, dev, dtype, model_dir=None) -> dict:
    """Time transformers' generate of n_tokens after `prompt`: a checkpoint on disk is loaded
    by transformers itself; an in-memory model (any of the three families, unquantized) is
    wrapped by transformers' class of its family around the very same weight tensors
    (:func:`hf_model_sharing_weights`: no second copy, so it fits wherever the model does)."""
    import transformers as tf

    missing = unexpected = ()
    if model_dir is not None:  # a checkpoint on disk: transformers loads it itself (any family)
        hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev)
    else:
        try:
            hf, missing, unexpected = hf_model_sharing_weights(model, dev)
        except ValueError as e:
            return {"skipped": str(e)}
    hf.eval()
    try:
        import fla.ops.gated_delta_rule  # noqa: F401

        has_fla = True
    except Exception:
        has_fla = False
    ids = torch.tensor([prompt], device=dev)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(n):
        sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(dev)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    run(2)  # warm-up
    t_first, _ = run(1)
    t_all, tokens = run(n_tokens)
    hf = None  # free it before the caller goes on
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": n_tokens, "total_s": t_all, "prefill_s": t_first,
            "decode_tok_s": (n_tokens - 1) / max(t_all - t_first, 1e-9), "fla_importable": has_fla,
            "missing_keys": len(missing), "unexpected_keys": len(unexpected), "greedy_tokens": tokens}
