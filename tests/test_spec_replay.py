"""replay_acceptance: teacher-forced draft acceptance of the MTP head over a text.

Checked against (1) a direct computation of the target's log-probs, (2) a brute-force
drafter that fills a fresh draft KV for each position, (3) itself under other chunk sizes
and strides, and (4) the speculative loop: on a text that is the target's own greedy
continuation, the rounds generate_speculative runs are a subset of the replayed positions,
and every round's acceptance must equal the replay's (so the telemetry matches exactly).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import ARCHS, PROMPT
from hyspec.model.ops import StepCtx
from hyspec.core import round as round_mod
from hyspec.speculative.loop import SpecOptions, generate_speculative
from hyspec.speculative.replay import check_finite_logits, perplexity, replay_acceptance
from hyspec.speculative.telemetry import SpecTelemetry


from spec_helpers import RoundLog  # noqa: E402


def _text(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 512, (n,), generator=g).tolist()


def _check_report(rep: dict, N: int, k: int, stride: int) -> None:
    npos = len(range(0, N - k - 1, stride))
    assert rep["tokens"] == N and rep["k"] == k and rep["positions"] == npos
    pp = rep["per_position"]
    assert pp["position"] == list(range(0, N - k - 1, stride))
    assert rep["drafted_at"] == [npos] * k
    acc = rep["accepted_at"]
    assert len(acc) == k and all(a >= b for a, b in zip(acc, acc[1:])) and acc[0] <= npos
    assert acc == [sum(a > d for a in pp["accepted"]) for d in range(k)]
    assert rep["accept_rate_at"] == pytest.approx([a / npos for a in acc])
    cond = [acc[0] / npos] + [acc[d] / acc[d - 1] if acc[d - 1] else 0.0 for d in range(1, k)]
    assert rep["conditional_rate_at"] == pytest.approx(cond)
    assert rep["acceptance_length"] == pytest.approx([1 + sum(acc[:kk]) / npos for kk in range(1, k + 1)])
    assert rep["tau"] == pytest.approx(sum(pp["accepted"]) / npos)
    assert rep["acceptance_length"][-1] == pytest.approx(1 + rep["tau"])
    tel = SpecTelemetry.from_dict(rep["telemetry"])
    assert tel.rounds == npos and tel.drafted == npos * k and tel.accepted == sum(pp["accepted"])
    assert tel.per_depth_rate() == pytest.approx(rep["accept_rate_at"][: tel.depth])
    vt = rep["vs_target"]
    assert vt["accepted_at"] == [sum(a > d for a in pp["accepted_vs_target"]) for d in range(k)]
    assert vt["tau"] == pytest.approx(sum(pp["accepted_vs_target"]) / npos if npos else 0.0)
    assert rep["nll_tokens"] == N - 1
    assert rep["perplexity"] == pytest.approx(math.exp(rep["nll"]))
    assert 0.0 <= rep["target_top1"] <= 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_random_model_report_is_consistent(zoo, arch):
    m = zoo.model("tiny", arch, "float64")
    ids = _text(90)
    rep = replay_acceptance(m, ids, k=3, chunk=32)
    _check_report(rep, len(ids), 3, 1)
    # target NLL equals the log-probs of one whole-sequence forward
    lp = torch.log_softmax(m(torch.tensor(ids)), -1)
    nll = -lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum().item()
    assert rep["nll_sum"] == pytest.approx(nll, rel=1e-10)
    assert abs(rep["nll"] - math.log(512)) < 0.3  # a random model is nearly uniform
    assert rep["tau"] < 0.2  # and its random MTP head rarely guesses right


def test_chunking_stride_and_progress_do_not_change_results(zoo):
    m = zoo.model("tiny", "qwen3_5", "float64", "coop")
    ids = PROMPT + zoo.plain("tiny", "qwen3_5", "float64", 60)
    calls = []
    whole = replay_acceptance(m, ids, k=3, chunk=512, return_drafts=True)
    small = replay_acceptance(m, ids, k=3, chunk=7, return_drafts=True, progress=lambda d, t: calls.append((d, t)))
    _check_report(whole, len(ids), 3, 1)
    assert 0.1 < whole["tau"] < 2.5, "the cooperative head should accept some drafts, not all"
    assert small["drafts"] == whole["drafts"]
    assert small["per_position"] == whole["per_position"]
    assert small["nll"] == pytest.approx(whole["nll"], rel=1e-12)
    N = len(ids)
    assert calls == [(min(e, N), N) for e in range(7, N + 7, 7)]
    # without return_drafts chains stop once decided: same outcome, fewer MTP forwards
    lazy = replay_acceptance(m, ids, k=3, chunk=7)
    assert lazy["per_position"] == whole["per_position"]
    assert lazy["mtp_forwards"] < whole["mtp_forwards"]
    strided = replay_acceptance(m, ids, k=3, stride=3, chunk=7, return_drafts=True)
    _check_report(strided, N, 3, 3)
    assert strided["drafts"] == whole["drafts"][::3]
    assert strided["per_position"]["accepted"] == whole["per_position"]["accepted"][::3]
    # the text is the target's greedy continuation (after the prompt): both metrics agree there
    P = len(PROMPT)
    pp = whole["per_position"]
    for i, a, at in zip(pp["position"], pp["accepted"], pp["accepted_vs_target"]):
        if i >= P - 1:
            assert a == at


@pytest.mark.parametrize("hidden", ["post", "pre"])
def test_drafts_match_brute_force_drafter(zoo, hidden):
    """Each position's drafts equal a fresh draft KV that fills rows 0..i and chains:
    the replay's shared draft KV (chains written into rows later positions need, then put
    back) changes nothing."""
    arch = "qwen3_5_moe"
    m = zoo.model("tiny", arch, "float64", "coop")
    ids = PROMPT + zoo.plain("tiny", arch, "float64", 40)
    k = 4
    rep = replay_acceptance(m, ids, k=k, chunk=16, hidden=hidden, return_drafts=True)
    drafts = dict(zip(rep["per_position"]["position"], rep["drafts"]))
    pre, post = m.forward_states(torch.tensor(ids), None, StepCtx(chunked=True))
    seed = post if hidden == "post" else pre

    def brute_force(i: int) -> list[int]:
        """A fresh draft KV: fill rows 0..i with (ids[r+1], seed[r]), then chain k greedy drafts."""
        kv = m.new_draft_kv(len(ids) + k)
        h = m.mtp_hidden(torch.tensor(ids[1: i + 2]), seed[: i + 1], StepCtx(start=0), kv)[-1:]
        out = []
        for j in range(k):
            out.append(int(torch.argmax(m.logits(h)[0])))
            if j + 1 < k:
                h = m.mtp_hidden(torch.tensor(out[-1:]), h, StepCtx(start=i + 1 + j), kv)
        return out

    assert sorted(drafts) == list(range(len(ids) - k - 1))
    for i in drafts:
        assert brute_force(i) == drafts[i], i


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("K, hidden", [(1, "post"), (3, "post"), (3, "pre")])
def test_replay_agrees_with_speculative_loop(zoo, monkeypatch, arch, dtype, K, hidden):
    """Text = prompt + the target's greedy continuation. The loop's round r starts at draft
    row i_r (i_0 = P-1, i_{r+1} = i_r + accepted + 1) and drafts k_r = min(K, remaining-1)
    tokens; the replay drafted from every row. Same MTP inputs -> the same drafts (checked
    token by token) -> the same acceptance, round by round, so the telemetry matches
    exactly. The loop's target hiddens come from exact-mode verify forwards and the
    replay's from chunked prefill (they differ in the last bits in float32); that moved no
    argmax here."""
    M = 70 if K == 1 else 50
    m = zoo.model("tiny", arch, dtype, "coop")
    cont = zoo.plain("tiny", arch, dtype, M + K + 2)
    P = len(PROMPT)
    rep = replay_acceptance(m, PROMPT + cont, k=K, chunk=32, hidden=hidden, return_drafts=True)
    pp = rep["per_position"]
    acc = dict(zip(pp["position"], pp["accepted"]))
    rep_drafts = dict(zip(pp["position"], rep["drafts"]))

    loop_drafts = []
    orig = round_mod.draft

    def draft(backend, seqs):
        out = orig(backend, seqs)
        if seqs[0].round.drafts or seqs[0].pending is not None:  # rounds that verify
            loop_drafts.append(list(seqs[0].round.drafts))
        return out

    monkeypatch.setattr(round_mod, "draft", draft)
    tel = RoundLog()
    res = generate_speculative(m, PROMPT, max_new_tokens=M, opts=SpecOptions(k=K, hidden=hidden), telemetry=tel)
    assert res.tokens == cont[:M]

    sim = SpecTelemetry()
    i, emitted = P - 1, 1
    for (drafted, accepted), drafts in zip(tel.log, loop_drafts, strict=True):
        k_r = min(K, M - emitted - 1)
        assert drafted == k_r
        assert drafts == rep_drafts[i][:k_r], i
        n = min(acc[i], k_r)
        sim.record_round(k_r, n)
        i += n + 1
        emitted += n + 1
    assert sim == tel, (sim.to_dict(), tel.to_dict())
    assert tel.accepted > 0 and tel.accepted < tel.drafted  # a mix of accepts and rejects
    if K == 1:  # depth-1 acceptance over the loop's rounds, as both report it
        assert sim.per_depth_rate()[0] == tel.per_depth_rate()[0]


def test_replay_rejects_bad_arguments(zoo):
    m = zoo.model("tiny", "qwen3_5", "float32")
    ids = _text(20)
    for kw, word in [({"k": 0}, "k"), ({"k": 17}, "k"), ({"stride": 0}, "stride"), ({"chunk": 0}, "chunk"),
                     ({"hidden": "mid"}, "hidden")]:
        with pytest.raises(ValueError, match=word):
            replay_acceptance(m, ids, **kw)
    with pytest.raises(ValueError, match="at least 2"):
        replay_acceptance(m, [5])
    with pytest.raises(ValueError, match="out of range"):
        replay_acceptance(m, [5, 512, 3])
    from hyspec.loading import load_model

    nomtp = load_model(zoo.path("tiny", "qwen3_5"), load_mtp=False)
    with pytest.raises(ValueError, match="MTP.*nothing to replay"):
        replay_acceptance(nomtp, ids)


def test_short_text_has_no_positions(zoo):
    m = zoo.model("tiny", "qwen3_5", "float32")
    rep = replay_acceptance(m, [3, 4, 5], k=2)
    assert rep["positions"] == 0 and rep["accepted_at"] == [0, 0] and rep["acceptance_length"] == [1.0, 1.0]
    assert rep["nll_tokens"] == 2 and math.isfinite(rep["nll"])


def test_acceptance_is_the_leading_run_of_matching_drafts(zoo):
    """A position accepts the drafts up to the first mismatch, against the text and against
    the target's own greedy tokens (one whole-sequence forward); a later draft that happens
    to equal its token does not count. The text is the greedy continuation with every third
    token changed, so drafts match, miss and match again."""
    m = zoo.model("tiny", "qwen3_5", "float64", "coop")
    cont = zoo.plain("tiny", "qwen3_5", "float64", 40)
    ids = PROMPT + [t if j % 3 else t % 500 + 1 for j, t in enumerate(cont)]
    k = 4
    rep = replay_acceptance(m, ids, k=k, chunk=16, return_drafts=True)
    greedy = torch.argmax(m(torch.tensor(ids)), -1).tolist()  # row r predicts t_{r+1}

    def leading(drafts, ref):
        n = 0
        while n < len(drafts) and drafts[n] == ref[n]:
            n += 1
        return n

    pp = rep["per_position"]
    later = 0
    for i, drafts, a, at in zip(pp["position"], rep["drafts"], pp["accepted"], pp["accepted_vs_target"]):
        text, target = ids[i + 2: i + 2 + k], greedy[i + 1: i + 1 + k]
        assert (a, at) == (leading(drafts, text), leading(drafts, target)), i
        later += any(d == t for d, t in zip(drafts[a + 1:], text[a + 1:]))
        later += any(d == t for d, t in zip(drafts[at + 1:], target[at + 1:]))
    assert later > 0, "no draft matched after a miss: the check is vacuous"
    top1 = sum(g == t for g, t in zip(greedy, ids[1:])) / (len(ids) - 1)
    assert 0 < rep["target_top1"] == pytest.approx(top1)


def test_non_finite_logits_name_the_position_and_dtype():
    """check_finite_logits: the first row (counted from the chunk's start) with a NaN or an
    inf, and a hint that depends on the dtype; perplexity overflows to inf."""
    logits = torch.zeros(5, 7)
    check_finite_logits(logits, 40, torch.float16)  # all finite: nothing to say
    logits[3, 1] = float("inf")  # (an inf alone, no NaN)
    logits[4, 2] = float("nan")
    with pytest.raises(ValueError, match=r"from position 43 on, in float16: .*load it in float32 or bfloat16"):
        check_finite_logits(logits, 40, torch.float16)
    with pytest.raises(ValueError, match=r"from position 3 on, in bfloat16: .*\(load it in float32\)"):
        check_finite_logits(logits, 0, torch.bfloat16)
    with pytest.raises(ValueError, match=r"in float32: .*damaged"):
        check_finite_logits(logits, 0, torch.float32)
    assert perplexity(math.log(3.0)) == pytest.approx(3.0) and perplexity(710.0) == math.inf
