"""The up-front memory estimate of a training run, and the refusal of a CPU run that would
not fit."""

from __future__ import annotations

from pathlib import Path

import torch

from hyspec.config import ModelConfig
from hyspec.train.config import TrainConfig
from hyspec.train.model import count_params, model_config

# Saved activations per training token, in fp32 values: per layer (the target layers and the
# MTP layer) _ACT_HIDDEN per hidden unit + _ACT_INTER per MLP unit + _ACT_HEADS per unit of
# the widest mixer projection (Gated DeltaNet q|k|v|z or attention q|gate|k|v), and
# _ACT_PER_VOCAB per vocabulary entry (the two heads' logits, softmax and their grads).
# Fitted on the CPU to peak memory of one step at 2 x 1024 tokens, varying each width apart
# (hidden 32 / 288, intermediate 64 / 864 / 2048, head dims 16 / 64: each term adds up; the
# activations hardly follow hidden alone, which the earlier 64 x hidden per layer assumed, so
# --hidden 32 was estimated at 1.4 GB and used 2.0), scaled to the default model's 0.74 MB per
# token measured at batch 1..4 x 512..2048 (so 17-30 % above those 2 x 1024-token peaks).
_ACT_HIDDEN = 9
_ACT_INTER = 9
_ACT_HEADS = 11
_ACT_PER_VOCAB = 6
_FIXED_BYTES = 1 << 30  # interpreter, torch, the token streams


def _train_memory_terms(a: TrainConfig, vocab_size: int) -> tuple[int, int]:
    """(bytes independent of the batch, bytes per training token)."""
    cfg = ModelConfig.from_dict(model_config(vocab_size, **a.arch))
    gdn = 2 * (cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    attn = 2 * (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim
    per_layer = _ACT_HIDDEN * cfg.hidden_size + _ACT_INTER * cfg.intermediate_size + _ACT_HEADS * max(gdn, attn)
    per_token = 4 * ((cfg.num_hidden_layers + 1) * per_layer + _ACT_PER_VOCAB * vocab_size)
    return 16 * count_params(cfg) + _FIXED_BYTES, per_token


def estimate_train_bytes(a: TrainConfig, vocab_size: int, device: str | torch.device = "cpu") -> int:
    """Peak memory of a training run: fp32 weights + grads + two AdamW moments (16 B per
    parameter), the activations autograd keeps for batch_size x seq_len tokens (target
    layers + the MTP layer, and the two heads' logits), and a fixed overhead. Calibrated
    on the CPU (fp32); a CUDA run (bf16 autocast, fla kernels) needs less."""
    fixed, per_token = _train_memory_terms(a, vocab_size)
    return fixed + a.batch_size * a.seq_len * per_token


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (else free physical pages), lowered to a cgroup v2
    memory.max when one is set."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        try:
            import os

            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def check_train_memory(a: TrainConfig, vocab_size: int, device) -> None:
    """Refuse a CPU run whose estimated peak memory exceeds what is available (the OOM
    killer would end it minutes later), naming the estimate and the flags to lower."""
    if torch.device(device).type != "cpu":
        return
    need, avail = estimate_train_bytes(a, vocab_size), available_memory_bytes()
    if avail is None or need <= 0.9 * avail:
        return
    fixed, per_token = _train_memory_terms(a, vocab_size)
    fits = min(a.batch_size - 1, int((0.9 * avail - fixed) // (a.seq_len * per_token)))
    hint = f"--batch-size {fits} fits" if fits >= 1 else "even --batch-size 1 does not fit at this --seq-len"
    raise ValueError(f"training on the CPU needs about {need / 1e9:.1f} GB (--batch-size {a.batch_size} x "
                     f"--seq-len {a.seq_len} tokens per step), but {avail / 1e9:.1f} GB is available: lower "
                     f"--batch-size ({hint}) or --seq-len, or train on a GPU (--device cuda)")
