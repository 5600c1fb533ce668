"""FastDecoder on CPU: with the torch runner (the model's own modules) its greedy output,
telemetry and per-round drafts equal hyspec.decode / hyspec.speculative.loop bitwise for every
family (the Triton runner under the interpreter: tests/test_fast_kernels.py)."""
import pytest

from hyspec.decode import generate_plain
from hyspec.gpu import FastDecoder, generate_plain_fast, generate_speculative_fast
from hyspec.core import round as round_mod
from hyspec.speculative.loop import SpecOptions, generate_speculative
from hyspec.tiny import make_tiny
from hyspec.loading import load_model

PROMPT = [5, 17, 99, 3, 250, 7, 7, 42]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("fast")
    return {a: load_model(make_tiny(a, d / a, seed=1, layers=4)) for a in ("qwen3_next", "qwen3_5", "qwen3_5_moe")}


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_torch_runner_matches_reference_loops(models, arch, monkeypatch):
    m = models[arch]
    N = 20
    ref = generate_plain(m, PROMPT, max_new_tokens=N)
    dec = FastDecoder(m, len(PROMPT) + N + 8, 3, backend="torch")
    assert generate_plain_fast(m, PROMPT, max_new_tokens=N, decoder=dec).tokens == ref.tokens
    drafts_ref = []
    orig = round_mod.draft

    def spy(backend, seqs):
        out = orig(backend, seqs)
        drafts_ref.append(list(seqs[0].round.drafts))
        return out

    monkeypatch.setattr(round_mod, "draft", spy)
    for rates in ((0.9, 0.8, 0.7, 0.6), None):
        opts = SpecOptions(k=3, forced_rates=rates)
        drafts_ref.clear()
        rs = generate_speculative(m, PROMPT, max_new_tokens=N, opts=opts, reference=ref.tokens)
        trace = []
        fs = generate_speculative_fast(m, PROMPT, max_new_tokens=N, opts=opts, reference=ref.tokens, decoder=dec,
                                       trace=trace)
        assert fs.tokens == rs.tokens == ref.tokens
        assert fs.stats["spec"] == rs.stats["spec"]
        if rates is None:  # the forced drafter replaces tokens; the MTP's own drafts must match
            assert [d for _, _, d in trace if d] == [d for d in drafts_ref if d]


def test_stop_ids_and_short_budgets(models):
    m = models["qwen3_5"]
    ref = generate_plain(m, PROMPT, max_new_tokens=12)
    stop = ref.tokens[5]
    dec = FastDecoder(m, len(PROMPT) + 20, 3, backend="torch")
    for n in (0, 1, 2, 5):
        assert generate_plain_fast(m, PROMPT, max_new_tokens=n, decoder=dec).tokens == ref.tokens[:n]
        s = generate_speculative_fast(m, PROMPT, max_new_tokens=n, opts=SpecOptions(k=3), decoder=dec)
        assert s.tokens == ref.tokens[:n]
    p = generate_plain_fast(m, PROMPT, max_new_tokens=12, stop_ids=[stop], decoder=dec)
    s = generate_speculative_fast(m, PROMPT, max_new_tokens=12, stop_ids=[stop], decoder=dec,
                                  opts=SpecOptions(k=3, forced_rates=(1.0,)), reference=ref.tokens)
    want = ref.tokens[: ref.tokens.index(stop) + 1]
    assert p.tokens == want and p.stop_reason == "eos"
    assert s.tokens == want and s.stop_reason == "eos"
