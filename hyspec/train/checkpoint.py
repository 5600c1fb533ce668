"""The written checkpoint: HF layout (config.json, generation_config.json, model.safetensors
in bf16 with A_log and dt_bias kept fp32, tokenizer.json) and its size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from hyspec.config import ModelConfig
from hyspec.model.hybrid import HybridLM
from hyspec.train.model import EOS_ID


def _keep_fp32(name: str) -> bool:
    return name.endswith(("A_log", "dt_bias"))


def checkpoint_tensor_bytes(cfg: ModelConfig | dict, with_mtp: bool = True) -> int:
    """Bytes of tensor data in the written model.safetensors (bf16; A_log/dt_bias fp32)."""
    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(cfg)
    with torch.device("meta"):
        m = HybridLM(cfg, with_mtp=with_mtp)
    return sum(p.numel() * (4 if _keep_fp32(n) else 2) for n, p in m.named_parameters())



def round_to_bf16_(model: HybridLM) -> None:
    """Round parameters to what the checkpoint stores (bf16, A_log/dt_bias fp32)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not _keep_fp32(n):
                p.copy_(p.to(torch.bfloat16).to(p.dtype))


def save_checkpoint(model: HybridLM, cfg_dict: dict, out: str | Path, tokenizer: str | Path | None) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in model.state_dict().items():
        v = v.detach().to("cpu")
        tensors[k] = (v.float() if _keep_fp32(k) else v.to(torch.bfloat16)).contiguous()
    # every file is written beside its final name and renamed once all are complete, so a save
    # interrupted part-way leaves an older checkpoint in `out` whole (and a train_log.json of an
    # earlier run goes, since the one of this run is written after the weights)
    parts = {"model.safetensors": lambda f: save_file(tensors, str(f), metadata={"format": "pt"}),
             "config.json": lambda f: f.write_text(json.dumps(cfg_dict, indent=2) + "\n"),
             "generation_config.json": lambda f: f.write_text(json.dumps({"eos_token_id": EOS_ID}, indent=2) + "\n")}
    if tokenizer is not None:
        parts["tokenizer.json"] = lambda f: shutil.copyfile(tokenizer, f)
    tmp = {name: out / f".{name}.partial" for name in parts}
    try:
        for name, write in parts.items():
            write(tmp[name])
    except BaseException:
        for f in tmp.values():
            f.unlink(missing_ok=True)
        raise
    (out / "train_log.json").unlink(missing_ok=True)
    for name, f in tmp.items():
        f.replace(out / name)
    return out
