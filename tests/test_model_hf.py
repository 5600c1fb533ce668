"""hyspec's target model against transformers' implementation of the three families.

Checkpoints are written by transformers (`save_pretrained`, per-expert MoE keys, plus
random mtp.* tensors) and loaded by hyspec's loader; the transformers model that wrote
them is the reference. float32 throughout (transformers computes norms in float32 anyway).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import ARCHS
from hyspec.decode import generate_plain
from hyspec.loading import load_model
from hyspec.model.ops import StepCtx

TOL = 1e-4  # on per-token log-probs, float32
N_TOK = 75  # > 64: crosses a chunk of the chunked Gated-DeltaNet form


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logprobs(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None]).logits[0].float().log_softmax(-1)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full recomputation (no cache, no stop tokens)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _hf_save(arch: str, out: Path, *, seed: int = 0, tie: bool = False, **overrides):
    """Like hf_ref.make_hf_checkpoint (no mtp.*), with config overrides."""
    from hf_ref import _hf_classes

    from hyspec.tiny import tiny_config

    torch.manual_seed(seed)
    cfg_cls, model_cls = _hf_classes(arch)
    d = tiny_config(arch)
    for k in ("architectures", "model_type"):
        d.pop(k)
    interval = d.pop("full_attention_interval")
    d["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(d["num_hidden_layers"])]
    d["tie_word_embeddings"] = tie
    d.update(overrides)
    model = model_cls(cfg_cls(**d)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return model


@torch.no_grad()
def _spread(hf, out: Path, factor: float = 5.0):
    """Scale hf's matrices (projections, experts, embedding, head) by `factor` and save it
    again into `out`. At transformers' init (std 0.02) the layers barely move the log-probs
    of these tiny models (a norm's eps, RoPE's frequencies or the routing weights could be
    off and the log-probs still within TOL); at std 0.1 their outputs count."""
    for name, p in hf.named_parameters():
        if p.dim() >= 2 and "conv1d" not in name:
            p.mul_(factor)
    hf.save_pretrained(out)


@pytest.fixture(scope="module")
def extra_ckpts(tmp_path_factory):
    """Tied-head and odd-shape checkpoints, built once for the module."""
    out = {}
    for arch in ("qwen3_5", "qwen3_next"):
        d = tmp_path_factory.mktemp(f"hf_tied_{arch}")
        out[("tied", arch)] = (d, _hf_save(arch, d, seed=3, tie=True))
    # Gated DeltaNet with nv/nk = 3 and 12-wide heads; attention head_dim 24 (rotary dim 6)
    odd = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=12,
               linear_value_head_dim=12, head_dim=24)
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(f"hf_odd_{arch}")
        extra = dict(decoder_sparse_step=2, mlp_only_layers=[]) if arch == "qwen3_next" else {}
        out[("odd", arch)] = (d, _hf_save(arch, d, seed=4, **odd, **extra))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers(zoo, arch):
    hf = zoo.hf_model(arch)
    m = load_model(zoo.path("hf", arch), dtype="float32")
    assert m.has_mtp and m.cfg.family == ("qwen3_next" if arch == "qwen3_next" else "qwen3_5")
    ids = _ids(N_TOK)
    ref = hf_logprobs(hf, ids)
    with torch.no_grad():
        # one whole-sequence forward (chunked GDN, no cache)
        full = m(ids).log_softmax(-1)
        # cached: prefill 40 tokens, then the other 35 in one chunked forward
        cache = m.new_cache(N_TOK)
        h1 = m.forward_hidden(ids[:40], cache, StepCtx(start=0, chunked=True))
        h2 = m.forward_hidden(ids[40:], cache, StepCtx(start=40, chunked=True))
        two = m.logits(torch.cat([h1, h2])).log_softmax(-1)
        # prefill 10, then one exact decode step per token (the decode path)
        cache = m.new_cache(N_TOK)
        hs = [m.forward_hidden(ids[:10], cache, StepCtx(start=0, chunked=True))]
        for t in range(10, N_TOK):
            hs.append(m.forward_hidden(ids[t : t + 1], cache, StepCtx(start=t, exact=True)))
        steps = m.logits(torch.cat(hs)).log_softmax(-1)
    for ours in (full, two, steps):
        torch.testing.assert_close(ours, ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(zoo, arch):
    hf = zoo.hf_model(arch)
    m = load_model(zoo.path("hf", arch), dtype="float32")
    prompt = _ids(10, seed=2).tolist()
    assert generate_plain(m, prompt, max_new_tokens=32).tokens == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_tied_head_checkpoint(extra_ckpts, arch):
    d, hf = extra_ckpts[("tied", arch)]
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # transformers drops the tied copy
    m = load_model(d, dtype="float32")
    assert m.cfg.tie_word_embeddings and not hasattr(m, "lm_head") and not m.has_mtp
    ids = _ids(N_TOK, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(m(ids).log_softmax(-1), hf_logprobs(hf, ids), rtol=0, atol=TOL)


ROPE_SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24},
    "linear": {"rope_type": "linear", "factor": 2.5},
    # a long pretraining length for this 4-wide rotary: the ramp of dims ends at 1.26, past
    # the last dim (1) -- truncated to 2 (clipped at rot - 1, not rot / 2 - 1) or, untruncated,
    # kept at 1.26, both move dim 1's frequency; mscale / mscale_all_dim set the attention
    # factor (with a short length, as above, neither the clip nor the truncation shows)
    "yarn_long": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                  "mscale": 2.0, "mscale_all_dim": 1.0},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                         "truncate": False},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_rope_scaling_matches_transformers(tmp_path, arch, kind):
    """YaRN (Qwen's long-context recipe) and linear RoPE scaling, as transformers applies
    them (they once ran as plain RoPE, silently): log-probs of the whole-sequence and the
    decode paths; an unimplemented type is refused naming the field."""
    from hyspec.config import ConfigError
    from hyspec.tiny import tiny_config

    base = tiny_config(arch)
    rope = {"rope_theta": base.get("rope_theta", 10000.0),
            "partial_rotary_factor": base.get("partial_rotary_factor", 0.25), **ROPE_SCALINGS[kind]}
    hf = _hf_save(arch, tmp_path, seed=6, rope_parameters=rope)
    _spread(hf, tmp_path)
    m = load_model(tmp_path, dtype="float32")
    assert m.cfg.rope_type == kind.split("_")[0]
    ids = _ids(N_TOK, seed=7)
    ref = hf_logprobs(hf, ids)
    with torch.no_grad():
        full = m(ids).log_softmax(-1)
        cache = m.new_cache(N_TOK)
        hs = [m.forward_hidden(ids[:10], cache, StepCtx(start=0, chunked=True))]
        for t in range(10, N_TOK):
            hs.append(m.forward_hidden(ids[t: t + 1], cache, StepCtx(start=t, exact=True)))
        steps = m.logits(torch.cat(hs)).log_softmax(-1)
    for ours in (full, steps):
        torch.testing.assert_close(ours, ref, rtol=0, atol=TOL)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="rope_type 'dynamic' is not supported"):
        load_model(tmp_path, dtype="float32")


def test_a_top_level_yarn_pretraining_length_matches_transformers(tmp_path):
    """config.json with YaRN's original_max_position_embeddings both at the top level (64)
    and in rope_parameters (24): the model transformers loads computes with the top-level
    one (its AutoConfig alone still shows 24); hyspec used 24 (log-probs off by ~0.05 here;
    16 at the top would give this 8-wide rotary the same ramp as 24: no test)."""
    import transformers

    rope = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, **ROPE_SCALINGS["yarn"]}
    _hf_save("qwen3_5", tmp_path, seed=6, rope_parameters=rope)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["original_max_position_embeddings"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from hf_ref import _hf_classes

    hf = _hf_classes("qwen3_5")[1].from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    transformers.logging.set_verbosity_error()
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 64
    ids = _ids(N_TOK, seed=7)
    with torch.no_grad():
        ours = load_model(tmp_path, dtype="float32")(ids).log_softmax(-1)
    torch.testing.assert_close(ours, hf_logprobs(hf, ids), rtol=0, atol=TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_odd_gdn_shapes_match_transformers(extra_ckpts, arch):
    """nv/nk = 3 (Qwen3-Next groups value heads under key heads inside in_proj_qkvz /
    in_proj_ba: a wrong grouping only shows with r > 1, and an odd r catches more) and
    12-wide DeltaNet heads; for Qwen3-Next also decoder_sparse_step = 2 (dense and MoE
    layers alternate)."""
    d, hf = extra_ckpts[("odd", arch)]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"] == 3
    m = load_model(d, dtype="float32")
    if arch == "qwen3_next":
        assert [hasattr(layer.mlp, "experts") for layer in m.model.layers] == [False, True, False, True]
    ids = _ids(N_TOK, seed=6)
    ref = hf_logprobs(hf, ids)
    with torch.no_grad():
        torch.testing.assert_close(m(ids).log_softmax(-1), ref, rtol=0, atol=TOL)
        cache = m.new_cache(N_TOK)
        hs = [m.forward_hidden(ids[:66], cache, StepCtx(start=0, chunked=True))]
        for t in range(66, N_TOK):
            hs.append(m.forward_hidden(ids[t : t + 1], cache, StepCtx(start=t, exact=True)))
        torch.testing.assert_close(m.logits(torch.cat(hs)).log_softmax(-1), ref, rtol=0, atol=TOL)
    prompt = _ids(8, seed=7).tolist()
    assert generate_plain(m, prompt, max_new_tokens=32).tokens == hf_greedy(hf, prompt, 32)


def test_norm_eps_rope_theta_and_unnormalised_routing_match_transformers(tmp_path):
    """The tiny configs keep rms_norm_eps = 1e-6 (every norm's default), rope_theta = 10000
    and Qwen3-Next's norm_topk_prob true, so a norm that ignored the configured eps (the
    model's, the attention's q/k norms, the DeltaNet's gated norm), a hard-wired theta or
    routing that always renormalised (or took the softmax over the top k only) matched
    transformers there; here all three differ from those defaults."""
    rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    hf = _hf_save("qwen3_next", tmp_path, seed=9, rms_norm_eps=0.05, norm_topk_prob=False, rope_parameters=rope)
    _spread(hf, tmp_path)
    m = load_model(tmp_path, dtype="float32")
    assert (m.cfg.rms_norm_eps, m.cfg.rope_theta, m.cfg.norm_topk_prob) == (0.05, 1e6, False)
    ids = _ids(N_TOK, seed=10)
    with torch.no_grad():
        torch.testing.assert_close(m(ids).log_softmax(-1), hf_logprobs(hf, ids), rtol=0, atol=TOL)


def test_qwen3_5_moe_ignores_qwen3_next_routing_fields_as_transformers_does(tmp_path):
    """transformers' Qwen3.5-MoE makes every layer MoE and always renormalises the top-k
    weights; a config carrying Qwen3-Next's norm_topk_prob false, decoder_sparse_step or
    mlp_only_layers loaded here as other routing (false: log-probs off by ~2) or was refused
    ("intermediate_size must be positive when some layers are dense")."""
    hf = _hf_save("qwen3_5_moe", tmp_path, seed=8, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[0])
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["norm_topk_prob"], cfg["decoder_sparse_step"], cfg["mlp_only_layers"]) == (False, 2, [0])
    m = load_model(tmp_path, dtype="float32")
    ids = _ids(24, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(m(ids).log_softmax(-1), hf_logprobs(hf, ids), rtol=0, atol=TOL)
