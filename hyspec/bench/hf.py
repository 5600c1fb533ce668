"""transformers' generate on the same weights (target only), greedy, side by side with ours."""

from __future__ import annotations

import time

import torch

from hyspec.bench.timing import sync


def hf_generate(model, prompt, n_tokens, dev, dtype, model_dir=None) -> dict:
    """Time transformers' generate of n_tokens after `prompt`: a checkpoint on disk is loaded
    by transformers itself; an in-memory model (qwen3_next layout only) is rebuilt as
    Qwen3NextForCausalLM with our weights."""
    import transformers as tf

    cfg = model.cfg
    missing = unexpected = ()
    if model_dir is not None:  # a checkpoint on disk: transformers loads it itself (any family)
        hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev)
    else:  # an in-memory bench model (qwen3_next layout): same config, our weights
        hf_config = dict(cfg.raw)
        hf_config.pop("architectures", None)
        model_type = hf_config.pop("model_type", None)
        if model_type != "qwen3_next":
            return {"skipped": f"in-memory HF comparison only wired for qwen3_next (got {model_type})"}
        hf_config.pop("full_attention_interval", None)
        hf_config["layer_types"] = list(cfg.layer_types)
        old_default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(dev):
                hf = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**hf_config))
        finally:
            torch.set_default_dtype(old_default)
        target_weights = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
        missing, unexpected = hf.load_state_dict(target_weights, strict=False)
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
