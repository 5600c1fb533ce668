"""Engine options that act on how a request runs: generate's `cancel` (a caller ending the
samples between rounds, with their stats so far: the server's sequential fallback ends a
cancelled job with it) and the pipeline-only attributes Engine.lanes / Engine.optimistic,
refused where they cannot act, as the CLI refuses --lanes / --optimistic (they were ignored
in silence). On a pipeline: tests/test_pipeline.py."""

from __future__ import annotations

import pytest

from hyspec.engine import Engine
from hyspec.sampling import ParamError, SamplingParams

PROMPT = [5, 17, 99, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hyspec.tiny import make_tiny

    return make_tiny("qwen3_5", tmp_path_factory.mktemp("tiny") / "ckpt", seed=3, layers=4, hidden=32,
                     vocab_size=320, std=0.2)


@pytest.mark.parametrize("graphs", [False, True], ids=["core", "graph-lanes"])
def test_cancel_ends_the_samples_after_the_round_with_their_stats(tiny, graphs):
    if graphs:
        pytest.importorskip("triton")
    eng = Engine.load(tiny)
    eng.batch_graphs = graphs  # (the CUDA-graph lanes through the Triton interpreter: CI's time, fewer tokens)
    n, at = (10, 3) if graphs else (24, 4)
    full = eng.generate(PROMPT, max_new_tokens=n, draft=2, ignore_eos=True)
    seen = []
    out = eng.generate(PROMPT, max_new_tokens=n, draft=2, ignore_eos=True,
                       on_tokens=lambda i, ids: seen.extend(ids), cancel=lambda: len(seen) >= at)
    s = out.samples[0]
    assert s.stop_reason == "cancelled" and at <= len(s.tokens) < len(full.tokens)
    assert s.tokens == seen == full.tokens[:len(s.tokens)]
    assert s.stats["generated_tokens"] == len(s.tokens) and s.stats["spec"]["rounds"] > 0
    assert s.stats["prompt_tokens"] == len(PROMPT) and s.stats["decode_s"] >= 0
    assert (s.stats.get("path") == "batch-graphs") == graphs
    if graphs:
        return
    # every sample ends (without on_tokens too) after its round; a cancel that never fires changes nothing
    out = eng.generate(PROMPT, max_new_tokens=n, draft=2, ignore_eos=True, num_samples=3,
                       params=SamplingParams(temperature=0.9, seed=1), cancel=lambda: True)
    assert [x.stop_reason for x in out.samples] == ["cancelled"] * 3
    # (the first sample's first token cancels all three: one still prefilling ends with none)
    assert all(len(x.tokens) < n and x.stats["generated_tokens"] == len(x.tokens) for x in out.samples)
    assert out.samples[0].tokens
    assert eng.generate(PROMPT, max_new_tokens=n, draft=2, ignore_eos=True, cancel=lambda: False).tokens \
        == full.tokens
    with pytest.raises(ParamError) as e:
        eng.generate(PROMPT, max_new_tokens=2, cancel=True)
    assert e.value.field == "cancel"


@pytest.mark.parametrize("graphs", [False, True], ids=["core", "graph-lanes"])
def test_generate_batch_cancel_for_the_call_or_per_prompt(tiny, graphs):
    """generate_batch(cancel=fn) ends every prompt, running or still waiting for a slot
    (max_batch 2 of 3 prompts), after the round where fn() turned True; cancel=[...] (one
    entry per prompt) ends only the prompts whose own callable says so, the others' outputs
    are bitwise what they are without it. A cancelled prompt's tokens are a prefix of its
    uncancelled output and its stats count them."""
    if graphs:
        pytest.importorskip("triton")
    eng = Engine.load(tiny)
    eng.batch_graphs = graphs  # (the CUDA-graph lanes through the Triton interpreter: CI's time, fewer tokens)
    prompts, n = [PROMPT, PROMPT[:2], [7, 8, 9]], (6 if graphs else 12)
    kw = dict(max_new_tokens=n, draft=2, ignore_eos=True, max_batch=2,
              params=[None, SamplingParams(temperature=0.9, seed=4), None])
    full = [o.tokens for o in eng.generate_batch(prompts, **kw)]
    seen = []
    outs = eng.generate_batch(prompts, **kw, on_tokens=lambda i, ids: seen.append(i), cancel=lambda: len(seen) >= 1)
    assert [o.samples[0].stop_reason for o in outs] == ["cancelled"] * 3
    for o, want in zip(outs, full):
        assert o.tokens == want[:len(o.tokens)] and len(o.tokens) < n
        assert o.samples[0].stats["generated_tokens"] == len(o.tokens)
    assert outs[2].tokens == [] and 2 not in seen  # it waited for a slot: it never ran
    # one prompt's own cancel ends it alone
    outs = eng.generate_batch(prompts, **kw, cancel=[None, lambda: True, None])
    assert [o.samples[0].stop_reason for o in outs] == ["length", "cancelled", "length"]
    assert [outs[0].tokens, outs[2].tokens] == [full[0], full[2]]
    assert outs[1].tokens and outs[1].tokens == full[1][:len(outs[1].tokens)] and len(outs[1].tokens) < n
    if graphs:
        return
    assert [o.tokens for o in eng.generate_batch(prompts, **kw, cancel=lambda: False)] == full
    for bad, err in ((True, ParamError), ([None, 3, None], ParamError), ([None], ValueError)):
        with pytest.raises(err, match="cancel"):
            eng.generate_batch(prompts, **kw, cancel=bad)


def test_lanes_and_optimistic_without_a_pipeline_are_refused(tiny):
    """Engine.lanes > 1 and Engine.optimistic act on pipeline stages only (hyspec generate
    refuses --lanes / --optimistic without --pp N >= 2): without one, a request (and a new session) is refused
    with a ValueError naming the attribute (both were ignored in silence); so is a lanes value
    that is no integer >= 1 and an optimistic that is no bool. Nothing runs: the next request with the defaults back runs as
    always."""
    eng = Engine.load(tiny)
    want = eng.generate_batch([PROMPT, PROMPT[:2]], max_new_tokens=3, ignore_eos=True)
    cases = [(2, False, r"Engine\.lanes = 2 .*needs a pipeline"), (1, True, r"Engine\.optimistic .*needs a pipeline"),
             (3, True, r"Engine\.lanes = 3 .*needs a pipeline"), (0, False, r"Engine\.lanes=0: must be an integer >= 1"),
             ("2", False, r"Engine\.lanes='2': must be an integer"), (True, False, r"Engine\.lanes=True: must be an"),
             (1, "no", r"Engine\.optimistic='no': must be True or False")]
    for lanes, optimistic, match in cases:
        eng.lanes, eng.optimistic = lanes, optimistic
        calls = [lambda: eng.generate(PROMPT, max_new_tokens=3, ignore_eos=True),
                 lambda: eng.generate_batch([PROMPT, PROMPT[:2]], max_new_tokens=3, ignore_eos=True),
                 lambda: eng.chat([{"role": "user", "content": "hi"}], max_new_tokens=3),
                 lambda: eng.session()]  # (a session's turns do not run through the request path)
        for call in calls:
            with pytest.raises(ValueError, match=match):
                call()
    eng.lanes, eng.optimistic = 1, False
    assert [o.tokens for o in eng.generate_batch([PROMPT, PROMPT[:2]], max_new_tokens=3, ignore_eos=True)] \
        == [o.tokens for o in want]


def test_lanes_with_optimistic_are_refused_on_a_pipeline_before_anything_runs(tiny, monkeypatch):
    """On a pipeline backend (a driver; here a stand-in that fails any use) Engine.lanes > 1
    with Engine.optimistic is refused, as `--lanes N --optimistic` is: run_lanes ran the
    lanes without the fork in silence (one request: the fork ran, the lanes were ignored)."""
    from types import SimpleNamespace

    eng = Engine.load(tiny)

    class Driver:
        optimistic = False

        def __getattr__(self, name):
            raise AssertionError(f"the pipeline was used ({name})")

    eng.backend = SimpleNamespace(driver=Driver())
    import hyspec.parallel.lanes as lanes_mod

    monkeypatch.setattr(lanes_mod, "run_lanes", lambda *a, **kw: pytest.fail("run_lanes ran"))
    eng.lanes, eng.optimistic = 2, True
    for call in (lambda: eng.generate(PROMPT, max_new_tokens=3, ignore_eos=True),
                 lambda: eng.generate_batch([PROMPT, PROMPT[:2]], max_new_tokens=3, ignore_eos=True)):
        with pytest.raises(ValueError, match=r"Engine\.optimistic does not go with Engine\.lanes = 2"):
            call()
    assert eng.backend.driver.optimistic is False
