"""FP8 block-quantized checkpoints (Qwen's "-FP8" format): the loader dequantizes
float8_e4m3fn weights with their per-block ``weight_scale_inv`` at load, for all three
families and both MoE expert layouts; malformed quantization configs and tensors fail
with errors naming the field or key.

Parity (stated tolerance): the FP8 checkpoint loaded by hyspec is *bitwise* the model
built directly from the same weights dequantized by an independent block-by-block loop
(so its log-probs are identical, tolerance 0); against the unquantized original it
differs by the FP8 rounding only (max |delta log-prob| under 0.15 on these tiny models;
measured 0.04-0.09)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyspec.config import ModelConfig
from hyspec.loading import CheckpointError, ConfigError, load_model, read_tensors
from hyspec.model.hybrid import HybridLM
from hyspec.quant import (
    FP8_DTYPE,
    QuantConfigError,
    dequantize,
    dequantize_tensors,
    parse_quantization_config,
    quantize,
)
from hyspec.tiny import make_tiny

TOKENS = torch.tensor([1, 17, 42, 99, 7, 250, 3, 88, 400, 12, 5, 301, 77, 64, 128, 9])

# (arch, expert layout, weight_block_size): Qwen's 128x128 blocks (every tiny matrix is one
# partial block, or two for qkvz) and a small non-square 32x48 block (many blocks, partial
# ones on both axes, catches a transposed scale grid)
CASES = [
    ("qwen3_next", "per_expert", (32, 48)),
    ("qwen3_next", "stacked", (128, 128)),
    ("qwen3_5", "stacked", (32, 48)),
    ("qwen3_5", "stacked", (128, 128)),
    ("qwen3_5_moe", "per_expert", (32, 48)),
    ("qwen3_5_moe", "stacked", (32, 48)),
    ("qwen3_5_moe", "per_expert", (128, 128)),
]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    cache: dict = {}

    def get(arch: str, experts: str = "stacked", block=(128, 128), fp8: bool = True) -> Path:
        key = (arch, experts, tuple(block), fp8)
        if key not in cache:
            d = root / f"{arch}_{experts}_{block[0]}x{block[1]}_{'fp8' if fp8 else 'fp32'}"
            cache[key] = make_tiny(arch, d, seed=3, fp8=fp8, fp8_block=tuple(block), experts=experts)
        return cache[key]

    return get


def ref_dequant(w: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """Block by block, written independently of hyspec.quant."""
    out = torch.empty(w.shape, dtype=torch.float32)
    R, C = w.shape[-2:]
    for i in range(math.ceil(R / block[0])):
        for j in range(math.ceil(C / block[1])):
            rs, cs = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[..., rs, cs] = w[..., rs, cs].float() * s[..., i, j, None, None].float()
    return out


def reference_model(d: Path) -> HybridLM:
    """HybridLM from the checkpoint's raw tensors, dequantized by ref_dequant and stacked here."""
    cfg = ModelConfig.from_dir(d)
    block = tuple(json.loads((d / "config.json").read_text())["quantization_config"]["weight_block_size"])
    raw = load_file(str(d / "model.safetensors"))
    sd = {}
    for k, v in raw.items():
        if k.endswith("_scale_inv"):
            continue
        sd[k] = ref_dequant(v, raw[k + "_scale_inv"], block) if v.dtype == FP8_DTYPE else v.float()
    experts: dict = {}
    for k in [k for k in sd if ".mlp.experts." in k and k.endswith("_proj.weight")]:
        pre, rest = k.split(".mlp.experts.")
        e, part = rest.split(".")[:2]
        experts.setdefault(pre, {}).setdefault(int(e), {})[part] = sd.pop(k)
    for pre, ex in experts.items():
        n = len(ex)
        sd[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([ex[e]["gate_proj"], ex[e]["up_proj"]]) for e in range(n)])
        sd[f"{pre}.mlp.experts.down_proj"] = torch.stack([ex[e]["down_proj"] for e in range(n)])
    m = HybridLM(cfg, with_mtp=True)
    m.load_state_dict(sd, strict=True)
    return m.eval().requires_grad_(False)


def logprobs(m: HybridLM) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(m(TOKENS), dim=-1)


# ---------------------------------------------------------------------------------------
# block (de)quantization
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,block", [((130, 200), (128, 128)), ((3, 64, 96), (128, 128)),
                                         ((5, 70, 33), (32, 48)), ((256, 384), (128, 128)),
                                         # blocks past the matrix's edge (one block): nothing is sized by the block
                                         # (a [10**12, 10**12] block tried to allocate 4 TB at load)
                                         ((70, 33), (10 ** 12, 10 ** 12)), ((130, 200), (64, 10 ** 9))])
def test_dequantize_matches_block_loop_with_edge_blocks(shape, block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 3
    q, s = quantize(w, block)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert s.shape[-2:] == (math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    d = dequantize(q, s, block)
    assert torch.equal(d, ref_dequant(q, s, block))
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step = scale * 2^-9
    step = ref_dequant(torch.ones(shape).to(FP8_DTYPE), s, block) * 2.0 ** -9
    assert ((d - w).abs() <= w.abs() * 2.0 ** -4 + step + 1e-12).all()


# ---------------------------------------------------------------------------------------
# parity: all three families, both expert layouts
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,experts,block", CASES)
def test_fp8_load_equals_dequantized_reference(ckpts, arch, experts, block):
    d = ckpts(arch, experts, block)
    raw = load_file(str(d / "model.safetensors"))
    n_fp8 = sum(v.dtype == FP8_DTYPE for v in raw.values())
    assert n_fp8 > 0 and all((k + "_scale_inv") in raw for k, v in raw.items() if v.dtype == FP8_DTYPE)
    if arch != "qwen3_5":
        assert any(".mlp.experts." in k for k, v in raw.items() if v.dtype == FP8_DTYPE)
        assert any(k.endswith(".experts.0.gate_proj.weight") for k in raw) == (experts == "per_expert")
    # what Qwen's FP8 checkpoints leave in bf16 stays unquantized here too
    for k, v in raw.items():
        if k.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight",
                       "in_proj_a.weight", "in_proj_b.weight", "in_proj_ba.weight", "conv1d.weight", "mtp.fc.weight",
                       "norm.weight", "A_log", "dt_bias")):
            assert v.dtype != FP8_DTYPE, k

    m = load_model(d, dtype="float32")
    ref = reference_model(d)
    pm, pr = dict(m.named_parameters()), dict(ref.named_parameters())
    assert pm.keys() == pr.keys()
    for k in pm:
        assert torch.equal(pm[k], pr[k]), k
    lp, lr = logprobs(m), logprobs(ref)
    assert torch.equal(lp, lr)  # stated tolerance: 0 (same fp32 weights, same code)

    # vs the unquantized original (same seed): only the FP8 rounding differs
    orig = load_model(ckpts(arch, experts, block, fp8=False), dtype="float32")
    diff = (logprobs(orig) - lp).abs().max().item()
    assert 0 < diff < 0.15, diff  # measured 0.04-0.09 (max |delta log-prob| over 16 x 512)


def test_fp8_loads_in_bf16(ckpts):
    d = ckpts("qwen3_5_moe", "per_expert", (128, 128))
    m = load_model(d, dtype="bfloat16")
    ref = load_model(d, dtype="float32")
    assert m.dtype == torch.bfloat16
    for (k, a), (_, b) in zip(m.named_parameters(), ref.named_parameters()):
        if k.endswith(("A_log", "dt_bias")):
            assert a.dtype == torch.float32
        else:
            assert torch.equal(a, b.to(torch.bfloat16)), k


def test_engine_memory_counts_the_kept_fp8_scales(ckpts):
    """Engine.memory's weight_bytes summed the parameters only: weights kept FP8 left out
    their block scales and row maps (buffers), which the bench's report counted."""
    from hyspec.engine import Engine

    for arch, block in (("qwen3_5_moe", (32, 48)), ("qwen3_next", (128, 128))):
        m = load_model(ckpts(arch, "per_expert", block), dtype="bfloat16", fp8="keep")
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in m.state_dict().values()}
        assert any(n.endswith("_scale_inv") for n, _ in m.named_buffers())
        assert Engine(m).memory(16)["weight_bytes"] == sum(held.values())


def test_keep_fp8_hook_returns_weights_and_scales(ckpts):
    """read_tensors(dequantize=False): the GPU path's hook gets the stored fp8 weights + scales."""
    d = ckpts("qwen3_5_moe", "per_expert", (32, 48))
    kept = read_tensors(d, dequantize=False)
    raw = load_file(str(d / "model.safetensors"))
    assert kept.keys() == raw.keys()
    bits = lambda t: t.view(torch.uint8) if t.dtype == FP8_DTYPE else t  # noqa: E731
    for k in raw:
        assert kept[k].dtype == raw[k].dtype and torch.equal(bits(kept[k]), bits(raw[k])), k
    from hyspec.loading import _stack_experts

    qcfg = parse_quantization_config(json.loads((d / "config.json").read_text()))
    deq = _stack_experts(dequantize_tensors(dict(kept), qcfg))
    full = read_tensors(d)
    assert deq.keys() == full.keys()
    assert all(torch.equal(deq[k], full[k]) for k in full)


def test_multimodal_prefix_and_nested_quantization_config(ckpts, tmp_path):
    """Qwen3.5 checkpoints as published: keys under model.language_model., config nested
    under text_config (quantization_config may sit on the wrapper or in text_config)."""
    src = ckpts("qwen3_5", "stacked", (128, 128))
    for where in ("outer", "text"):
        d = tmp_path / where
        d.mkdir()
        cfg = json.loads((src / "config.json").read_text())
        q = cfg.pop("quantization_config")
        q["modules_to_not_convert"] = [m.replace("model.", "model.language_model.", 1) for m in
                                       q["modules_to_not_convert"]]
        wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                   "text_config": {**cfg, "model_type": "qwen3_5_text"}}
        if where == "outer":
            wrapped["quantization_config"] = q
        else:
            wrapped["text_config"]["quantization_config"] = q
        (d / "config.json").write_text(json.dumps(wrapped))
        t = load_file(str(src / "model.safetensors"))
        t = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
             for k, v in t.items()}
        save_file(t, str(d / "model.safetensors"))
        m = load_model(d)
        ref = load_model(src)
        assert torch.equal(logprobs(m), logprobs(ref))


def test_make_tiny_fp8_cli(tmp_path):
    from hyspec.cli import main

    for arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        out = tmp_path / arch
        assert main(["make-tiny", "--arch", arch, "--out", str(out), "--fp8", "--fp8-block", "32,48",
                     "--experts", "per_expert"]) == 0
        q = json.loads((out / "config.json").read_text())["quantization_config"]
        assert q["quant_method"] == "fp8" and q["weight_block_size"] == [32, 48]
        assert q["activation_scheme"] == "dynamic" and "lm_head" in q["modules_to_not_convert"]
        load_model(out)


# ---------------------------------------------------------------------------------------
# errors name the field / key
# ---------------------------------------------------------------------------------------
@pytest.fixture()
def ckpt(ckpts, tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(ckpts("qwen3_5_moe", "stacked", (32, 48)), d)
    return d


def _set_q(d: Path, **kw) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in kw.items():
        if v is None:
            cfg["quantization_config"].pop(k, None)
        else:
            cfg["quantization_config"][k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("kw,match", [
    ({"quant_method": "awq"}, r"'quantization_config\.quant_method' is 'awq'"),
    ({"quant_method": None}, r"'quantization_config\.quant_method' is missing"),
    ({"activation_scheme": "static"}, r"'quantization_config\.activation_scheme' is 'static'"),
    ({"weight_block_size": None}, r"'quantization_config\.weight_block_size' is missing"),
    ({"weight_block_size": [128]}, r"'quantization_config\.weight_block_size' must be two positive integers"),
    ({"weight_block_size": [128, 0]}, r"'quantization_config\.weight_block_size' must be two positive integers"),
    ({"fmt": "e5m2"}, r"'quantization_config\.fmt' is 'e5m2'"),
    ({"scale_fmt": "ue8m0"}, r"'quantization_config\.scale_fmt' is 'ue8m0'"),
    ({"weight_per_tensor": True}, r"'quantization_config\.weight_per_tensor' is true"),
    ({"act_per_tensor": True}, r"'quantization_config\.act_per_tensor' is true"),
    # JSON true is no block size (Python's bool is an int: a block of 1 row), nor is 128.5
    ({"weight_block_size": [True, 128]}, r"'quantization_config\.weight_block_size' must be two positive integers"),
    ({"weight_block_size": [128.5, 128]}, r"'quantization_config\.weight_block_size' must be two positive integers"),
    ({"modules_to_not_convert": "lm_head"}, r"'quantization_config\.modules_to_not_convert' must be a list"),
    # vLLM's name for the list: named as the user wrote it (the message named modules_to_not_convert)
    ({"modules_to_not_convert": None, "ignored_layers": "lm_head"},
     r"'quantization_config\.ignored_layers' must be a list"),
])
def test_bad_quantization_config_is_named(ckpt, kw, match):
    _set_q(ckpt, **kw)
    with pytest.raises(QuantConfigError, match=match):
        load_model(ckpt)
    assert issubclass(QuantConfigError, ConfigError)


def test_nested_bad_quantization_config_names_text_config():
    with pytest.raises(QuantConfigError, match=r"'text_config\.quantization_config\.quant_method' is 'gptq'"):
        parse_quantization_config({"text_config": {"quantization_config": {"quant_method": "gptq"}}})
    with pytest.raises(QuantConfigError, match=r"'quantization_config' must be an object"):
        parse_quantization_config({"quantization_config": "fp8"})
    assert parse_quantization_config({"model_type": "qwen3_5"}) is None


def _edit(d: Path, fn) -> None:
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"))


KEY = "model.layers.0.linear_attn.in_proj_qkv.weight"
EXP = "model.layers.2.mlp.experts.gate_up_proj"


def test_missing_scale_is_named(ckpt):
    _edit(ckpt, lambda t: t.pop(KEY + "_scale_inv"))
    with pytest.raises(CheckpointError,
                       match=rf"'{KEY}' is float8_e4m3fn but its block scale '{KEY}_scale_inv' is missing"):
        load_model(ckpt)


def test_missing_stacked_expert_scale_is_named(ckpt):
    _edit(ckpt, lambda t: t.pop(EXP + "_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"block scale '{EXP}_scale_inv' is missing"):
        load_model(ckpt)


@pytest.mark.parametrize("fp8", ["dequantize", "keep"])
def test_scale_shape_mismatch_is_named(ckpt, fp8):
    def f(t):
        s = t[KEY + "_scale_inv"]
        t[KEY + "_scale_inv"] = torch.ones(s.shape[0] + 1, s.shape[1])
    _edit(ckpt, f)
    with pytest.raises(CheckpointError, match=rf"'{KEY}_scale_inv' has shape \[\d+, \d+\], expected \[\d+, \d+\] "
                                              rf"for weight shape \[112, 64\] and weight_block_size \[32, 48\]"):
        load_model(ckpt, fp8=fp8)


@pytest.mark.parametrize("fp8", ["dequantize", "keep"])
def test_an_integer_scale_grid_is_refused(ckpt, fp8):
    """Integer scales (0.0002 -> 0) zeroed every kept weight without a word (fp8="keep", the
    default on CUDA); the dequantizing path refused them."""
    _edit(ckpt, lambda t: t.update({KEY + "_scale_inv": t[KEY + "_scale_inv"].to(torch.int32)}))
    with pytest.raises(CheckpointError, match=rf"'{KEY}_scale_inv' has dtype torch.int32; expected float32"):
        load_model(ckpt, fp8=fp8)


@pytest.mark.parametrize("fp8", ["dequantize", "keep"])
@pytest.mark.parametrize("key", [KEY, EXP])
def test_a_nan_code_in_an_fp8_weight_is_named_as_damage(ckpt, fp8, key):
    """A float8 NaN code (0x7f / 0xff) in a weight: named at load by the dequantizing path, and
    loaded without a word by fp8="keep" (the default on CUDA), only its scales were checked."""
    def f(t):
        t[key].view(torch.uint8).view(-1)[5] = 0xFF
    _edit(ckpt, f)
    with pytest.raises(CheckpointError, match=rf"'{key}' holds NaN or infinite values: the checkpoint is damaged"):
        load_model(ckpt, fp8=fp8)


@pytest.mark.parametrize("fp8", ["dequantize", "keep"])
def test_the_positive_nan_code_in_an_fp8_weight_is_named_as_damage(ckpt, fp8):
    """float8_e4m3fn has two NaN codes, 0xff and 0x7f (S.1111.111): fp8="keep" checks the raw
    bytes, so 0x7f must count as damage as 0xff does."""
    _edit(ckpt, lambda t: t[KEY].view(torch.uint8).view(-1)[5].fill_(0x7F))
    with pytest.raises(CheckpointError, match=rf"'{KEY}' holds NaN or infinite values: the checkpoint is damaged"):
        load_model(ckpt, fp8=fp8)


@pytest.mark.parametrize("fp8", ["dequantize", "keep"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_infinite_block_scale_is_named_as_damage(ckpt, fp8, bad):
    """A NaN or infinite entry in a weight's scale grid decodes garbage for its whole block:
    fp8="keep" (the default on CUDA) holds the grid as stored, so it is checked at load, as
    the dequantizing path checks the product."""
    _edit(ckpt, lambda t: t[KEY + "_scale_inv"].view(-1)[1].fill_(bad))
    with pytest.raises(CheckpointError, match=rf"'{KEY}'( \(its block scales\))? holds NaN or infinite values: "
                                              r"the checkpoint is damaged"):
        load_model(ckpt, fp8=fp8)


@pytest.mark.parametrize("fp8", ["dequantize", "keep"])
@pytest.mark.parametrize("key", [KEY, EXP])
def test_a_negative_block_scale_is_named_as_damage(ckpt, fp8, key):
    """A block scale is its block's amax / 448, never negative: a negative one flipped its
    block's signs and the checkpoint decoded garbage without a word (both load paths)."""
    _edit(ckpt, lambda t: t[key + "_scale_inv"].view(-1)[1].mul_(-1))
    with pytest.raises(CheckpointError, match=rf"'{key}_scale_inv' holds negative block scales"):
        load_model(ckpt, fp8=fp8)


def test_a_weight_that_dequantizes_beyond_float16s_range_is_not_called_damage(ckpt):
    _edit(ckpt, lambda t: t[KEY + "_scale_inv"].view(-1)[0].fill_(1e4))
    with pytest.raises(CheckpointError, match=rf"'{KEY}' dequantizes to values up to .*beyond the range of "
                                              r"torch.float16 .*bfloat16 or float32"):
        load_model(ckpt, dtype="float16")
    load_model(ckpt, dtype="float32")


def test_scale_shape_of_other_block_size_is_rejected(ckpt):
    """A scale grid made for another block size does not silently dequantize."""
    _set_q(ckpt, weight_block_size=[128, 128])
    with pytest.raises(CheckpointError, match=r"_scale_inv' has shape .* weight_block_size \[128, 128\]"):
        load_model(ckpt)


def test_scale_without_weight_and_scale_of_unquantized_weight(ckpt):
    _edit(ckpt, lambda t: t.update({"model.layers.0.foo.weight_scale_inv": torch.ones(1, 1)}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.foo\.weight_scale_inv' is a block scale but its "
                                              r"weight 'model\.layers\.0\.foo\.weight' is missing"):
        load_model(ckpt)


def test_scale_of_unquantized_weight_is_named(ckpt):
    k = "model.layers.0.mlp.gate.weight"
    _edit(ckpt, lambda t: t.update({k + "_scale_inv": torch.ones(1, 2)}))
    with pytest.raises(CheckpointError, match=rf"'{k}_scale_inv' scales '{k}', which is torch.float32"):
        load_model(ckpt)


def test_fp8_without_quantization_config_is_named(ckpt):
    _set_q(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"is float8_e4m3fn but config\.json has no quantization_config"):
        load_model(ckpt)


def test_static_activation_scale_tensor_is_named(ckpt):
    k = KEY.replace(".weight", ".input_scale")
    _edit(ckpt, lambda t: t.update({k: torch.ones(())}))
    with pytest.raises(CheckpointError, match=rf"'{k}' is a static activation scale"):
        load_model(ckpt)


def test_other_fp8_format_is_named(ckpt):
    if not hasattr(torch, "float8_e5m2"):
        pytest.skip("no float8_e5m2 in this torch")
    _edit(ckpt, lambda t: t.update({KEY: t[KEY].float().to(torch.float8_e5m2)}))
    with pytest.raises(CheckpointError, match=rf"'{KEY}' has dtype torch.float8_e5m2; only float8_e4m3fn"):
        load_model(ckpt)


# ---------------------------------------------------------------------------------------
# vs transformers (FineGrainedFP8: without a GPU it dequantizes at load, needs accelerate)
# ---------------------------------------------------------------------------------------
# transformers' CPU dequantization derives the block from the scale grid (rows // grid rows),
# so it refuses partial edge blocks or mis-scales them, and it leaves stacked experts'
# `gate_up_proj_scale_inv` / `down_proj_scale_inv` unused (UNEXPECTED keys, raw fp8 values).
# The comparison therefore uses per-expert layouts and blocks that divide every quantized
# dimension (or exceed it); docs/models.md has the details.
HF_CASES = [("qwen3_next", "per_expert", (16, 16)), ("qwen3_5", "stacked", (128, 128)),
            ("qwen3_5", "stacked", (16, 16)), ("qwen3_5_moe", "per_expert", (128, 128)),
            ("qwen3_5_moe", "per_expert", (16, 16))]


@pytest.mark.parametrize("arch,experts,block", HF_CASES)
def test_fp8_matches_transformers(ckpts, arch, experts, block):
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")
    tf = pytest.importorskip("transformers")
    d = ckpts(arch, experts, block)
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = load_model(d, dtype="float32")
    with torch.no_grad():
        a = torch.log_softmax(hf(TOKENS[None]).logits[0].float(), dim=-1)
    b = logprobs(ours)
    assert (a - b).abs().max().item() < 1e-5  # stated tolerance (fp32 both; measured <= 1e-6)


def test_an_all_zero_block_quantizes_to_zeros():
    w = torch.randn(64, 96)
    w[:32, 48:] = 0  # one block of (32, 48) all zero: scale 1, not 0 (0 / 0: NaN codes)
    q, s = quantize(w, (32, 48))
    assert s[0, 1] == 1 and bool((q[:32, 48:].float() == 0).all())
    assert torch.equal(dequantize(q, s, (32, 48))[:32, 48:], torch.zeros(32, 48))


def test_a_float64_dequantization_is_the_exact_product():
    """For float64 the product is taken in float64 (exact: 4 + 24 significant bits), not
    rounded to float32 first."""
    g = torch.Generator().manual_seed(1)
    q, _ = quantize(torch.randn(64, 96, generator=g), (32, 48))
    s = torch.rand(2, 2, generator=g) + 0.1  # full float32 mantissas
    want = q.double() * s.double().repeat_interleave(32, 0).repeat_interleave(48, 1)
    assert torch.equal(dequantize(q, s, (32, 48), dtype=torch.float64), want)
    assert not torch.equal(want.float().double(), want)  # (a float32 product would differ)


@pytest.mark.parametrize("fp8", ["dequantize", "keep"])
def test_an_fp8_expert_of_another_shape_is_named(ckpts, tmp_path, fp8):
    d = tmp_path / "c"
    shutil.copytree(ckpts("qwen3_5_moe", "per_expert", (32, 48)), d)
    k = "model.layers.1.mlp.experts.3.down_proj.weight"

    def f(t):
        t[k], t[k + "_scale_inv"] = t[k][:, :48].contiguous(), t[k + "_scale_inv"][:, :1].contiguous()
    _edit(d, f)
    with pytest.raises(CheckpointError, match=rf"'{k}' has shape \[64, 48\], expert 0's is \[64, 64\]"):
        load_model(d, fp8=fp8)
