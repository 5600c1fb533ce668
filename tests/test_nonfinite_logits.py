"""Non-finite logits at run time (weights finite in the file, activations that overflow):
the target's row is an error for that request on every path (greedy too, not argmax's
first NaN id), and a drafter row that is not finite only stops drafting (output unchanged)."""

from __future__ import annotations

import pytest
import torch

from hyspec import Engine, SamplingParams
from hyspec.tiny import make_tiny

from conftest import make_overflowing

POISON = 100  # the token whose embedding overflows layer 0's MLP


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny("qwen3_5", tmp_path_factory.mktemp("nonfinite") / "tiny", seed=0)


def _poison(eng: Engine) -> Engine:
    """Token POISON drives layer 0's MLP past float32's range (inf * inf), every other token not."""
    make_overflowing(eng.model, token=POISON)
    return eng


@pytest.mark.parametrize("draft", [0, 3])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)],
                         ids=["greedy", "sampled"])
def test_nan_target_logits_are_an_error(ckpt, draft, params):
    eng = _poison(Engine.load(str(ckpt)))
    ok = eng.generate([1, 2, 3], max_new_tokens=4, params=params, draft=draft, ignore_eos=True)
    assert len(ok.tokens) == 4
    with pytest.raises(ValueError, match="NaN"):
        eng.generate([1, POISON, 3], max_new_tokens=4, params=params, draft=draft, ignore_eos=True)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.8, seed=1, mode="coupled"),
                                    SamplingParams(temperature=0.8, seed=1)], ids=["greedy", "coupled", "rejection"])
def test_nan_drafter_rows_only_stop_drafting(ckpt, params):
    eng = Engine.load(str(ckpt))
    with torch.no_grad():
        eng.model.mtp.fc.weight.fill_(1e38)  # the MTP head's rows overflow to NaN
    plain = eng.generate([1, 2, 3], max_new_tokens=12, params=params, draft=0, ignore_eos=True)
    spec = eng.generate([1, 2, 3], max_new_tokens=12, params=params, draft=3, ignore_eos=True)
    assert len(spec.tokens) == 12
    if params.greedy or params.mode == "coupled":
        assert spec.tokens == plain.tokens


def test_one_overflowing_prompt_of_a_batch_ends_in_error_alone(ckpt):
    """generate_batch (and so a prompts file): the poisoned prompt's Output ends in error, the
    others are their solo runs (it raised for the whole call, losing them)."""
    eng = _poison(Engine.load(str(ckpt)))
    prompts = [[1, 2, 3], [1, POISON, 3], [4, 5, 6, 7]]
    outs = eng.generate_batch(prompts, max_new_tokens=5, draft=2, ignore_eos=True)
    assert outs[1].stop_reason == "error" and "NaN" in outs[1].stats["error"]
    for i in (0, 2):
        solo = eng.generate(prompts[i], max_new_tokens=5, draft=2, ignore_eos=True)
        assert outs[i].tokens == solo.tokens and outs[i].stop_reason == "length"


def test_score_names_a_float32_overflow_as_the_checkpoint_s(ckpt):
    eng = _poison(Engine.load(str(ckpt)))
    with pytest.raises(ValueError, match="in float32: its activations overflow even this dtype") as e:
        eng.score([1, POISON, 3, 4])
    assert "load it in float32" not in str(e.value)


@pytest.mark.parametrize("draft", [0, 2])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)],
                         ids=["greedy", "sampled"])
def test_an_overflow_in_a_decode_round_ends_that_sequence_alone(ckpt, draft, params):
    """The overflow comes from a generated token (a decode round, not the prompt's prefill):
    the round's other sequences go on as their solo runs (the round's exception ended them
    all, each with the poisoned one's NonFiniteLogits)."""
    eng = Engine.load(str(ckpt))
    m = eng.model
    with torch.no_grad():  # _poison's wiring, without a poisoned token yet
        m.model.embed_tokens.weight[:, 0] = 0.0
        m.model.layers[0].linear_attn.out_proj.weight[0, :] = 0.0
        m.model.layers[0].mlp.gate_proj.weight[:, 0] = 1e19
        m.model.layers[0].mlp.up_proj.weight[:, 0] = 1e19
    bad, others = [4, 5, 6, 7], [[1, 2, 3], [8, 9, 10]]
    kw = dict(max_new_tokens=6, params=params, draft=draft, ignore_eos=True)
    poison = eng.generate(bad, **{**kw, "max_new_tokens": 3}).tokens[1]  # chosen in a round, fed in the next
    solo = [eng.generate(p, **kw).tokens for p in others]
    assert poison not in bad and all(poison not in t and poison not in p for t, p in zip(solo, others))
    with torch.no_grad():
        m.model.embed_tokens.weight[poison] = 0.0
        m.model.embed_tokens.weight[poison, 0] = 8.0
    outs = eng.generate_batch([others[0], bad, others[1]], **kw)
    assert outs[1].stop_reason == "error" and "NaN" in outs[1].stats["error"]
    assert [outs[0].tokens, outs[2].tokens] == solo and outs[0].stop_reason == outs[2].stop_reason == "length"
    with pytest.raises(ValueError, match="NaN"):
        eng.generate(bad, **kw)


@pytest.mark.parametrize("mode", ["rejection", "coupled"])
def test_an_overflowing_verify_row_after_a_rejected_draft_is_not_needed(mode):
    """Row j of a sampled round follows drafts[:j]: when draft 0 is rejected, row 1 is never
    used (plain decoding would not have fed that draft), so its NaN must not end the
    sequence (it did: every row's probabilities were formed first); when draft 0 is
    accepted, row 1 decides the next token and its NaN is the sequence's error."""
    from hyspec.core.round import sampled_accept
    from hyspec.sampling import NonFiniteLogits, coupled_token, draft_token, row_probs

    V, pos = 16, 7
    params = SamplingParams(temperature=1.0, seed=3, mode=mode)
    row0 = torch.full((V,), -1e4)
    row0[[2, 5]] = 0.0  # the target: 2 or 5, never 9
    nan = torch.full((V,), float("nan"))
    q = torch.zeros(V)
    q[9] = 1.0  # a drafter sure of 9
    n, tok = sampled_accept(torch.stack([row0, nan]), [9], [q], [], params, pos)
    p0 = row_probs(row0, [], params)
    plain = coupled_token(p0, 3, pos) if mode == "coupled" else None
    assert n == 0 and tok in (2, 5) and (plain is None or tok == plain)
    sure = torch.full((V,), -1e4)
    sure[2] = 0.0  # the target takes 2 for sure; so does the drafter
    q2 = torch.zeros(V)
    q2[2] = 1.0
    d = coupled_token(row_probs(sure, [], params), 3, pos) if mode == "coupled" else draft_token(q2, 3, pos)
    assert d == 2
    with pytest.raises(NonFiniteLogits):
        sampled_accept(torch.stack([sure, nan]), [2], [q2], [], params, pos)


@pytest.mark.parametrize("mode", ["greedy", "rejection", "coupled"])
def test_an_overflowing_row_that_decides_a_stop_draft_is_an_error(mode):
    """Row j of a round decides draft j. When draft j is a stop id (stop_cut's index) and the
    drafts before it are accepted, row j is needed (plain decoding computes it to choose token
    j), so its NaN is the sequence's error -- not a silent end without a token (greedy) or a
    token drawn from the stand-in row (sampled). A row after the stop draft is never needed:
    its NaN changes nothing."""
    from types import SimpleNamespace

    from hyspec.core.round import accept
    from hyspec.sampling import NonFiniteLogits

    V, STOP = 16, 9
    params = SamplingParams(temperature=0.0) if mode == "greedy" else SamplingParams(temperature=1.0, seed=3, mode=mode)

    def sure(tok):  # a target row (and a drafter's q) certain of tok
        row = torch.full((V,), -1e4)
        row[tok] = 0.0
        return row

    def one_hot(tok):
        q = torch.zeros(V, dtype=torch.float64)
        q[tok] = 1.0
        return q

    nan = torch.full((V,), float("nan"))

    def run(drafts, rows):
        seq = SimpleNamespace(params=params, req=SimpleNamespace(constraint=None, stop_text=None), history=[1, 2, 3],
                              speculative=True, stops={STOP})
        rd = SimpleNamespace(drafts=drafts, q_rows=[] if mode == "greedy" else [one_hot(t) for t in drafts],
                             first_draft_pos=3)
        return accept(seq, rd, torch.stack(rows))

    with pytest.raises(NonFiniteLogits):  # draft 0 accepted; row 1 decides the stop draft 1
        run([2, STOP], [sure(2), nan, sure(4)])
    n, _ = run([STOP, 2], [sure(STOP), nan, sure(4)])  # the stop draft 0 accepted; row 1 comes after it
    assert n == 1
