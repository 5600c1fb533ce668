"""The checkpoint loader: accepted layouts load the same weights; broken checkpoints fail
with a CheckpointError / ConfigError that names what is wrong."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import PROMPT
from hyspec.loading import CheckpointError, ConfigError, load_model, parse_dtype
from hyspec.model.ops import StepCtx

ARCH = "qwen3_5_moe"  # routed experts + shared expert + dense-free layers: the most keys


@pytest.fixture()
def ckpt(zoo, tmp_path) -> Path:
    """A private copy of the make_tiny checkpoint (tests rewrite its files)."""
    d = tmp_path / "ckpt"
    shutil.copytree(zoo.path("tiny", ARCH), d)
    return d


@pytest.fixture(scope="module")
def reference(zoo):
    return load_model(zoo.path("tiny", ARCH), dtype="float32")


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def _write(d: Path, t: dict[str, torch.Tensor], name: str = "model.safetensors") -> None:
    save_file({k: v.contiguous() for k, v in t.items()}, str(d / name), metadata={"format": "pt"})


def _same_params(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------
def test_missing_tensor_is_named(ckpt):
    t = _tensors(ckpt)
    del t["model.layers.2.linear_attn.A_log"]
    _write(ckpt, t)
    with pytest.raises(CheckpointError, match=r"missing tensor.*'model\.layers\.2\.linear_attn\.A_log'"):
        load_model(ckpt)


def test_wrong_shape_is_named(ckpt):
    t = _tensors(ckpt)
    t["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(31, 64)
    _write(ckpt, t)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.3\.self_attn\.k_proj\.weight' has shape \[31, 64\], "
                                             r"expected \[32, 64\]"):
        load_model(ckpt)


def test_unknown_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"model_type.*'llama'.*supported: qwen3_next"):
        load_model(ckpt)


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read"):
        load_model(ckpt)


def test_truncated_header(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(ckpt)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.pop("hidden_size"), "'hidden_size' is missing"),
    (lambda c: c.update(linear_num_value_heads=3), "linear_num_value_heads"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c.update(layer_types=["linear_attention"] * 3), "layer_types"),
    (lambda c: c.update(layer_types=["linear_attention"] * 3 + ["sliding"]), "unknown layer type 'sliding'"),
    (lambda c: c.update(num_experts_per_tok=9), "num_experts_per_tok"),
    (lambda c: c.pop("num_experts_per_tok"), "'num_experts_per_tok' is missing"),  # (it said "=0 must be in")
    (lambda c: c.update(vocab_size=0), "vocab_size"),
])
def test_bad_config_fields_are_named(ckpt, edit, match):
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        load_model(ckpt)


def test_missing_or_broken_files(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(ckpt)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(ckpt.parent / "ckpt" / "generation_config.json", empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    with pytest.raises(ConfigError, match="required field"):
        load_model(empty)


def test_a_tokenizer_json_that_is_a_directory_is_named(ckpt):
    """It was taken for an absent tokenizer ("this checkpoint has no tokenizer.json" at the first text)."""
    from hyspec.engine import Engine

    (ckpt / "tokenizer.json").unlink(missing_ok=True)
    (ckpt / "tokenizer.json").mkdir()
    with pytest.raises(ValueError, match=r"tokenizer\.json is a directory, not the tokenizer's file"):
        Engine.load(ckpt)


def test_broken_links_and_folders_among_the_checkpoint_files_are_named(ckpt, tmp_path):
    """In huggingface_hub's cache layout each file is a link to a blob: a blob gone made a shard
    "No such file or directory", a tokenizer.json or config.json "no tokenizer.json" / "no
    config.json" (the file is there, as a link to nothing); a *.safetensors that is a folder
    read as "No such device (os error 19)", and, named by a shard index, as one that "does not
    exist". Each is now named as what it is."""
    from hyspec.engine import Engine

    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for f in ckpt.iterdir():  # the cache's layout: the snapshot's files link to blobs
        f.rename(blobs / f.name)
        f.symlink_to(blobs / f.name)
    load_model(ckpt)  # (links to files load)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        (blobs / name).rename(blobs / (name + ".gone"))
        with pytest.raises(CheckpointError, match=rf"{name} is a broken symbolic link \(to .*blobs/{name}\): "
                                                  r"the file it points to is missing"):
            Engine.load(ckpt)
        (blobs / (name + ".gone")).rename(blobs / name)
    (ckpt / "extra.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"extra\.safetensors is a directory, not a safetensors file"):
        load_model(ckpt)


def test_a_broken_link_hyspec_does_not_read_is_no_error(ckpt):
    """A snapshot's chat_template.json (a processor's file: hyspec reads chat_template.jinja and
    tokenizer_config.json) linking to a pruned blob: the checkpoint loaded, and was then refused
    as a broken link."""
    (ckpt / "chat_template.json").symlink_to(ckpt / "gone.json")
    (ckpt / "README.md").symlink_to(ckpt / "gone.md")
    load_model(ckpt)


def test_shard_index_naming_a_missing_file(ckpt):
    t = _tensors(ckpt)
    (ckpt / "model.safetensors").unlink()
    _write(ckpt, t, "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors" for k in t}}
    index["weight_map"]["mtp.fc.weight"] = "model-00002-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, which does not exist"):
        load_model(ckpt)


def test_missing_expert_is_named(ckpt):
    t = _tensors(ckpt)
    _write(ckpt, _per_expert(t, drop="model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"):
        load_model(ckpt)


def test_an_expert_of_another_shape_is_named(ckpt):
    t = _per_expert(_tensors(ckpt))
    k = "model.layers.1.mlp.experts.3.down_proj.weight"
    t[k] = t[k][:, :-1]
    _write(ckpt, t)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight' has shape"):
        load_model(ckpt)


@pytest.mark.parametrize("damage,match", [
    # an int32 expert was copied into the float stack (its values truncated to other numbers) and loaded
    (lambda w: w.to(torch.int32), r"'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight' is stored as "
                                  r"torch\.int32; a weight must be a floating-point tensor"),
    # a 0-d expert tensor raised a bare IndexError
    (lambda w: w[0, 0], r"'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight' has shape \[\]; an expert's "
                        r"weight is a matrix"),
])
def test_a_damaged_expert_tensor_is_named(ckpt, damage, match):
    t = _per_expert(_tensors(ckpt))
    k = "model.layers.1.mlp.experts.2.up_proj.weight"
    t[k] = damage(t[k]).contiguous()
    _write(ckpt, t)
    with pytest.raises(CheckpointError, match=match):
        load_model(ckpt)


def test_a_stray_expert_id_is_named(ckpt):
    """An expert id far past the others was reported as the first missing expert's tensor."""
    t = _per_expert(_tensors(ckpt))
    t["model.layers.1.mlp.experts.1000000.up_proj.weight"] = t["model.layers.1.mlp.experts.0.up_proj.weight"].clone()
    _write(ckpt, t)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts' has tensors of \d+ experts with "
                                              r"ids up to 1000000: expert \d+ is missing"):
        load_model(ckpt)


def test_unknown_dtype_and_unexpected_tensor(ckpt):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        parse_dtype("float8")
    with pytest.raises(ValueError, match="torch.int8 is not a model dtype"):  # (a TypeError deep in torch once;
        parse_dtype(torch.int8)  # complex64 loaded and ran)
    t = _tensors(ckpt)
    t["model.mystery.weight"] = torch.zeros(3)  # outside the layers: ignored, with a warning
    _write(ckpt, t)
    with pytest.warns(UserWarning, match="mystery"):
        load_model(ckpt)
    # a layer's weight the model has no place for: config.json and the weights disagree (it ran without it)
    t["model.layers.0.mystery.weight"] = torch.zeros(3)
    _write(ckpt, t)
    with pytest.raises(CheckpointError, match=r"layer weight\(s\) that config.json does not describe.*mystery"):
        load_model(ckpt)


def test_a_config_that_describes_another_model_than_the_weights_is_refused(ckpt):
    """Found loading and running a cut-down model with one vague warning (fewer layers, no
    shared expert), or dying in the allocator with a traceback (an absurd size): each is now
    an error naming the disagreement, before any weight memory is taken."""
    cfg = json.loads((ckpt / "config.json").read_text())

    def refused(patch, match):
        (ckpt / "config.json").write_text(json.dumps({**cfg, **patch}))
        with pytest.raises(CheckpointError, match=match):
            load_model(ckpt)

    n = cfg["num_hidden_layers"]
    refused({"num_hidden_layers": n - 1},
            f"num_hidden_layers={n - 1} but the checkpoint .* holds weights of {n} layers")
    # ... also for a pipeline stage (--pp), which reads only its own layers: it ran a
    # cut-down model without a word
    for stage in (range(0, 1), range(1, n - 1)):
        with pytest.raises(CheckpointError, match=f"num_hidden_layers={n - 1} but the checkpoint .* holds weights "
                                                  f"of {n} layers"):
            load_model(ckpt, layers=stage)
    # more layers than the weights hold: named before a model of that many layers is built
    # (10,000,000 layers hung in the meta model's construction, memory growing; a smaller
    # excess was reported as the first missing tensor of the first absent layer)
    refused({"num_hidden_layers": n + 2},
            f"num_hidden_layers={n + 2} but the checkpoint .* holds weights of {n} layers")
    refused({"shared_expert_intermediate_size": 0}, "does not describe, e.g. .*shared_expert")
    refused({"vocab_size": 10 ** 12}, r"'model.embed_tokens.weight' has shape \[\d+, \d+\], expected \[1000000000000")
    # a tokenizer larger than the vocabulary is named at load (it surfaced per request, as an id out of range)
    from hyspec.engine import Engine, default_model_dir

    (ckpt / "config.json").write_text(json.dumps(cfg))
    shutil.copy(default_model_dir() / "tokenizer.json", ckpt / "tokenizer.json")
    with pytest.warns(UserWarning, match=f"tokenizer.json has 4096 tokens, more than config.json's vocab_size "
                                         f"{cfg['vocab_size']}"):
        Engine.load(ckpt)


# ---------------------------------------------------------------------------------------
# layouts that must load the same weights
# ---------------------------------------------------------------------------------------
def _per_expert(t: dict, drop: str | None = None) -> dict:
    """Stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) -> per-expert keys."""
    out = {}
    for k, v in t.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, dim=0)
                out[f"{pre}{e}.gate_proj.weight"] = gate
                out[f"{pre}{e}.up_proj.weight"] = up
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    if drop:
        del out[drop]
    return out


def test_per_expert_and_transposed_stacked_experts(ckpt, reference):
    t = _tensors(ckpt)
    assert "model.layers.0.mlp.experts.gate_up_proj" in t  # make_tiny writes stacked
    _write(ckpt, _per_expert(t))
    _same_params(load_model(ckpt), reference)
    # Stacked experts stored transposed ([E, H, 2I] / [E, I, H]) are recognised by shape, so
    # this needs 2I != H != I (make_tiny has I == H): cut the experts to I = 16 first.
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["moe_intermediate_size"] = 16
    (ckpt / "config.json").write_text(json.dumps(cfg))
    small = {}
    for k, v in t.items():
        if k.endswith("experts.gate_up_proj"):
            v = torch.cat([v[:, :16], v[:, 64:80]], dim=1)  # gate rows, then up rows
        elif k.endswith("experts.down_proj"):
            v = v[:, :, :16]
        small[k] = v
    _write(ckpt, small)
    stacked = load_model(ckpt)
    _write(ckpt, _per_expert(small))
    _same_params(load_model(ckpt), stacked)
    _write(ckpt, {k: (v.transpose(1, 2) if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
                  for k, v in small.items()})
    _same_params(load_model(ckpt), stacked)


def test_sharded_checkpoint(ckpt, reference):
    t = _tensors(ckpt)
    (ckpt / "model.safetensors").unlink()
    keys = sorted(t)
    half = len(keys) // 2
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for name, part in zip(names, (keys[:half], keys[half:])):
        _write(ckpt, {k: t[k] for k in part}, name)
        weight_map.update({k: name for k in part})
    index = ckpt / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _same_params(load_model(ckpt), reference)
    # an index that leaves out a shard of the series (config.json was blamed for the layers it
    # held), and one that names none (its tensors were called missing)
    index.write_text(json.dumps({"weight_map": {k: v for k, v in weight_map.items() if v == names[0]}}))
    with pytest.raises(CheckpointError, match=r"leaves out shard model-00002-of-00002\.safetensors"):
        load_model(ckpt)
    index.write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(CheckpointError, match="'weight_map' names no shard"):
        load_model(ckpt)
    # an index whose tensor names its shards do not hold (another checkpoint's) loaded as if right
    index.write_text(json.dumps({"weight_map": {k + ".bogus": v for k, v in weight_map.items()}}))
    with pytest.raises(CheckpointError, match=r"places \d+ tensor\(s\) in model-0000\d-of-00002\.safetensors "
                                              r"that it does not hold, e.g. '.*\.bogus'"):
        load_model(ckpt)
    index.write_text(json.dumps({"weight_map": weight_map}))
    _same_params(load_model(ckpt), reference)


def test_multimodal_layout(ckpt, reference):
    """Qwen3.5 multimodal checkpoints: config nests the LM under text_config, keys carry
    model.language_model., vision tensors sit beside them (ignored)."""
    t = _tensors(ckpt)
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in t.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(6, 4)
    _write(ckpt, renamed)
    text = json.loads((ckpt / "config.json").read_text())
    text.pop("architectures")
    text["model_type"] = "qwen3_5_moe_text"
    wrapper = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (ckpt / "config.json").write_text(json.dumps(wrapper))
    m = load_model(ckpt)
    assert m.cfg.model_type == "qwen3_5_moe_text" and m.has_mtp
    _same_params(m, reference)


def test_a_wrapper_checkpoint_under_language_model_loads_as_the_plain_one(ckpt, reference):
    """Older multimodal wrappers (LLaVA-style) store the language model as
    language_model.model.* and its head as language_model.lm_head.weight: both prefixes map
    onto the plain names (either one left as it is: the layers or the head 'missing')."""
    _write(ckpt, {("language_model." + k if k.startswith(("model.", "lm_head.")) else k): v
                  for k, v in _tensors(ckpt).items()})
    _same_params(load_model(ckpt), reference)


def test_vision_tower_tensors_are_skipped_without_a_warning(ckpt, reference):
    """A multimodal checkpoint's vision tower (model.visual.*, visual.*, model.vision_tower.*,
    vision_tower.*: hundreds of tensors in Qwen3.5's) is no part of the language model: not
    read, and not reported as unexpected tensors."""
    import warnings

    t = _tensors(ckpt)
    for prefix in ("model.visual.", "visual.", "model.vision_tower.", "vision_tower."):
        t[prefix + "blocks.0.attn.qkv.weight"] = torch.zeros(6, 4)
    _write(ckpt, t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = load_model(ckpt)
    _same_params(m, reference)


def test_a_wrapper_config_decides_the_tied_head():
    """transformers ties a *ForConditionalGeneration head by the wrapper's
    tie_word_embeddings (save_pretrained then leaves lm_head.weight out, or keeps it),
    whatever text_config says; hyspec once took text_config's value (a refused load, or a
    saved head silently replaced by the embedding)."""
    from hyspec.config import ModelConfig
    from hyspec.tiny import tiny_config

    text = {**tiny_config("qwen3_5"), "model_type": "qwen3_5_text"}
    for outer, inner in ((True, False), (False, True)):
        d = {"model_type": "qwen3_5", "text_config": {**text, "tie_word_embeddings": inner},
             "tie_word_embeddings": outer}
        assert ModelConfig.from_dict(d).tie_word_embeddings is outer
    d = {"model_type": "qwen3_5", "text_config": {**text, "tie_word_embeddings": True}}  # wrapper silent
    assert ModelConfig.from_dict(d).tie_word_embeddings is True


def test_checkpoint_without_mtp(zoo, tmp_path):
    from hyspec.speculative.loop import SpecOptions, generate_speculative

    m = load_model(zoo.path("tiny", ARCH, with_mtp=False))
    assert not m.has_mtp
    shutil.copytree(zoo.path("tiny", ARCH, with_mtp=False), tmp_path / "c")  # config.json promises an MTP head
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    with pytest.warns(UserWarning, match=r"mtp_num_hidden_layers=1 but the weights have no mtp\.\* tensors"):
        assert not load_model(tmp_path / "c").has_mtp
    with pytest.raises(ValueError, match="no MTP head.*--draft 0"):
        generate_speculative(m, PROMPT, max_new_tokens=4, opts=SpecOptions(k=2))
    m2 = load_model(zoo.path("tiny", ARCH), load_mtp=False)  # MTP weights present but skipped
    assert not m2.has_mtp
    for a, b in zip(m.parameters(), m2.parameters()):
        assert a.shape == b.shape


@pytest.mark.parametrize("n", [2, 3, 12])
def test_mtp_layers_past_the_first_are_not_called_unexpected(ckpt, reference, n):
    """mtp_num_hidden_layers > 1: one warning says only mtp.layers.0 drafts; mtp.layers.2.* (and
    later) were also reported as "unexpected tensors" (only names starting mtp.layers.1 were spared)."""
    import warnings

    t = _tensors(ckpt)
    for k in [k for k in t if k.startswith("mtp.layers.0.")]:
        for i in range(1, n):
            t[k.replace("mtp.layers.0.", f"mtp.layers.{i}.")] = t[k].clone()
    _write(ckpt, t)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": n}))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = load_model(ckpt, dtype="float32")
    msgs = [str(x.message) for x in w]
    assert not [s for s in msgs if "unexpected tensor" in s], msgs
    assert [s for s in msgs if f"mtp_num_hidden_layers={n}; hyspec drafts with the first MTP layer" in s], msgs
    _same_params(m, reference)


def test_float64_float32_bfloat16(zoo):
    p = zoo.path("tiny", "qwen3_next")
    m64, m32, m16 = (load_model(p, dtype=d) for d in ("float64", "float32", torch.bfloat16))
    assert m64.dtype == torch.float64 and m32.dtype == torch.float32 and m16.dtype == torch.bfloat16
    # the decay parameters stay float32 under low precision (float64 models keep float64)
    a_log = "model.layers.0.linear_attn.A_log"
    assert dict(m16.named_parameters())[a_log].dtype == torch.float32
    assert dict(m64.named_parameters())[a_log].dtype == torch.float64
    ids = torch.tensor(PROMPT * 3)
    with torch.no_grad():
        l64, l32, l16 = (m(ids) for m in (m64, m32, m16))
        cache = m32.new_cache(len(ids))
        hs = [m32.forward_hidden(ids[:5], cache, StepCtx(start=0, chunked=True))]
        for i in range(5, len(ids)):
            hs.append(m32.forward_hidden(ids[i : i + 1], cache, StepCtx(start=i, exact=True)))
        l32_steps = m32.logits(torch.cat(hs))
    assert l64.dtype == torch.float64 and l32.dtype == torch.float32
    torch.testing.assert_close(l32.double(), l64, rtol=0, atol=1e-5)
    torch.testing.assert_close(l32_steps, l32, rtol=0, atol=1e-5)
    assert (l16.double() - l64).abs().max() < 0.05  # bf16 runs, roughly


@pytest.mark.parametrize("patch,words", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3' is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": -1.0, "original_max_position_embeddings": 64}},
     "rope_parameters.factor must be a positive number"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor is required"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                       "truncate": "false"}}, "rope_parameters.truncate must be true or false"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window true is not supported"),  # (was ignored)
    # another family's class name: the other family's missing tensors were listed, with no hint
    ({"architectures": ["Qwen3NextForCausalLM"]}, r"architectures \['Qwen3NextForCausalLM'\] are the qwen3_next "
                                                  r"family but model_type is 'qwen3_5_text'"),
    ({"architectures": "Qwen3_5ForCausalLM"}, "'architectures' must be a list of class names"),
    ({"text_config": [1]}, "'text_config' must be an object, got list"),  # (was: "'num_hidden_layers' is missing")
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    # fields of the wrong type, named (were: TypeError tracebacks, or bool("false") read as true)
    ({"num_hidden_layers": "4"}, "'num_hidden_layers' must be a positive integer, got '4'"),
    ({"max_position_embeddings": "big"}, "'max_position_embeddings' must be an integer >= 1"),
    ({"intermediate_size": "128"}, "'intermediate_size' must be an integer"),
    ({"rope_parameters": "x"}, "'rope_parameters' must be an object"),
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false"),
    ({"rms_norm_eps": -1e-6}, "'rms_norm_eps' must be a positive number"),
    ({"rope_theta": "x", "rope_parameters": None}, "'rope_theta' must be a positive number"),
    ({"eos_token_id": "x"}, "'eos_token_id' must be a token id"),
    ({"eos_token_id": 10 ** 6}, "outside the vocabulary"),
    ({"mtp_num_hidden_layers": "one"}, "'mtp_num_hidden_layers' must be an integer"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": None}, "must divide hidden_size"),
    ({"layer_types": "linear"}, "'layer_types' must be a list"),
    ({"model_type": ["qwen3_5_text"]}, "'model_type' must be a string, got list"),  # (unhashable: a traceback)
    ({"rope_scaling": {"rope_type": "yarn", "factor": float("inf"), "original_max_position_embeddings": 64}},
     "rope_parameters.factor must be a positive number"),  # (Infinity in JSON: it decoded garbage)
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                       "mscale": float("nan")}}, "rope_parameters.mscale must be a finite number"),
    # transformers' per-layer-type form: every value in it was dropped (plain RoPE, theta 10000)
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                             "original_max_position_embeddings": 16}}},
     r"rope_parameters nested by layer type \(full_attention\)"),
    ({"original_max_position_embeddings": 0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 64}},
     r"^config.json: original_max_position_embeddings must be a positive number, got 0"),
    ({"layer_types": [["full_attention"], "linear_attention", "linear_attention", "full_attention"],
      "rope_parameters": {"x": {}}},
     "unknown layer type"),  # (an unhashable entry: a TypeError traceback in the nesting check)
])
def test_config_fields_the_model_cannot_honour_are_refused(patch, words):
    from hyspec.config import ConfigError, ModelConfig
    from hyspec.tiny import tiny_config

    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_dict({**tiny_config("qwen3_5"), **patch})
    legacy = ModelConfig.from_dict({**tiny_config("qwen3_5"),  # the older spelling `type`, top-level theta
                                    "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64}})
    assert legacy.rope_type == "yarn" and dict(legacy.rope_scaling)["factor"] == 4.0


def test_a_top_level_original_max_position_embeddings_wins_as_in_transformers():
    """YaRN's pretraining length given both at the top level and in the rope dict: transformers
    takes the top-level one (Phi3-style configs); hyspec took the dict's (logits off by ~0.5;
    tests/test_model_hf.py compares the logits)."""
    from hyspec.config import ModelConfig
    from hyspec.tiny import tiny_config

    d = {**tiny_config("qwen3_5"), "original_max_position_embeddings": 16,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    assert dict(ModelConfig.from_dict(d).rope_scaling)["original_max_position_embeddings"] == 16.0
    d.pop("original_max_position_embeddings")
    assert dict(ModelConfig.from_dict(d).rope_scaling)["original_max_position_embeddings"] == 64.0


def test_numbered_shards_without_an_index_must_all_be_there(ckpt, reference):
    """PREFIX-0000i-of-0000N shards without model.safetensors.index.json: all N load as one
    checkpoint; one missing (an interrupted download) is named, not loaded short."""
    t = _tensors(ckpt)
    (ckpt / "model.safetensors").unlink()
    keys = sorted(t)
    for i in range(3):
        _write(ckpt, {k: t[k] for k in keys[i::3]}, f"model-{i + 1:05d}-of-00003.safetensors")
    _same_params(load_model(ckpt), reference)
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"1 of 3 shard\(s\) missing \(model-00002-of-00003.safetensors\)"):
        load_model(ckpt)
    _write(ckpt, {k: t[k] for k in keys[1::3]}, "model-00002-of-00003.safetensors")
    (ckpt / "model-00003-of-00003.safetensors").unlink()  # the last one (not a gap in the numbers)
    with pytest.raises(CheckpointError, match=r"1 of 3 shard\(s\) missing \(model-00003-of-00003.safetensors\)"):
        load_model(ckpt)


def test_more_damaged_checkpoints_are_named(ckpt, tmp_path):
    """What a new-user walkthrough found loading or decoding garbage in silence, or with a
    traceback: each is now a CheckpointError / ConfigError / TemplateError naming the file,
    field or tensor, and the good checkpoint still loads (checked last)."""
    from hyspec.chat_template import TemplateError, load_template
    from hyspec.config import ModelConfig

    good = _tensors(ckpt)
    name = "model.layers.0.mlp.shared_expert.down_proj.weight"

    def with_tensors(edit, match, err=CheckpointError):
        t = {k: v.clone() for k, v in good.items()}
        edit(t)
        _write(ckpt, t)
        with pytest.raises(err, match=match):
            load_model(ckpt)
        _write(ckpt, good)

    with_tensors(lambda t: t[name].view(-1)[0].fill_(float("nan")), f"'{name}' holds NaN")
    with_tensors(lambda t: t["lm_head.weight"][5].fill_(float("inf")), "'lm_head.weight' holds NaN or infinite")
    with_tensors(lambda t: t.__setitem__(name, torch.ones_like(t[name], dtype=torch.int32)), "stored as torch.int32")
    with_tensors(lambda t: t.__setitem__("mtp.d2t", torch.zeros(0, dtype=torch.long)), "non-empty 1-D integer")
    with_tensors(lambda t: t.__setitem__("mtp.d2t", torch.zeros(2, 3, dtype=torch.long)), "non-empty 1-D integer")
    with_tensors(lambda t: t.__setitem__("mtp.d2t", torch.zeros(4)), "non-empty 1-D integer")
    _write(ckpt, {"model.norm.weight": good["model.norm.weight"]}, "zz.safetensors")  # one tensor in two files
    with pytest.raises(CheckpointError, match="'model.norm.weight' is in both model.safetensors and zz"):
        load_model(ckpt)
    (ckpt / "zz.safetensors").unlink()
    index = ckpt / "model.safetensors.index.json"
    for weight_map, match in ((5, "'weight_map' must map"), ({"a": "../../etc/passwd"}, "in the checkpoint folder")):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match=match):
            load_model(ckpt)
    index.unlink()
    gen = ckpt / "generation_config.json"
    for text, match in (("[1]", "top level must be a JSON object"), ('{"eos_token_id": [null]}', "eos_token_id")):
        gen.write_text(text)
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_dir(ckpt)
    gen.unlink()
    tc = ckpt / "tokenizer_config.json"
    for text, match in (("{bad", "cannot read it"), ('{"chat_template": 5}', "chat_template must be a string"),
                        ('{"chat_template": ["junk"]}', r"a list with no \{name, template\} entry"),
                        ('{"chat_template": [{"name": "default"}]}', "a list with no")):
        tc.write_text(text)
        with pytest.raises(TemplateError, match=match):
            load_template(ckpt)
    tc.unlink()
    # a template's own Python error at render time (a ZeroDivisionError / TypeError traceback in chat)
    from hyspec.chat_template import render_template

    for source, match in (("{{ 1 / 0 }}", "ZeroDivisionError"), ("{{ messages[0].content + 5 }}", "TypeError")):
        with pytest.raises(TemplateError, match=f"does not render: {match}"):
            render_template(source, [{"role": "user", "content": "hi"}])
    # files that are not UTF-8 are named (the message named no file)
    (ckpt / "chat_template.jinja").write_bytes(b"\xff{{ x }}")
    with pytest.raises(TemplateError, match="chat_template.jinja: not UTF-8"):
        load_template(ckpt)
    (ckpt / "chat_template.jinja").unlink()
    gen.write_bytes(b"\xff{}")
    with pytest.raises(ConfigError, match="generation_config.json: not UTF-8"):
        ModelConfig.from_dir(ckpt)
    gen.unlink()
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.warns(UserWarning, match="lm_head.weight differs"):
        load_model(ckpt)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert load_model(ckpt).cfg.num_hidden_layers == cfg["num_hidden_layers"]


def test_a_weight_beyond_float16s_range_is_not_called_damage(ckpt):
    """A finite weight that overflows the load dtype (float16: max 65504) names the range and
    the way out; it was "holds NaN or infinite values: the checkpoint is damaged"."""
    key = "model.layers.0.mlp.shared_expert.down_proj.weight"
    t = _tensors(ckpt)
    t[key] = t[key].clone()
    t[key][0, 0] = 1e6
    _write(ckpt, t)
    with pytest.raises(CheckpointError, match=rf"'{key}' holds values up to 1e\+06, beyond the range of "
                                              r"torch.float16 .*bfloat16 or float32"):
        load_model(ckpt, dtype="float16")
    load_model(ckpt, dtype="float32")  # (the file is fine)
    t[key][0, 0] = float("inf")
    _write(ckpt, t)
    with pytest.raises(CheckpointError, match="holds NaN or infinite values: the checkpoint is damaged"):
        load_model(ckpt, dtype="float32")


def _hub_cache(root: Path, repo: str, sha: str, files_from: Path | None) -> Path:
    """A Hugging Face hub cache under `root` holding `repo` at commit `sha` as `main`
    (huggingface_hub's layout: models--org--name/refs/main, snapshots/<sha>/...)."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / sha
    snap.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(sha)
    if files_from is not None:
        for f in files_from.iterdir():
            shutil.copy(f, snap / f.name)
    return snap


def test_a_hugging_face_model_id_loads_from_the_hub_cache(tmp_path, monkeypatch):
    """`--model org/name` (as vLLM, SGLang and transformers take it) is the model's snapshot in
    huggingface_hub's cache (downloaded there when missing): it said only "model directory
    Qwen/Qwen3.5-27B does not exist". Offline here: a cached id loads, the same tokens as its
    directory; one not cached (or cached without its weights) is one line naming the id; a
    path that does not exist is not taken for an id."""
    from cli_helpers import cli_many

    from hyspec.tiny import make_tiny

    sha = "0123456789abcdef0123456789abcdef01234567"
    ckpt = make_tiny("qwen3_5", tmp_path / "ckpt", seed=3)
    hub = tmp_path / "hub"
    _hub_cache(hub, "acme/tiny", sha, ckpt)
    part = _hub_cache(hub, "acme/part", sha, None)  # (a config fetched alone, no weights)
    shutil.copy(ckpt / "config.json", part / "config.json")
    gen = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "6", "--draft", "2", "--json"]
    calls = [[*gen, "--model", str(ckpt)], [*gen, "--model", "acme/tiny"], [*gen, "--model", f"acme/tiny@{sha}"],
             [*gen, "--model", "acme/missing"], [*gen, "--model", "acme/part"], [*gen, "--model", "no/such/dir"],
             [*gen, "--model", "./acme/other"],
             ["score", "--model", "acme/tiny", "--text", "def f(x): return x", "--json"],
             ["bench", "--model", "acme/tiny", "--device", "cpu", "--prompt-len", "4", "--new-tokens", "4", "--ks", "2",
              "--verify-max", "1", "--reps", "1", "--exact-prompts", "0", "--hf-tokens", "0", "--out", "b.json"]]
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    res = cli_many(calls, env=env, cwd=tmp_path)
    want = json.loads(res[0][1])["tokens"]
    for code, out, err in res[1:3]:
        assert code == 0, err
        assert json.loads(out)["tokens"] == want
    for (code, out, err), want_msg in zip(res[3:5], (
            "model directory acme/missing does not exist, and as a Hugging Face model id it is neither in the "
            "local cache nor could it be downloaded",
            "Hugging Face model acme/part: its snapshot ")):
        assert code != 0 and "Traceback" not in err, err
        msg = err.strip().splitlines()
        assert len(msg) == 1 and want_msg in msg[0], err
    for (code, _, err), path in zip(res[5:7], ("no/such/dir", "acme/other")):  # (./acme/other: a path)
        assert code != 0 and f"model directory {path} does not exist" in err and "Hugging Face" not in err, err
    assert res[7][0] == 0, res[7][2]
    assert res[8][0] == 0, res[8][2]  # the bench's results name the id (and where its snapshot lies)
    meta = json.loads((tmp_path / "b.json").read_text())["meta"]
    assert meta["config"] == "acme/tiny" and Path(meta["model_dir"]).parent.name == "snapshots", meta
    # `hyspec serve --model acme/tiny` answers to the id
    import subprocess
    import sys

    code = ("from hyspec.server import build_parser, make_app; "
            "args = build_parser().parse_args(['--model', 'acme/tiny@%s', '--no-prefix-store', '--no-warm-up']); "
            "print(make_app(args).state.hyspec.cfg.served_model_name)" % sha)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), **env})
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "acme/tiny", r.stderr[-2000:]
    # a directory that exists wins over an id of the same spelling
    from hyspec.loading import check_model_dir

    shutil.copytree(ckpt, tmp_path / "acme" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert check_model_dir("acme/tiny") == Path("acme/tiny")


def test_one_tensor_stored_under_two_spellings_is_named_as_such(ckpt):
    """A file holding `model.norm.weight` and `model.language_model.norm.weight` (both load as
    model.norm.weight): the error said the tensor "is in both model.safetensors and
    model.safetensors", the one file twice and one of the two keys."""
    t = _tensors(ckpt)
    t["model.language_model.norm.weight"] = t["model.norm.weight"] + 1
    _write(ckpt, t)
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert "model.safetensors and model.safetensors" not in msg, msg
    assert "'model.language_model.norm.weight'" in msg and "'model.norm.weight'" in msg and "twice" in msg, msg


def test_a_hub_snapshot_missing_a_shard_names_the_shard(tmp_path, monkeypatch):
    """An interrupted download leaves a hub snapshot with config.json, the index and some of
    its shards. With HF_HUB_OFFLINE (or the Hub out of reach, when huggingface_hub falls
    back to the cache) the error said the snapshot "lacks config.json or *.safetensors
    weights" and blamed HF_HUB_OFFLINE; it names the missing shard."""
    from hyspec.loading import resolve_model_dir
    from hyspec.tiny import make_tiny

    sha = "0123456789abcdef0123456789abcdef01234567"
    ckpt = make_tiny("qwen3_5", tmp_path / "ckpt", seed=3)
    snap = _hub_cache(tmp_path / "hub", "acme/sharded", sha, ckpt)
    t = load_file(str(snap / "model.safetensors"))
    (snap / "model.safetensors").unlink()
    keys = sorted(t)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    _write(snap, {k: t[k] for k in keys[: len(keys) // 2]}, names[0])  # the second shard never arrived
    weight_map = {k: names[i >= len(keys) // 2] for i, k in enumerate(keys)}
    (snap / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError) as e:
        resolve_model_dir("acme/sharded")
    msg = str(e.value)
    assert "Hugging Face model acme/sharded" in msg and names[1] in msg, msg
    assert "lacks config.json or" not in msg, msg


def test_a_path_like_that_is_not_a_path_object_still_loads(ckpt):
    """load_model / Engine.load take any os.PathLike (Path() reads it by os.fspath); the
    hub-id resolution read it by str(), which for an os.DirEntry (os.scandir) is its repr:
    "model directory <DirEntry 'ckpt'> does not exist"."""
    from hyspec.engine import Engine
    from hyspec.loading import resolve_model_dir

    entry = next(e for e in os.scandir(ckpt.parent) if e.name == ckpt.name)
    assert resolve_model_dir(entry) == ckpt
    assert load_model(entry, dtype="float32").cfg.num_hidden_layers > 0
    assert Engine.load(entry).model_dir == str(ckpt)


def test_a_cached_snapshot_without_its_tokenizer_is_completed(tmp_path, monkeypatch):
    """A hub cache holding config.json and the weights but no tokenizer.json (filled by a
    weights-only download) counted as complete: it was used without asking the Hub, and the
    model loaded with no tokenizer ("this checkpoint has no tokenizer.json") and no chat
    template. It is completed by a download; offline, it is still used as it is."""
    import huggingface_hub

    from hyspec.loading import resolve_model_dir
    from hyspec.tiny import make_tiny

    sha = "0123456789abcdef0123456789abcdef01234567"
    ckpt = make_tiny("qwen3_5", tmp_path / "ckpt", seed=3)
    snap = _hub_cache(tmp_path / "hub", "acme/notok", sha, ckpt)
    (snap / "tokenizer.json").unlink()
    calls = []

    def fake_snapshot_download(repo, revision=None, allow_patterns=None, ignore_patterns=None, local_files_only=False):
        assert allow_patterns and ignore_patterns == ["*/*"]
        calls.append(local_files_only)
        if not local_files_only and online:  # (the Hub: the missing files fetched)
            shutil.copy(ckpt / "tokenizer.json", snap / "tokenizer.json")
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    online = False  # (HF_HUB_OFFLINE or the Hub out of reach: the cached folder back as it is)
    assert resolve_model_dir("acme/notok") == snap and calls == [True, False]
    assert not (snap / "tokenizer.json").exists()
    calls.clear()
    online = True
    assert resolve_model_dir("acme/notok") == snap and calls == [True, False]
    assert (snap / "tokenizer.json").is_file()
    calls.clear()
    assert resolve_model_dir("acme/notok") == snap and calls == [True]  # (complete now: the cache alone)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_an_absent_head_dim_is_read_as_transformers_reads_it(tmp_path, arch):
    """A config.json without head_dim means 256 (transformers' default for the three
    families: its config classes fill it in), not hidden_size / heads, which refused a
    checkpoint with 256-wide heads that transformers loads ("q_proj.weight has shape ...")."""
    from hyspec.tiny import make_tiny

    d = make_tiny(arch, tmp_path / "t", vocab_size=256, hidden=32, layers=4, overrides={"head_dim": 256})
    want = load_model(d).cfg
    cfg = json.loads((d / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    del text["head_dim"]
    (d / "config.json").write_text(json.dumps(cfg))
    got = load_model(d).cfg
    assert got.head_dim == 256 and got == want


def test_a_model_id_with_a_trailing_line_break_is_no_hub_id():
    """`$` matched before a last line break: "acme/tiny\n" (a line read from a file) was taken
    as a Hugging Face id, and a download of a repository that cannot exist was tried."""
    from hyspec.loading import is_hub_id

    assert is_hub_id("acme/tiny") and is_hub_id("acme/tiny@v1.0")
    assert not is_hub_id("acme/tiny\n") and not is_hub_id("acme/tiny@main\n")
    assert not is_hub_id("acme/..") and not is_hub_id("acme/tiny@../../x")  # (no way out of the hub cache)


def test_mtp_weights_under_the_model_prefix_are_the_mtp_head(ckpt, reference):
    """Keys spelled model.mtp.* load as the MTP head (not ignored as unexpected tensors)."""
    _write(ckpt, {("model." + k if k.startswith("mtp.") else k): v for k, v in _tensors(ckpt).items()})
    m = load_model(ckpt)
    assert m.has_mtp
    _same_params(m, reference)


def test_experts_whose_gate_and_up_differ_in_width_are_named(ckpt):
    t = _per_expert(_tensors(ckpt))
    for k in [k for k in t if k.startswith("model.layers.1.mlp.experts.") and k.endswith(".up_proj.weight")]:
        t[k] = t[k][:, :-1]
    _write(ckpt, t)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight' and "
                                              r"'model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight' have shapes "
                                              r"\[64, 64\] and \[64, 63\]: their columns \(the hidden size\) differ"):
        load_model(ckpt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_decay_parameters_stay_float32_in_a_half_precision_model(zoo, dtype):
    from hyspec.config import keeps_fp32

    params = dict(load_model(zoo.path("tiny", "qwen3_next"), dtype=dtype).named_parameters())
    assert {n for n, p in params.items() if p.dtype == torch.float32} == {n for n in params if keeps_fp32(n)}
    assert any(n.endswith("dt_bias") for n in params) and any(n.endswith("A_log") for n in params)
    assert all(p.dtype in (dtype, torch.float32) for p in params.values())


def test_a_pipeline_stage_reads_only_its_own_weights():
    from hyspec.loading import stage_keeps

    assert stage_keeps("model.layers.1.mlp.gate.weight", range(2), False)
    assert not stage_keeps("model.layers.2.mlp.gate.weight", range(2), False)
    for k in ("mtp.fc.weight", "mtp.layers.0.mlp.gate.weight", "lm_head.weight", "model.norm.weight", "d2t"):
        assert not stage_keeps(k, range(2), False) and stage_keeps(k, range(2, 4), True), k
    assert stage_keeps("model.embed_tokens.weight", range(2), False)
    assert stage_keeps("model.embed_tokens.weight", range(2, 4), True)


def test_a_pipeline_stage_of_a_strided_range_is_refused(ckpt):
    with pytest.raises(ValueError, match=r"stage layers range\(0, 4, 2\) are not a contiguous range of 0\.\.3"):
        load_model(ckpt, layers=range(0, 4, 2))


def test_a_stacked_expert_of_the_right_size_but_another_shape_is_named(ckpt):
    """Only [E, H, 2I] / [E, I, H] read as stacked experts stored transposed."""
    t = _tensors(ckpt)
    k = "model.layers.1.mlp.experts.gate_up_proj"
    t[k] = t[k].reshape(t[k].shape[0], 256, 32)
    _write(ckpt, t)
    with pytest.raises(CheckpointError, match=rf"'{k}' has shape \[4, 256, 32\], expected \[4, 128, 64\]"):
        load_model(ckpt)


def test_a_tied_checkpoint_that_keeps_its_head_loads_without_warnings(ckpt):
    import warnings

    t = _tensors(ckpt)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    _write(ckpt, t)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = load_model(ckpt)
    assert not hasattr(m, "lm_head") and torch.equal(m.model.embed_tokens.weight, t["model.embed_tokens.weight"])


def test_draft_to_target_offsets_are_checked_against_the_vocabulary(ckpt):
    """mtp.d2t maps draft id i to target id i + d2t[i] (EAGLE offsets): negative offsets are
    fine, a target id of vocab_size or more is not."""
    t = _tensors(ckpt)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    d2t = torch.zeros(8, dtype=torch.long)
    d2t[4:] = torch.tensor([-4, -3, vocab - 8, vocab - 8])  # targets 0 1 2 3 0 2 vocab-2 vocab-1
    _write(ckpt, {**t, "mtp.d2t": d2t})
    assert load_model(ckpt).d2t.tolist() == d2t.tolist()
    d2t[-1] += 1  # target vocab_size
    _write(ckpt, {**t, "mtp.d2t": d2t})
    with pytest.raises(CheckpointError, match=rf"'mtp\.d2t' must map draft ids to target ids in 0\.\.{vocab - 1}"):
        load_model(ckpt)


def test_a_draft_id_mapped_below_zero_is_refused(ckpt):
    """A target id below 0 (i + d2t[i] < 0) is refused like one past the vocabulary: as an
    index into the LM head's rows (hyspec.speculative.drafter.draft_vocab) it takes a row from
    the vocabulary's end, in silence."""
    d2t = torch.zeros(8, dtype=torch.long)
    d2t[3] = -4  # draft id 3 -> target -1
    _write(ckpt, {**_tensors(ckpt), "mtp.d2t": d2t})
    with pytest.raises(CheckpointError, match=r"'mtp\.d2t' must map draft ids to target ids in 0\.\."):
        load_model(ckpt)
