"""Adaptive K on the batched graph lanes (hyspec.gpu.batch_loop: LaneRequest.adaptive_floor,
the engine core's rule next k = clamp(accepted + 1, floor, k), each lane's k_lane set per
round and the round's graphs as deep as the deepest lane asks). On the CPU (the Triton
interpreter, fp32) a request with SpecOptions(adaptive=True) runs on the lanes and gives
the engine core's tokens and round-by-round telemetry (so the same k every round), greedy
== plain greedy, and seeded sampling; HYSPEC_TEST_DEVICE=cuda runs the lanes' own checks
on a GPU (fp32 models on the device: greedy speculative == plain, the k schedule used)."""

from __future__ import annotations

import pytest

from conftest import ARCHS
from hyspec.sampling import SamplingParams
from hyspec.speculative.loop import SpecOptions
from session_helpers import DEVICE, engine, skip_unless_lanes_run

pytest.importorskip("triton")

ON_CPU = DEVICE == "cpu"
N = 10  # (greedy: k falls to the floor after the first round; one draft accepted, in round 8)
PROMPT = [5, 17, 99, 3, 41]


@pytest.fixture(autouse=True)
def _lanes_run_here():
    skip_unless_lanes_run()


@pytest.mark.parametrize("arch", ["qwen3_5"] if ON_CPU else ARCHS[:2])  # (CI's time: one family on the CPU)
def test_adaptive_k_on_the_lanes_equals_the_engine_core(zoo, arch):
    lanes = engine(zoo, arch, dtype="float32")
    lanes.batch_graphs = True
    spec = SpecOptions(adaptive=True, adaptive_floor=1)
    # plain greedy: on the CPU the engine core's (the interpreter's plain lanes give its tokens:
    # tests/test_batch_logprobs.py, draft=0; N plain steps on the lanes cost seconds there), on a GPU the lanes'
    ref = engine(zoo, arch, dtype="float32") if ON_CPU else lanes
    plain = ref.generate(PROMPT, max_new_tokens=N, ignore_eos=True).samples[0].tokens
    for params in (None, SamplingParams(temperature=0.9, seed=5)):
        out = lanes.generate(PROMPT, max_new_tokens=N, draft=3, spec=spec, params=params, ignore_eos=True)
        s = out.samples[0]
        assert s.stats["path"] == "batch-graphs"
        tel = s.stats["spec"]
        assert tel["drafted"] < 3 * tel["rounds"]  # k went below 3 in some rounds
        if params is None:
            assert s.tokens == plain  # speculative == plain, greedy, whatever k each round took
        if ON_CPU:
            core = engine(zoo, arch, dtype="float32").generate(PROMPT, max_new_tokens=N, draft=3, spec=spec,
                                                               params=params, ignore_eos=True).samples[0]
            assert core.stats.get("path") != "batch-graphs"
            assert s.tokens == core.tokens
            assert {k: tel[k] for k in ("rounds", "drafted", "accepted", "drafted_at", "accepted_at")} == \
                {k: core.stats["spec"][k] for k in ("rounds", "drafted", "accepted", "drafted_at", "accepted_at")}


def test_adaptive_session_turns_carry_their_k(zoo):
    """Session turns with adaptive K, seeded sampling: each turn starts from the k its
    state's last round chose (SeqState.k_next, as the engine core's slots do), so the lanes'
    session gives the core session's tokens and telemetry turn by turn (CPU); the state
    each turn hands back carries the lane's k."""
    from session_helpers import messages

    spec = SpecOptions(adaptive=True, adaptive_floor=1)
    params = SamplingParams(temperature=0.9, seed=0)  # (turns 1 and 3 end asking for k = 1)
    lanes = engine(zoo, "qwen3_5", dtype="float32")
    lanes.batch_graphs = lanes.session_graphs = True
    msgs = messages(lanes.model.cfg.vocab_size, 3, seed=6)
    s = lanes.session(draft=3, spec=spec, params=params, max_new_tokens=5, ignore_eos=True)
    outs, ks = [], []
    for m in msgs:
        outs.append(s.send(m))
        ks.append(s._boundary.k_next)
    assert all(o.samples[0].stats["path"] == "batch-graphs" for o in outs)
    assert all(1 <= k <= 3 for k in ks) and min(ks[:-1]) < 3  # a turn hands the next one a smaller k
    if ON_CPU:
        core = engine(zoo, "qwen3_5", dtype="float32")
        core.session_graphs = False
        c = core.session(draft=3, spec=spec, params=params, max_new_tokens=5, ignore_eos=True)
        for o, m in zip(outs, msgs):
            oc = c.send(m)
            assert o.tokens == oc.tokens
            assert o.stats["spec"]["drafted_at"] == oc.stats["spec"]["drafted_at"]


def test_a_stop_among_accepted_drafts_sets_k_as_on_the_core(zoo):
    """The forced drafter proposing the greedy continuation (rate 1: every draft accepted);
    a stop id that is the second draft of the first round. The core applies its rule after
    cutting the round at the stop (k = clamp(1 + 1, ...) = 2, where the raw count would give
    3); the lane's exported state carries the same k (and the core's Sequence has it)."""
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler
    from hyspec.gpu.batch_loop import LaneRequest, run_batch

    eng = engine(zoo, "qwen3_5", dtype="float32")
    m = eng.model
    greedy = eng.generate(PROMPT, max_new_tokens=10, ignore_eos=True).samples[0].tokens
    stop = greedy[2]  # token 0 comes from the prefill; the first round drafts greedy[1..3]
    assert stop not in greedy[:2]
    spec = SpecOptions(k=3, adaptive=True, adaptive_floor=1, forced_rates=(1.0, 1.0, 1.0))
    saved = []
    lane = LaneRequest(prompt=PROMPT, max_new_tokens=8, k=3, stop_ids=frozenset({stop}), reference=greedy,
                       adaptive_floor=1, keep=True, on_state=saved.append)
    run_batch(eng.new_batch_decoder(1, 32, 3), [lane], forced_rates=(1.0, 1.0, 1.0))
    assert lane.tokens == greedy[:3] and lane.reason == "eos" and saved[0].k_next == 2
    if ON_CPU:
        sched = Scheduler(m, max_batch=1)
        req = Request(prompt_ids=PROMPT, max_new_tokens=8, draft=3, spec=spec, reference=greedy, stop_ids={stop},
                      keep=True)
        sched.submit(req)
        sched.run()
        assert req.tokens == lane.tokens and req.sequence.k_next == 2
