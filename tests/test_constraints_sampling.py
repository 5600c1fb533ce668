"""Constrained rejection sampling is distribution-exact under speculation.

On a 16-token model (tests/test_spec_sampling_e2e.py's 2-layer hybrid) with its own
byte-level tokenizer.json and the grammar [ab]{2,4} (112 token sequences, the longest 5
tokens with EOS), the distribution of complete outputs with --draft 3 matches the exact
constrained distribution (enumerated from the target's masked rows: plain sampling's
distribution) and the --draft 0 samples; the same tests reject an always-accept rule.

Statistics: chi-square over complete outputs (cells with expected count < 5 pooled, by the
exact probabilities, never by the data), ALPHA = 1e-3 per test; fixed seeds, so the test is
deterministic. Measured (torch 2.13 CPU, float32): plain vs exact p = 0.36, draft 3 vs exact
p = 0.62, draft 3 vs plain p = 0.60 (500 samples each); always accept: p ~ 1e-54 and 3e-30
(200 samples).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from hyspec.constraints import make_constraint  # noqa: E402
from hyspec.decode import generate_plain  # noqa: E402
from hyspec.sampling import SamplingParams, row_probs  # noqa: E402
from hyspec.speculative.loop import SpecOptions, generate_speculative  # noqa: E402

EOS = 0
ALPHA = 1e-3


T16_VOCAB = {"<|endoftext|>": 0, "a": 1, "b": 2, "c": 3, "d": 4, "ab": 5, "ba": 6, "aa": 7, "bb": 8, "abc": 9,
             "e": 10, "f": 11, "bc": 12, "ac": 13, "g": 14, "h": 15}
T16_MERGES = [("a", "b"), ("b", "a"), ("a", "a"), ("b", "b"), ("ab", "c"), ("b", "c"), ("a", "c")]
GRAMMAR16 = "[ab]{2,4}"
PROMPT16 = [3, 7, 1, 5]
N_DRAW = 500  # per arm
N_BIASED = 200
MAX16 = 8  # longer than any output of the grammar (4 letters, EOS)
T1 = SamplingParams(temperature=1.0)


def write_t16_tokenizer(path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=T16_VOCAB, merges=T16_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def t16(tmp_path_factory):
    from test_spec_sampling_e2e import STD, write_tiny_hybrid

    from hyspec.loading import load_model

    d = write_tiny_hybrid(tmp_path_factory.mktemp("t16"), seed=0, std=STD)
    write_t16_tokenizer(d)
    model = load_model(d, dtype="float32")
    return model, make_constraint(d, "regex", GRAMMAR16)


def exact_outputs(model, c) -> dict[tuple, float]:
    """{complete output (ending in EOS): probability} under constrained plain sampling."""
    out: dict[tuple, float] = {}

    def expand(prefix: list[int], prob: float) -> None:
        with torch.no_grad():
            logits = model(torch.tensor(PROMPT16 + prefix))[-1]
        allow = c.allowed(prefix)
        p = row_probs(logits.masked_fill(~allow, float("-inf")), PROMPT16 + prefix, T1)
        for t, pt in enumerate(p.tolist()):
            if pt <= 0.0:
                continue
            if t == EOS:
                out[tuple(prefix + [t])] = prob * pt
            else:
                expand(prefix + [t], prob * pt)

    expand([], 1.0)
    assert abs(sum(out.values()) - 1.0) < 1e-6
    return out


def _groups(exact: dict, n: int) -> list[list]:
    cells = sorted(exact, key=lambda s: (-exact[s], s))
    big = [[s] for s in cells if exact[s] * n >= 5]
    rest = [s for s in cells if exact[s] * n < 5]
    if rest:
        if sum(exact[s] for s in rest) * n >= 5 or not big:
            big.append(rest)
        else:
            big[-1] = big[-1] + rest
    return big


def gof_pvalue(samples: list[tuple], exact: dict) -> float:
    from scipy import stats

    if any(s not in exact for s in samples):
        return 0.0
    counts = Counter(samples)
    groups = _groups(exact, len(samples))
    obs = np.array([sum(counts[s] for s in g) for g in groups], dtype=float)
    exp = np.array([sum(exact[s] for s in g) for g in groups]) * len(samples)
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def two_sample_pvalue(a: list[tuple], b: list[tuple], exact: dict) -> float:
    from scipy import stats

    groups = _groups(exact, min(len(a), len(b)))
    index = {s: g for g, cells in enumerate(groups) for s in cells}
    table = np.zeros((2, len(groups) + 1))
    for row, xs in enumerate((a, b)):
        for s in xs:
            table[row, index.get(s, len(groups))] += 1
    table = table[:, table.sum(axis=0) > 0]
    return float(stats.chi2_contingency(table, correction=False).pvalue)


def draw(model, c, draft: int, seeds, accepted: list | None = None) -> list[tuple]:
    out = []
    for s in seeds:
        params = SamplingParams(temperature=1.0, seed=s)
        if draft:
            res = generate_speculative(model, PROMPT16, max_new_tokens=MAX16, opts=SpecOptions(k=draft),
                                       params=params, stop_ids=(EOS,), constraint=c.clone())
        else:
            res = generate_plain(model, PROMPT16, max_new_tokens=MAX16, params=params, stop_ids=(EOS,),
                                 constraint=c.clone())
        assert res.stop_reason == "eos"
        out.append(tuple(res.tokens))
        if accepted is not None:
            accepted.append(res.stats["spec"]["accepted"])
    return out


@pytest.fixture(scope="module")
def exact16(t16):
    return exact_outputs(*t16)


@pytest.fixture(scope="module")
def plain16(t16):
    return draw(*t16, 0, range(10_000, 10_000 + N_DRAW))


def test_constrained_sampling_is_distribution_exact(t16, exact16, plain16):
    model, c = t16
    assert len(exact16) > 50 and max(exact16.values()) < 0.2  # many outputs, none dominant
    assert sum(p for s, p in exact16.items() if len(s) >= 4) > 0.3  # long enough for 3 drafts to matter
    accepted: list[int] = []
    spec = draw(model, c, 3, range(N_DRAW), accepted)
    assert sum(accepted) > N_DRAW // 2  # drafts were accepted (and rejected: residuals were drawn)
    p_plain, p_spec = gof_pvalue(plain16, exact16), gof_pvalue(spec, exact16)
    p_two = two_sample_pvalue(spec, plain16, exact16)
    assert p_plain > ALPHA and p_spec > ALPHA and p_two > ALPHA, (p_plain, p_spec, p_two)
    print(f"p-values: plain vs exact {p_plain:.3g}, draft 3 vs exact {p_spec:.3g}, draft 3 vs plain {p_two:.3g}")


def _always_accept(p_rows, q_rows, drafts, seed, position):
    from hyspec.sampling import speculative_sample

    k = len(drafts)
    tok = speculative_sample(p_rows[k:], p_rows[:0], [], seed, position + k)[1]
    return k, tok


def test_biased_acceptance_is_caught(t16, exact16, plain16, monkeypatch):
    """The same tests, with an always-accept rule in the loop, must fail."""
    import importlib

    for name in ("hyspec.speculative.loop", "hyspec.core.round"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "speculative_sample"):
            monkeypatch.setattr(mod, "speculative_sample", _always_accept)
    model, c = t16
    biased = draw(model, c, 3, range(50_000, 50_000 + N_BIASED))
    p_exact, p_two = gof_pvalue(biased, exact16), two_sample_pvalue(biased, plain16, exact16)
    print(f"always accept: vs exact {p_exact:.3g}, vs plain {p_two:.3g}")
    assert p_exact < ALPHA and p_two < ALPHA, (p_exact, p_two)
