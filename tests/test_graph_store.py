"""Graph lanes and the prefix store (hyspec.gpu.batch BatchDecoder.export / load / resume,
hyspec.gpu.batch_loop LaneRequest.resume / on_state), on CPU through the Triton interpreter,
fp32, a tiny model:

* a lane's end state, put back into a graph lane (beside another sequence, in another lane)
  with nothing new to prefill, goes on as the lane that never stopped: the same tokens and,
  for a plain lane, at the end the same state (every tensor; a drafting lane prefills its
  pending token first, as the engine core does);
* the same state resumed by the engine core (Scheduler + PrefixStore) gives the same tokens,
  and an engine-core end state resumed on a graph lane too;
* a resumed lane that prefills new tokens after the state equals the engine core resuming
  from the same state;
* an end state is handed over only when the lane's state is exactly its transcript's.

Greedy and seeded sampling (plain: rejection mode; speculative: coupled, whose tokens do
not depend on how the rounds are cut), plain and speculative (k = 2).

With CUDA the same tests run on the GPU (fp32, CUDA graphs, fla's prefill when it imports):
there the engine core's reference modules are other kernels than the lanes', so the
core's states are not compared bitwise with the lanes' (tokens still are)."""

from __future__ import annotations

import pytest
import torch

from session_helpers import assert_same, target_part

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    pytestmark = pytest.mark.usefixtures("triton_interpreter")

PROMPT = [5, 17, 99, 3, 7]
NEW = [9, 4, 33]
N, M = 3, 3  # tokens before the stop, tokens after it


def _params():
    from hyspec.sampling import SamplingParams

    return {"greedy": None, "sampled": SamplingParams(temperature=0.9, seed=5, presence_penalty=0.5, penalty_last_n=4),
            "coupled": SamplingParams(temperature=0.9, seed=7, mode="coupled")}


# speculative: coupled sampling (its draws cover the sampled commit; greedy speculative lanes
# round-trip in test_stop_among_accepted_drafts_keeps_the_state and the server chat test)
CASES = [(0, "greedy"), (0, "sampled"), (2, "coupled")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_next", tmp_path_factory.mktemp("graph_store"), seed=3, layers=4, hidden=32, vocab_size=128,
                  std=0.2)
    return load_model(d, dtype="float32", device="cuda" if CUDA else "cpu")


@pytest.fixture(scope="module")
def dec(model):
    from hyspec.gpu.batch import BatchDecoder

    return BatchDecoder(model, 40, 2, slots=2, graphs=CUDA)


def _lane(prompt, n, k, params, **kw):
    from hyspec.gpu.batch_loop import LaneRequest

    return LaneRequest(prompt=list(prompt), max_new_tokens=n, k=k, params=params, **kw)


def _core(model, store, prompt, n, k, params, **kw):
    from hyspec.core.request import GREEDY, Request
    from hyspec.core.scheduler import Scheduler

    sched = Scheduler(model, max_batch=1, store=store)
    r = sched.submit(Request(prompt_ids=list(prompt), max_new_tokens=n, draft=k,
                             params=params if params is not None else GREEDY, **kw))
    sched.run()
    assert r.stop_reason == "length", r.error
    return r


def _run(dec, *reqs):
    from hyspec.gpu.batch_loop import run_batch

    run_batch(dec, list(reqs))


@pytest.mark.parametrize("k,kind", CASES)
def test_lane_state_round_trip(model, dec, k, kind):
    from hyspec.prefix_store import PrefixStore

    params = _params()[kind]
    kept, kept_a = [], []
    b = _lane(PROMPT, N, k, params, on_state=kept.append)  # the lane that stops after N tokens
    _run(dec, b)
    state_b = kept.pop()
    assert state_b.tokens == tuple(PROMPT + b.tokens) and state_b.pos == len(state_b.tokens) - 1
    assert state_b.pending == b.tokens[-1] and (state_b.drafter == "post") == (k > 0)

    # back into a graph lane, lane 1 this time, nothing new to prefill: a plain lane goes on
    # from the state itself, bitwise the lane that never stopped -- which is the other
    # sequence beside it, in lane 0 (from the prompt: N positions behind, so lane 1 reading
    # lane 0's cache or state would not go unnoticed); a drafting lane prefills its pending
    # token and draws the next from that row, as the engine core resumes (its rounds start
    # there): coupled sampling's tokens are those of the lane that never stopped all the same
    a = _lane(PROMPT, N + M, k, params, on_state=kept_a.append)  # the lane that never stops
    c = _lane(state_b.tokens, M, k, params, resume=state_b, on_state=kept.append)
    _run(dec, a, c)
    state_a, state_c = kept_a.pop(), kept.pop()
    assert b.tokens == a.tokens[:N]
    assert c.tokens == a.tokens[N:] and c.cached == len(state_b.tokens) - 1
    if k == 0:
        assert_same(state_c, state_a)
    else:  # (the one-token prefill's kernels are not the decode step's: the same tokens, other bits)
        assert state_c.tokens == state_a.tokens and state_c.pos == state_a.pos

    # into the engine core: a prefix-store hit whose pending token is prefilled
    store = PrefixStore()
    store.put(state_b)
    r = _core(model, store, state_b.tokens, M, k, params)
    assert store.hits == 1 and r.stats["cached_tokens"] == len(state_b.tokens) - 1
    assert r.tokens == a.tokens[N:]

    # and the other way: the engine core's end state, resumed on a graph lane
    store = PrefixStore()
    core_b = _core(model, store, PROMPT, N, k, params, store_state=True)
    assert core_b.tokens == b.tokens
    from hyspec.gpu.batch_loop import stored_state

    st = stored_state(store, state_b.tokens, k)
    assert st is not None and st.tokens == state_b.tokens
    d = _lane(st.tokens, M, k, params, resume=st)

    # a prompt that extends the state by new tokens: the lane prefills [pending] + new after
    # loading it, as the engine core does from the same state (the chunked prefill from the
    # state's position): the same tokens. (It runs beside d, in one batch: each lane's
    # tokens are its own, whoever else is in the batch.)
    prompt = list(state_b.tokens) + NEW
    g = _lane(prompt, M, k, params, resume=state_b, on_state=kept.append)
    _run(dec, d, g)
    assert d.tokens == a.tokens[N:]
    state_g = kept.pop()
    assert not kept
    assert g.cached == len(state_b.tokens) - 1 and state_g.tokens == tuple(prompt + g.tokens)
    store = PrefixStore()
    store.put(state_b)
    r = _core(model, store, prompt, M, k, params)
    assert r.stats["cached_tokens"] == g.cached and r.tokens == g.tokens
    # right after that prefill (one token: the lane leaves at admission) the lane's state is
    # the engine core's, bitwise: KV rows, conv / SSM states, drafter rows and queue
    g1 = _lane(prompt, 1, k, params, resume=state_b, on_state=kept.append)
    _run(dec, g1)
    state_g1 = kept.pop()
    r1 = _core(model, store, prompt, 1, k, params, store_state=True)
    state_r1 = store.lookup(prompt + r1.tokens)
    assert r1.tokens == g1.tokens == g.tokens[:1] and state_r1.tokens == state_g1.tokens
    state_r1.last_logits = None  # (the lane does not keep the row that chose the pending token)
    if not CUDA:
        assert_same(state_g1, state_r1)


def test_end_state_only_when_exact(model, dec):
    """A stop token among a round's accepted drafts, or a pipelined round after the stop,
    leaves the lane past its transcript: no state is handed over (and the runner counts it);
    with a state wanted and stop ids, rounds are not pipelined, so a stop as the round's own
    token keeps its state."""
    from hyspec.gpu.batch_loop import BatchRunner

    plain = _core(model, None, PROMPT, 12, 0, None).tokens  # (the lanes give the engine core's tokens)
    stop = next(t for i, t in enumerate(plain) if i >= 4 and t not in plain[:i])
    kept = []
    r = _lane(PROMPT, 12, 0, None, stop_ids=frozenset({stop}), on_state=kept.append)
    runner = BatchRunner(dec)
    runner.submit(r)
    runner.run()
    assert r.reason == "eos" and r.tokens == plain[: plain.index(stop) + 1]
    assert len(kept) == 1 and kept[0].tokens == tuple(PROMPT + r.tokens) and kept[0].pending == stop
    # the same request with rounds pipelined regardless (the wanted state disables it): the
    # round queued after the stop's moves the lane on, and its state is not handed over
    runner = BatchRunner(dec)
    runner._may_queue_next = lambda k: not any(x.reason for x in runner.active)
    r2 = _lane(PROMPT, 12, 0, None, stop_ids=frozenset({stop}), on_state=kept.append)
    runner.submit(r2)
    runner.run()
    assert r2.tokens == r.tokens and len(kept) == 1 and runner.states_not_kept == 1


def test_stop_among_accepted_drafts_keeps_the_state(model, dec):
    """A stop token accepted as a draft (the forced drafter proposes the plain continuation:
    every draft is accepted) ends the device's commit there, as the engine core's does: the
    cache keeps the tokens before it and the stop stays pending, so the lane's end state is
    its transcript's, and its target part is bitwise the plain lane's that stopped there."""
    from hyspec.gpu.batch_loop import BatchRunner

    ref = _core(model, None, PROMPT, 9, 0, None).tokens  # the plain continuation (the lanes give the core's tokens)
    # rounds of k = 2 emit tokens 1-3, 4-6, 7-9 (two accepted drafts and the bonus each)
    i = next(i for i in (4, 5, 7) if ref[i] not in ref[:i])
    stop = frozenset({ref[i]})
    kept = []
    runner = BatchRunner(dec, forced_rates=(1.0, 1.0), forced_seed=0)
    r = _lane(PROMPT, 9, 2, None, stop_ids=stop, reference=ref, on_state=kept.append)
    runner.submit(r)
    runner.run()
    assert r.reason == "eos" and r.tokens == ref[: i + 1] and runner.states_kept == 1
    assert r.telemetry.to_dict()["acceptance_length"] > 2
    p = _lane(PROMPT, 9, 0, None, stop_ids=stop, on_state=kept.append)
    _run(dec, p)
    spec_state, plain_state = kept
    assert spec_state.tokens == plain_state.tokens == tuple(PROMPT + ref[: i + 1])
    assert spec_state.pending == ref[i] and spec_state.fill_tokens[-1] == ref[i]
    assert_same(target_part(spec_state), target_part(plain_state))


def test_a_moved_lane_keeps_its_stop_ids_and_forced_drafts(model, dec):
    """A lane moved into a freed one (the last lane fills the hole) takes its stop ids (all
    of them: here two) and its forced drafter's table with it: after the move its drafts
    are still the reference's (every one accepted), and a stop among them still ends the
    device's commit, so its end state is kept (its transcript's)."""
    from hyspec.gpu.batch_loop import BatchRunner

    ref = _core(model, None, PROMPT, 9, 0, None).tokens
    i = next(i for i in (4, 5, 7) if ref[i] not in ref[:i])  # (rounds of k = 2 after the move: tokens 2-4, 5-7)
    other = min(t for t in range(128) if t not in ref)  # a second stop id, sorted before it (never met)
    assert other < ref[i]
    stop = frozenset({ref[i], other})
    kept = []
    runner = BatchRunner(dec, forced_rates=(1.0, 1.0), forced_seed=0)
    first = _lane([8, 1, 2], 2, 0, None)  # lane 0: leaves after one round, lane 1 moves into it
    r = _lane(PROMPT, 9, 2, None, stop_ids=stop, reference=ref, on_state=kept.append)
    runner.submit(first)
    runner.submit(r)
    runner.run()
    assert first.reason == "length" and r.reason == "eos" and r.tokens == ref[: i + 1]
    assert runner.states_kept == 1 and kept[0].tokens == tuple(PROMPT + ref[: i + 1])
    tel = r.telemetry.to_dict()
    assert tel["accepted"] == tel["drafted"] > 0
