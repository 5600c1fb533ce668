"""Train the default hyspec model: a small Qwen3.5-style dense hybrid with one MTP layer.

The model is ``HybridLM`` itself (same parameters, same names); training runs a *batched*
forward built from the modules' own parameters and row-wise sub-functions:

* row-wise parts (projections, norms, MLP, the GDN gated norm) run on flattened [B*T, H];
* the depthwise causal conv is ``F.conv1d(groups=C)`` over a left pad of W-1, then SiLU;
* the Gated-DeltaNet recurrence is flash-linear-attention's ``chunk_gated_delta_rule`` on
  CUDA when ``fla`` is importable and usable for training, else ``chunked_scan_batched`` (our
  torch ``chunked_scan`` math batched over sequences, autograd). fla 0.6.0 refuses its gated
  backward on Hopper (H100/H200) with 3.4 <= Triton < 3.7.1 unless TileLang is installed
  (fla issue #640); that case is detected up front and the torch path is used. Before
  training, a first-batch comparison of fla vs torch (loss, logits, gradients) guards the
  kernel path and falls back to torch if they disagree or fla raises;
* full attention is ``F.scaled_dot_product_attention(is_causal=True)`` with our q/k norms,
  partial RoPE and sigmoid output gate.

Loss = CE(next token) + mtp_weight * CE(MTP), where MTP row i is fed exactly as inference
feeds the drafter, ``fc(cat(norm_e(embed(t_{i+1})), norm_h(h_i)))`` with h_i the target's
output of ``model.norm``, at RoPE position i, and predicts t_{i+2}.

CLI (one command on a GPU machine reproduces ``hyspec/default_model``)::

    python -m hyspec.train.train --corpus data/pystdlib_corpus.jsonl.xz \\
        --tokenizer data/tokenizer/tokenizer.json --out DIR --minutes 7.5 [--device cuda] [--seed 0]

It prints a loss-curve line every ``--log-every`` steps, evaluates held-out loss /
perplexity / top-1 accuracy (target and MTP) after training, and writes an HF-layout
checkpoint: config.json, generation_config.json, model.safetensors (bf16; A_log and
dt_bias kept fp32), tokenizer.json and train_log.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from hyspec.config import FULL, LINEAR, ModelConfig
from hyspec.model.attention import GatedAttention
from hyspec.model.gdn import GatedDeltaNet, chunked_scan, l2norm
from hyspec.model.hybrid import DecoderLayer, HybridLM
from hyspec.model.ops import GatedRMSNorm, RMSNorm, apply_rope, rope_cos_sin

EOS_ID = 0
_PROCESS_START = time.time()
VAL_PERCENT = 3  # train-split documents kept out of training to pick the best checkpoint

# ---------------------------------------------------------------------------------------
# Model config
# ---------------------------------------------------------------------------------------
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


def _keep_fp32(name: str) -> bool:
    return name.endswith(("A_log", "dt_bias"))


def checkpoint_tensor_bytes(cfg: ModelConfig | dict, with_mtp: bool = True) -> int:
    """Bytes of tensor data in the written model.safetensors (bf16; A_log/dt_bias fp32)."""
    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(cfg)
    with torch.device("meta"):
        m = HybridLM(cfg, with_mtp=with_mtp)
    return sum(p.numel() * (4 if _keep_fp32(n) else 2) for n, p in m.named_parameters())


# ---------------------------------------------------------------------------------------
# Init
# ---------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------
# Batched training forward (same math as HybridLM.forward / mtp_hidden, per sequence)
# ---------------------------------------------------------------------------------------
_FLA = None
FLA_UNUSABLE_REASON: str | None = None


def fla_kernel():
    """flash-linear-attention's chunk_gated_delta_rule, or None (lazy import). None also
    where fla itself refuses the training backward: on Hopper with 3.4 <= Triton < 3.7.1 and
    no TileLang, fla 0.6 raises in the gated chunk_bwd_dqkwg (fla issue #640)."""
    global _FLA, FLA_UNUSABLE_REASON
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            _FLA = chunk_gated_delta_rule
        except Exception as e:  # not installed / no triton
            _FLA, FLA_UNUSABLE_REASON = False, f"fla not importable ({e.__class__.__name__})"
        if _FLA:
            try:
                import importlib.util

                import fla.utils as fu

                bad = (getattr(fu, "IS_NVIDIA_HOPPER", False) and getattr(fu, "TRITON_ABOVE_3_4_0", False)
                       and not getattr(fu, "TRITON_ABOVE_3_7_1", True)
                       and importlib.util.find_spec("tilelang") is None)
            except Exception:
                bad = False
            if bad:
                _FLA = False
                FLA_UNUSABLE_REASON = ("fla refuses the gated backward on Hopper with Triton < 3.7.1 and no "
                                       "tilelang (fla #640)")
    return _FLA or None


def chunked_scan_batched(q, k, v, g, beta, chunk: int = 64) -> torch.Tensor:
    """The model's ``chunked_scan`` from a zero state over a batch of sequences:
    q, k [B, T, Hv, Dk] (l2-normed, expanded to value heads, q scaled), v [B, T, Hv, Dv],
    g, beta [B, T, Hv] -> o [B, T, Hv, Dv]. Runs in the inputs' dtype with autocast off."""
    with torch.autocast(q.device.type, enabled=False):
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1])
        return chunked_scan(q, k, v, g, beta, state, chunk)[0]


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def gdn_batched(mod: GatedDeltaNet, x: torch.Tensor, use_fla: bool) -> torch.Tensor:
    """x [B, T, H] -> [B, T, H]: GatedDeltaNet.forward for each sequence from a zero state."""
    B, T, _ = x.shape
    qkv, z, b, a = mod.project(_flat(x), None)  # [BT, C], [BT, Hv, Dv], [BT, Hv] x2
    C, W = qkv.shape[-1], mod.W
    w = mod.conv1d.weight.to(qkv.dtype)  # [C, 1, W]
    y = F.conv1d(F.pad(qkv.view(B, T, C).transpose(1, 2), (W - 1, 0)), w, groups=C)  # [B, C, T]
    y = F.silu(y).transpose(1, 2).reshape(B * T, C)
    nk, nv, dk, dv = mod.nk, mod.nv, mod.dk, mod.dv
    if use_fla:
        kern = fla_kernel()
        kd = nk * dk
        kdt = y.dtype  # bf16 under autocast, fp32 otherwise
        q = l2norm(y[:, :kd].float().view(B, T, nk, dk)).to(kdt)
        k = l2norm(y[:, kd:2 * kd].float().view(B, T, nk, dk)).to(kdt)
        v = y[:, 2 * kd:].reshape(B, T, nv, dv).to(kdt)
        beta = torch.sigmoid(b.float()).view(B, T, nv).to(kdt)
        g = (-mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias.float())).view(B, T, nv)
        # GVA: value head h reads key head h // (nv // nk), as repeat_interleave in prepare()
        o, _ = kern(q, k, v, g, beta, scale=dk ** -0.5, output_final_state=False)
        o = o.reshape(B * T, nv, dv)
    else:
        q, k, v, g, beta = mod.prepare(y, b, a)  # [BT, Hv, Dk] (expanded, q scaled), state dtype
        q, k, v = (t.view(B, T, nv, -1) for t in (q, k, v))
        o = chunked_scan_batched(q, k, v, g.view(B, T, nv), beta.view(B, T, nv))
        o = o.reshape(B * T, nv, dv)
    o = mod.norm(o.to(x.dtype), z)  # [BT, Hv, Dv]
    return mod.out_proj(o.reshape(B * T, nv * dv)).view(B, T, -1)


def attn_batched(mod: GatedAttention, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H] -> [B, T, H]: GatedAttention.forward (no cache, start 0) per sequence."""
    B, T, _ = x.shape
    D, nh, nkv = mod.head_dim, mod.n_heads, mod.n_kv
    xf = _flat(x)
    qg = mod.q_proj(xf).view(B, T, nh, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    q = mod.q_norm(q)
    k = mod.k_norm(mod.k_proj(xf).view(B, T, nkv, D))
    v = mod.v_proj(xf).view(B, T, nkv, D)
    cos, sin = rope_cos_sin(torch.arange(T, device=x.device), mod.rot_dim, mod.theta, x.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    dt = v.dtype
    q, k, v = (t.to(dt).transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
    if nh != nkv:
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D ** -0.5)
    out = out.transpose(1, 2).reshape(B * T, nh * D)
    out = out * torch.sigmoid(gate.reshape(B * T, nh * D))
    return mod.o_proj(out).view(B, T, -1)


def layer_batched(layer: DecoderLayer, x: torch.Tensor, use_fla: bool, dropout: float = 0.0) -> torch.Tensor:
    """DecoderLayer.forward over [B, T, H] (dropout on the two residual branches, training only)."""
    B, T, H = x.shape
    h = layer.input_layernorm(x)
    if layer.layer_type == FULL:
        h = attn_batched(layer.self_attn, h)
    else:
        h = gdn_batched(layer.linear_attn, h, use_fla)
    if dropout:
        h = F.dropout(h, dropout, training=True)
    x = x + h
    m = layer.mlp(_flat(layer.post_attention_layernorm(x))).view(B, T, H)
    if dropout:
        m = F.dropout(m, dropout, training=True)
    return x + m


def resolve_fla(x: torch.Tensor, use_fla: bool | None) -> bool:
    if use_fla is None:
        use_fla = x.is_cuda and fla_kernel() is not None
    if use_fla and fla_kernel() is None:
        raise RuntimeError(f"use_fla=True but fla's kernel is unusable here: {FLA_UNUSABLE_REASON}")
    return use_fla


def batched_hidden(model: HybridLM, ids: torch.Tensor, use_fla: bool | None = None,
                   dropout: float = 0.0) -> torch.Tensor:
    """ids [B, T] -> post-final-norm hidden [B, T, H] (= forward_hidden per sequence)."""
    if model.cfg.has_moe:
        raise NotImplementedError("batched training forward supports dense models only")
    x = model.model.embed_tokens(ids)
    use_fla = resolve_fla(x, use_fla)
    for layer in model.model.layers:
        x = layer_batched(layer, x, use_fla, dropout)
    return model.model.norm(x)


def batched_mtp_hidden(model: HybridLM, tokens: torch.Tensor, h_prev: torch.Tensor,
                       use_fla: bool | None = None, dropout: float = 0.0) -> torch.Tensor:
    """tokens [B, T'] (t_{i+1}) paired with h_prev [B, T', H] (h_i) -> MTP hidden [B, T', H]
    (= mtp_hidden(tokens, h_prev, StepCtx(start=0), None) per sequence)."""
    mtp = model.mtp
    e = model.model.embed_tokens(tokens)
    x = torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(h_prev)], dim=-1)
    B, T, _ = x.shape
    x = mtp.fc(_flat(x)).view(B, T, -1)
    x = layer_batched(mtp.layers[0], x, resolve_fla(x, use_fla), dropout)
    return mtp.norm(x)


def batched_logits(model: HybridLM, h: torch.Tensor) -> torch.Tensor:
    """h [..., H] -> fp32 logits [..., V] through the (tied) LM head."""
    return F.linear(h, model.head_weight).float()


def loss_fn(model: HybridLM, win: torch.Tensor, mtp_weight: float, use_fla: bool | None = None,
            dropout: float = 0.0, mask: torch.Tensor | None = None) -> dict:
    """win [B, T+2] token windows. Target rows i < T predict win[i+1] from win[:i+1]; MTP
    row i takes (win[i+1], h_i) and predicts win[i+2]. mask [B, T+2] (optional) marks real
    tokens; a row counts when its target is real. Returns sums and counts (for eval) and
    the training loss."""
    T = win.shape[1] - 2
    ids = win[:, :T]
    h = batched_hidden(model, ids, use_fla, dropout)
    logits = batched_logits(model, h)
    V = logits.shape[-1]
    tgt = win[:, 1:T + 1]
    ce = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), reduction="none").view_as(tgt)
    out = {"logits": logits}
    m1 = torch.ones_like(ce) if mask is None else mask[:, 1:T + 1].to(ce.dtype)
    out["main_sum"], out["main_n"] = (ce * m1).sum(), m1.sum()
    out["main_correct"] = ((logits.argmax(-1) == tgt).to(ce.dtype) * m1).sum()
    loss = out["main_sum"] / m1.sum().clamp_min(1)
    out["main"] = loss
    if model.has_mtp:
        hm = batched_mtp_hidden(model, win[:, 1:T + 1], h, use_fla, dropout)
        ml = batched_logits(model, hm)
        tgt2 = win[:, 2:T + 2]
        ce2 = F.cross_entropy(ml.reshape(-1, V), tgt2.reshape(-1), reduction="none").view_as(tgt2)
        m2 = torch.ones_like(ce2) if mask is None else mask[:, 2:T + 2].to(ce2.dtype)
        out["mtp_sum"], out["mtp_n"] = (ce2 * m2).sum(), m2.sum()
        out["mtp_correct"] = ((ml.argmax(-1) == tgt2).to(ce2.dtype) * m2).sum()
        out["mtp"] = out["mtp_sum"] / m2.sum().clamp_min(1)
        out["mtp_logits"] = ml
        loss = loss + mtp_weight * out["mtp"]
    out["loss"] = loss
    return out


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------
def is_val_doc(path: str) -> bool:
    h = int.from_bytes(hashlib.sha256(("val:" + path).encode()).digest(), "big")
    return h % 100 < VAL_PERCENT


def load_streams(corpus: str | Path, tokenizer: str | Path) -> dict[str, torch.Tensor]:
    """{'train', 'val', 'heldout'}: int64 token streams, documents (in corpus order) each
    followed by EOS. 'val' = ~3% of the corpus's train split, kept out of training."""
    from tokenizers import Tokenizer

    from hyspec.train.corpus import load_corpus

    tok = Tokenizer.from_file(str(tokenizer))
    splits = load_corpus(corpus)
    docs = {"train": [], "val": [], "heldout": [t for _, t in splits["heldout"]]}
    for p, t in splits["train"]:
        docs["val" if is_val_doc(p) else "train"].append(t)
    out = {}
    for name, texts in docs.items():
        enc = tok.encode_batch(texts, add_special_tokens=False) if texts else []
        ids: list[int] = []
        for e in enc:
            ids.extend(e.ids)
            ids.append(EOS_ID)
        out[name] = torch.tensor(ids, dtype=torch.long)
    return out


class WindowSampler:
    """Deterministic epochs of windows of `win` tokens: each epoch draws a random offset in
    [0, stride) and a random order of the windows starting at offset + k*stride."""

    def __init__(self, stream: torch.Tensor, win: int, stride: int, batch: int, seed: int) -> None:
        if stream.numel() < win + batch * stride:
            raise ValueError(f"training stream of {stream.numel()} tokens is too short for "
                             f"{batch} windows of {win}")
        self.stream, self.win, self.stride, self.batch = stream, win, stride, batch
        self.g = torch.Generator().manual_seed(seed)
        self.epoch, self.starts, self.pos = 0, None, 0
        self.ar = torch.arange(win, device=stream.device)
        self._new_epoch()

    def _new_epoch(self) -> None:
        off = int(torch.randint(0, self.stride, (1,), generator=self.g))
        starts = torch.arange(off, self.stream.numel() - self.win + 1, self.stride)
        self.starts = starts[torch.randperm(starts.numel(), generator=self.g)]
        self.pos = 0
        self.epoch += 1

    def next(self) -> torch.Tensor:
        if self.pos + self.batch > self.starts.numel():
            self._new_epoch()
        s = self.starts[self.pos:self.pos + self.batch].to(self.stream.device)
        self.pos += self.batch
        return self.stream[s[:, None] + self.ar]

    @property
    def epochs_done(self) -> float:
        return self.epoch - 1 + self.pos / self.starts.numel()


def eval_windows(stream: torch.Tensor, T: int, max_tokens: int | None = None):
    """Non-overlapping coverage of `stream`: windows [s, s+T+2) for s = 0, T, 2T, ... with
    a mask (0 past the end). Each target token is counted once per head."""
    n = stream.numel() if max_tokens is None else min(stream.numel(), max_tokens)
    stream = stream[:n]
    wins, masks = [], []
    for s in range(0, n - 1, T):
        w = stream[s:s + T + 2]
        m = torch.ones(T + 2, dtype=torch.bool)
        if w.numel() < T + 2:
            m[w.numel():] = False
            w = torch.cat([w, w.new_full((T + 2 - w.numel(),), EOS_ID)])
        wins.append(w)
        masks.append(m)
    return torch.stack(wins), torch.stack(masks)


@torch.no_grad()
def evaluate(model: HybridLM, stream: torch.Tensor, T: int, batch: int, device, mtp_weight: float,
             use_fla: bool | None, amp: bool, max_tokens: int | None = None) -> dict:
    """Held-out next-token / MTP loss (nats per token), perplexity and top-1 accuracy."""
    wins, masks = eval_windows(stream, T, max_tokens)
    tot = {k: 0.0 for k in ("main_sum", "main_n", "main_correct", "mtp_sum", "mtp_n", "mtp_correct")}
    for i in range(0, wins.shape[0], batch):
        w, m = wins[i:i + batch], masks[i:i + batch]
        if w.shape[0] < batch:  # keep one batch shape (kernel autotune caches); pad rows are masked
            pad = batch - w.shape[0]
            w = torch.cat([w, w[:1].expand(pad, -1)])
            m = torch.cat([m, torch.zeros(pad, m.shape[1], dtype=torch.bool)])
        w, m = w.to(device), m.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            o = loss_fn(model, w, mtp_weight, use_fla, 0.0, m)
        for k in tot:
            if k in o:
                tot[k] += float(o[k])
    res = {"tokens": int(tot["main_n"]), "loss": tot["main_sum"] / max(tot["main_n"], 1),
           "top1": tot["main_correct"] / max(tot["main_n"], 1)}
    res["ppl"] = math.exp(res["loss"])
    if model.has_mtp:
        res["mtp_loss"] = tot["mtp_sum"] / max(tot["mtp_n"], 1)
        res["mtp_ppl"] = math.exp(res["mtp_loss"])
        res["mtp_top1"] = tot["mtp_correct"] / max(tot["mtp_n"], 1)
    return res


# ---------------------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------------------
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
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}, indent=2) + "\n")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    return out


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------
@dataclass
class TrainArgs:
    corpus: str = "data/pystdlib_corpus.jsonl.xz"
    tokenizer: str = "data/tokenizer/tokenizer.json"
    out: str = "runs/default_model"
    minutes: float = 7.5
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
    arch: dict = field(default_factory=lambda: dict(DEFAULT_ARCH))


def lr_at(step: int, total: int, a: TrainArgs) -> float:
    warm = min(a.warmup, max(1, total // 10))
    if step < warm:
        return a.lr * (step + 1) / warm
    p = min(1.0, (step - warm) / max(1, total - warm))
    lo = a.lr * a.min_lr_ratio
    return lo + 0.5 * (a.lr - lo) * (1.0 + math.cos(math.pi * p))


def _param_groups(model: HybridLM, wd: float):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.dim() >= 2 and "embed_tokens" not in n and not n.endswith("conv1d.weight"):
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# bytes of saved activations per training token and layer, in units of 4 * hidden (fp32),
# and per token in units of 4 * vocab (the two heads' logits, softmax and their grads);
# measured on the CPU with the default model (0.74 MB per token at batch 1..4 x 512..2048)
_ACT_PER_LAYER_HIDDEN = 64
_ACT_PER_VOCAB = 6
_FIXED_BYTES = 1 << 30  # interpreter, torch, the token streams


def _train_memory_terms(a: TrainArgs, vocab_size: int) -> tuple[int, int]:
    """(bytes independent of the batch, bytes per training token)."""
    cfg = ModelConfig.from_dict(model_config(vocab_size, **a.arch))
    per_token = 4 * ((cfg.num_hidden_layers + 1) * _ACT_PER_LAYER_HIDDEN * cfg.hidden_size
                     + _ACT_PER_VOCAB * vocab_size)
    return 16 * count_params(cfg) + _FIXED_BYTES, per_token


def estimate_train_bytes(a: TrainArgs, vocab_size: int, device: str | torch.device = "cpu") -> int:
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


def check_train_memory(a: TrainArgs, vocab_size: int, device) -> None:
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


def train(a: TrainArgs, streams: dict[str, torch.Tensor] | None = None, log=print) -> dict:
    """Train, evaluate and write the checkpoint to a.out. Returns the log dict."""
    t_start = time.time()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    torch.manual_seed(a.seed)
    if cuda:
        torch.cuda.manual_seed_all(a.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    use_fla = {"auto": None, "on": True, "off": False}[a.fla]
    if use_fla is None:
        use_fla = cuda and fla_kernel() is not None
    amp = cuda

    from tokenizers import Tokenizer

    if not Path(a.tokenizer).is_file():
        raise FileNotFoundError(f"--tokenizer {a.tokenizer} does not exist")
    vocab = Tokenizer.from_file(str(a.tokenizer)).get_vocab_size(with_added_tokens=True)
    check_train_memory(a, vocab, device)  # before anything large is allocated
    if streams is None:
        if not Path(a.corpus).is_file():
            raise FileNotFoundError(f"--corpus {a.corpus} does not exist")
        streams = load_streams(a.corpus, a.tokenizer)
    log(f"data: train {streams['train'].numel():,} tokens, val {streams['val'].numel():,}, "
        f"heldout {streams['heldout'].numel():,} ({time.time() - t_start:.1f}s)")

    cfg_dict = model_config(vocab, **a.arch)
    cfg = ModelConfig.from_dict(cfg_dict)
    model = HybridLM(cfg, with_mtp=True)
    init_params(model, a.seed)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    ckpt_bytes = checkpoint_tensor_bytes(cfg)
    log(f"model: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers} ({''.join('A' if t == FULL else 'L' for t in cfg.layer_types)}) "
        f"+ MTP, {n_params:,} params, {ckpt_bytes / 1e6:.2f} MB tensors; device {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if cuda else ''}; GDN recurrence: "
        f"{'fla chunk_gated_delta_rule' if use_fla else 'torch chunked_scan (batched)'}"
        f"{'' if use_fla or not FLA_UNUSABLE_REASON else ' -- ' + FLA_UNUSABLE_REASON}")

    opt_kw = {"fused": True} if cuda else {}
    opt = torch.optim.AdamW(_param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **opt_kw)
    T, B = a.seq_len, a.batch_size
    train_stream = streams["train"].to(device)
    sampler = WindowSampler(train_stream, T + 2, T, B, a.seed)
    budget = a.minutes * 60.0
    reserve = 25.0  # seconds kept for the final evals and the save under --wall-minutes
    total = a.steps if a.steps > 0 else 0
    eval_kw = dict(T=T, batch=B, device=device, mtp_weight=a.mtp_weight, use_fla=use_fla, amp=amp,
                   max_tokens=a.eval_max_tokens or None)

    history, val_hist = [], []
    best = {"val_loss": float("inf"), "step": -1, "state": None}

    def run_val(step: int) -> float:
        t0 = time.time()
        model.eval()
        r = evaluate(model, streams["val"], **eval_kw)
        model.train()
        dt = time.time() - t0
        score = r["loss"] + a.mtp_weight * r.get("mtp_loss", 0.0)
        val_hist.append({"step": step, "tokens": step * B * T, **r, "score": score, "seconds": round(dt, 2)})
        log(f"  val @ step {step}: loss {r['loss']:.4f} (ppl {r['ppl']:.2f}, top1 {r['top1']:.3f})"
            f" mtp {r.get('mtp_loss', float('nan')):.4f} (top1 {r.get('mtp_top1', float('nan')):.3f}) [{dt:.1f}s]")
        if score < best["val_loss"]:
            best.update(val_loss=score, step=step,
                        state={k: v.detach().clone() for k, v in model.state_dict().items()})
        return dt

    model.train()
    if streams["val"].numel() > 1:
        run_val(0)
    kernel_check = None
    if use_fla and a.check_fla:
        t_chk = time.time()
        try:
            kernel_check = compare_gdn_paths(model, sampler.next()[:4], a.mtp_weight, amp)
            ok = (abs(kernel_check["loss_fla"] - kernel_check["loss_torch"]) < 0.02
                  and abs(kernel_check["mtp_fla"] - kernel_check["mtp_torch"]) < 0.02
                  and kernel_check["grad_rel_err"] < 0.1 and kernel_check["gdn_grad_rel_err_max"] < 0.25)
        except Exception as e:  # a kernel that fails here would fail in training too
            kernel_check, ok = {"error": repr(e)}, False
        kernel_check["ok"] = ok
        kernel_check["seconds"] = round(time.time() - t_chk, 1)
        log(f"fla vs torch GDN check (first batch, 4 rows): {json.dumps(kernel_check)}")
        if not ok:
            use_fla = False
            eval_kw["use_fla"] = False
            log("WARNING: fla kernel disagrees with the torch reference; training with torch chunked_scan")
        sampler = WindowSampler(train_stream, T + 2, T, B, a.seed)  # the check does not consume data
    if a.wall_minutes > 0:
        left = a.wall_minutes * 60.0 - (time.time() - _PROCESS_START) - reserve
        if left < budget:
            log(f"wall-clock limit {a.wall_minutes:g} min: training budget cut to {left:.0f}s")
            budget = max(0.0, left)
    n_val_batches = math.ceil(eval_windows(streams["val"], T, eval_kw["max_tokens"])[0].shape[0] / B) \
        if streams["val"].numel() > 1 else 0
    t0 = time.time()
    st = {"step": 0, "total": total, "eval_every": max(1, total // a.n_evals) if total else 0,
          "stopped": "steps"}

    def train_loop() -> None:
        acc = torch.zeros(3, device=device)  # loss, main, mtp sums since last log
        n_acc, t_log, t_calib = 0, time.time(), None
        calib = (10, 30)
        while True:
            step, total = st["step"], st["total"]
            if total and step >= total:
                return
            if time.time() - t0 > budget:
                st["stopped"] = "time budget"
                return
            lr = lr_at(step, total or 10 ** 9, a) if total or step < a.warmup else a.lr
            for gr in opt.param_groups:
                gr["lr"] = lr
            win = sampler.next()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                o = loss_fn(model, win, a.mtp_weight, use_fla, a.dropout)
            o["loss"].backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            acc += torch.stack([o["loss"].detach(), o["main"].detach(), o.get("mtp", o["main"]).detach()])
            n_acc += 1
            step = st["step"] = step + 1
            if not total and step == calib[0]:
                _sync(device)
                t_calib = time.time()
            if not total and step == calib[1]:
                _sync(device)
                per_step = (time.time() - t_calib) / (calib[1] - calib[0])
                eval_est = n_val_batches * 0.5 * per_step + 0.3  # a forward is ~1/3 of a step
                remaining = budget - (time.time() - t0) - a.n_evals * eval_est
                total = st["total"] = step + max(1, int(0.98 * remaining / per_step))
                st["eval_every"] = max(1, total // a.n_evals)
                log(f"timing: {per_step * 1000:.1f} ms/step ({B * T / per_step:,.0f} tok/s) -> {total} steps "
                    f"in the {budget:.0f}s budget ({total * B * T / train_stream.numel():.1f} epochs)")
            if step % a.log_every == 0 or step == total:
                _sync(device)
                now = time.time()
                tok_s = n_acc * B * T / (now - t_log)
                l, lm, lt = (acc / n_acc).tolist()
                history.append({"step": step, "tokens": step * B * T, "loss": l, "main_loss": lm, "mtp_loss": lt,
                                "lr": lr, "grad_norm": float(gn), "tok_s": tok_s,
                                "epoch": round(sampler.epochs_done, 3), "elapsed": round(now - t0, 1)})
                log(f"step {step:5d} tok {step * B * T:>11,d} loss {l:.4f} main {lm:.4f} mtp {lt:.4f} "
                    f"lr {lr:.2e} gn {float(gn):.2f} {tok_s:,.0f} tok/s ep {sampler.epochs_done:.2f} "
                    f"t {now - t0:.0f}s")
                acc.zero_()
                n_acc, t_log = 0, time.time()
                if not math.isfinite(l):
                    st["stopped"] = "non-finite loss"
                    return
            ee = st["eval_every"]
            if ee and step % ee == 0 and step != total and streams["val"].numel() > 1:
                run_val(step)
                t_log = time.time()

    try:
        train_loop()
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # keep what was learnt so far
        import traceback

        traceback.print_exc()
        st["stopped"] = f"error: {e!r}"[:300]
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
    step, total, stopped = st["step"], st["total"], st["stopped"]
    _sync(device)
    train_seconds = time.time() - t0
    peak_mem = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else 0.0
    log(f"training stopped ({stopped}) after {step} steps, {step * B * T:,} tokens, {train_seconds:.1f}s"
        f"{f', peak GPU memory {peak_mem:.1f} GiB' if cuda else ''}")
    if streams["val"].numel() > 1:
        if not val_hist or val_hist[-1]["step"] != step:
            run_val(step)
        if best["step"] != step:
            log(f"restoring best val checkpoint from step {best['step']}")
            model.load_state_dict(best["state"])
    chosen_step = best["step"] if best["step"] >= 0 else step
    round_to_bf16_(model)
    model.eval()
    final = {}
    for split in ("heldout", "val"):
        if streams[split].numel() > 1:
            final[split] = evaluate(model, streams[split], **eval_kw)
            r = final[split]
            log(f"final {split} ({r['tokens']:,} tokens, bf16 weights): loss {r['loss']:.4f} ppl {r['ppl']:.2f} "
                f"top1 {r['top1']:.4f} | mtp loss {r.get('mtp_loss', float('nan')):.4f} ppl "
                f"{r.get('mtp_ppl', float('nan')):.2f} top1 {r.get('mtp_top1', float('nan')):.4f}")
    out = save_checkpoint(model, cfg_dict, a.out, a.tokenizer)
    size = (out / "model.safetensors").stat().st_size
    train_tok_s = [h["tok_s"] for h in history[1:]] or [h["tok_s"] for h in history]
    result = {
        "args": {k: v for k, v in asdict(a).items()},
        "config": cfg_dict,
        "params": n_params,
        "tensor_bytes": ckpt_bytes,
        "safetensors_bytes": size,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if cuda else ""),
        "torch": torch.__version__,
        "gdn_kernel": "fla.chunk_gated_delta_rule" if use_fla else "torch chunked_scan_batched",
        "fla_unusable": None if use_fla else FLA_UNUSABLE_REASON,
        "kernel_check": kernel_check,
        "train_budget_s": round(budget, 1),
        "steps": step,
        "planned_steps": total,
        "stopped": stopped,
        "tokens_seen": step * B * T,
        "epochs": round(sampler.epochs_done, 3),
        "train_seconds": round(train_seconds, 1),
        "peak_gpu_mem_gib": round(peak_mem, 2),
        "median_tok_s": sorted(train_tok_s)[len(train_tok_s) // 2] if train_tok_s else None,
        "chosen_step": chosen_step,
        "data_tokens": {k: int(v.numel()) for k, v in streams.items()},
        "log": history,
        "val": val_hist,
        "final": final,
        "total_seconds": round(time.time() - t_start, 1),
    }
    (out / "train_log.json").write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out} (model.safetensors {size:,} bytes; {n_params:,} params) in {result['total_seconds']}s total")
    return result


def compare_gdn_paths(model: HybridLM, win: torch.Tensor, mtp_weight: float, amp: bool) -> dict:
    """Loss and gradients of one batch through the fla kernel and through torch chunked_scan
    (same autocast setting, no dropout)."""
    out = {}
    for name, flag in (("fla", True), ("torch", False)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            o = loss_fn(model, win, mtp_weight, use_fla=flag)
        o["loss"].backward()
        out[name] = (o["main"].item(), o["mtp"].item(), o["logits"].detach().float(),
                     {n: p.grad.detach().float().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    gf, gt = out["fla"][3], out["torch"][3]
    vf = torch.cat([gf[n].flatten() for n in gt])
    vt = torch.cat([gt[n].flatten() for n in gt])
    per = {n: float((gf[n] - gt[n]).norm() / gt[n].norm().clamp_min(1e-12)) for n in gt if "linear_attn" in n}
    worst = max(per, key=per.get) if per else None
    return {
        "loss_fla": out["fla"][0], "loss_torch": out["torch"][0],
        "mtp_fla": out["fla"][1], "mtp_torch": out["torch"][1],
        "logits_maxdiff": float((out["fla"][2] - out["torch"][2]).abs().max()),
        "logits_scale": float(out["torch"][2].abs().max()),
        "grad_rel_err": float((vf - vt).norm() / vt.norm()),
        "gdn_grad_rel_err_max": per[worst] if worst else 0.0,
        "gdn_grad_worst": worst,
    }


# ---------------------------------------------------------------------------------------
# GPU self-check: fla kernel path vs torch path, values and gradients
# ---------------------------------------------------------------------------------------
def selfcheck(device: str = "cuda") -> dict:
    from hyspec.tiny import tiny_config

    torch.manual_seed(0)
    d = tiny_config("qwen3_5", vocab_size=512, hidden=64, layers=4)
    d["linear_value_head_dim"] = 16  # fla wants power-of-two head dims
    cfg = ModelConfig.from_dict(d)
    model = HybridLM(cfg)
    init_params(model, 0)
    model.to(device)
    win = torch.randint(0, 512, (3, 202), device=device)
    res = {}
    grads = {}
    for name in ("fla", "torch"):
        model.zero_grad()
        o = loss_fn(model, win, 0.5, use_fla=(name == "fla"))
        o["loss"].backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
        res[name] = (float(o["main"]), float(o["mtp"]), o["logits"].detach(), o["mtp_logits"].detach())
    res_out = {
        "loss_fla": res["fla"][0], "loss_torch": res["torch"][0],
        "mtp_fla": res["fla"][1], "mtp_torch": res["torch"][1],
        "logits_maxdiff": float((res["fla"][2] - res["torch"][2]).abs().max()),
        "mtp_logits_maxdiff": float((res["fla"][3] - res["torch"][3]).abs().max()),
        "grad_rel_err": float((grads["fla"] - grads["torch"]).norm() / grads["torch"].norm()),
    }
    # the reference model's own forward on one sequence
    with torch.no_grad():
        ref = model(win[0, :200])
    res_out["vs_hybridlm_maxdiff"] = float((ref - res["fla"][2][0]).abs().max())
    return res_out


# ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> TrainArgs:
    from hyspec.cli import HelpFormatter

    d = TrainArgs()
    ap = argparse.ArgumentParser(prog="hyspec train", description="Train the default hyspec hybrid model (+MTP head). "
                                 "On the CPU the run is refused up front when its estimated memory does not fit.",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--corpus", default=d.corpus, help="corpus (.jsonl.xz of documents)")
    ap.add_argument("--tokenizer", default=d.tokenizer, help="tokenizer.json")
    ap.add_argument("--out", default=d.out, help="output checkpoint directory")
    ap.add_argument("--minutes", type=float, default=d.minutes, help="training time budget")
    ap.add_argument("--wall-minutes", type=float, default=d.wall_minutes,
                    help="stop training early enough that the whole process ends within this (0: off)")
    ap.add_argument("--steps", type=int, default=d.steps, help="fixed step count (0: from the time budget)")
    ap.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N ('': cuda when available)")
    ap.add_argument("--seed", type=int, default=d.seed, help="init and data order seed")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step")
    ap.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per window")
    ap.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    ap.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr (cosine)")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    ap.add_argument("--grad-clip", type=float, default=d.grad_clip, help="gradient norm clip")
    ap.add_argument("--mtp-weight", type=float, default=d.mtp_weight, help="weight of the MTP loss")
    ap.add_argument("--dropout", type=float, default=d.dropout, help="residual dropout")
    ap.add_argument("--log-every", type=int, default=d.log_every, help="log every N steps")
    ap.add_argument("--n-evals", type=int, default=d.n_evals, help="validation evaluations in the run")
    ap.add_argument("--eval-max-tokens", type=int, default=d.eval_max_tokens,
                    help="tokens per validation evaluation (0: the whole split)")
    ap.add_argument("--fla", choices=("auto", "on", "off"), default=d.fla, help="fla GDN kernels (CUDA)")
    ap.add_argument("--no-check-fla", dest="check_fla", action="store_false",
                    help="skip the fla-vs-torch comparison on the first batch (default: compare)")
    for k, v in DEFAULT_ARCH.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v, help=f"model: {k}")
    ap.add_argument("--selfcheck", action="store_true", help="compare the fla and torch GDN paths and exit")
    ns = ap.parse_args(argv)
    if ns.selfcheck:
        return ns  # type: ignore[return-value]
    kw = {k: getattr(ns, k) for k in TrainArgs.__dataclass_fields__ if k != "arch"}
    kw["arch"] = {k: getattr(ns, k) for k in DEFAULT_ARCH}
    return TrainArgs(**kw)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if isinstance(a, argparse.Namespace):
        print(json.dumps(selfcheck(a.device or "cuda"), indent=1))
        return 0
    train(a, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
