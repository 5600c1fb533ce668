"""Random tiny checkpoints of the three families, in the Hugging Face layout (with mtp.*
weights and a byte-level tokenizer), so tests and users can run hyspec without downloads."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from hyspec.config import ModelConfig

# the file make_tiny leaves beside a checkpoint it wrote (`hyspec make-tiny --out` replaces only those)
MADE_BY_MAKE_TINY = "make_tiny.json"

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, shown: str | Path | None = None) -> None:
    """safetensors' save_file, a failed write (a full disk, an I/O error) an OSError naming the
    file (`shown`: the name to give, e.g. a staged file's final one) and why: safetensors' own
    SafetensorError is no OSError, and the CLI reported it as a traceback."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type (not importable by name)
        if type(e).__name__ != "SafetensorError":
            raise
        why = (str(e).strip().splitlines() or [""])[0]
        why = why.split("I/O error: ", 1)[-1] or type(e).__name__  # ("Error while serializing: I/O error: ...")
        raise OSError(f"cannot write {shown or path}: {why}") from None

_SAMPLE_TEXT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
    "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n\n"
    "The quick brown fox jumps over the lazy dog. Hello, world! 0123456789\n"
)


def tiny_config(arch: str, *, vocab_size: int = 512, hidden: int = 64, layers: int = 4) -> dict:
    """config.json contents for a tiny model of `arch` (every 4th layer full attention)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    text = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 12,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
        "eos_token_id": 0,
        "hidden_act": "silu",
    }
    if arch == "qwen3_next":
        return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **text,
                "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden,
                "shared_expert_intermediate_size": hidden, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": [1]}
    if arch == "qwen3_5":
        return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **text}
    return {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", **text,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden,
            "shared_expert_intermediate_size": hidden}


def init_weights(model: torch.nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """HF-like random init: normal(0, std) matrices, identity norms, sane decays. Weights kept
    in block-FP8 (hyspec.quant.keep_fp8_params) get fp8 values ~ normal(0, 64) (clamped to
    the fp8 range) and every block scale std / 64: the same spread, one byte each."""
    from hyspec.quant import FP8_DTYPE, FP8_MAX, SCALE_SUFFIX

    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(SCALE_SUFFIX):
                buf.fill_(std / 64.0)
        for name, p in model.named_parameters():
            if p.dtype == FP8_DTYPE:
                flat = p.view(-1)
                step = 1 << 26  # bf16 staging of 128 MiB at a time, not a copy of the weight
                for i in range(0, flat.numel(), step):
                    chunk = flat[i: i + step]
                    tmp = torch.empty(chunk.shape, device=p.device, dtype=torch.bfloat16)
                    chunk.copy_(tmp.normal_(0.0, 64.0, generator=generator).clamp_(-FP8_MAX, FP8_MAX))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0, generator=generator).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name.split(".")[-2] or name.endswith(("_norm.weight", "norm.weight")):
                p.normal_(0.0, 0.1, generator=generator)  # zero-centred norms: small spread around identity
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)


def tiny_tokenizer(vocab_size: int):
    from hyspec.train.tokenizer_train import train_tokenizer

    return train_tokenizer([_SAMPLE_TEXT] * 4, vocab_size=vocab_size, min_frequency=1)


def _is_unquantized(key: str) -> bool:
    from hyspec.quant import UNQUANTIZED_LINEARS

    mod = key[: -len(".weight")] if key.endswith(".weight") else key
    return any(mod == s or mod.endswith("." + s) for s in UNQUANTIZED_LINEARS)


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) -> per-expert keys
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``, the layout ``save_pretrained`` writes."""
    out = {}
    for k, v in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p, inter = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{p}{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def quantize_fp8(tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Block-FP8 the way Qwen's -FP8 checkpoints are: every linear weight (and stacked expert
    tensor) becomes float8_e4m3fn + ``<key>_scale_inv``, except the ones Qwen leaves in bf16
    (hyspec.quant.UNQUANTIZED_LINEARS); norms, conv1d, A_log, dt_bias stay as they are.
    Returns (tensors, modules_to_not_convert)."""
    from hyspec.quant import quantize, scale_key_of

    out, skip = {}, []
    for k, v in tensors.items():
        stacked = k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        linear = (k.endswith(".weight") or stacked) and not k.endswith("conv1d.weight")
        if v.dim() >= 2 and v.is_floating_point() and linear:
            if _is_unquantized(k):
                skip.append(k[: -len(".weight")])
                out[k] = v
                continue
            q, sc = quantize(v, block)
            out[k], out[scale_key_of(k)] = q, sc
        else:
            out[k] = v
    return out, sorted(skip)


def make_tiny(arch: str, out: str | Path, *, seed: int = 0, vocab_size: int = 512, hidden: int = 64,
              layers: int = 4, std: float = 0.02, with_mtp: bool = True, draft_vocab: int = 0,
              fp8: bool = False, fp8_block: tuple[int, int] = (128, 128), experts: str = "stacked",
              overrides: dict | None = None) -> Path:
    """Write a random checkpoint of `arch` to `out`: config.json, generation_config.json,
    model.safetensors (incl. mtp.* unless with_mtp=False; `mtp.d2t` with draft_vocab > 0)
    and tokenizer.json (only for
    vocab_size >= 300; smaller models are driven with token ids).

    experts: MoE experts ``stacked`` (gate_up_proj / down_proj) or ``per_expert``.
    overrides: config.json entries set over the tiny config's (e.g. head sizes).
    fp8: block-quantize it like Qwen's -FP8 checkpoints (float8_e4m3fn weights,
    ``*_scale_inv`` per fp8_block block, ``quantization_config`` in config.json)."""
    out = Path(out)
    shards = sorted(p.name for p in out.glob("model*.safetensors*") if p.name != "model.safetensors") \
        if out.is_dir() else []
    if shards:  # (the loader prefers a shard index: the other checkpoint's weights loaded under this config)
        raise ValueError(f"{out} holds another checkpoint's shards ({', '.join(shards[:3])}"
                         f"{', ...' if len(shards) > 3 else ''}); make-tiny writes one model.safetensors: give a new "
                         "or empty directory")

    from hyspec.model.hybrid import HybridLM

    if draft_vocab and not with_mtp:
        raise ValueError("a reduced draft vocabulary (draft_vocab) needs the MTP head; drop with_mtp=False (--no-mtp)")
    if draft_vocab and not 0 < draft_vocab <= vocab_size:
        raise ValueError(f"draft_vocab must be in 1..{vocab_size} (the vocabulary size), got {draft_vocab}")
    if experts not in ("stacked", "per_expert"):
        raise ValueError(f"experts must be 'stacked' or 'per_expert', got {experts!r}")
    cfg_dict = tiny_config(arch, vocab_size=vocab_size, hidden=hidden, layers=layers)
    cfg_dict.update(overrides or {})
    if not with_mtp:
        cfg_dict["mtp_num_hidden_layers"] = 0
    cfg = ModelConfig.from_dict(cfg_dict)
    g = torch.Generator().manual_seed(seed)
    model = HybridLM(cfg, with_mtp=with_mtp)
    init_weights(model, g, std)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if draft_vocab:
        # a reduced draft vocabulary: the drafter scores these ids only (EAGLE-style offsets)
        ids = torch.randperm(vocab_size, generator=g)[:draft_vocab].sort().values
        tensors["mtp.d2t"] = ids - torch.arange(draft_vocab)
    if experts == "per_expert":
        tensors = _per_expert(tensors)
    if fp8:
        from hyspec.quant import Fp8BlockConfig

        tensors, skip = quantize_fp8(tensors, tuple(fp8_block))
        qcfg = Fp8BlockConfig(block=tuple(fp8_block), modules_to_not_convert=tuple(skip))
        cfg_dict["quantization_config"] = qcfg.to_dict()
    out.mkdir(parents=True, exist_ok=True)  # only once everything is built: a refused call leaves no folder
    try:
        marker = out / MADE_BY_MAKE_TINY  # first: a run cut short leaves a folder the next make-tiny may replace
        marker.unlink(missing_ok=True)  # (made afresh: its mode is the umask's, the weights file's below)
        marker.write_text(json.dumps({"arch": arch, "seed": seed}) + "\n")
        if vocab_size < 300:  # an earlier checkpoint's tokenizer here would be loaded with this one (and refuse its ids)
            (out / "tokenizer.json").unlink(missing_ok=True)
        save_safetensors(tensors, out / "model.safetensors")
        # (safetensors creates the file for its owner only: the mode a new file gets, as the others)
        os.chmod(out / "model.safetensors", marker.stat().st_mode & 0o777)
        (out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}, indent=2))
        if vocab_size >= 300:  # a byte-level BPE needs the 256 byte tokens plus some merges
            try:
                tiny_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
            except Exception as e:  # noqa: BLE001 - tokenizers' write error is a bare Exception ("No space
                if type(e) is not Exception:  # left on device (os error 28)"): the CLI showed its traceback
                    raise
                raise OSError(f"cannot write {out / 'tokenizer.json'}: {e}") from None
    except OSError as e:  # (a full disk: "[Errno 28] No space left on device" named no file)
        if e.filename is None and e.strerror:
            raise OSError(f"cannot write the checkpoint to {out}: {e.strerror}") from None
        raise
    return out
