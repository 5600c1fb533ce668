"""Constrained lanes on the batched CUDA-graph decoder (hyspec.gpu.batch), on CPU through
the Triton interpreter (fp32, a tiny model with its tiny tokenizer; short on purpose:
every interpreted round costs seconds).

* greedy: a constrained lane gives the engine core's constrained greedy tokens with k = 0
  and with k = 3 (so speculative == plain, bitwise), next to an unconstrained lane whose
  tokens stay the engine core's unconstrained ones; the forced drafter's wrong proposals
  exercise the masked-argmax fallback;
* a constraint that allows nothing more ends the lane with stop_reason "constraint"
  (k = 3: the drafts up to the dead end are emitted without a bonus);
* seeded sampling (rejection mode, the MTP drafter: accept tests and residuals on masked
  distributions, a penalty over a 2-token window) through Engine.generate on the graph
  path equals the engine core.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_infinite, make_overflowing

pytest.importorskip("triton")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

REGEX = r"[a-z_ ]{3,40}\.?"
PROMPTS = [[5, 17, 99, 3], [8, 1, 2]]
N = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path_factory.mktemp("cons_batch"), seed=3, layers=4, hidden=32, vocab_size=320,
                  std=0.2)  # vocab >= 300: it has a tokenizer.json
    return d, load_model(d)


def _core(model, prompts, ks, params, constraints, n=N, stops=(0,)):
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler

    sched = Scheduler(model, max_batch=len(prompts))
    reqs = [Request(prompt_ids=list(p), max_new_tokens=n, params=sp, draft=k, stop_ids=stops,
                    constraint=None if c is None else c.clone())
            for p, k, sp, c in zip(prompts, ks, params, constraints)]
    for r in reqs:
        sched.submit(r)
    sched.run()
    return [(list(r.tokens), r.stop_reason) for r in reqs]


def test_constrained_greedy_k0_k3_core_and_a_mixed_batch(tiny):
    from hyspec.constraints import make_constraint
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.sampling import SamplingParams

    d, m = tiny
    c = make_constraint(d, "regex", REGEX)
    g = SamplingParams(temperature=0.0)
    want = _core(m, PROMPTS, [0, 0], [g, g], [c, None])  # constrained lane 0, unconstrained lane 1
    dec = BatchDecoder(m, 4 + N + 8, 3, slots=2, graphs=False)
    # k = 3 with the forced drafter (proposals from the wanted outputs, some wrong: the
    # constrained lane's wrong ones the regex forbids fall back to the masked argmax)
    reqs = [LaneRequest(prompt=p, max_new_tokens=N, k=3, stop_ids=frozenset({0}), reference=w[0],
                        constraint=cc) for p, w, cc in zip(PROMPTS, want, [c.clone(), None])]
    stats = run_batch(dec, reqs, forced_rates=(0.9, 0.7, 0.6))
    assert [(r.tokens, r.reason) for r in reqs] == want
    assert stats["masked_rounds"] == stats["rounds"] > 0 and sum(r.telemetry.accepted for r in reqs) > 0
    # k = 0: the same constrained tokens
    plain = LaneRequest(prompt=PROMPTS[0], max_new_tokens=N, stop_ids=frozenset({0}), constraint=c.clone())
    run_batch(dec, [plain])
    assert (plain.tokens, plain.reason) == want[0]
    # a dead end (EOS is not a stop id, and nothing may follow it): the drafts up to it are
    # emitted without a bonus, stop_reason "constraint", as in the engine core
    ch = make_constraint(d, "choice", ["ab cd", "xy"])
    end = _core(m, PROMPTS[:1], [3], [g], [ch], stops=())
    assert end[0][1] == "constraint"
    lane = LaneRequest(prompt=PROMPTS[0], max_new_tokens=N, k=3, constraint=ch.clone())
    run_batch(dec, [lane])
    assert (lane.tokens, lane.reason) == end[0]
    # a dead end right after all k drafts were accepted (the bonus row allows nothing): the
    # round counts, with its drafts and accepts, in the lane's telemetry as in the core's
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler

    ch = make_constraint(d, "choice", ["abcdefgh", "xyz"])
    sched = Scheduler(m, max_batch=1)
    ref = Request(prompt_ids=PROMPTS[0], max_new_tokens=N, params=g, draft=3, stop_ids=(), constraint=ch.clone())
    sched.submit(ref)
    sched.run()
    lane = LaneRequest(prompt=PROMPTS[0], max_new_tokens=N, k=3, constraint=ch.clone())
    run_batch(dec, [lane])
    assert ref.stop_reason == "constraint" and ref.stats["spec"]["accepted"] == 3 == len(ref.tokens) - 1
    assert (lane.tokens, lane.reason, lane.telemetry.to_dict()) == (ref.tokens, ref.stop_reason, ref.stats["spec"])


def test_constrained_sampling_on_the_graph_path_equals_the_engine_core(tiny):
    """Engine.generate routes a constrained request to the BatchDecoder (batch_graphs: the
    interpreter here, CUDA in production); seeded rejection sampling with the MTP drafter
    with a presence penalty over the last 2 tokens (drafts included: the window crosses the
    masked round's separate draft graphs) gives the engine core's tokens."""
    from hyspec.constraints import make_constraint
    from hyspec.engine import Engine
    from hyspec.sampling import SamplingParams

    d, m = tiny
    c = make_constraint(d, "regex", REGEX)
    sp = SamplingParams(temperature=0.9, seed=7, presence_penalty=2.0, penalty_last_n=2)
    ref = Engine(m).generate(PROMPTS[0], max_new_tokens=N, params=sp, draft=3, constraint=c)
    eng = Engine(m)
    eng.batch_graphs = True
    out = eng.generate(PROMPTS[0], max_new_tokens=N, params=sp, draft=3, constraint=c)
    s = out.samples[0]
    assert s.stats["path"] == "batch-graphs" and ref.samples[0].stats.get("path") != "batch-graphs"
    assert (s.tokens, s.stop_reason) == (ref.samples[0].tokens, ref.samples[0].stop_reason)
    spec = s.stats["spec"]
    assert 0 < spec["accepted"] < spec["drafted"]  # accept tests passed and failed (residual draws)
    assert c.committed == 0  # generate ran on a clone


def test_logprobs_under_a_constraint_on_the_graph_path(tiny):
    """Logprobs of constrained lanes (the raw logits' log-softmax, as the engine core
    reports them: the masked round's rows are copied before its commit masks them in
    place): a mixed batch (a constrained and an unconstrained lane, greedy, K=3) and seeded
    sampling through Engine.generate equal the engine core's tokens and logprobs, and each
    value is the reference's teacher-forced log-probability."""
    from hyspec.constraints import make_constraint
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler
    from hyspec.engine import Engine
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.sampling import SamplingParams

    d, m = tiny
    c = make_constraint(d, "regex", REGEX)

    def reference(prompt, tokens):
        with torch.no_grad():
            lg = m(torch.tensor(list(prompt) + list(tokens))).double()
        return torch.log_softmax(lg, -1)[len(prompt) - 1: len(prompt) - 1 + len(tokens)]

    def same(got, want, prompt, tokens):
        assert len(got) == len(want) == len(tokens) > 0
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-5)
        assert [[i for i, _ in a] for _, a in got] == [[i for i, _ in a] for _, a in want]
        ref = reference(prompt, tokens)
        assert [lp for lp, _ in got] == pytest.approx([float(ref[j, t]) for j, t in enumerate(tokens)], abs=1e-5)

    sched = Scheduler(m, max_batch=2)
    core = [Request(prompt_ids=list(p), max_new_tokens=N, draft=3, stop_ids={0}, logprobs=2, constraint=cc)
            for p, cc in zip(PROMPTS, [c.clone(), None])]
    for r in core:
        sched.submit(r)
    sched.run()
    dec = BatchDecoder(m, 4 + N + 8, 3, slots=2, graphs=False)
    lanes = [LaneRequest(prompt=list(p), max_new_tokens=N, k=3, stop_ids=frozenset({0}), logprobs=2, constraint=cc)
             for p, cc in zip(PROMPTS, [c.clone(), None])]
    stats = run_batch(dec, lanes)
    assert stats["masked_rounds"] > 0
    for lr, r, p in zip(lanes, core, PROMPTS):
        assert lr.tokens == r.tokens
        same(lr.token_logprobs, r.token_logprobs, p, lr.tokens)
    # a dead end (nothing may follow the choice): the drafts up to it, each with its entry
    ch = make_constraint(d, "choice", ["ab cd", "xy"])
    core_end = Request(prompt_ids=PROMPTS[0], max_new_tokens=N, draft=3, logprobs=1, constraint=ch.clone())
    sched.submit(core_end)
    sched.run()
    lane_end = LaneRequest(prompt=PROMPTS[0], max_new_tokens=N, k=3, logprobs=1, constraint=ch.clone())
    run_batch(dec, [lane_end])
    assert lane_end.reason == core_end.stop_reason == "constraint" and lane_end.tokens == core_end.tokens
    same(lane_end.token_logprobs, core_end.token_logprobs, PROMPTS[0], lane_end.tokens)
    sp = SamplingParams(temperature=0.9, seed=7, presence_penalty=2.0, penalty_last_n=2)
    want = Engine(m).generate(PROMPTS[0], max_new_tokens=N, params=sp, draft=3, constraint=c, logprobs=3)
    eng = Engine(m)
    eng.batch_graphs = True
    out = eng.generate(PROMPTS[0], max_new_tokens=N, params=sp, draft=3, constraint=c, logprobs=3)
    assert out.samples[0].stats["path"] == "batch-graphs" and out.samples[0].tokens == want.samples[0].tokens
    same(out.logprobs[0], want.logprobs[0], PROMPTS[0], out.samples[0].tokens)


def test_a_constraint_that_cannot_go_on_ends_only_its_own_sequence(tiny):
    """A grammar that cannot be completed (after "ab" its next character comes from an empty
    set: the matcher offers EOS alone though the output is incomplete) ends its own
    sequence with stop_reason "error" and a ConstraintFailure naming it, in the engine core
    and on the lanes; the unconstrained sequence beside it keeps its tokens (was: the
    commit's ValueError escaped the round and ended every sequence in the batch)."""
    from hyspec.constraints import make_constraint
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler
    from hyspec.engine import Engine
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.sampling import SamplingParams

    d, m = tiny
    poison = make_constraint(d, "grammar", 'start: "ab" x\nx: /[^\\x00-\\U0010FFFF]/')
    g = SamplingParams(temperature=0.0)
    alone = _core(m, PROMPTS[1:], [0], [g], [None])[0]
    sched = Scheduler(m, max_batch=2)
    reqs = [Request(prompt_ids=list(PROMPTS[0]), max_new_tokens=N, constraint=poison.clone()),
            Request(prompt_ids=list(PROMPTS[1]), max_new_tokens=N, stop_ids=(0,))]
    for r in reqs:
        sched.submit(r)
    sched.run()
    assert reqs[0].stop_reason == "error" and "cannot be completed" in reqs[0].error
    assert type(reqs[0].exception).__name__ == "ConstraintFailure"
    assert (list(reqs[1].tokens), reqs[1].stop_reason) == alone
    dec = BatchDecoder(m, 4 + N + 8, 3, slots=2, graphs=False)
    lanes = [LaneRequest(prompt=PROMPTS[0], max_new_tokens=N, k=3, constraint=poison.clone(), reference=[1] * N),
             LaneRequest(prompt=PROMPTS[1], max_new_tokens=N, k=3, stop_ids=frozenset({0}), reference=alone[0])]
    run_batch(dec, lanes, forced_rates=(0.9, 0.7, 0.6))
    assert lanes[0].reason == "error" and "grammar constraint" in lanes[0].error
    assert (lanes[1].tokens, lanes[1].reason) == alone
    with pytest.raises(ValueError, match="constraint cannot be completed"):  # the Python API names it
        Engine(m).generate(PROMPTS[0], max_new_tokens=N, constraint=poison)
    # generate_batch returns every prompt's output, the failed one ended in "error" with its reason
    # (it raised after the batch and the others' outputs were lost)
    outs = Engine(m).generate_batch([PROMPTS[0], PROMPTS[1]], max_new_tokens=N, constraint=[poison, None],
                                    stop_ids=[0])
    assert outs[0].samples[0].stop_reason == "error" and "cannot be completed" in outs[0].stats["error"]
    assert (outs[1].tokens, outs[1].samples[0].stop_reason) == alone and "error" not in outs[1].stats
    # with drafts the dead end is found after the round that reached it: the same tokens, the same error
    # (it ended "constraint", as if an EOS had ended the grammar)
    spec = Engine(m).generate_batch([PROMPTS[0]], max_new_tokens=N, constraint=poison, draft=3)[0]
    assert spec.tokens == outs[0].tokens == lanes[0].tokens and spec.samples[0].stop_reason == "error"
    assert "cannot be completed" in spec.stats["error"] and "cannot be completed" in lanes[0].error
    # nothing allowed before the first token: refused when the constraint is built; a matcher in that
    # state anyway (built around the check) is an error on the core path too (it ended "constraint")
    dead = 'start: x\nx: /[^\x00-\U0010FFFF]/'
    with pytest.raises(ValueError, match="the grammar admits no output"):
        make_constraint(d, "grammar", dead)
    import llguidance

    from hyspec.constraints import Constraint, grammar_for, vocab_for

    vocab, text = vocab_for(d), grammar_for("grammar", dead, "grammar")
    never = Constraint(vocab, text, _matcher=llguidance.LLMatcher(vocab.lltok, text, log_level=0))
    for draft in (0, 2):
        first = Engine(m).generate_batch([PROMPTS[0]], max_new_tokens=N, constraint=never, draft=draft)[0]
        assert (first.tokens, first.samples[0].stop_reason) == ([], "error") and "after 0 token" in first.stats["error"]
    # a session whose speculative turn failed: "go on" names the failure (it raised a TypeError), a new
    # message without the constraint goes on
    sess = Engine(m).session(draft=3, max_new_tokens=N, constraint=poison)
    with pytest.raises(ValueError, match="cannot be completed"):
        sess.send(PROMPTS[0])
    with pytest.raises(ValueError, match="the last reply's constraint cannot go on"):
        sess.send([])
    assert sess.send([7], constraint=False).samples[0].stop_reason in ("eos", "length")


def test_a_round_the_grammar_refuses_leaves_the_output_as_it_was_streamed(tiny):
    """A commit the constraint refuses (here planted: llguidance raising on tokens its own mask
    allowed would be a matcher bug) ends that sequence in error, and the refused round's tokens
    leave its output: the final tokens are exactly what on_tokens streamed, on the engine core
    and on the lanes (they stayed in the output, never streamed: a server's stream and a
    Python caller's tokens disagreed). A failure marked while the round's tokens were taken
    (the commit went through) keeps and streams them before the error end. The sequence
    beside it is untouched."""
    from hyspec.constraints import make_constraint
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.sampling import SamplingParams

    d, m = tiny
    g = SamplingParams(temperature=0.0)
    base = make_constraint(d, "regex", REGEX)
    full = _core(m, PROMPTS[:1], [3], [g], [base], n=6, stops=())[0]
    alone = _core(m, PROMPTS[1:], [0], [g], [None], n=6)[0]
    assert len(full[0]) == 6
    dec = BatchDecoder(m, 4 + 6 + 8, 3, slots=2, graphs=False)

    def planted(how):  # the second commit refuses its tokens (raise) or takes them and marks a failure (mark)
        c, calls = base.clone(), []
        real = c.commit

        def commit(tokens):
            calls.append(list(tokens))
            if len(calls) == 2 and how == "raise":
                raise RuntimeError("planted matcher failure")
            real(tokens)
            if len(calls) == 2:
                c.fail("planted failure after the commit")
        c.commit = commit
        return c, calls

    for how in ("raise", "mark"):
        c, calls = planted(how)
        streamed = []
        sched = Scheduler(m, max_batch=2)
        reqs = [Request(prompt_ids=list(PROMPTS[0]), max_new_tokens=6, draft=3, stop_ids=(), constraint=c,
                        on_tokens=lambda r, t: streamed.extend(t)),
                Request(prompt_ids=list(PROMPTS[1]), max_new_tokens=6, stop_ids=(0,))]
        for r in reqs:
            sched.submit(r)
        sched.run()
        kept = calls[0] + (calls[1] if how == "mark" else [])
        assert reqs[0].stop_reason == "error" and "planted" in reqs[0].error, how
        assert list(reqs[0].tokens) == streamed == kept == full[0][:len(kept)] and len(calls) == 2, how
        assert (list(reqs[1].tokens), reqs[1].stop_reason) == alone
        c, calls = planted(how)
        streamed = []
        lanes = [LaneRequest(prompt=PROMPTS[0], max_new_tokens=6, k=3, constraint=c, reference=full[0],
                             on_tokens=streamed.extend)]
        if how == "raise":  # (the lanes' neighbour once: interpreted rounds cost seconds)
            lanes.append(LaneRequest(prompt=PROMPTS[1], max_new_tokens=6, k=0, stop_ids=frozenset({0})))
        run_batch(dec, lanes, forced_rates=(1.0,))
        kept = calls[0] + (calls[1] if how == "mark" else [])
        assert lanes[0].reason == "error" and "planted" in lanes[0].error, how
        assert lanes[0].tokens == streamed == kept == full[0][:len(kept)] and len(calls) == 2, how
        assert all((r.tokens, r.reason) == alone for r in lanes[1:])


def test_a_constrained_lane_whose_row_overflows_ends_in_error_as_on_the_engine_core(tmp_path):
    """Token 100 (allowed by the constraint) drives the model's activations past float32
    when it is fed: the next row's allowed logits are NaN. The engine core masks, then
    finds NaN (NonFiniteLogits: an error); the masked lanes took such a row for a dead end
    (no allowed token with a finite logit: stop_reason "constraint") before they checked
    it. Greedy, plain and speculative (the masked round's commit): the engine core's
    tokens and end, next to a lane that goes on."""
    from hyspec.constraints import make_constraint
    from hyspec.engine import Engine
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=320, std=0.2)
    engines = []
    for graphs in (False, True):
        eng = Engine.load(d)
        m = eng.model
        make_overflowing(m, 3.0)  # token 100 overflows when fed
        eng.batch_graphs = graphs
        engines.append(eng)
    c = make_constraint(d, "regex", r"[^\n]{1,200}")
    prompts = [[2, 15, 3], [3, 22, 3]]
    for draft in (0, 3):
        kw = dict(max_new_tokens=6, draft=draft, ignore_eos=True, constraint=c)
        want, got = (eng.generate_batch(prompts, **kw) for eng in engines)
        assert got[0].stats["path"] == "batch-graphs"
        assert [(w.tokens, w.stop_reason) for w in want] == [(g.tokens, g.stop_reason) for g in got], draft
        assert [g.stop_reason for g in got] == ["error", "length"] and 100 in got[0].tokens
        assert got[0].stats["error"].startswith("NonFiniteLogits: ")


def test_masked_drafts_end_at_a_drafter_row_with_an_infinite_allowed_logit_as_on_the_engine_core(tmp_path):
    """A damaged MTP head whose draft rows give token 150 (allowed) a logit of +inf now and
    then, every other logit finite: the engine core drafts nothing from such a row
    (NonFiniteLogits); a masked round took it for a live row -- a greedy lane drafted 150
    from it (the same tokens, other drafted counts), a sampled lane drew from q of NaN and
    emitted tokens the target never gave. Now its drafts end there, greedy and sampled:
    the engine core's tokens and drafted counts."""
    from hyspec.constraints import make_constraint
    from hyspec.engine import Engine
    from hyspec.sampling import SamplingParams
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=320, std=0.2)
    engines = []
    for graphs in (False, True):
        eng = Engine.load(d)
        make_infinite(eng.model, 150)
        eng.batch_graphs = graphs
        engines.append(eng)
    c = make_constraint(d, "regex", r"[^\n]{1,200}")
    prompts = [[2, 15, 3], [5, 100, 3]]
    for params in (None, SamplingParams(temperature=0.9, seed=4)):
        kw = dict(max_new_tokens=10, draft=3, ignore_eos=True, constraint=c, params=params)
        want, got = (eng.generate_batch(prompts, **kw) for eng in engines)
        assert got[0].stats["path"] == "batch-graphs"
        assert [g.tokens for g in got] == [w.tokens for w in want], params
        drafted = [w.stats["spec"]["drafted_at"] for w in want]
        assert [g.stats["spec"]["drafted_at"] for g in got] == drafted, params
        assert all(d[-1] < d[0] for d in drafted)  # (drafts ended early: rows with +inf)
