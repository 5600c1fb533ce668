"""The up-front memory estimate of a training run, and the refusal of a CPU run that would
not fit."""

from __future__ import annotations

from pathlib import Path

import torch

from hyspec.config import ModelConfig
from hyspec.train.config import TrainConfig
from hyspec.train.model import count_params, model_config

# bytes of saved activations per training token and layer, in units of 4 * hidden (fp32),
# and per token in units of 4 * vocab (the two heads' logits, softmax and their grads);
# measured on the CPU with the default model (0.74 MB per token at batch 1..4 x 512..2048)
_ACT_PER_LAYER_HIDDEN = 64
_ACT_PER_VOCAB = 6
_FIXED_BYTES = 1 << 30  # interpreter, torch, the token streams


def _train_memory_terms(a: TrainConfig, vocab_size: int) -> tuple[int, int]:
    """(bytes independent of the batch, bytes per training token)."""
    cfg = ModelConfig.from_dict(model_config(vocab_size, **a.arch))
    per_token = 4 * ((cfg.num_hidden_layers + 1) * _ACT_PER_LAYER_HIDDEN * cfg.hidden_size
                     + _ACT_PER_VOCAB * vocab_size)
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
