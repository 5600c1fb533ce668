"""The bench's transformers baseline on an in-memory model: transformers' class of each family
built around the model's own weight tensors (no copy) decodes the same greedy tokens as
hyspec, and what it cannot wrap is named."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCHS
from hyspec.bench.hf import hf_generate, hf_model_sharing_weights
from hyspec.config import ModelConfig
from hyspec.decode import generate_plain
from hyspec.model.hybrid import HybridLM
from hyspec.tiny import init_weights, tiny_config

pytest.importorskip("transformers")


def _model(arch: str) -> HybridLM:
    cfg = ModelConfig.from_dict(tiny_config(arch))
    model = HybridLM(cfg, with_mtp=True)
    init_weights(model, torch.Generator().manual_seed(3), 0.05)
    return model.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_on_the_same_weights_decodes_the_same_tokens(arch):
    model = _model(arch)
    prompt = torch.randint(0, model.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = generate_plain(model, prompt, max_new_tokens=8).tokens
    r = hf_generate(model, prompt, 8, torch.device("cpu"), torch.float32)
    assert "skipped" not in r, r
    assert r["greedy_tokens"] == ours
    hf, missing, _ = hf_model_sharing_weights(model, torch.device("cpu"))
    assert missing == []
    # the very same tensors, not copies
    ours_sd = model.state_dict()
    shared = [n for n, p in hf.named_parameters() if n in ours_sd and p.data_ptr() == ours_sd[n].data_ptr()]
    assert len(shared) == len(list(hf.named_parameters()))


def test_a_planted_weight_change_shows():
    """The comparison is of the same weights: perturbing one of ours after wrapping changes
    transformers' logits too (shared storage), while a copy would not."""
    model = _model("qwen3_5")
    hf, _, _ = hf_model_sharing_weights(model, torch.device("cpu"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = hf(ids).logits.clone()
        model.state_dict()["lm_head.weight"].mul_(2.0)
        after = hf(ids).logits
    assert not torch.allclose(before, after)


def test_unknown_family_is_named():
    model = _model("qwen3_next")
    model.cfg.raw["model_type"] = "llama"
    with pytest.raises(ValueError, match="model_type 'llama'"):
        hf_model_sharing_weights(model, torch.device("cpu"))
    assert "llama" in hf_generate(model, [1, 2], 2, torch.device("cpu"), torch.float32)["skipped"]


def test_bench_prints_the_baseline_ratio(tmp_path, capsys):
    from hyspec.cli import main

    out = tmp_path / "b.json"
    rc = main(["bench", "--config", "tiny", "--prompt-len", "8", "--new-tokens", "8", "--ks", "1",
               "--verify-max", "2", "--reps", "1", "--exact-prompts", "0", "--hf-tokens", "4",
               "--variants", "exact", "--out", str(out)])
    assert rc == 0
    import json

    r = json.loads(out.read_text())
    assert not r["errors"] and r["hf"]["missing_keys"] == 0 and r["hf"]["hyspec_plain_vs_hf"] > 0
    assert "hyspec plain x" in capsys.readouterr().out


def test_fp8_weights_are_refused_by_name():
    """Block-FP8 weights (kept FP8 on a GPU) are not wrapped: the skip names them."""
    model = _model("qwen3_5")
    w = model.state_dict()["lm_head.weight"]
    model.lm_head.weight = torch.nn.Parameter(w.to(torch.float8_e4m3fn), requires_grad=False)  # as on a GPU
    with pytest.raises(ValueError, match="block-FP8"):
        hf_model_sharing_weights(model, torch.device("cpu"))
    assert "block-FP8" in hf_generate(model, [1, 2], 2, torch.device("cpu"), torch.float32)["skipped"]


def test_bench_without_transformers_skips_its_default_comparison_and_refuses_the_asked_one(monkeypatch, capsys):
    """transformers is in no user extra, and the GPU bench compares with it by default: the
    run failed at its end ("1 part(s) failed ... No module named 'transformers'"). The default
    is now skipped with a note; --hf-tokens given by the user is refused before any work."""
    import importlib.util

    from hyspec.bench import cli as bench_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    parse = bench_cli.build_parser().parse_args
    with pytest.raises(ValueError, match=r"--hf-tokens 4: the comparison runs transformers, which is not installed"):
        bench_cli.resolve_device(parse(["--config", "tiny", "--device", "cpu", "--hf-tokens", "4"]))
    monkeypatch.setattr(bench_cli, "DEVICE_DEFAULTS", tuple((f, t, g, 4 if f == "--hf-tokens" else c, w)
                                                            for f, t, g, c, w in bench_cli.DEVICE_DEFAULTS))
    args = parse(["--config", "tiny", "--device", "cpu"])  # (4 by default, as 32 is on a GPU)
    bench_cli.resolve_device(args)
    assert args.hf_tokens == 0 and "transformers is not installed" in capsys.readouterr().out


def test_baseline_ratio_is_ours_over_transformers(tmp_path, monkeypatch):
    """hyspec_plain_vs_hf is hyspec's plain tok/s over transformers' (x2: hyspec twice as fast)."""
    import json

    from hyspec.bench import cli as bench_cli

    monkeypatch.setattr(bench_cli, "hf_generate", lambda *a, **k: {"decode_tok_s": 0.5, "fla_importable": False})
    out = tmp_path / "b.json"
    assert bench_cli.main(["--config", "tiny", "--device", "cpu", "--prompt-len", "4", "--new-tokens", "4", "--ks", "1",
                           "--verify-max", "2", "--reps", "1", "--exact-prompts", "0", "--hf-tokens", "2",
                           "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["hf"]["hyspec_plain_vs_hf"] == pytest.approx(r["variants"]["exact"]["plain"]["tok_s"] / 0.5)
