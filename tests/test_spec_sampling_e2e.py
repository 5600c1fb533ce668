"""End-to-end sampling checks of the speculative loop on a tiny random checkpoint.

What is checked (the sampling part of docs/sampling.md):

* **Lossless** (rejection mode): the first 3 tokens sampled with ``SpecOptions(k=3)``
  follow the same distribution as plain sampling.  Every arm is compared with the
  *exact* distribution of the first 3 tokens (computed by expanding the target's
  next-token distributions over every 1- and 2-token continuation of the prompt) by a
  chi-square goodness-of-fit test, and the speculative arm is also compared with the
  plain arm by a two-sample (contingency) chi-square test.
* The **same tests reject** two deliberately biased acceptance rules (always accept;
  residual = p instead of max(0, p - q)), so they have the power to catch a wrong rule.
* Same seed => identical output (rejection mode, plain and speculative); coupled mode
  => speculative output == plain output token for token for K in {1, 3, 5}.
* Filters (top-k / top-p / min-p) and penalties (repetition / frequency / presence) are
  applied identically in plain and speculative decoding: token-exact in coupled and
  greedy mode, and distributionally (exact goodness of fit) in rejection mode.
* ``Engine.generate(num_samples=N)``.

Statistics: every test uses fixed seeds, so it is deterministic; ALPHA is the
significance level of each test.  A test is the Bonferroni combination of one joint
test (cells of the 3-token joint distribution) and three per-position marginal tests:
p = min(1, 4 * min(p_joint, p_1, p_2, p_3)).  Cells whose expected count is below 5 are
pooled (the pooling is decided from the exact probabilities, never from the data).  A
token sequence the exact distribution gives probability 0 makes the p-value 0.

The checkpoint is a 2-layer hybrid (one Gated-DeltaNet layer, one full-attention layer,
plus the MTP head) written with the same pieces as :func:`hyspec.tiny.make_tiny`
(``tiny_config`` + ``init_weights``); two layers instead of make_tiny's minimum hybrid of
four keep the ~3000 sampled generations of this file inside its time budget.

Measured p-values with the seeds below (torch 2.13 CPU, float32):

    arm (N)                                  vs exact      vs plain (two-sample)
    plain (600)                              0.63          -
    speculative k=3, pending (600)           0.012         0.50
    speculative k=3, no pending (500)        0.22          0.49
    filters + penalties, no pending (400)    1.0           -
    always accept, pending (150)             6e-34         6e-21      <- must fail
    always accept, no pending (150)          2e-34         5e-22      <- must fail
    residual = p, no pending (500)           8e-9          9e-8       <- must fail
    --adaptive, no pending (300)             0.36          -
    --p-min 0.2, no pending (300)            (was 4e-10 before the fix: see test_pmin_...)

Offline, with 3000 speculative samples per form (other seeds) the exact test gave p = 0.31
(pending) and 0.37 (no pending).  residual = p in the pending form, where only tokens 2
and 3 are drafts, gave p = 3e-5 .. 1.5e-3 at N = 800 depending on the seeds: not reliably
below ALPHA, hence it is asserted in the no-pending form only.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

import hyspec.sampling as sampling_mod
import hyspec.core.round as round_mod
from hyspec.config import ModelConfig
from hyspec.decode import generate_plain
from hyspec.engine import Engine, derive_seed
from hyspec.loading import load_model
from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx
from hyspec.sampling import SamplingParams, row_probs
from hyspec.speculative.loop import SpecOptions, generate_speculative
from hyspec.tiny import init_weights, tiny_config

ALPHA = 1e-3  # significance level of every distribution test in this file
# the tests of the module-scoped draws (plain_t1, spec_t1, spec_t1_np: ~16 s each) run on one
# pytest-xdist worker (the suite runs with --dist loadgroup), so the draws are made once
DRAWS = pytest.mark.xdist_group("spec_sampling_e2e_draws")
VOCAB = 16
HIDDEN = 32
STD = 0.3  # weight scale: next-token entropy ~2 nats of log(16) = 2.77, top token ~0.25-0.45
CKPT_SEED = 0
PROMPT = [3, 7, 1, 5]
N_TOK = 3  # the tested prefix: the first 3 generated tokens
K = 3

# Sample sizes, chosen for power within ~60 s (a speculative generation costs ~10-25 ms
# on one busy CPU core).  Measured p-values: see the module docstring.
N_PLAIN = 600  # plain arm: the --draft 0 reference
N_SPEC = 600  # speculative, prefill token pending (what `--draft 3` runs)
N_SPEC_NP = 500  # speculative, no pending: the first round decides all 3 tokens
N_ALWAYS = 150  # biased: always accept (a gross bias)
N_RESID = 500  # biased: residual = p (a subtle bias)
N_FILTERED = 400  # filters + penalties, rejection mode
N_PMIN = 300  # drafter options that change the number of drafts (--p-min, --adaptive)

T1 = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.5,
                          frequency_penalty=0.4, presence_penalty=0.3, penalty_last_n=-1)


# --------------------------------------------------------------------------------------
# The checkpoint
# --------------------------------------------------------------------------------------


def write_tiny_hybrid(out: Path, *, seed: int, std: float, vocab: int = VOCAB, hidden: int = HIDDEN) -> Path:
    """make_tiny's recipe with 2 layers: [linear_attention, full_attention] + MTP head."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config("qwen3_5", vocab_size=vocab, hidden=hidden, layers=2)
    cfg["full_attention_interval"] = 2
    model = HybridLM(ModelConfig.from_dict(cfg), with_mtp=True)
    init_weights(model, torch.Generator().manual_seed(seed), std)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_tiny_hybrid(tmp_path_factory.mktemp("tiny_e2e"), seed=CKPT_SEED, std=STD)


@pytest.fixture(scope="module")
def model(ckpt) -> HybridLM:
    m = load_model(ckpt, dtype="float32")
    assert m.has_mtp and set(m.cfg.layer_types) == {"linear_attention", "full_attention"}
    return m


# --------------------------------------------------------------------------------------
# Exact distribution of the first N_TOK tokens, and the tests
# --------------------------------------------------------------------------------------


@torch.no_grad()
def next_probs(model: HybridLM, seq: list[int], params: SamplingParams) -> torch.Tensor:
    """What plain sampling draws from after `seq`: row_probs of the full forward's last row
    (penalty history = the whole sequence, as plain decoding sees it)."""
    logits = model(torch.tensor(seq))[-1]
    return row_probs(logits, seq, params)


def exact_joint(model: HybridLM, prompt: list[int], params: SamplingParams, n: int = N_TOK) -> dict:
    """{(t1..tn): probability} for the first n sampled tokens (by enumeration)."""
    joint: dict[tuple[int, ...], float] = {}

    def expand(prefix: list[int], prob: float) -> None:
        p = next_probs(model, prompt + prefix, params)
        for t, pt in enumerate(p.tolist()):
            if pt <= 0.0:
                continue
            if len(prefix) + 1 == n:
                joint[tuple(prefix + [t])] = prob * pt
            else:
                expand(prefix + [t], prob * pt)

    expand([], 1.0)
    total = sum(joint.values())
    assert abs(total - 1.0) < 1e-6
    return joint


def _marginal(joint: dict, i: int) -> dict:
    out: dict = {}
    for cell, pr in joint.items():
        out[(cell[i],)] = out.get((cell[i],), 0.0) + pr
    return out


def _groups(exact: dict, n: int) -> list[list]:
    """Cells with expected count n*p >= 5 alone; the rest pooled into one group (merged
    into the smallest single cell if it still expects < 5)."""
    cells = sorted(exact, key=lambda c: (-exact[c], c))
    big = [[c] for c in cells if exact[c] * n >= 5]
    rest = [c for c in cells if exact[c] * n < 5]
    if rest:
        if sum(exact[c] for c in rest) * n >= 5 or not big:
            big.append(rest)
        else:
            big[-1] = big[-1] + rest
    return big


def _project(samples: list[tuple], i: int | None) -> list[tuple]:
    return samples if i is None else [(s[i],) for s in samples]


def gof_pvalue(samples: list[tuple], joint: dict) -> float:
    """Goodness of fit of samples (tuples of N_TOK tokens) to the exact joint distribution:
    Bonferroni over the joint and the N_TOK marginals."""
    if any(tuple(s) not in joint for s in samples):
        return 0.0  # a sequence plain sampling can never produce
    ps = []
    for i in [None, *range(N_TOK)]:
        exact = joint if i is None else _marginal(joint, i)
        counts = Counter(_project(samples, i))
        groups = _groups(exact, len(samples))
        if len(groups) < 2:
            continue
        obs = np.array([sum(counts[c] for c in g) for g in groups], dtype=float)
        exp = np.array([sum(exact[c] for c in g) for g in groups]) * len(samples)
        exp *= obs.sum() / exp.sum()
        ps.append(float(stats.chisquare(obs, exp).pvalue))
    return min(1.0, len(ps) * min(ps))


def two_sample_pvalue(a: list[tuple], b: list[tuple], joint: dict) -> float:
    """Are a and b drawn from the same distribution?  Contingency chi-square over cells
    pooled by the exact probabilities (expected >= 5 in the smaller sample); Bonferroni
    over the joint and the marginals."""
    n = min(len(a), len(b))
    ps = []
    for i in [None, *range(N_TOK)]:
        exact = joint if i is None else _marginal(joint, i)
        groups = _groups(exact, n)
        index = {c: g for g, cells in enumerate(groups) for c in cells}
        table = np.zeros((2, len(groups) + 1))  # last column: sequences outside the support
        for row, xs in enumerate((a, b)):
            for c in _project(xs, i):
                table[row, index.get(tuple(c), len(groups))] += 1
        table = table[:, table.sum(axis=0) > 0]
        if table.shape[1] < 2:
            continue
        ps.append(float(stats.chi2_contingency(table, correction=False).pvalue))
    return min(1.0, len(ps) * min(ps))


# --------------------------------------------------------------------------------------
# Drawing samples
# --------------------------------------------------------------------------------------


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "seed": seed})


def draw_plain(model, params, seeds) -> list[tuple]:
    return [tuple(generate_plain(model, PROMPT, max_new_tokens=N_TOK, params=_with_seed(params, s)).tokens)
            for s in seeds]


def draw_spec(model, params, seeds, *, prime_pending: bool = True, **spec_opts) -> list[tuple]:
    """The first N_TOK tokens of speculative generations whose first round drafts K tokens:
    with the prefill's token pending (the default, what `--draft 3` runs) the round decides
    tokens 2..K+2, so generate K+2 tokens; without it the round decides tokens 1..K+1, so
    generate K+1 (a round never drafts more than the tokens still to emit, minus its bonus)."""
    opts = SpecOptions(k=K, prime_pending=prime_pending, **spec_opts)
    max_new = K + 2 if prime_pending else K + 1
    out = []
    for s in seeds:
        res = generate_speculative(model, PROMPT, max_new_tokens=max_new, opts=opts, params=_with_seed(params, s))
        if not opts.p_min:
            assert res.stats["spec"]["drafted"] >= K  # the first round did draft K tokens
        out.append(tuple(res.tokens[:N_TOK]))
    return out


# Seed ranges of the arms are disjoint: each arm's samples are independent of the others'.
SEEDS_PLAIN = range(100_000, 100_000 + N_PLAIN)
SEEDS_SPEC = range(0, N_SPEC)
SEEDS_SPEC_NP = range(500_000, 500_000 + N_SPEC_NP)
SEEDS_ALWAYS = range(200_000, 200_000 + N_ALWAYS)
SEEDS_RESID = range(300_000, 300_000 + N_RESID)
SEEDS_FILTERED = range(400_000, 400_000 + N_FILTERED)


@pytest.fixture(scope="module")
def joint_t1(model) -> dict:
    return exact_joint(model, PROMPT, T1)


@pytest.fixture(scope="module")
def plain_t1(model) -> list[tuple]:
    return draw_plain(model, T1, SEEDS_PLAIN)


@pytest.fixture(scope="module")
def spec_t1(model) -> list[tuple]:
    return draw_spec(model, T1, SEEDS_SPEC, prime_pending=True)


@pytest.fixture(scope="module")
def spec_t1_np(model) -> list[tuple]:
    return draw_spec(model, T1, SEEDS_SPEC_NP, prime_pending=False)


# --------------------------------------------------------------------------------------
# The checkpoint is what the statistics need
# --------------------------------------------------------------------------------------


def test_checkpoint_is_peaked_and_drafter_differs(model) -> None:
    """Target rows are peaked but not one-hot, and the MTP's q differs clearly from p (so
    accept, reject and the residual are all exercised)."""
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        _, post = model.forward_states(ids, None, StepCtx(chunked=True))
        p = torch.softmax(model.logits(post[-1:]).double(), -1)[0]  # row predicting position P
        # no-pending form: pairs (prompt[i+1], h_i); the last pair predicts position P too
        h = model.mtp_hidden(ids[1:], post[:-1], StepCtx(start=0), model.new_draft_kv(16))
        q = torch.softmax(model.logits(h[-1:]).double(), -1)[0]
    entropy = float(-(p * p.log()).sum())
    assert 0.5 < entropy < 0.8 * math.log(VOCAB), entropy
    assert 0.2 < float(p.max()) < 0.95
    tv = 0.5 * float((p - q).abs().sum())
    assert 0.2 < tv < 0.8, tv  # the acceptance probability of the first draft is 1 - tv


# --------------------------------------------------------------------------------------
# Lossless: speculative == plain in distribution
# --------------------------------------------------------------------------------------


@DRAWS
def test_first_token_follows_prefill_row_in_both_arms(model, plain_t1, spec_t1_np) -> None:
    """The first token's distribution is exactly row_probs of the prefill's last row (in
    the no-pending form the speculative arm decides it by accept/residual/bonus)."""
    with torch.no_grad():
        p = row_probs(model(torch.tensor(PROMPT))[-1], PROMPT, T1)
    exact = {(t,): float(pt) for t, pt in enumerate(p.tolist()) if pt > 0}
    for samples in (plain_t1, spec_t1_np):
        counts = Counter((s[0],) for s in samples)
        groups = _groups(exact, len(samples))
        obs = np.array([sum(counts[c] for c in g) for g in groups], dtype=float)
        exp = np.array([sum(exact[c] for c in g) for g in groups]) * len(samples)
        assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > ALPHA


@DRAWS
def test_plain_arm_matches_exact_distribution(plain_t1, joint_t1) -> None:
    """Sanity check of the enumerated reference (and of plain sampling itself)."""
    assert gof_pvalue(plain_t1, joint_t1) > ALPHA


@DRAWS
def test_speculative_draft3_matches_exact_distribution(spec_t1, joint_t1) -> None:
    p = gof_pvalue(spec_t1, joint_t1)
    assert p > ALPHA, f"speculative samples do not follow the target distribution (p={p:.2e})"


@DRAWS
def test_speculative_draft3_indistinguishable_from_plain(spec_t1, plain_t1, joint_t1) -> None:
    p = two_sample_pvalue(spec_t1, plain_t1, joint_t1)
    assert p > ALPHA, f"--draft 3 and --draft 0 samples differ (p={p:.2e})"


@DRAWS
def test_speculative_no_pending_matches_exact_and_plain(spec_t1_np, plain_t1, joint_t1) -> None:
    """The 'no pending' form (how a session continues): round 1 decides all 3 tokens."""
    p = gof_pvalue(spec_t1_np, joint_t1)
    assert p > ALPHA, p
    p = two_sample_pvalue(spec_t1_np, plain_t1, joint_t1)
    assert p > ALPHA, p


def test_filters_and_penalties_rejection_mode_match_exact(model) -> None:
    """Temperature, top-k, top-p, min-p and all three penalties in rejection mode: the
    speculative samples follow the plain-decoding distribution, enumerated exactly with
    the row_probs plain decoding uses (penalty history = prompt + earlier tokens)."""
    joint = exact_joint(model, PROMPT, FILTERED)
    assert len(joint) < 5**N_TOK  # top-k 5 and top-p / min-p really cut the support
    samples = draw_spec(model, FILTERED, SEEDS_FILTERED, prime_pending=False)
    p = gof_pvalue(samples, joint)
    assert p > ALPHA, p


def test_adaptive_rejection_mode_matches_exact(model, joint_t1) -> None:
    """--adaptive changes K from round to round (from past acceptance only): still exact."""
    samples = draw_spec(model, T1, range(800_000, 800_000 + N_PMIN), prime_pending=False, adaptive=True)
    p = gof_pvalue(samples, joint_t1)
    assert p > ALPHA, p


def test_pmin_rejection_mode_matches_exact(model, joint_t1) -> None:
    """With --p-min the emitted tokens must still follow the target distribution.
    Two-token example of the bias: q = (0.9, 0.1), p = (0.5, 0.5), p_min = 0.5 emits token 0
    with probability 0.1 * 0.5 (stopped, bonus from p) + 0.9 * (0.5 / 0.9) (accepted) = 0.55."""
    samples = draw_spec(model, T1, range(700_000, 700_000 + N_PMIN), prime_pending=False, p_min=0.2)
    p = gof_pvalue(samples, joint_t1)
    assert p > ALPHA, f"p_min=0.2: speculative samples do not follow the target distribution (p={p:.2e})"


# --------------------------------------------------------------------------------------
# ... and the same tests reject biased rules
# --------------------------------------------------------------------------------------


def _always_accept(p_rows, q_rows, drafts, seed, position):
    """Biased: every draft accepted, bonus from p_k (emits the drafter's q)."""
    k = len(drafts)
    u = sampling_mod.u01(seed, sampling_mod.Stream.BONUS, position + k)
    return k, sampling_mod.sample_index(p_rows[k], u)


def _residual_is_p(p, q, draft, u_accept, u_resid):
    """Biased: the right accept test, but the rejected token resampled from p instead of
    normalize(max(0, p - q)).  Emits min(p, q) + (1 - sum min(p, q)) * p != p."""
    if u_accept * float(q[draft]) < float(p[draft]):
        return True, None
    return False, sampling_mod.sample_index(p, u_resid)


@DRAWS
@pytest.mark.parametrize("rule,prime_pending", [("always_accept", True), ("always_accept", False),
                                                ("residual_is_p", False)])
def test_biased_acceptance_rule_fails_the_same_tests(rule, prime_pending, model, monkeypatch, joint_t1,
                                                     plain_t1) -> None:
    """The biased arm runs exactly like the correct arm of the same form (same draw_spec,
    same gof_pvalue / two_sample_pvalue, same plain arm); its p-values must fall below
    ALPHA.  (residual = p is asserted in the no-pending form, where all 3 tested tokens
    are speculative decisions; see the module docstring.)"""
    if rule == "always_accept":
        monkeypatch.setattr(round_mod, "speculative_sample", _always_accept)
        seeds = SEEDS_ALWAYS
    else:
        monkeypatch.setattr(sampling_mod, "accept_or_resample", _residual_is_p)
        seeds = SEEDS_RESID
    biased = draw_spec(model, T1, seeds, prime_pending=prime_pending)
    p_exact = gof_pvalue(biased, joint_t1)
    p_two = two_sample_pvalue(biased, plain_t1, joint_t1)
    assert p_exact < ALPHA, f"{rule}: the goodness-of-fit test missed the bias (p={p_exact:.2e})"
    assert p_two < ALPHA, f"{rule}: the two-sample test missed the bias (p={p_two:.2e})"


# --------------------------------------------------------------------------------------
# Reproducibility: same seed, same output
# --------------------------------------------------------------------------------------

N_LONG = 50  # tokens per generation in the token-exact tests below


def _plain(model, params, n=N_LONG) -> list[int]:
    return generate_plain(model, PROMPT, max_new_tokens=n, params=params).tokens


def _spec(model, params, k, n=N_LONG, **opts):
    return generate_speculative(model, PROMPT, max_new_tokens=n, opts=SpecOptions(k=k, **opts), params=params)


@pytest.mark.parametrize("params", [T1, FILTERED], ids=["t1", "filtered"])
def test_same_seed_same_output_rejection_mode(model, params) -> None:
    n = 40
    p1, p2 = _with_seed(params, 1), _with_seed(params, 2)
    plain = _plain(model, p1, n)
    assert _plain(model, p1, n) == plain
    spec = _spec(model, p1, 3, n).tokens
    assert _spec(model, p1, 3, n).tokens == spec and len(spec) == n
    # and the seed matters
    assert _plain(model, p2, n) != plain
    assert _spec(model, p2, 3, n).tokens != spec


# --------------------------------------------------------------------------------------
# Coupled mode: speculative output == plain output, token for token
# --------------------------------------------------------------------------------------

COUPLED = {
    "t1": SamplingParams(mode="coupled"),
    "topk_topp_minp": SamplingParams(mode="coupled", temperature=0.7, top_k=6, top_p=0.85, min_p=0.05),
    "filters_and_penalties": SamplingParams(mode="coupled", temperature=1.3, top_k=8, top_p=0.95, min_p=0.02,
                                            repetition_penalty=1.3, frequency_penalty=0.4,
                                            presence_penalty=0.4, penalty_last_n=16),
}


COUPLED_SEEDS = {"t1": (0, 11), "topk_topp_minp": (3,), "filters_and_penalties": (5, 23)}


@pytest.mark.parametrize("name", list(COUPLED))
def test_coupled_speculative_equals_plain(model, name) -> None:
    """Coupled mode: identical output for --draft 0 and --draft K, K in {1, 3, 5}, over
    50 tokens, for several seeds; filters and penalties included (this makes 'applied
    identically in plain and speculative decoding' a token-exact check)."""
    accepted = 0
    for seed in COUPLED_SEEDS[name]:
        params = _with_seed(COUPLED[name], seed)
        ref = _plain(model, params)
        assert len(ref) == N_LONG
        for k in (1, 3, 5):
            res = _spec(model, params, k)
            assert res.tokens == ref, f"{name} seed={seed} k={k}"
            accepted += res.stats["spec"]["accepted"]
    assert accepted > 0  # drafts were accepted, so the spec path did more than bonus tokens


def test_coupled_with_pmin_adaptive_and_other_rollbacks_equals_plain(model) -> None:
    params = _with_seed(COUPLED["filters_and_penalties"], 8)
    ref = _plain(model, params, 30)
    for opts in ({"rollback": "rescan"}, {"rollback": "replay"}, {"p_min": 0.2}, {"adaptive": True},
                 {"prime_pending": False}):
        assert _spec(model, params, 4, 30, **opts).tokens == ref, opts


def test_coupled_penalties_change_the_output(model) -> None:
    """Sanity for the tests above: the penalties and filters are not no-ops here."""
    base = _plain(model, _with_seed(COUPLED["t1"], 0))
    assert _plain(model, _with_seed(COUPLED["filters_and_penalties"], 0)) != base
    assert _plain(model, _with_seed(COUPLED["topk_topp_minp"], 0)) != base
    unpenalised = SamplingParams(**{**COUPLED["filters_and_penalties"].__dict__, "repetition_penalty": 1.0,
                                    "frequency_penalty": 0.0, "presence_penalty": 0.0, "seed": 0})
    assert _plain(model, _with_seed(COUPLED["filters_and_penalties"], 0)) != _plain(model, unpenalised)


# --------------------------------------------------------------------------------------
# Greedy with penalties: speculative == plain
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("pen", [
    {"repetition_penalty": 1.5},
    {"frequency_penalty": 0.7, "presence_penalty": 0.4, "penalty_last_n": 8},
    {"repetition_penalty": 1.3, "frequency_penalty": 0.3, "presence_penalty": 0.3, "penalty_last_n": -1},
], ids=["repetition", "freq_presence_window8", "all"])
def test_greedy_with_penalties_speculative_equals_plain(model, pen) -> None:
    params = SamplingParams(temperature=0.0, **pen)
    ref = _plain(model, params, 40)
    assert ref != _plain(model, SamplingParams(temperature=0.0), 40)  # the penalties matter
    for k in (1, 3, 5):
        assert _spec(model, params, k, 40).tokens == ref, k


# --------------------------------------------------------------------------------------
# num_samples
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft", [0, 3])
def test_engine_num_samples(model, draft) -> None:
    eng = Engine(model)
    params = SamplingParams(temperature=1.0, seed=7)
    out = eng.generate(PROMPT, max_new_tokens=12, params=params, draft=draft, num_samples=4, ignore_eos=True)
    assert len(out.samples) == 4
    assert all(len(s.tokens) == 12 for s in out.samples)
    single = eng.generate(PROMPT, max_new_tokens=12, params=params, draft=draft, ignore_eos=True)
    assert out.samples[0].tokens == single.tokens == out.tokens
    for i in range(1, 4):  # sample i is a run with the derived seed
        again = eng.generate(PROMPT, max_new_tokens=12, params=_with_seed(params, derive_seed(7, i)), draft=draft,
                             ignore_eos=True)
        assert out.samples[i].tokens == again.tokens
    assert len({tuple(s.tokens) for s in out.samples}) == 4  # independent samples differ
    d = out.to_dict()
    assert [s["tokens"] for s in d["samples"]] == [s.tokens for s in out.samples]
    assert all(set(s) >= {"tokens", "text"} for s in d["samples"])
    assert d["stats"]["num_samples"] == 4 and d["stats"]["generated_tokens"] == 48
    # same call, same samples
    assert [s.tokens for s in eng.generate(PROMPT, max_new_tokens=12, params=params, draft=draft, num_samples=4,
                                           ignore_eos=True).samples] == [s.tokens for s in out.samples]


def test_engine_num_samples_coupled_draft_equals_plain(model) -> None:
    eng = Engine(model)
    params = SamplingParams(temperature=1.0, seed=3, mode="coupled", top_k=8)
    a = eng.generate(PROMPT, max_new_tokens=20, params=params, draft=0, num_samples=3, ignore_eos=True)
    b = eng.generate(PROMPT, max_new_tokens=20, params=params, draft=3, num_samples=3, ignore_eos=True)
    assert [s.tokens for s in a.samples] == [s.tokens for s in b.samples]


def test_derive_seed() -> None:
    assert derive_seed(5, 0) == 5
    seeds = {derive_seed(s, i) for s in range(20) for i in range(1, 20)}
    assert len(seeds) == 20 * 19  # no collisions between neighbouring seeds' samples
    assert all(0 <= x < 2**63 for x in seeds)


# --------------------------------------------------------------------------------------
# The penalty context of draft rows
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=4, repetition_penalty=1.5, presence_penalty=0.5, penalty_last_n=5),
    SamplingParams(temperature=1.0, seed=4, mode="coupled", frequency_penalty=0.5, penalty_last_n=-1),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, penalty_last_n=-1),
], ids=["rejection", "coupled", "greedy"])
def test_draft_rows_see_the_plain_history(model, monkeypatch, params) -> None:
    """The drafter's q at absolute position t is built with the history plain decoding
    would see at t: the prompt, every emitted token, and the earlier drafts of the same
    round.  (The output cannot show this -- a wrong q only lowers acceptance -- so the
    chooser's inputs are recorded.)"""
    seen: list[tuple[int, list[int], int]] = []
    original = round_mod._draft_one

    def record(seq, rd, logits, j):
        hist = list(seq.history) + list(rd.drafts[:j])
        seen.append((rd.first_draft_pos + j, hist, len(seq.history)))
        ok = original(seq, rd, logits, j)
        if ok:
            tok = rd.drafts[-1]
            if params.greedy:  # the drafter's token is the argmax of the penalised logits
                assert tok == int(torch.argmax(sampling_mod.apply_penalties(logits, hist, params)))
            else:  # q is row_probs under that history: penalties, then the same filters
                assert torch.equal(rd.q_rows[-1], row_probs(logits, hist, params))
        return ok

    monkeypatch.setattr(round_mod, "_draft_one", record)
    res = _spec(model, params, 4, 30)
    assert seen
    final = PROMPT + res.tokens
    for position, hist, committed in seen:
        assert len(hist) == position  # every position before t, nothing more
        assert hist[:committed] == final[:committed]  # the committed part is the real output
    # at least one round drafted on top of earlier drafts of the same round
    assert any(len(h) > c for _, h, c in seen)
