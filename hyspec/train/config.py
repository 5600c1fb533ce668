"""TrainConfig: every setting of a training run, with the help text the CLI shows for it
(``hyspec.train.cli`` builds its flags from these fields)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from hyspec.train.model import DEFAULT_ARCH


DEFAULT_MINUTES = 7.5  # the time budget when neither a step count nor minutes is given


@dataclass
class TrainConfig:
    corpus: str = "data/pystdlib_corpus.jsonl.xz"
    tokenizer: str = "data/tokenizer/tokenizer.json"
    out: str = "runs/default_model"
    minutes: float | None = None  # None: DEFAULT_MINUTES, or no limit when steps is given; 0: no limit
    wall_minutes: float = 0.0  # 0: none; else stop training so the whole process ends within this
    steps: int = 0  # 0: choose from the time budget after timing the first steps
    device: str = ""
    seed: int = 0
    batch_size: int = 32
    seq_len: int = 2048
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.5
    dropout: float = 0.1
    log_every: int = 10
    n_evals: int = 8
    eval_max_tokens: int = 0  # 0: whole val split
    fla: str = "auto"  # auto | on | off
    check_fla: bool = True  # compare fla vs torch GDN (loss, grads) on the first batch; fall back if off
    arch: dict = field(default_factory=lambda: dict(DEFAULT_ARCH))  # model shape, keys of DEFAULT_ARCH

    def __post_init__(self) -> None:
        for name in ("corpus", "tokenizer", "out"):  # a user's ~ (in --out=~/m the shell leaves it): the
            setattr(self, name, os.path.expanduser(getattr(self, name)))  # folder checked is the one written
        if self.minutes is None:  # as on the command line: a step count alone has no time limit
            self.minutes = 0.0 if self.steps > 0 else DEFAULT_MINUTES


def flag(name: str) -> str:
    """The command-line flag of a TrainConfig field (or an arch key)."""
    return "--" + name.replace("_", "-")


def check_config(a: TrainConfig) -> None:
    """ValueError naming the flag for a setting that cannot train (checked before the corpus
    loads or anything is written)."""
    for name, lo in (("batch_size", 1), ("seq_len", 2), ("log_every", 1), ("n_evals", 1), ("warmup", 0),
                     ("eval_max_tokens", 0), ("steps", 0)):
        v = getattr(a, name)
        if v < lo:
            raise ValueError(f"{flag(name)} must be >= {lo}, got {v}")
    for name in ("minutes", "wall_minutes", "lr", "min_lr_ratio", "weight_decay", "grad_clip", "mtp_weight",
                 "dropout"):
        v = getattr(a, name)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{flag(name)} must be a finite number >= 0, got {v}")
    if a.lr == 0:
        raise ValueError("--lr must be > 0")
    if 0 < a.eval_max_tokens < 3:  # (1 crashed in the evaluation; a window needs a token and two targets)
        raise ValueError(f"--eval-max-tokens must be 0 (the whole split) or >= 3, got {a.eval_max_tokens}")
    from hyspec.sampling import SEED_MAX

    if not 0 <= a.seed <= SEED_MAX:
        raise ValueError(f"--seed must be in 0..2**64-1, got {a.seed}")
    if a.min_lr_ratio > 1 or a.dropout >= 1:
        raise ValueError(f"--min-lr-ratio must be in [0, 1] and --dropout in [0, 1), got {a.min_lr_ratio} / "
                         f"{a.dropout}")
    if a.steps == 0 and a.minutes == 0:
        raise ValueError("nothing to train: give --steps N or a --minutes budget > 0")
    for k, v in a.arch.items():
        if v < 1:
            raise ValueError(f"{flag(k)} must be >= 1, got {v}")
    check_arch(a.arch)
    from hyspec.cli.common import check_out_dir

    check_out_dir(a.out)  # before hours of training whose checkpoint it holds
    check_no_other_weights(a.out)
    if a.device:
        from hyspec.engine import check_device

        check_device(a.device)


def check_no_other_weights(out) -> None:
    """ValueError when the folder `out` holds weights the written model.safetensors would not
    replace (another checkpoint's shards, their model.safetensors.index.json, other
    *.safetensors): the loader prefers the index (or reads every *.safetensors), so the trained
    checkpoint would load the other weights under its config, or fail to load."""
    from pathlib import Path

    out = Path(out)
    if not out.is_dir():
        return
    held = sorted(p.name for p in out.iterdir()
                  if p.name != "model.safetensors" and (p.name.endswith(".safetensors")
                                                       or p.name == "model.safetensors.index.json"))
    if held:
        raise ValueError(f"--out {out}: holds another checkpoint's weights ({', '.join(held[:3])}"
                         f"{', ...' if len(held) > 3 else ''}), which would be loaded in place of the trained "
                         "model.safetensors: give a new or empty folder, or remove them")


# the config.json field each model-shape flag sets (hyspec.train.model.model_config)
ARCH_FIELDS = {"hidden_size": "hidden", "intermediate_size": "intermediate", "num_hidden_layers": "layers",
               "num_attention_heads": "heads", "num_key_value_heads": "kv_heads", "head_dim": "head_dim",
               "linear_num_key_heads": "lin_k_heads", "linear_num_value_heads": "lin_v_heads",
               "linear_key_head_dim": "lin_head_dim", "linear_value_head_dim": "lin_head_dim",
               "linear_conv_kernel_dim": "conv", "full_attention_interval": "full_every"}


def check_arch(arch: dict) -> None:
    """ValueError naming the flags (not config.json's fields) for a model shape the model
    definition refuses (heads that do not divide, ...)."""
    import re

    from hyspec.config import ConfigError, ModelConfig
    from hyspec.train.model import model_config

    try:
        ModelConfig.from_dict(model_config(**arch))
    except ConfigError as e:
        msg = re.sub(r"^config\.json: (field )?", "", str(e))
        msg = re.sub(r"'?\b(" + "|".join(ARCH_FIELDS) + r")\b'?", lambda m: flag(ARCH_FIELDS[m.group(1)]), msg)
        raise ValueError(f"model shape: {msg}") from None


TrainArgs = TrainConfig  # the earlier name

# the CLI help of each field (a bool field's flag is --no-NAME when it defaults to True)
HELP = {
    "corpus": "corpus (.jsonl.xz of documents)",
    "tokenizer": "tokenizer.json",
    "out": "output checkpoint directory",
    "minutes": "training time budget in minutes (default: 7.5, or no limit when --steps is given)",
    "wall_minutes": "stop training early enough that the whole process ends within this (0: off)",
    "steps": "fixed step count (0: from the time budget)",
    "device": "cpu, cuda or cuda:N ('': cuda when available)",
    "seed": "init and data order seed",
    "batch_size": "windows per step",
    "seq_len": "tokens per window",
    "lr": "peak learning rate",
    "min_lr_ratio": "final lr / peak lr (cosine)",
    "warmup": "warm-up steps (at most a tenth of the run's steps)",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient norm clip (0: none)",
    "mtp_weight": "weight of the MTP loss",
    "dropout": "residual dropout",
    "log_every": "log every N steps",
    "n_evals": "validation evaluations in the run",
    "eval_max_tokens": "tokens per validation evaluation during training (0: the whole split); the final "
                       "evaluations are of the whole splits, except with --wall-minutes",
    "fla": "fla GDN kernels (CUDA)",
    "check_fla": "skip the fla-vs-torch comparison on the first batch (default: compare)",
}
CHOICES = {"fla": ("auto", "on", "off")}
