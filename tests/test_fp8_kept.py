"""FP8 weights kept as FP8 (load_model(fp8="keep"), the default on CUDA): the model holds
float8 weights + scale grids and no dequantized copy; its torch forward (dequantizing on
the fly) is bitwise the dequantizing load's; the Triton runner packs fp8 groups (params
become views of the packed weight, mixed fp8 / bf16 groups become Segments, off-grid parts
a row map) and decodes through the FP8 matmul and the grouped MoE kernels (interpreter):
plain == the reference, speculative == plain, distinct experts counted."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyspec.loading import load_model
from hyspec.quant import FP8_DTYPE, Fp8Weight, module_fp8, module_weight
from hyspec.tiny import make_tiny

TOKENS = torch.tensor([1, 17, 42, 99, 7, 250, 3, 88])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8kept")
    cache = {}

    def get(arch, experts="stacked", block=(128, 128), **kw):
        key = (arch, experts, block, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_tiny(arch, root / f"{arch}_{experts}_{block[0]}x{block[1]}_{len(cache)}", seed=3,
                                   fp8=True, fp8_block=block, experts=experts, **kw)
        return cache[key]

    return get


@pytest.mark.parametrize("arch,experts,block", [("qwen3_5_moe", "per_expert", (128, 128)),
                                                ("qwen3_5_moe", "per_expert", (32, 48)),
                                                ("qwen3_next", "stacked", (128, 128))])
def test_kept_fp8_forward_is_the_dequantized_models(ckpt, arch, experts, block):
    d = ckpt(arch, experts, block)
    kept, deq = load_model(d, fp8="keep"), load_model(d)
    params = dict(deq.named_parameters())
    n8 = 0
    for name, p in kept.named_parameters():
        if p.dtype == FP8_DTYPE:
            n8 += 1
            mod_name, _, attr = name.rpartition(".")
            w = module_weight(kept.get_submodule(mod_name), attr, torch.float32)
            assert torch.equal(w, params[name]), name  # on-the-fly dequantization == the load's
        else:
            assert torch.equal(p, params[name]), name
    assert n8 > 10
    # every fp8 weight of the checkpoint is kept in fp8 (none dequantized at load by mistake: the
    # MTP layer's and the shared expert's projections, the stacked experts), and nothing else
    from hyspec.loading import _quant_config, read_tensors
    from hyspec.quant import is_fp8, prepare_fp8

    raw = prepare_fp8(read_tensors(d, dequantize=False), _quant_config(Path(d)))
    want = {k for k, v in raw.items() if is_fp8(v)}
    assert any(k.startswith("mtp.") for k in want) and any("shared_expert." in k for k in want)
    assert {name for name, p in kept.named_parameters() if p.dtype == FP8_DTYPE} == want
    if experts == "per_expert" and block == (128, 128):  # gate | up of 64 rows each: a row map
        assert "gate_up_proj_scale_rows" in kept.model.layers[0].mlp.experts._buffers
    nbytes = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    assert nbytes(kept) < 0.6 * nbytes(deq)  # fp32 tiny model: ~1 byte instead of 4 per quantized weight
    with torch.no_grad():
        assert torch.equal(kept(TOKENS), deq(TOKENS))


@pytest.mark.parametrize("key", ["model.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.gate.weight",
                                 "model.embed_tokens.weight", "lm_head.weight"])
def test_a_quantized_router_embedding_or_head_loads_kept_as_dequantized(ckpt, tmp_path, key):
    """Qwen leaves the router, embedding and LM head in bf16, but a checkpoint that quantizes
    one of them (a scale beside it) loaded with fp8="keep" (the default on CUDA) held it as
    float8, which their forwards read as a plain tensor: 'expected m1 and m2 to have the same
    dtype' at the first forward, where fp8="dequantize" runs it. Now dequantized at load."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hyspec.quant import quantize

    d = tmp_path / "q"
    shutil.copytree(ckpt("qwen3_5_moe", "stacked", (32, 48)), d)
    t = load_file(str(d / "model.safetensors"))
    t[key], t[key + "_scale_inv"] = quantize(t[key], (32, 48))
    save_file(t, str(d / "model.safetensors"))
    kept, deq = load_model(d, fp8="keep"), load_model(d)
    mod_name, _, attr = key.rpartition(".")
    assert getattr(kept.get_submodule(mod_name), attr).dtype == torch.float32
    assert torch.equal(getattr(kept.get_submodule(mod_name), attr), getattr(deq.get_submodule(mod_name), attr))
    with torch.no_grad():
        assert torch.equal(kept(TOKENS), deq(TOKENS))
    from hyspec.engine import Engine

    a, b = Engine(kept), Engine(deq)
    assert a.generate(TOKENS.tolist(), max_new_tokens=6, draft=2, ignore_eos=True).tokens == \
        b.generate(TOKENS.tolist(), max_new_tokens=6, ignore_eos=True).tokens


def test_runner_packs_fp8_groups_without_copies(ckpt):
    from hyspec.gpu.packing import Segments, pack_gdn_in, pack_layer

    kept, deq = load_model(ckpt("qwen3_5", block=(32, 48)), fp8="keep"), load_model(ckpt("qwen3_5", block=(32, 48)))
    lay, ref = kept.model.layers[0], deq.model.layers[0]
    p = pack_layer(lay, 0, 0)
    assert isinstance(p.w_in, Segments) and isinstance(p.w_in.parts[0], Fp8Weight)  # q|k|v|z fp8, b|a bf16
    g = lay.linear_attn
    packed = p.w_in.parts[0]
    assert g.in_proj_qkv.weight.data_ptr() == packed.w.data_ptr()  # the module reads the packed tensor
    assert g.in_proj_z.weight.data_ptr() == packed.w[g.in_proj_qkv.weight.shape[0]:].data_ptr()
    want = pack_gdn_in(ref.linear_attn)
    assert torch.equal(torch.cat([packed.dequantize(), p.w_in.parts[1]]), want)
    assert isinstance(p.w_gu, Fp8Weight) and torch.equal(p.w_gu.dequantize(), torch.cat(
        [ref.mlp.gate_proj.weight, ref.mlp.up_proj.weight]))
    # Qwen3-Next: q|k|v|z re-ordered per key head, 128-row blocks over 32-row heads -> a row map
    kept, deq = load_model(ckpt("qwen3_next"), fp8="keep"), load_model(ckpt("qwen3_next"))
    w = pack_gdn_in(kept.model.layers[0].linear_attn)
    assert isinstance(w, Segments) and w.parts[0].rows is not None
    want = pack_gdn_in(deq.model.layers[0].linear_attn)
    assert torch.equal(torch.cat([w.parts[0].dequantize(), w.parts[1]]), want)
    assert module_fp8(kept.model.layers[0].linear_attn.in_proj_ba) is None


def test_layer_weight_bytes_count_every_packed_weight(ckpt):
    """The bench roofline's bytes per layer (hyspec.gpu.packing.layer_weight_bytes) are the
    layer's matmul weights, each once: every projection (the output ones too), a mixed
    fp8 / bf16 group's every part (Segments: with the fp8 part's scales and its row map), and
    of an MoE layer the router, the shared expert and `experts` of the E routed experts."""
    from hyspec.gpu.packing import expert_bytes, layer_weight_bytes, pack_layer, weight_nbytes

    skip = ("layernorm", "conv1d", "A_log", "dt_bias", "linear_attn.norm", "q_norm", "k_norm")

    def held(lay, only=""):
        return sum(t.numel() * t.element_size() for n, t in [*lay.named_parameters(), *lay.named_buffers()]
                   if only in n and not any(x in n for x in skip))

    moe = load_model(ckpt("qwen3_5_moe", "per_expert", (32, 48)))  # dequantized: plain tensors
    for i, lay in enumerate(moe.model.layers):
        p = pack_layer(lay, 0, i)
        E = lay.mlp.experts.gate_up_proj.shape[0]
        per = held(lay, "mlp.experts.") / E
        assert expert_bytes(p) == per and layer_weight_bytes(p) == held(lay), i
        assert layer_weight_bytes(p, experts=2) == held(lay) - (E - 2) * per, i
        assert layer_weight_bytes(p, with_moe=False) == held(lay) - held(lay, "mlp."), i
    kept = load_model(ckpt("qwen3_5", block=(32, 48)), fp8="keep")  # GDN w_in: Segments (fp8 q|k|v|z, bf16 b|a)
    lay = kept.model.layers[0]
    p = pack_layer(lay, 0, 0)
    rows = p.w_in.parts[0].rows
    assert weight_nbytes(p.w_in) == held(lay, "in_proj_") + (0 if rows is None else rows.numel() * rows.element_size())
    assert layer_weight_bytes(p) == held(lay) + weight_nbytes(p.w_in) - held(lay, "in_proj_")


def test_triton_runner_fp8_moe_interpreted(ckpt, triton_interpreter):
    """The GPU decoder's Triton runner on a block-FP8 MoE model (Triton interpreter, fp32
    activations; one sequence on a one-lane BatchDecoder through decode_one): FP8 matmuls
    (row maps: 128-row blocks over a 32-wide model) and the grouped MoE."""
    from hyspec.decode import generate_plain
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import decode_one

    m = load_model(ckpt("qwen3_5_moe", "per_expert", (128, 128), layers=4, hidden=32, vocab_size=128), fp8="keep")
    prompt, n = [5, 17, 99, 3, 7], 5
    ref = generate_plain(m, prompt, max_new_tokens=n)
    dec = BatchDecoder(m, len(prompt) + n + 8, 2, slots=1, graphs=False)
    assert isinstance(dec.runner.layers[0].ex_gu, Fp8Weight) and dec.runner.layers[0].ex_gu.rows is not None
    dec.runner.reset_moe_counts()
    p = decode_one(dec, prompt, n)
    assert p.tokens == ref.tokens
    read = dec.runner.moe_experts_read()
    assert read[1]["experts_per_layer"] == m.cfg.num_experts_per_tok  # a decode step: top-k distinct experts
    # the tuner's shape lists: every matmul's (N, K), the FP8 ones among them (not the head)
    from hyspec.gpu.tune import fp8_shapes, model_shapes

    shapes, f8 = model_shapes(dec.runner), fp8_shapes(dec.runner)
    assert f8 and f8 < set(shapes) and tuple(dec.runner.head.shape) in set(shapes) - f8
    assert tuple(dec.runner.layers[0].w_out.shape) in f8
    s = decode_one(dec, prompt, n, k=2, forced_rates=(0.9, 0.7), reference=p.tokens)
    assert s.tokens == p.tokens
    assert 2 <= dec.runner.moe_experts_read()[3]["experts_per_layer"] <= min(m.cfg.num_experts, 6)
    # the bench's figures from those counts: t = 1 reads what weight_bytes_per_step says (top-k)
    from hyspec.bench.variants import moe_figures

    f = moe_figures(dec.runner, read, dec.runner.moe_experts_read(), 1.0, {}, 1.0)
    assert f["by_rows"][1]["bytes_per_step"] == dec.runner.weight_bytes_per_step()
    assert f["by_rows"][3]["bytes_per_step"] > f["by_rows"][1]["bytes_per_step"]


def test_a_column_block_the_kernels_cannot_step_is_dequantized(ckpt):
    """fp8="keep" with a column block that is not a multiple of 16 (the FP8 kernels' K step):
    the weights are dequantized at load, with a warning, and the model is the dequantized one."""
    d = ckpt("qwen3_5_moe", "per_expert", (16, 24))
    with pytest.warns(UserWarning, match=r"weight_block_size \[16, 24\]: the FP8 kernels need a column block that "
                                         r"is a multiple of 16; dequantizing"):
        kept = load_model(d, fp8="keep")
    assert not any(p.dtype == FP8_DTYPE for p in kept.parameters())
    with torch.no_grad():
        assert torch.equal(kept(TOKENS), load_model(d)(TOKENS))


def test_experts_of_one_layer_partly_quantized_load_kept_as_dequantized(ckpt, tmp_path):
    """A layer whose per-expert weights are partly float8 and partly not (one left unconverted):
    fp8="keep" cannot stack them as one float8 tensor, so that layer's experts are dequantized
    at load and the model is the dequantizing load's (stacked as found, the bf16 part went
    into a float8 stack and the float8 parts' scales were left over)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hyspec.quant import dequantize

    d = tmp_path / "mixed"
    shutil.copytree(ckpt("qwen3_5_moe", "per_expert", (32, 48)), d)
    t = load_file(str(d / "model.safetensors"))
    k = "model.layers.1.mlp.experts.2.up_proj.weight"
    t[k] = dequantize(t[k], t.pop(k + "_scale_inv"), (32, 48))
    save_file(t, str(d / "model.safetensors"))
    kept, deq = load_model(d, fp8="keep"), load_model(d)
    assert kept.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
    assert kept.model.layers[0].mlp.experts.gate_up_proj.dtype == FP8_DTYPE  # (the other layers' stay fp8)
    assert torch.equal(kept.model.layers[1].mlp.experts.gate_up_proj, deq.model.layers[1].mlp.experts.gate_up_proj)
    with torch.no_grad():
        assert torch.equal(kept(TOKENS), deq(TOKENS))


def test_stacked_fp8_experts_stored_transposed_load_kept_as_dequantized(tmp_path):
    """Stacked experts stored transposed ([E, H, 2I] / [E, I, H], recognised by shape) have their
    scale grid in the stored orientation: fp8="keep" dequantizes them at load (kept as float8
    in the model's orientation, the grid no longer fits the weight) and the model is the
    dequantizing load's."""
    import json

    from safetensors.torch import load_file, save_file

    from hyspec.quant import Fp8BlockConfig
    from hyspec.tiny import quantize_fp8

    # I = 16, H = 64: the transposed shapes differ from the model's (make_tiny's I == H would not)
    d = make_tiny("qwen3_5_moe", tmp_path / "t", seed=3, vocab_size=256, overrides={"moe_intermediate_size": 16})
    t = load_file(str(d / "model.safetensors"))
    t = {k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
         for k, v in t.items()}
    q, skip = quantize_fp8(t, (32, 48))
    assert q["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
    save_file(q, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = Fp8BlockConfig(block=(32, 48), modules_to_not_convert=tuple(skip)).to_dict()
    (d / "config.json").write_text(json.dumps(cfg))
    kept, deq = load_model(d, fp8="keep"), load_model(d)
    assert kept.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    assert kept.model.layers[0].mlp.shared_expert.down_proj.weight.dtype == FP8_DTYPE
    with torch.no_grad():
        assert torch.equal(kept(TOKENS), deq(TOKENS))


@pytest.mark.parametrize("key,param", [("model.layers.0.linear_attn.in_proj_qkv.weight",
                                        "model.layers.0.linear_attn.in_proj_qkv.weight"),
                                       ("model.layers.1.mlp.experts.2.up_proj.weight",
                                        "model.layers.1.mlp.experts.gate_up_proj")])
def test_a_kept_weight_beyond_float16_is_named_at_load(ckpt, tmp_path, key, param):
    """A block scale that takes a weight past float16's range (65504): fp8="keep" with
    dtype float16 refuses it at load, naming the weight, as a dequantizing load does (it
    loaded, and the first forward failed naming 'weight', in its on-the-fly dequantization);
    bfloat16 keeps it. Also for an expert stacked from per-expert tensors (its stack named)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hyspec.loading import CheckpointError

    d = tmp_path / "big"
    shutil.copytree(ckpt("qwen3_5_moe", "per_expert", (32, 48)), d)
    t = load_file(str(d / "model.safetensors"))
    t[key + "_scale_inv"].view(-1)[-1] = 1e4  # the block's largest entry: 448 x 1e4
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor '{param}' dequantizes to values up to 4\.48e\+06, "
                                              r"beyond the range of torch.float16"):
        load_model(d, dtype="float16", fp8="keep")
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' dequantizes to values up to 4\.48e\+06"):
        load_model(d, dtype="float16")
    kept = load_model(d, dtype="bfloat16", fp8="keep")
    mod_name, _, attr = param.rpartition(".")
    assert module_fp8(kept.get_submodule(mod_name), attr).abs_max() == pytest.approx(4.48e6)
