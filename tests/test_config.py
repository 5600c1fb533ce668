"""hyspec.config without a checkpoint: config.json dicts parsed into ModelConfig (defaults,
the fields transformers reads, what is refused), and the small helpers beside it."""

from __future__ import annotations

import json

import pytest

from hyspec.config import ConfigError, ModelConfig, finite_json, keeps_fp32
from hyspec.tiny import tiny_config


def _cfg(arch: str = "qwen3_5", **patch) -> ModelConfig:
    return ModelConfig.from_dict({**tiny_config(arch), **patch})


def test_the_decay_parameters_are_the_fp32_ones():
    assert keeps_fp32("model.layers.0.linear_attn.A_log") and keeps_fp32("mtp.layers.0.linear_attn.dt_bias")
    assert not keeps_fp32("model.layers.0.linear_attn.in_proj_a.weight")


def test_finite_json_clears_non_finite_floats_at_every_depth():
    x = {"loss": [1.5, float("nan")], "ppl": (float("inf"), 2), "last": float("-inf"), "n": 3}
    assert finite_json(x) == {"loss": [1.5, None], "ppl": [None, 2], "last": None, "n": 3}
    json.dumps(finite_json(x), allow_nan=False)


def test_yarn_defaults_and_a_factor_from_the_context_lengths():
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert dict(_cfg(rope_scaling=rope).rope_scaling) == {
        "factor": 4.0, "original_max_position_embeddings": 64.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": True}
    no_factor = {"rope_type": "yarn", "original_max_position_embeddings": 64}
    assert dict(_cfg(rope_scaling=no_factor, max_position_embeddings=512).rope_scaling)["factor"] == 8.0


@pytest.mark.parametrize("max_pos", ["absent", None])
def test_yarn_without_factor_or_max_position_embeddings_uses_the_default_length(max_pos):
    """The factor is max_position_embeddings / original_max_position_embeddings; with
    max_position_embeddings left out it was taken as 0 (factor 0: NaN and inf RoPE
    frequencies, garbage logits) while the config reported 32768, and null was a TypeError."""
    import torch

    from hyspec.model.ops import rope_frequencies

    d = {**tiny_config("qwen3_5"), "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64}}
    if max_pos == "absent":
        del d["max_position_embeddings"]
    else:
        d["max_position_embeddings"] = max_pos
    cfg = ModelConfig.from_dict(d)
    assert cfg.max_position_embeddings == 32768
    assert dict(cfg.rope_scaling)["factor"] == 32768 / 64
    inv_freq, scale = rope_frequencies(cfg)
    assert bool(torch.isfinite(inv_freq).all()) and scale > 1
    with pytest.raises(ConfigError, match="'max_position_embeddings' must be an integer >= 1, got 'big'"):
        ModelConfig.from_dict({**d, "max_position_embeddings": "big"})


def test_moe_layers_follow_the_sparse_step_and_the_dense_only_layers():
    cfg = _cfg("qwen3_next", decoder_sparse_step=2, mlp_only_layers=[3])
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert [_cfg("qwen3_next").is_moe_layer(i) for i in range(5)] == [True, False, True, True, True]  # 4: MTP


def test_an_eos_id_equal_to_the_vocabulary_size_is_outside_it():
    with pytest.raises(ConfigError, match="outside the vocabulary of 512"):
        _cfg(eos_token_id=512)
    assert _cfg(eos_token_id=[511, 0]).eos_token_ids == (511, 0)


def test_a_wrapper_config_lends_its_eos_to_text_config():
    text = {k: v for k, v in tiny_config("qwen3_5").items() if k != "eos_token_id"}
    d = {"model_type": "qwen3_5", "text_config": {**text, "model_type": "qwen3_5_text"}, "eos_token_id": [7, 9]}
    assert ModelConfig.from_dict(d).eos_token_ids == (7, 9)
    d["text_config"]["eos_token_id"] = 3  # text_config's own wins
    assert ModelConfig.from_dict(d).eos_token_ids == (3,)


def test_layer_types_from_the_full_attention_interval():
    assert _cfg(full_attention_interval=2).layer_types == ("linear_attention", "full_attention") * 2
    assert _cfg().layer_types == ("linear_attention",) * 3 + ("full_attention",)
    for bad in (0, True, 2.0):  # (true was read as 1: every layer full attention, named only by missing tensors)
        with pytest.raises(ConfigError, match="field 'full_attention_interval' must be a positive int"):
            _cfg(full_attention_interval=bad)


def test_rope_parameters_theta_wins_over_a_top_level_one():
    """As transformers' standardize_rope_params (setdefault): the top-level value is the fallback."""
    assert _cfg(rope_theta=5e5, rope_parameters={"rope_theta": 1e6}).rope_theta == 1e6
    assert _cfg(rope_theta=5e5, rope_parameters={"rope_type": "default"}).rope_theta == 5e5


def test_moe_routing_fields_by_family():
    """Qwen3-Next reads norm_topk_prob (default true), decoder_sparse_step and mlp_only_layers;
    Qwen3.5-MoE's model reads none of them (every layer MoE, top-k always renormalised)."""
    nxt = {k: v for k, v in tiny_config("qwen3_next").items() if k != "norm_topk_prob"}
    assert ModelConfig.from_dict(nxt).norm_topk_prob is True
    assert ModelConfig.from_dict({**nxt, "norm_topk_prob": False}).norm_topk_prob is False
    moe = _cfg("qwen3_5_moe", norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[0])
    assert (moe.norm_topk_prob, moe.decoder_sparse_step, moe.mlp_only_layers) == (True, 1, ())
    assert all(moe.is_moe_layer(i) for i in range(4))


def test_mtp_layers_under_their_other_name():
    d = {k: v for k, v in tiny_config("qwen3_5").items() if k != "mtp_num_hidden_layers"}
    assert ModelConfig.from_dict({**d, "num_nextn_predict_layers": 1}).mtp_num_hidden_layers == 1
    assert ModelConfig.from_dict(d).mtp_num_hidden_layers == 0


def test_a_wrapper_config_lends_its_mamba_ssm_dtype():
    text = {**tiny_config("qwen3_5"), "model_type": "qwen3_5_text"}
    d = {"model_type": "qwen3_5", "text_config": text, "mamba_ssm_dtype": "bf16"}
    assert ModelConfig.from_dict(d).mamba_ssm_dtype == "bfloat16"


def test_generation_config_eos_ids_join_config_jsons(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**tiny_config("qwen3_5"), "eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 512}))
    with pytest.raises(ConfigError, match=r"generation_config\.json: eos_token_id must be token ids below the "
                                          r"vocabulary size 512, got 512"):
        ModelConfig.from_dir(tmp_path)


def test_generation_config_sampling_defaults(tmp_path):
    """checkpoint_sampling_defaults: with do_sample true the recommended temperature, top_k,
    top_p, min_p and repetition_penalty (Qwen's files: 0.6 / 20 / 0.95); with do_sample
    false or absent (transformers then decodes greedily) the repetition_penalty alone; a
    value the sampler refuses is a ConfigError naming the file and the field."""
    from hyspec.config import checkpoint_sampling_defaults as defaults

    g = tmp_path / "generation_config.json"
    assert defaults(tmp_path) == {}
    g.write_text(json.dumps({"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                             "min_p": 0, "repetition_penalty": 1.05, "max_new_tokens": 9}))
    assert defaults(tmp_path) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
                                  "repetition_penalty": 1.05}
    g.write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.1}))
    assert defaults(tmp_path) == {"repetition_penalty": 1.1}
    g.write_text(json.dumps({"do_sample": True, "top_k": -1}))
    assert defaults(tmp_path) == {"top_k": 0}
    for bad, what in (({"do_sample": "yes"}, "do_sample must be true or false"),
                      ({"do_sample": True, "top_k": 2.5}, "top_k must be an integer, got 2.5"),
                      ({"do_sample": True, "temperature": "hot"}, "temperature must be a number"),
                      ({"do_sample": True, "top_p": 1.5}, "top_p"), ([1], "top level must be a JSON object")):
        g.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=r"generation_config\.json: .*" + what.split(",")[0]):
            defaults(tmp_path)


def test_integral_floats_are_integers_and_infinity_is_no_number():
    assert _cfg(intermediate_size=128.0, max_position_embeddings=4096.0).intermediate_size == 128
    with pytest.raises(ConfigError, match="'intermediate_size' must be an integer >= 0, got 128.5"):
        _cfg(intermediate_size=128.5)
    with pytest.raises(ConfigError, match="'rms_norm_eps' must be a positive number, got inf"):
        _cfg(rms_norm_eps=float("inf"))
