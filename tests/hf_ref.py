"""Helpers that build tiny checkpoints with Hugging Face transformers (test reference only)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hyspec.tiny import tiny_config


def _hf_classes(arch: str):
    import transformers as tf

    if arch == "qwen3_next":
        return tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM
    if arch == "qwen3_5":
        return tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM
    return tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM


def make_hf_checkpoint(arch: str, out: Path, *, seed: int = 0, with_mtp: bool = True, tie: bool = False,
                       vocab_size: int = 512):
    """save_pretrained() a random transformers model of `arch` (fp32) into `out`, then
    append random mtp.* tensors the way Qwen checkpoints carry them. Returns the HF model."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    cfg_cls, model_cls = _hf_classes(arch)
    d = tiny_config(arch, vocab_size=vocab_size)
    d["tie_word_embeddings"] = tie
    d.pop("architectures")
    d.pop("model_type")
    interval = d.pop("full_attention_interval")
    d["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(d["num_hidden_layers"])]
    cfg = cfg_cls(**d)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # HF inits zero-centred norms at 0; spread them so norms matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    if with_mtp:
        from hyspec.config import ModelConfig
        from hyspec.model.hybrid import MTPHead
        from hyspec.tiny import init_weights

        ours = ModelConfig.from_dir(out)
        head = MTPHead(ours)
        init_weights(head, torch.Generator().manual_seed(seed + 1))
        files = sorted(Path(out).glob("*.safetensors"))
        t = load_file(str(files[0]))
        t.update({f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()})
        save_file(t, str(files[0]), metadata={"format": "pt"})
        c = json.loads((Path(out) / "config.json").read_text())
        c["mtp_num_hidden_layers"] = 1
        (Path(out) / "config.json").write_text(json.dumps(c, indent=2))
    return model
