"""p_min on the batched graph lanes (SpecOptions.p_min; hyspec.gpu.batch.BatchDecoder._pmin_cut):
a lane's drafts end at the first the drafter gives less probability than its p_min (a
greedy lane: the softmax of its draft logits, penalised as its choice was, at its argmax; a
sampled lane: q at the draft, and a kept draft's q restricted to {q >= p_min} and
renormalised for the rejection test), computed on the device inside the round's graphs
(k_round: the drafts each lane kept; the host reads it back for the telemetry).

On the CPU (the Triton interpreter, fp32) the lanes give the engine core's tokens and
round-by-round telemetry: greedy (== plain greedy), penalised greedy, seeded rejection
and coupled sampling, alone, in a mixed batch (lanes with different p_min, one without,
a plain one) and under a constraint (masked rounds). HYSPEC_TEST_DEVICE=cuda runs the
lanes' own checks on a GPU (greedy speculative == plain; p_min cut some drafts, kept
others). The p_min of each case is the first of CANDIDATES with which the engine core
cuts some drafts and keeps others (the tiny models' draft probabilities lie near
1 / vocab)."""

from __future__ import annotations

import pytest

from hyspec.sampling import SamplingParams
from hyspec.speculative.loop import SpecOptions
from session_helpers import DEVICE, engine, skip_unless_lanes_run

pytest.importorskip("triton")

ON_CPU = DEVICE == "cpu"
K = 3
N = 8
PROMPTS = [[5, 17, 99, 3, 41], [8, 1, 2, 77], [300, 12, 9]]
CANDIDATES = tuple(0.0019 * 1.07 ** i for i in range(30))  # 0.0019 .. 0.0135
TEL = ("rounds", "drafted", "accepted", "drafted_at", "accepted_at")
KINDS = {
    "greedy": None,
    "penalised": SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3),
    "rejection": SamplingParams(temperature=0.9, seed=5),
    "coupled": SamplingParams(temperature=0.9, seed=3, mode="coupled"),
}


@pytest.fixture(autouse=True)
def _lanes_run_here():
    skip_unless_lanes_run()


def core_run(model, prompts, params, p_mins, constraint=None, ks=None, n=N):
    """The engine core's tokens, stop reasons and telemetry of these requests, each alone."""
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler
    from hyspec.speculative.telemetry import SpecTelemetry

    out = []
    for i, (prompt, sp, pm) in enumerate(zip(prompts, params, p_mins)):
        k = K if ks is None else ks[i]
        sched = Scheduler(model, max_batch=1)
        r = Request(prompt_ids=list(prompt), max_new_tokens=n, params=sp or SamplingParams(temperature=0.0),
                    draft=k, spec=SpecOptions(k=max(k, 1), p_min=pm) if k else None,
                    constraint=None if constraint is None else constraint.clone(), telemetry=SpecTelemetry())
        sched.submit(r)
        sched.run()
        tel = r.telemetry.to_dict() if k else None
        out.append((list(r.tokens), r.stop_reason, None if tel is None else {t: tel[t] for t in TEL}))
    return out


def cutting_p_min(model, prompt, params, constraint=None, n=N) -> tuple[float, int]:
    """(the first candidate p_min with which the engine core drafts fewer tokens than
    without one, but some; the core's drafted count without p_min)."""
    full = core_run(model, [prompt], [params], [0.0], constraint, n=n)[0][2]["drafted"]
    for pm in CANDIDATES:
        tel = core_run(model, [prompt], [params], [pm], constraint, n=n)[0][2]
        if 0 < tel["drafted"] < full:
            return pm, full
    pytest.fail("no candidate p_min cuts some drafts and keeps others on this model")


def lanes_run(model, prompts, params, p_mins, constraint=None, ks=None, slots=None, n=N):
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch

    dec = BatchDecoder(model, max(len(p) for p in prompts) + n + 8, K, slots=slots or len(prompts), graphs=not ON_CPU)
    reqs = [LaneRequest(prompt=list(p), max_new_tokens=n, k=K if ks is None else ks[i], params=sp, p_min=pm,
                        constraint=None if constraint is None else constraint.clone())
            for i, (p, sp, pm) in enumerate(zip(prompts, params, p_mins))]
    run_batch(dec, reqs)
    return [(r.tokens, r.reason or "length", {t: r.telemetry.to_dict()[t] for t in TEL} if r.k else None)
            for r in reqs]


@pytest.mark.parametrize("kind", list(KINDS))
def test_p_min_on_the_lanes_equals_the_engine_core(zoo, kind):
    eng = engine(zoo, "qwen3_5", dtype="float32")
    m, params = eng.model, KINDS[kind]
    n = 12 if kind == "rejection" else N  # (enough accept tests that the renormalised q shows)
    pm, full = cutting_p_min(m, PROMPTS[0], params, n=n)
    got = lanes_run(m, PROMPTS[:1], [params], [pm], n=n)[0]
    assert 0 < got[2]["drafted"] < full  # p_min cut some drafts on the lanes too
    if ON_CPU:  # (the core's greedy speculative == plain: tests/test_exactness*.py)
        assert got == core_run(m, PROMPTS[:1], [params], [pm], n=n)[0]
    elif params is None or params.greedy:
        plain = lanes_run(m, PROMPTS[:1], [params], [0.0], ks=[0])[0]
        assert got[0] == plain[0]  # speculative == plain, whatever p_min cut


def test_p_min_lanes_in_a_mixed_batch(zoo):
    """Three lanes in one batch, each equal to the engine core run alone: greedy with one
    p_min, seeded rejection sampling with another, a plain lane (k = 0: rounds with plain
    and drafting lanes)."""
    eng = engine(zoo, "qwen3_5", dtype="float32")
    m = eng.model
    params, ks = [None, KINDS["rejection"], KINDS["rejection"]], [K, K, 0]
    n = 6
    (pm0, full), (pm1, _) = cutting_p_min(m, PROMPTS[0], None, n=n), cutting_p_min(m, PROMPTS[1], params[1], n=n)
    p_mins = [pm0, pm1, 0.0]
    got = lanes_run(m, PROMPTS, params, p_mins, ks=ks, n=n)
    assert 0 < got[0][2]["drafted"] < full
    if ON_CPU:  # each lane as the core runs it alone
        assert got == core_run(m, PROMPTS, params, p_mins, ks=ks, n=n)
    else:  # the greedy lane as it runs alone
        assert got[0] == lanes_run(m, PROMPTS[:1], [None], [pm0], n=n)[0]


@pytest.mark.parametrize("kind", ["greedy"] if ON_CPU else ["greedy", "rejection"])
def test_p_min_under_a_constraint(zoo, kind):
    """Masked rounds (a constraint allowing the even ids): the drafter's probability is the
    masked row's, as on the core; the lanes give the core's tokens and telemetry."""
    from test_batch_logprobs import EvenIds

    eng = engine(zoo, "qwen3_5", dtype="float32")
    m, params = eng.model, KINDS[kind]
    c = EvenIds(m.cfg.vocab_size)
    pm, full = cutting_p_min(m, PROMPTS[0], params, c)
    got = lanes_run(m, PROMPTS[:1], [params], [pm], constraint=c)[0]
    assert all(t % 2 == 0 for t in got[0])
    assert 0 < got[2]["drafted"] < full
    if ON_CPU:
        assert got == core_run(m, PROMPTS[:1], [params], [pm], constraint=c)[0]
