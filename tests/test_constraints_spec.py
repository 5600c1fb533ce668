"""Speculative decoding under a constraint is exact.

* Greedy: constrained speculative == constrained plain, token for token (and the same
  stop_reason), for the three tiny families, K = 1..5, a regex and a JSON schema; also with
  a reduced draft vocabulary (mtp.d2t: the mask is applied to the mapped draft row), the
  forced drafter (drafts the constraint does not allow), and coupled sampling (speculative
  output == plain output token for token, so the sampled masking is checked exactly too).
* Sampling is distribution-exact: tests/test_constraints_sampling.py.
* Batches: each sequence of one scheduler its own matcher.
* Every output of the default model under a JSON schema validates against it (jsonschema).
"""

from __future__ import annotations

import json
import pytest
import torch

pytest.importorskip("llguidance")

from conftest import ARCHS, PROMPT  # noqa: E402
from hyspec.constraints import make_constraint  # noqa: E402
from hyspec.decode import generate_plain  # noqa: E402
from hyspec.engine import Engine  # noqa: E402
from hyspec.sampling import SamplingParams  # noqa: E402
from hyspec.speculative.loop import SpecOptions, generate_speculative  # noqa: E402

EOS = 0
REGEX = r"[a-z_ ]{3,40}\.?"
SCHEMA = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 20}, "y": {"type": "integer"}},
          "required": ["x", "y"], "additionalProperties": False}
N_NEW = 60


def _plain(model, c, n=N_NEW, params=None, prompt=PROMPT):
    return generate_plain(model, list(prompt), max_new_tokens=n, params=params, stop_ids=(EOS,),
                          constraint=c.clone())


def _spec(model, c, k, n=N_NEW, params=None, prompt=PROMPT, **opts):
    return generate_speculative(model, list(prompt), max_new_tokens=n, opts=SpecOptions(k=k, **opts), params=params,
                                stop_ids=(EOS,), constraint=c.clone())


def _valid(c, tokens) -> bool:
    d = c.clone()
    try:
        d.commit(tokens)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------
# Greedy (and coupled) exactness
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_constrained_speculative_equals_plain(zoo, arch):
    model = zoo.model("tiny", arch, "float32", "coop")
    accepted = 0
    for kind, value in (("regex", REGEX), ("json_schema", SCHEMA)):
        c = make_constraint(zoo.path("tiny", arch), kind, value)
        ref = _plain(model, c)
        assert _valid(c, ref.tokens) and len(ref.tokens) > 5
        assert ref.tokens != generate_plain(model, PROMPT, max_new_tokens=len(ref.tokens)).tokens  # the mask bites
        for k in (1, 2, 3, 4, 5):
            res = _spec(model, c, k)
            assert res.tokens == ref.tokens and res.stop_reason == ref.stop_reason, (arch, kind, k)
            accepted += res.stats["spec"]["accepted"]
    assert accepted > 50  # drafts were accepted under the mask


@pytest.mark.parametrize("arch", ARCHS)
def test_coupled_constrained_speculative_equals_plain(zoo, arch):
    model = zoo.model("tiny", arch, "float32", "coop")
    c = make_constraint(zoo.path("tiny", arch), "json_schema", SCHEMA)
    for seed in (1, 2):
        params = SamplingParams(temperature=1.0, seed=seed, mode="coupled", top_k=40)
        ref = _plain(model, c, params=params)
        assert _valid(c, ref.tokens)
        for k in (1, 3):
            assert _spec(model, c, k, params=params).tokens == ref.tokens, (arch, seed, k)


def test_greedy_constrained_with_options_and_forced_drafter(zoo):
    model = zoo.model("tiny", "qwen3_5", "float64")
    c = make_constraint(zoo.path("tiny", "qwen3_5"), "json_schema", SCHEMA)
    ref = _plain(model, c)
    reference = generate_plain(model, PROMPT, max_new_tokens=N_NEW + 8).tokens  # unconstrained: mostly invalid
    for opts in ({"prime_pending": False}, {"adaptive": True}, {"rollback": "rescan"}, {"p_min": 0.003}):
        assert _spec(model, c, 3, **opts).tokens == ref.tokens, opts
    for rates in ((1.0,), (0.7, 0.5)):
        res = generate_speculative(model, PROMPT, max_new_tokens=N_NEW, opts=SpecOptions(k=3, forced_rates=rates),
                                   stop_ids=(EOS,), constraint=c.clone(), reference=reference)
        assert res.tokens == ref.tokens, rates


def test_reduced_draft_vocabulary_under_a_constraint(tmp_path):
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "d2t", seed=5, draft_vocab=96)
    model = load_model(d, dtype="float32")
    assert model.d2t is not None
    for kind, value in (("regex", REGEX), ("json_schema", SCHEMA)):
        c = make_constraint(d, kind, value)
        ref = _plain(model, c)
        for k in (1, 3):
            assert _spec(model, c, k).tokens == ref.tokens, (kind, k)
        params = SamplingParams(temperature=0.9, seed=4, mode="coupled")
        assert _spec(model, c, 3, params=params).tokens == _plain(model, c, params=params).tokens, kind


def test_engine_num_samples_each_its_own_constraint(zoo):
    """num_samples: every sample starts from the constraint's state and runs on its own clone."""
    path = zoo.path("tiny", "qwen3_5")
    eng = Engine.load(path)
    c = eng.constraint("regex", REGEX)
    params = SamplingParams(temperature=1.0, seed=9)
    out = eng.generate(PROMPT, max_new_tokens=30, params=params, draft=3, num_samples=3, constraint=c)
    assert c.committed == 0 and len({tuple(s.tokens) for s in out.samples}) > 1
    for s in out.samples:
        body = s.tokens[:-1] if s.stop_reason == "eos" else s.tokens
        assert _valid(c, s.tokens) and _valid(c, body)


# --------------------------------------------------------------------------------------
# The default model: every output validates against its schema
# --------------------------------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"op": {"enum": ["add", "sub", "mul"]},
                                      "args": {"type": "array", "items": {"type": "number"}, "minItems": 1,
                                               "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["op", "args"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                 "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
                                "required": ["id", "tag"], "additionalProperties": False},
     "minItems": 1, "maxItems": 2},
]


@pytest.fixture(scope="module")
def default_engine():
    torch.set_num_threads(1)
    return Engine.load()


@pytest.mark.parametrize("schema_i", range(len(SCHEMAS)))
def test_default_model_outputs_validate(default_engine, schema_i):
    import jsonschema

    eng = default_engine
    schema = SCHEMAS[schema_i]
    c = eng.constraint("json_schema", schema)
    runs = [(0, SamplingParams(temperature=0.0)), (3, SamplingParams(temperature=0.0))]
    runs += [(3 if s % 2 else 0, SamplingParams(temperature=1.0, seed=s)) for s in range(8)]
    for draft, params in runs:
        out = eng.generate("result = ", max_new_tokens=120, params=params, draft=draft, constraint=c)
        smp = out.samples[0]
        assert smp.stop_reason == "eos", (schema_i, draft, params.seed, smp.text)
        text = eng.decode(smp.tokens[:-1])
        jsonschema.validate(json.loads(text), schema)


# --------------------------------------------------------------------------------------
# Batches: each sequence its own matcher
# --------------------------------------------------------------------------------------


def test_batched_requests_each_with_its_own_constraint(zoo):
    """One scheduler, four sequences per round (different constraints, K and sampling):
    every output equals the same request run alone."""
    from hyspec.core import Request, Scheduler

    arch = "qwen3_5"
    model = zoo.model("tiny", arch, "float32", "coop")
    path = zoo.path("tiny", arch)
    sampled = SamplingParams(temperature=1.0, seed=5)
    specs = [  # (constraint, draft, params, prompt)
        (make_constraint(path, "regex", REGEX), 3, SamplingParams(temperature=0.0), PROMPT),
        (make_constraint(path, "json_schema", SCHEMA), 2, sampled, PROMPT[:5]),
        (make_constraint(path, "choice", ["first", "second", "third"]), 4, sampled, PROMPT[2:]),
        (None, 3, SamplingParams(temperature=0.0), PROMPT[1:]),
        (make_constraint(path, "json_object"), 0, SamplingParams(temperature=0.0), PROMPT),
    ]

    def request(c, draft, params, prompt):
        return Request(prompt_ids=list(prompt), max_new_tokens=40, params=params, draft=draft, stop_ids=(EOS,),
                       constraint=None if c is None else c.clone())

    alone = []
    for spec in specs:
        sched = Scheduler(model, max_batch=1)
        req = request(*spec)
        sched.submit(req)
        while not req.done:
            sched.step()
        alone.append((list(req.tokens), req.stop_reason))
    sched = Scheduler(model, max_batch=4)
    reqs = [request(*spec) for spec in specs]
    for r in reqs:
        sched.submit(r)
    while not all(r.done for r in reqs):
        sched.step()
    for i, (r, (tokens, reason)) in enumerate(zip(reqs, alone)):
        assert r.error is None, r.error
        assert (list(r.tokens), r.stop_reason) == (tokens, reason), i
        if specs[i][0] is not None:
            assert _valid(specs[i][0], r.tokens)
    choice_tokens, reason = alone[2]
    assert reason == "eos" and specs[2][0].vocab.lltok.decode_str(choice_tokens[:-1]) in ("first", "second", "third")


def test_a_round_that_crosses_the_end_of_a_stop_lexeme(zoo):
    """A Lark stop= lexeme followed by more grammar: the coupled sample below writes
    'x ju forjrowakgeoxf.!' + EOS, and with drafts a round emitted the "." that ends the
    lexeme together with the "!" after it. llguidance's validate_tokens stops at that "."
    (consume_token goes on), so the commit refused the "!" and the speculative run ended
    in a ConstraintFailure where plain decoding completed; now speculative == plain."""
    model = zoo.model("tiny", "qwen3_5", "float32", "coop")
    c = make_constraint(zoo.path("tiny", "qwen3_5"), "grammar", 'start: "x" body "!"\nbody[stop="."]: /[a-z ]*/')
    params = SamplingParams(temperature=1.0, seed=5, mode="coupled")
    ref = _plain(model, c, n=25, params=params)
    assert ref.stop_reason == "eos"
    for k in (1, 3):
        res = _spec(model, c, k, n=25, params=params)
        assert (res.tokens, res.stop_reason) == (ref.tokens, ref.stop_reason), k
    assert _valid(c, ref.tokens)  # (committed at once: was refused at the "!" too)
