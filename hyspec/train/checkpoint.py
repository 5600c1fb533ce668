"""The written checkpoint: HF layout (config.json, generation_config.json, model.safetensors
in bf16 with A_log and dt_bias kept fp32, tokenizer.json) and its size."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from hyspec.config import ModelConfig
from hyspec.model.hybrid import HybridLM
from hyspec.tiny import MADE_BY_MAKE_TINY, save_safetensors
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


def stage_checkpoint(model: HybridLM, cfg_dict: dict, out: str | Path, tokenizer: str | Path | None,
                     staged: dict | None = None) -> dict:
    """Write the checkpoint's files beside their final names in `out` and return `staged`
    ({name: partial file}, filled as they are written, so a caller's clean-up sees every one);
    `commit_checkpoint` renames them into place. A failure (or Ctrl-C) part-way removes the
    partial files written so far and leaves `out` as it was."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in model.state_dict().items():
        v = v.detach().to("cpu")
        tensors[k] = (v.float() if _keep_fp32(k) else v.to(torch.bfloat16)).contiguous()
    parts = {"model.safetensors": lambda f: save_safetensors(tensors, f, out / "model.safetensors"),
             "config.json": lambda f: f.write_text(json.dumps(cfg_dict, indent=2) + "\n"),
             "generation_config.json": lambda f: f.write_text(json.dumps({"eos_token_id": EOS_ID}, indent=2) + "\n")}
    if tokenizer is not None:
        parts["tokenizer.json"] = lambda f: shutil.copyfile(tokenizer, f)
    staged = {} if staged is None else staged
    try:
        for name, write in parts.items():
            staged[name] = out / f".{name}.partial"
            try:
                write(staged[name])
            except OSError as e:  # (a full disk: "[Errno 28] No space left on device" named no file)
                if not e.strerror or e.filename is not None:  # (save_safetensors' line, or one naming its file)
                    raise
                raise OSError(f"cannot write {out / name}: {e.strerror}") from None
        # (safetensors creates its file for its owner only, 0600: the weights get the mode a new file
        # gets here, as config.json and the others have, so whoever may read the checkpoint can load it)
        os.chmod(staged["model.safetensors"], staged["config.json"].stat().st_mode & 0o777)
    except BaseException:
        discard_staged(staged)
        raise
    return staged


def discard_staged(staged: dict) -> None:
    for f in staged.values():
        Path(f).unlink(missing_ok=True)


@contextmanager
def _sigint_held(deliver: bool = True):
    """A Ctrl-C inside the block takes effect at its end (the handler in place before it then
    runs; deliver=False: it is dropped, the work it would have stopped being done), so the
    block's renames are never cut halfway. Off the main thread (no signals reach it) it holds
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if pressed and deliver and callable(old):
        old(signal.SIGINT, None)


def commit_checkpoint(out: str | Path, staged: dict, late_ctrl_c: bool = True) -> Path:
    """Rename staged files into place in `out`, with Ctrl-C held for the renames: a checkpoint
    is the old one or the new one, never a mix (a model.safetensors of one run beside the
    config.json of another). A train_log.json not among them goes (it was an earlier run's), and
    so does make-tiny's marker (the trained weights are not a make-tiny checkpoint it may replace).
    late_ctrl_c: a Ctrl-C during the renames raises after them (False: it is dropped; for a
    caller whose work ends with the write, which a late "interrupted" would misreport)."""
    out = Path(out)
    with _sigint_held(deliver=late_ctrl_c):
        if "train_log.json" not in staged:
            (out / "train_log.json").unlink(missing_ok=True)
        (out / MADE_BY_MAKE_TINY).unlink(missing_ok=True)
        for name, f in staged.items():
            Path(f).replace(out / name)
    return out


def save_checkpoint(model: HybridLM, cfg_dict: dict, out: str | Path, tokenizer: str | Path | None) -> Path:
    """Write the checkpoint to `out` (stage_checkpoint then commit_checkpoint): a save
    interrupted part-way leaves an older checkpoint in `out` whole."""
    return commit_checkpoint(out, stage_checkpoint(model, cfg_dict, out, tokenizer))
