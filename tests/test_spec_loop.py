"""The greedy speculative loop: each way a round can end, the cache each rollback strategy
leaves behind, rollback memory, forced acceptance rates, and argument errors.

The broad "speculative output == plain output" sweep over families x dtypes x K x
rollback x options x drafters lives in test_spec_matrix.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import ARCHS, PROMPT
from hyspec.cache import HybridCache
from hyspec.model.ops import StepCtx
from hyspec.speculative import rollback as rb_mod
from hyspec.core import round as round_mod
from hyspec.speculative.loop import MAX_DRAFT, SpecOptions, generate_speculative

ROLLBACKS = ("checkpoint", "rescan", "replay")


from spec_helpers import RoundLog  # noqa: E402


def spy_keep(monkeypatch) -> list[tuple[str, int, int]]:
    """Record every Rollback.keep(j, tokens) call as (strategy, j, len(tokens))."""
    calls: list[tuple[str, int, int]] = []
    for cls in rb_mod.ROLLBACKS.values():
        orig = cls.keep

        def keep(self, model, cache, snap, j, tokens, _orig=orig):
            calls.append((self.name, j, len(tokens)))
            return _orig(self, model, cache, snap, j, tokens)

        monkeypatch.setattr(cls, "keep", keep)
    return calls


def cache_state(cache: HybridCache) -> dict:
    return {
        "pos": cache.pos,
        "conv": [s.conv.clone() for s in cache.linear_states],
        "ssm": [s.ssm.clone() for s in cache.linear_states],
        "k": [b.k[:, : cache.pos].clone() for b in cache.kv_buffers],
        "v": [b.v[:, : cache.pos].clone() for b in cache.kv_buffers],
    }


def spy_round_states(monkeypatch, model) -> list[dict]:
    """Capture the sequence's cache state at the start of every round (after the previous
    round's commit: full accept, partial rollback or fold)."""
    states: list[dict] = []
    orig_draft = round_mod.draft

    def draft(backend, seqs):
        states.append(cache_state(seqs[0].cache))
        return orig_draft(backend, seqs)

    monkeypatch.setattr(round_mod, "draft", draft)
    return states


def plain_trajectory(model, tokens: list[int], n_prompt: int) -> dict[int, dict]:
    """Cache states of plain decoding: chunked prefill of the prompt, then one exact
    decode step per token, keyed by cache.pos."""
    cache = model.new_cache(len(tokens) + 1)
    model.forward_hidden(torch.tensor(tokens[:n_prompt]), cache, StepCtx(start=0, chunked=True))
    out = {cache.pos: cache_state(cache)}
    for t in tokens[n_prompt:]:
        model.forward_hidden(torch.tensor([t]), cache, StepCtx(start=cache.pos, exact=True))
        out[cache.pos] = cache_state(cache)
    return out


def assert_same_state(a: dict, b: dict, exact: bool) -> None:
    assert a["pos"] == b["pos"]
    for key in ("conv", "ssm", "k", "v"):
        for x, y in zip(a[key], b[key], strict=True):
            if exact:
                assert torch.equal(x, y), (key, a["pos"], (x - y).abs().max().item())
            else:
                torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------
# the three ways a round ends
# ---------------------------------------------------------------------------------------
def test_full_accept_rounds_never_roll_back(zoo, monkeypatch):
    m = zoo.model("tiny", "qwen3_5", "float64")
    ref = zoo.plain("tiny", "qwen3_5", "float64", 40)
    calls = spy_keep(monkeypatch)
    restores = []
    monkeypatch.setattr(HybridCache, "restore", lambda self, snap: restores.append(snap))
    tel = RoundLog()
    res = generate_speculative(m, PROMPT, max_new_tokens=40, opts=SpecOptions(k=4, forced_rates=(1.0,)),
                               reference=ref, telemetry=tel)
    assert res.tokens == ref
    assert calls == [] and restores == []
    assert tel.accepted == tel.drafted > 0
    assert all(d == a for d, a in tel.log)
    assert tel.log[0] == (4, 4) and tel.rounds == len(tel.log) == 8  # 1 + 7 rounds of 5 + a 4-token tail
    assert res.stats["generated_tokens"] == 1 + tel.accepted + tel.rounds


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_partial_accept_keeps_a_proper_prefix(zoo, monkeypatch, rollback):
    m = zoo.model("tiny", "qwen3_next", "float64")
    ref = zoo.plain("tiny", "qwen3_next", "float64", 60)
    calls = spy_keep(monkeypatch)
    tel = RoundLog()
    res = generate_speculative(m, PROMPT, max_new_tokens=60, reference=ref, telemetry=tel,
                               opts=SpecOptions(k=3, rollback=rollback, forced_rates=(0.8, 0.5, 0.5)))
    assert res.tokens == ref
    assert calls and all(name == rollback and 1 <= j < T for name, j, T in calls)
    partial_rounds = [(d, a) for d, a in tel.log if a < d]
    assert len(calls) == len(partial_rounds)  # every round that rejected a draft rolled back once
    assert {j for _, j, _ in calls} == {1, 2, 3}  # pending only, pending + 1 draft, pending + 2


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_no_pending_zero_accept_round_folds_away(zoo, monkeypatch, rollback):
    """prime_pending=False: the first round verifies drafts only. With every draft wrong it
    accepts nothing (j = 0): the loop restores the snapshot whole instead of calling keep()."""
    arch, dtype = "qwen3_5_moe", "float64"
    m = zoo.model("tiny", arch, dtype)
    ref = zoo.plain("tiny", arch, dtype, 12)
    calls = spy_keep(monkeypatch)
    restored = []
    orig_restore = HybridCache.restore

    def restore(self, snap):
        orig_restore(self, snap)
        restored.append((snap.pos, cache_state(self), snap))

    monkeypatch.setattr(HybridCache, "restore", restore)
    states = spy_round_states(monkeypatch, m)
    tel = RoundLog()
    res = generate_speculative(m, PROMPT, max_new_tokens=12, reference=ref, telemetry=tel,
                               opts=SpecOptions(k=2, rollback=rollback, forced_rates=(0.0,), prime_pending=False))
    assert res.tokens == ref
    assert tel.log[0] == (2, 0)
    assert all(j >= 1 for _, j, _ in calls)  # keep() is never asked for j = 0
    folds = [r for r in restored if r[0] == len(PROMPT)]
    assert len(folds) >= 1
    pos, st, snap = folds[0]
    assert st["pos"] == len(PROMPT)
    for a, b in zip(st["conv"] + st["ssm"], snap.conv + snap.ssm, strict=True):
        assert torch.equal(a, b)
    # after the fold the cache is exactly the prompt's prefill again
    plain = plain_trajectory(m, PROMPT + ref, len(PROMPT))
    assert states[1]["pos"] == len(PROMPT)
    assert_same_state(states[1], plain[len(PROMPT)], exact=True)


def test_no_pending_and_no_drafts(zoo):
    """prime_pending=False with a p_min no draft reaches: the first step has nothing to
    verify and takes the prefill row's token; later rounds verify the pending token alone."""
    m = zoo.model("tiny", "qwen3_next", "float32")
    ref = zoo.plain("tiny", "qwen3_next", "float32", 20)
    tel = RoundLog()
    res = generate_speculative(m, PROMPT, max_new_tokens=20, telemetry=tel,
                               opts=SpecOptions(k=3, p_min=0.9, prime_pending=False))
    assert res.tokens == ref
    assert tel.drafted == 0 and tel.rounds == 19 and all(d == 0 for d, _ in tel.log)


def test_no_pending_no_drafts_sampled_first_token_equals_plain_decoding(zoo):
    """prime_pending=False with a p_min no draft reaches, sampled: the first token is taken
    straight from the prefill's row, keyed by its own absolute position (len(prompt)): the
    token plain decoding draws there (coupled: the whole run equals plain decoding)."""
    from hyspec.decode import generate_plain
    from hyspec.sampling import SamplingParams

    m = zoo.model("tiny", "qwen3_5", "float64")
    opts = SpecOptions(k=3, p_min=0.999, prime_pending=False)
    for seed in (1, 2):
        for mode in ("coupled", "rejection"):
            params = SamplingParams(temperature=2.0, seed=seed, mode=mode)
            tel = RoundLog()
            got = generate_speculative(m, PROMPT, max_new_tokens=3, params=params, opts=opts, telemetry=tel).tokens
            want = generate_plain(m, PROMPT, max_new_tokens=3, params=params).tokens
            assert tel.drafted == 0
            assert got == want if mode == "coupled" else got[0] == want[0], (seed, mode, got, want)


@pytest.mark.parametrize("prime", [True, False])
def test_short_runs_and_one_token_prompt(zoo, prime):
    m = zoo.model("tiny", "qwen3_5", "float64")
    ref = zoo.plain("tiny", "qwen3_5", "float64", 8)
    for n in (0, 1, 2, 3, 4):
        for rate in (1.0, 0.0):
            res = generate_speculative(m, PROMPT, max_new_tokens=n, reference=ref,
                                       opts=SpecOptions(k=3, forced_rates=(rate,), prime_pending=prime))
            assert res.tokens == ref[:n], (n, rate)
    from hyspec.decode import generate_plain

    want = generate_plain(m, [PROMPT[0]], max_new_tokens=12).tokens
    res = generate_speculative(m, [PROMPT[0]], max_new_tokens=12, reference=want,
                               opts=SpecOptions(k=2, forced_rates=(0.7,), prime_pending=prime))
    assert res.tokens == want


def test_the_single_request_entry_points_stream_and_raise(zoo, monkeypatch):
    """generate_plain / generate_speculative call on_tokens(ids) with every committed token,
    and raise a request's error (a failed forward) instead of returning a cut result."""
    from hyspec.core.backend import ReferenceBackend
    from hyspec.decode import generate_plain

    m = zoo.model("tiny", "qwen3_5", "float64")
    plain, spec = [], []
    want = generate_plain(m, PROMPT, max_new_tokens=8, on_tokens=plain.extend).tokens
    got = generate_speculative(m, PROMPT, max_new_tokens=8, opts=SpecOptions(k=3), on_tokens=spec.extend).tokens
    assert plain == want == spec == got and len(want) == 8
    monkeypatch.setattr(ReferenceBackend, "verify", lambda self, items: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        generate_plain(m, PROMPT, max_new_tokens=8)
    with pytest.raises(RuntimeError, match="boom"):
        generate_speculative(m, PROMPT, max_new_tokens=8, opts=SpecOptions(k=3))


def test_on_tokens_streams_each_rounds_tokens(zoo):
    """generate_speculative's on_tokens(ids): the tokens of each round as it commits them,
    adding up to the result."""
    m = zoo.model("tiny", "qwen3_5", "float64")
    ref = zoo.plain("tiny", "qwen3_5", "float64", 12)
    pieces = []
    res = generate_speculative(m, PROMPT, max_new_tokens=12, reference=ref, on_tokens=pieces.append,
                               opts=SpecOptions(k=3, forced_rates=(0.7,)))
    assert res.tokens == ref and len(pieces) > 1
    assert [t for piece in pieces for t in piece] == ref


@pytest.mark.parametrize("prime", [True, False])
def test_stop_token_inside_accepted_drafts(zoo, prime):
    from hyspec.decode import generate_plain

    m = zoo.model("tiny", "qwen3_5", "float64")
    ref = zoo.plain("tiny", "qwen3_5", "float64", 60)
    idx = next(i for i in range(20, 60) if ref[i] not in ref[:i])  # first occurrence of a token
    stop = ref[idx]
    want = generate_plain(m, PROMPT, max_new_tokens=60, stop_ids=[stop])
    assert want.tokens == ref[: idx + 1] and want.stop_reason == "eos"
    for rate in (1.0, 0.7):
        res = generate_speculative(m, PROMPT, max_new_tokens=60, reference=ref, stop_ids=[stop],
                                   opts=SpecOptions(k=5, forced_rates=(rate,), prime_pending=prime))
        assert res.tokens == want.tokens and res.stop_reason == "eos"


def test_telemetry_counts_drafts_accepted_past_a_stop(zoo):
    """docs/speculative.md: tau and the acceptance length count what verification accepted;
    a stop id among the accepted drafts cuts what the round emits, not its telemetry (the
    CUDA-graph lanes record the same raw count)."""
    m = zoo.model("tiny", "qwen3_5", "float64")
    ref = zoo.plain("tiny", "qwen3_5", "float64", 10)
    stop = ref[2]  # the prefill emits ref[0]; the first round drafts ref[1..3], all accepted
    assert stop not in ref[:2]
    tel = RoundLog()
    res = generate_speculative(m, PROMPT, max_new_tokens=10, reference=ref, stop_ids=[stop], telemetry=tel,
                               opts=SpecOptions(k=3, forced_rates=(1.0,)))
    assert res.tokens == ref[:3] and res.stop_reason == "eos"
    assert tel.log == [(3, 3)] and tel.accepted == 3


@pytest.mark.parametrize("prime", [True, False])
def test_greedy_with_penalties_equals_plain(zoo, prime):
    """Greedy decoding with repetition / frequency / presence penalties: the drafter and
    the acceptance must see the history plain decoding sees at each position."""
    from hyspec.decode import generate_plain
    from hyspec.sampling import SamplingParams

    m = zoo.model("tiny", "qwen3_5", "float64", "coop")
    for params in (SamplingParams(temperature=0.0, repetition_penalty=1.5, penalty_last_n=8),
                   SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, penalty_last_n=-1)):
        want = generate_plain(m, PROMPT, max_new_tokens=40, params=params).tokens
        assert want != zoo.plain("tiny", "qwen3_5", "float64", 40)  # the penalties do change the text
        tel = RoundLog()
        res = generate_speculative(m, PROMPT, max_new_tokens=40, params=params, telemetry=tel,
                                   opts=SpecOptions(k=3, prime_pending=prime))
        assert res.tokens == want and tel.accepted > 0
        res = generate_speculative(m, PROMPT, max_new_tokens=40, params=params, reference=want,
                                   opts=SpecOptions(k=3, forced_rates=(0.7,), prime_pending=prime, rollback="rescan"))
        assert res.tokens == want


# ---------------------------------------------------------------------------------------
# every rollback leaves the cache as plain decoding would
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("rollback", ROLLBACKS)
@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_cache_equals_plain_decoding(zoo, monkeypatch, arch, rollback, dtype):
    """At the start of every round (after the previous commit, whichever way it ended) the
    loop's cache holds exactly the state plain decoding has after the same tokens: every
    linear layer's conv window and SSM state, and every attention layer's valid KV rows.
    Bitwise in float64; within 1e-6 in float32 (bitwise too in practice: verify rows are
    row-invariant)."""
    m = zoo.model("tiny", arch, dtype)
    M = 30
    ref = zoo.plain("tiny", arch, dtype, M)
    states = spy_round_states(monkeypatch, m)
    tel = RoundLog()
    res = generate_speculative(m, PROMPT, max_new_tokens=M, reference=ref, telemetry=tel,
                               opts=SpecOptions(k=3, rollback=rollback, forced_rates=(0.7,)))
    assert res.tokens == ref
    assert {a for _, a in tel.log} >= {0, 3} and any(0 < a < d for d, a in tel.log)
    plain = plain_trajectory(m, PROMPT + ref, len(PROMPT))
    assert len(states) == tel.rounds
    for st in states:
        assert_same_state(st, plain[st["pos"]], exact=dtype == "float64")
    if dtype == "float32":  # report whether float32 was bitwise too
        same = all(torch.equal(x, y) for st in states for key in ("conv", "ssm", "k", "v")
                   for x, y in zip(st[key], plain[st["pos"]][key]))
        print(f"{arch} {rollback} float32 bitwise: {same}")


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_real_mtp_rollbacks_agree_with_each_other(zoo, monkeypatch, rollback):
    """With the (cooperative) MTP head proposing, the three strategies give the same rounds
    and the same cache at every round start."""
    m = zoo.model("hf", "qwen3_5", "float64", "coop")
    ref = zoo.plain("hf", "qwen3_5", "float64", 40)
    states = spy_round_states(monkeypatch, m)
    tel = RoundLog()
    res = generate_speculative(m, PROMPT, max_new_tokens=40, telemetry=tel, opts=SpecOptions(k=3, rollback=rollback))
    assert res.tokens == ref
    assert 0 < tel.accepted < tel.drafted
    plain = plain_trajectory(m, PROMPT + ref, len(PROMPT))
    for st in states:
        assert_same_state(st, plain[st["pos"]], exact=True)


# ---------------------------------------------------------------------------------------
# rollback memory
# ---------------------------------------------------------------------------------------
def test_rollback_memory_per_round(zoo):
    """Extra bytes a round holds for rollback (snapshot + verify records): replay keeps only
    the snapshot; rescan adds the conv rows and the recurrence inputs; checkpoint adds the
    conv rows and one SSM state per verify row."""
    m = zoo.model("tiny", "qwen3_5", "float32")
    ref = zoo.plain("tiny", "qwen3_5", "float32", 12)
    snap_bytes = m.new_cache(4).state_nbytes()
    c = m.cfg
    n_lin = sum(t == "linear_attention" for t in c.layer_types)
    lines = []
    for k in (1, 3, 5):
        got = {}
        for rollback in ROLLBACKS:
            res = generate_speculative(m, PROMPT, max_new_tokens=12, reference=ref,
                                       opts=SpecOptions(k=k, rollback=rollback, forced_rates=(0.0,)))
            assert res.tokens == ref
            got[rollback] = res.stats["rollback_extra_bytes_per_round"]
        T = k + 1
        xcat = n_lin * (c.linear_conv_kernel_dim - 1 + T) * c.conv_dim * 4
        state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        inputs = T * c.linear_num_value_heads * (2 * c.linear_key_head_dim + c.linear_value_head_dim + 2) * 4
        assert got["replay"] == snap_bytes
        assert got["checkpoint"] == snap_bytes + xcat + n_lin * T * state
        assert got["rescan"] == snap_bytes + xcat + n_lin * inputs
        assert got["replay"] < got["rescan"] < got["checkpoint"]
        lines.append(f"K={k}: " + ", ".join(f"{r}={got[r]}" for r in ROLLBACKS))
    print("rollback_extra_bytes_per_round (qwen3_5 tiny, float32): " + "; ".join(lines))


# ---------------------------------------------------------------------------------------
# forced acceptance: measured rates and telemetry totals
# ---------------------------------------------------------------------------------------
def test_forced_rates_are_measured_per_depth(zoo):
    """Conditional acceptance at depth d (rounds that reached d and drafted past it) is the
    configured rate within sampling error (two-sided binomial test, alpha = 1e-3)."""
    from scipy.stats import binomtest

    rates = (0.9, 0.6, 0.3)
    m = zoo.model("tiny", "qwen3_5", "float32")
    M = 300
    ref = zoo.plain("tiny", "qwen3_5", "float32", M)
    tel = RoundLog()
    res = generate_speculative(m, PROMPT, max_new_tokens=M, reference=ref, telemetry=tel,
                               opts=SpecOptions(k=3, forced_rates=rates, forced_seed=5))
    assert res.tokens == ref
    for d, rate in enumerate(rates):
        trials = [a > d for dr, a in tel.log if dr > d and a >= d]
        assert len(trials) >= 40
        p = binomtest(sum(trials), len(trials), rate).pvalue
        assert p > 1e-3, (d, rate, sum(trials), len(trials))
    assert res.stats["generated_tokens"] == 1 + tel.accepted + tel.rounds
    assert res.stats["spec"] == tel.to_dict()


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------
def test_checkpoint_without_mtp_cannot_speculate(zoo):
    from hyspec.loading import load_model

    m = load_model(zoo.path("tiny", "qwen3_5", with_mtp=False))
    assert not m.has_mtp
    with pytest.raises(ValueError, match="no MTP head"):
        generate_speculative(m, PROMPT, max_new_tokens=5, opts=SpecOptions(k=2))


@pytest.mark.parametrize("k", [0, MAX_DRAFT + 1, -1, 2.0])
def test_bad_draft_length_is_rejected(k):
    with pytest.raises(ValueError, match=f"1..{MAX_DRAFT}"):
        SpecOptions(k=k)


def test_other_bad_options_are_rejected(zoo):
    with pytest.raises(ValueError, match="rollback"):
        SpecOptions(rollback="undo")
    with pytest.raises(ValueError, match="p_min"):
        SpecOptions(p_min=1.0)
    with pytest.raises(ValueError, match="hidden"):
        SpecOptions(hidden="mid")
    m = zoo.model("tiny", "qwen3_5", "float32")
    with pytest.raises(ValueError, match="reference"):
        generate_speculative(m, PROMPT, max_new_tokens=5, opts=SpecOptions(forced_rates=(0.5,)))
    with pytest.raises(ValueError, match="forced_rates"):
        generate_speculative(m, PROMPT, max_new_tokens=5, reference=[1] * 5, opts=SpecOptions(forced_rates=(1.5,)))


# ---------------------------------------------------------------------------------------
# regressions of defects found earlier (round length without pending, bool K)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3])
def test_no_pending_short_run_keeps_telemetry_identity(zoo, n):
    m = zoo.model("tiny", "qwen3_5", "float64")
    ref = zoo.plain("tiny", "qwen3_5", "float64", 8)
    res = generate_speculative(m, PROMPT, max_new_tokens=n, reference=ref,
                               opts=SpecOptions(k=3, forced_rates=(1.0,), prime_pending=False))
    assert res.tokens == ref[:n]  # the output is right ...
    spec = res.stats["spec"]
    # ... and no round verifies a draft whose bonus is thrown away: n=1 needs no target
    # forward at all (the prefill row gives the token), and every token is accounted for
    assert len(res.tokens) == res.stats["direct_tokens"] + spec["accepted"] + spec["rounds"], spec
    # n=1: the prefill row gives the token; n=3: one round verifies 2 drafts (all accepted) + bonus
    assert spec["rounds"] == {1: 0, 3: 1}[n] and spec["drafted"] == {1: 0, 3: 2}[n], spec


def test_no_pending_rounds_report_each_tokens_own_logprob(zoo):
    """prime_pending=False: the first round verifies the drafts alone, so its rows are the
    prefill's last row followed by the verify rows; each emitted token's logprob and top list
    must come from the row that predicted it -- plain decoding's entries, every draft accepted
    (rate 1) or none (rate 0)."""
    from hyspec import Engine

    m = zoo.model("tiny", "qwen3_5", "float64")
    ref = zoo.plain("tiny", "qwen3_5", "float64", 6)
    eng = Engine(m)
    plain = eng.generate(PROMPT, max_new_tokens=6, logprobs=2, ignore_eos=True)
    assert plain.tokens == ref
    want = plain.logprobs[0]
    for rate in (1.0, 0.0):
        out = eng.generate(PROMPT, max_new_tokens=6, draft=3, logprobs=2, ignore_eos=True, reference=ref,
                           spec=SpecOptions(k=3, forced_rates=(rate,), prime_pending=False))
        assert out.tokens == ref and out.stats["spec"]["drafted"] > 0
        got = out.logprobs[0]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-9), rate
        assert [[i for i, _ in a] for _, a in got] == [[i for i, _ in a] for _, a in want], rate


@pytest.mark.parametrize("greedy", [True, False])
def test_p_min_keeps_a_draft_whose_probability_equals_it(greedy):
    """p_min stops drafting at a draft the drafter gives *less* probability than p_min; a
    draft at exactly p_min is kept (as the lanes keep it, and as the kept sampled row
    q * [q >= p_min] keeps it), with its q row unchanged. Two equal logits: q = 1/2 exactly."""
    from types import SimpleNamespace

    from hyspec.sampling import SamplingParams

    params = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=1.0, seed=3)
    logits = torch.tensor([0.0, 0.0, -math.inf, -math.inf])
    for p_min, kept in ((0.5, True), (math.nextafter(0.5, 1.0), False)):
        seq = SimpleNamespace(params=params, opts=SpecOptions(k=2, p_min=p_min), history=[1, 2], forced_ref=None,
                              mask=lambda prefix: None)
        rd = round_mod._Round.scratch(2, 5, [])
        assert round_mod._draft_one(seq, rd, logits, 0) is kept, p_min
        assert len(rd.drafts) == int(kept) and rd.drafts[:1] in ([], [0], [1])
        if kept and not greedy:
            assert rd.q_rows[0].tolist() == [0.5, 0.5, 0.0, 0.0]


def test_option_ranges_and_numpy_values():
    """Each option's range is checked (a negative p_min, a floor above K or below 1, no
    forced rates at all, a bool seed), and numpy values are stored as Python values."""
    import numpy as np

    for kw, name in [({"p_min": -0.1}, "p_min"), ({"k": 2, "adaptive_floor": 3}, "adaptive_floor"),
                     ({"adaptive_floor": 0}, "adaptive_floor"), ({"forced_rates": ()}, "forced_rates"),
                     ({"forced_seed": True}, "forced_seed")]:
        with pytest.raises(ValueError, match=name):
            SpecOptions(**kw)
    o = SpecOptions(k=np.int64(4), p_min=np.float32(0.25), adaptive=np.bool_(True), adaptive_floor=np.int32(2),
                    prime_pending=np.bool_(False), forced_seed=np.int64(7), forced_rates=np.array([0.5, 1.0]))
    got = (o.k, o.p_min, o.adaptive, o.adaptive_floor, o.prime_pending, o.forced_seed, o.forced_rates)
    assert got == (4, 0.25, True, 2, False, 7, (0.5, 1.0))
    assert [type(v) for v in got] == [int, float, bool, int, bool, int, tuple]
    short = o.with_k(1)  # the floor follows a smaller K
    assert (short.k, short.adaptive_floor, short.forced_rates) == (1, 1, (0.5, 1.0))


def test_bool_draft_length_is_rejected():
    with pytest.raises(ValueError, match="1..16"):
        SpecOptions(k=True)


def test_forced_acceptance_follows_a_penalised_greedy_request():
    """The forced drafter's built-in reference was the bare model's greedy continuation: a
    greedy request with a repetition penalty split from it at once, and rates of 1.0 accepted
    nothing (acceptance length 1.0 against 3.6 without the penalty). It is now the request's
    own greedy continuation, penalties included."""
    from hyspec import Engine, SamplingParams

    eng = Engine.load()
    lengths = []
    for sp in (SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.3)):
        o = eng.generate("import os\n", max_new_tokens=30, draft=3, params=sp, ignore_eos=True,
                         spec=SpecOptions(forced_rates=(1.0, 1.0, 1.0)))
        assert o.tokens == eng.generate("import os\n", max_new_tokens=30, params=sp, ignore_eos=True).tokens
        lengths.append(o.stats["spec"]["acceptance_length"])
    assert min(lengths) > 3, lengths
