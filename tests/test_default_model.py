"""The embedded default model: size budget, loads with no path, speculation is exact on it,
and its MTP head really drafts (acceptance well above a random head's 1.0)."""

from pathlib import Path

import pytest

from hyspec.cli import main as cli_main
from hyspec.engine import DEFAULT_MODEL_DIR, Engine
from hyspec.speculative.telemetry import SpecTelemetry
from hyspec.train.corpus import load_corpus

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def eng():
    return Engine.load()


@pytest.fixture(scope="module")
def heldout():
    return load_corpus(ROOT / "data/pystdlib_corpus.jsonl.xz")["heldout"]


def test_checkpoint_and_tokenizer_fit_24mb():
    files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    total = sum((DEFAULT_MODEL_DIR / f).stat().st_size for f in files)
    assert total <= 24_000_000, total


def test_loads_without_a_path_with_mtp_and_tokenizer(eng):
    assert eng.model.cfg.model_type == "qwen3_5_text" and eng.model.has_mtp
    assert eng.eos_ids == (0,)
    text = "def fibonacci(n):\n    return n\n"
    assert eng.decode(eng.encode(text)) == text


def test_cli_generate_draft3_equals_draft0_on_the_default(capsys):
    import json

    outs = []
    for k in ("0", "3"):
        assert cli_main(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "64",
                         "--draft", k, "--ignore-eos", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["tokens"] == outs[1]["tokens"] and len(outs[0]["tokens"]) == 64
    assert outs[1]["stats"]["spec"]["acceptance_length"] > 1.5


def test_heldout_prompts_acceptance_and_perplexity(eng, heldout):
    tel = SpecTelemetry()
    for _, text in heldout[:3]:
        prompt = eng.encode(text)[:96]
        plain = eng.generate(prompt, max_new_tokens=48, draft=0, ignore_eos=True)
        spec = eng.generate(prompt, max_new_tokens=48, draft=3, ignore_eos=True)
        assert spec.tokens == plain.tokens
        tel.merge(SpecTelemetry.from_dict(spec.stats["spec"]))
    # a random MTP head gives 1.0 here; the trained one gives ~2.8 (bench/results/default_model_eval.json)
    assert tel.acceptance_length > 1.5, tel.summary_line()
    # the shipped weights are the trained ones: held-out perplexity is far below the vocabulary's 4096
    _, text = heldout[0]
    assert eng.score(eng.encode(text)[:400])["perplexity"] < 30
