"""The model the trainer builds: its architecture defaults, config.json contents, parameter
count and deterministic initialisation. The model is ``HybridLM`` itself (same parameters,
same names)."""

from __future__ import annotations

import math

import torch

from hyspec.config import FULL, LINEAR, ModelConfig
from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import GatedRMSNorm, RMSNorm

EOS_ID = 0

DEFAULT_ARCH = dict(
    hidden=288, layers=8, intermediate=864, heads=4, kv_heads=2, head_dim=64,
    lin_k_heads=2, lin_v_heads=4, lin_head_dim=64, conv=4, full_every=4,
)


def model_config(vocab_size: int = 4096, *, hidden: int = 288, layers: int = 8, intermediate: int = 864,
                 heads: int = 4, kv_heads: int = 2, head_dim: int = 64, lin_k_heads: int = 2,
                 lin_v_heads: int = 4, lin_head_dim: int = 64, conv: int = 4, full_every: int = 4,
                 max_positions: int = 4096, rope_theta: float = 10000.0, partial_rotary: float = 0.25) -> dict:
    """config.json contents (HF layout, model_type qwen3_5_text, tied embeddings, one MTP
    layer, every `full_every`-th layer gated full attention, the rest Gated DeltaNet)."""
    layer_types = [FULL if (i + 1) % full_every == 0 else LINEAR for i in range(layers)]
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "layer_types": layer_types,
        "full_attention_interval": full_every,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "attn_output_gate": True,
        "linear_num_key_heads": lin_k_heads,
        "linear_num_value_heads": lin_v_heads,
        "linear_key_head_dim": lin_head_dim,
        "linear_value_head_dim": lin_head_dim,
        "linear_conv_kernel_dim": conv,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_positions,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta,
                            "partial_rotary_factor": partial_rotary},
        "attention_bias": False,
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
    }


def default_config(vocab_size: int = 4096) -> dict:
    """The default hyspec model (~10.75M parameters with the MTP layer, ~21.5 MB in bf16)."""
    return model_config(vocab_size, **DEFAULT_ARCH)


def count_params(cfg: ModelConfig | dict, with_mtp: bool = True) -> int:
    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(cfg)
    with torch.device("meta"):
        m = HybridLM(cfg, with_mtp=with_mtp)
    return sum(p.numel() for p in m.parameters())


def init_params(model: HybridLM, seed: int, std: float = 0.02) -> None:
    """Deterministic init: normal(0, std) matrices (residual outputs scaled by
    1/sqrt(2*blocks)), identity norms, Mamba-2 style decays (A ~ U(1, 16), dt ~ logU(1e-3, 1e-1))."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = model.cfg.num_hidden_layers + (1 if model.has_mtp else 0)
    out_std = std / math.sqrt(2 * n_blocks)
    norm_params = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (RMSNorm, GatedRMSNorm)):
            norm_params[f"{mod_name}.weight"] = 1.0 if isinstance(mod, GatedRMSNorm) else 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in norm_params:
                p.fill_(norm_params[name])
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith("conv1d.weight"):
                b = 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.empty(p.shape).uniform_(-b, b, generator=g))
            elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                p.copy_(torch.empty(p.shape).normal_(0.0, out_std, generator=g))
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))
