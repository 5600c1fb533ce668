"""Logprobs on the batched graph lanes (hyspec.gpu.batch_loop.BatchRunner._round_logprobs):
a request with logprobs runs on the lanes (it used to fall back to the engine core) and each
emitted token's log-probability and top-N list are read from the round's own verify rows
(lane i's rows i*t .. i*t + n; a plain step's row i; the first token's from the prefill).

Checked against the reference model at the level where a wrong row shows: the log-softmax
of the reference's teacher-forced forward over prompt + the lane's tokens, position by
position (fp32: 1e-4 abs), the top-N ids being the reference's top-N; asking for logprobs
changes no token (the same run without them, bitwise); two lanes in one batch (each reads
its own rows); a stop id among accepted drafts cuts the list with the tokens. On the CPU
(the Triton interpreter) also the engine core's tokens and logprobs. Constrained lanes'
logprobs: tests/test_batch_constraints.py. HYSPEC_TEST_DEVICE=cuda runs the same on the GPU
(fp32 models on the device)."""

from __future__ import annotations


import pytest
import torch

from conftest import ARCHS
from hyspec.sampling import SamplingParams
from session_helpers import DEVICE, skip_unless_lanes_run, engine

pytest.importorskip("triton")

ON_CPU = DEVICE == "cpu"
N = 6
TOP = 3
TOL = 1e-5 if ON_CPU else 1e-4  # the interpreter's fp32 lanes are ~1e-7 from the reference; a GPU's kernels: the fp32 bound
PROMPT = [5, 17, 99, 3, 41]
SAMPLED = SamplingParams(temperature=0.9, seed=11, presence_penalty=0.7)


@pytest.fixture(autouse=True)
def _lanes_run_here():
    skip_unless_lanes_run()


def graph_engine(zoo, arch):
    eng = engine(zoo, arch, dtype="float32")
    eng.batch_graphs = True
    if not ON_CPU:  # prefill in the reference's torch chunked form: fla's fp32 kernel is 2e-4..4e-4 from it
        make = eng.new_batch_decoder  # (tests/test_gpu_fast.py::test_fla_prefill_logits_match_the_reference)

        def new_batch_decoder(*a, **k):
            dec = make(*a, **k)
            dec.use_fla = False
            return dec
        eng.new_batch_decoder = new_batch_decoder
    return eng


def reference_rows(model, prompt, tokens) -> torch.Tensor:
    """log p(. | prefix) for each generated token's position: [len(tokens), V], fp64."""
    ids = torch.tensor(list(prompt) + list(tokens), device=model.device)
    with torch.no_grad():
        lg = model(ids).double()
    return torch.log_softmax(lg, -1)[len(prompt) - 1: len(prompt) - 1 + len(tokens)]


def check_against_reference(model, prompt, tokens, lps, top=TOP) -> None:
    assert len(lps) == len(tokens) > 0
    ref = reference_rows(model, prompt, tokens).cpu()
    for j, (tok, (lp, alts)) in enumerate(zip(tokens, lps)):
        assert abs(lp - float(ref[j, tok])) <= TOL, (j, lp, float(ref[j, tok]))
        assert len(alts) == top
        kth = float(torch.topk(ref[j], top).values[-1]) if top else 0.0
        for i, v in alts:
            assert abs(v - float(ref[j, i])) <= TOL and v >= kth - TOL, (j, i, v)
        assert [v for _, v in alts] == sorted((v for _, v in alts), reverse=True)


# (CI's time: one family on the CPU, where the lanes' per-family forward is checked against
# the reference's logits by tests/test_batch_decoder.py; all three on the GPU)
@pytest.mark.parametrize("arch", ["qwen3_5"] if ON_CPU else ARCHS)
def test_logprobs_on_the_lanes_match_the_reference(zoo, arch):
    """Greedy K=2 and plain (one lane), seeded sampling with a penalty, K=2, two samples in
    one batch: on the lanes, each entry the reference's; no token changed by asking (on a
    GPU: the same run without logprobs; on the CPU: the engine core's tokens)."""
    eng = graph_engine(zoo, arch)
    m = eng.model
    for draft, params, samples in ((2, None, 1), (0, None, 1), (2, SAMPLED, 2)):
        out = eng.generate(PROMPT, max_new_tokens=N, draft=draft, params=params, num_samples=samples,
                           logprobs=TOP, ignore_eos=True)
        for s, lps in zip(out.samples, out.logprobs):
            assert s.stats["path"] == "batch-graphs", s.stats.get("path")
            check_against_reference(m, PROMPT, s.tokens, lps)
        if not ON_CPU:  # (on the CPU the engine core's tokens below, which lanes without logprobs equal)
            plain = eng.generate(PROMPT, max_new_tokens=N, draft=draft, params=params, num_samples=samples,
                                 ignore_eos=True)
            assert [s.tokens for s in out.samples] == [p.tokens for p in plain.samples]
        if ON_CPU:  # the interpreter's fp32 lanes give the engine core's tokens
            core = engine(zoo, arch, dtype="float32").generate(PROMPT, max_new_tokens=N, draft=draft, params=params,
                                                               num_samples=samples, logprobs=TOP, ignore_eos=True)
            for s, c, lps, clps in zip(out.samples, core.samples, out.logprobs, core.logprobs):
                assert c.stats.get("path") != "batch-graphs" and s.tokens == c.tokens
                assert [lp for lp, _ in lps] == pytest.approx([lp for lp, _ in clps], abs=TOL)
                assert [[i for i, _ in a] for _, a in lps] == [[i for i, _ in a] for _, a in clps]


def test_a_stop_inside_a_round_cuts_the_logprobs_with_the_tokens(zoo):
    """The forced drafter proposing the greedy continuation itself (rate 1: every draft
    accepted, 3 tokens a round at K=2); a stop id that is the middle token of a round cuts
    the tokens and their entries there."""
    from hyspec.speculative.loop import SpecOptions

    eng = graph_engine(zoo, "qwen3_5")
    greedy = eng.generate(PROMPT, max_new_tokens=N + 4, ignore_eos=True).samples[0].tokens
    spec = SpecOptions(forced_rates=(1.0, 1.0))
    chunks = []
    full = eng.generate(PROMPT, max_new_tokens=N, draft=2, spec=spec, reference=greedy, logprobs=1, ignore_eos=True,
                        on_tokens=lambda i, t: chunks.append(list(t)))
    toks = full.samples[0].tokens
    assert toks == greedy[:N] and [len(c) for c in chunks[:2]] == [1, 3]  # the first token, then a whole round
    stop = toks[2]  # the middle of the first round
    assert stop not in toks[:2]
    out = eng.generate(PROMPT, max_new_tokens=N, draft=2, spec=spec, reference=greedy, logprobs=1, stop_ids=[stop],
                       ignore_eos=True)
    s = out.samples[0]
    assert s.stats["path"] == "batch-graphs" and s.stop_reason == "eos"
    assert s.tokens == toks[:3] and out.logprobs[0] == full.logprobs[0][:3]
    check_against_reference(eng.model, PROMPT, s.tokens, out.logprobs[0], top=1)


def test_mixed_lanes_in_pipelined_rounds(zoo, monkeypatch):
    """Three lanes in one batch: K=2 asking for the top 3, K=1 not asking, plain asking for
    no alternatives (logprobs=0; the asking lanes 0 and 2 are not neighbours); 8 tokens
    each, so rounds are queued before the previous one is read (pipelined; two in a row: a
    queued round is still unread when the next one is queued). Each asking lane's entries
    are the reference's; the other has none."""
    from hyspec.gpu.batch_loop import BatchRunner, LaneRequest, run_batch

    queued = []
    may = BatchRunner._may_queue_next

    def spy(self, k):
        queued.append(may(self, k))
        return queued[-1]

    monkeypatch.setattr(BatchRunner, "_may_queue_next", spy)
    eng = graph_engine(zoo, "qwen3_5")
    dec = eng.new_batch_decoder(4, 48, 3)
    prompts = [PROMPT, [8, 1, 2, 9], [33, 4, 12]]
    # (8 tokens: a round is queued while >= 2 (k + 1) = 6 are left, so rounds 2 and 3 are
    # queued, each before the one before it is read; each round costs seconds in the interpreter)
    lanes = [LaneRequest(prompt=prompts[0], max_new_tokens=8, k=2, logprobs=3),
             LaneRequest(prompt=prompts[2], max_new_tokens=8, k=1),
             LaneRequest(prompt=prompts[1], max_new_tokens=8, k=0, logprobs=0)]  # asking: lanes 0 and 2
    run_batch(dec, lanes)
    assert sum(queued) >= 2 and all(len(lr.tokens) == 8 for lr in lanes)
    check_against_reference(eng.model, prompts[0], lanes[0].tokens, lanes[0].token_logprobs, top=3)
    check_against_reference(eng.model, prompts[1], lanes[2].tokens, lanes[2].token_logprobs, top=0)
    assert lanes[1].token_logprobs == []


class EvenIds:
    """A constraint that allows the even token ids only (the lanes' packed-mask interface:
    llguidance's int32 words, bit t % 32 of word t // 32), so the zoo's tokenizer-less
    models can run masked rounds on the GPU too."""

    def __init__(self, vocab_size: int, committed: int = 0) -> None:
        self.vocab_size, self.committed = vocab_size, committed

    def clone(self) -> "EvenIds":
        return EvenIds(self.vocab_size, self.committed)

    def allowed(self, prefix=()) -> torch.Tensor:
        return torch.arange(self.vocab_size) % 2 == 0

    def allowed_words(self, prefix=()):
        import numpy as np

        return np.full((self.vocab_size + 31) // 32, 0x55555555, dtype=np.uint32).view(np.int32)  # bits 0, 2, ...

    def commit(self, tokens) -> None:
        assert all(t % 2 == 0 for t in tokens), tokens
        self.committed += len(tokens)


def test_constrained_lanes_report_the_raw_logprobs(zoo):
    """Masked rounds (K=2; and masked plain steps) copy the verify rows before the commit
    masks them in place: the logprobs are the raw logits' (the reference's), the tokens all
    allowed ones."""
    eng = graph_engine(zoo, "qwen3_5")
    c = EvenIds(eng.model.cfg.vocab_size)
    for draft in (2, 0):
        out = eng.generate(PROMPT, max_new_tokens=N, draft=draft, constraint=c, logprobs=TOP, ignore_eos=True)
        s = out.samples[0]
        assert s.stats["path"] == "batch-graphs" and all(t % 2 == 0 for t in s.tokens)
        check_against_reference(eng.model, PROMPT, s.tokens, out.logprobs[0])


def test_session_turns_with_logprobs(zoo):
    """Session.send(logprobs=N): on the lanes and on the engine core (session_graphs off),
    each turn's entries are the reference's log-probabilities of the reply given the whole
    transcript before it; the two paths give the same tokens (the CPU; on a GPU each is
    checked against the reference)."""
    from session_helpers import messages

    lanes = graph_engine(zoo, "qwen3_next")
    lanes.session_graphs = True
    core = engine(zoo, "qwen3_next", dtype="float32")
    core.session_graphs = False
    msgs = messages(lanes.model.cfg.vocab_size, 2, seed=4)
    got = {}
    for name, eng in (("lanes", lanes), ("core", core)):
        s = eng.session(draft=2, max_new_tokens=4, ignore_eos=True)
        got[name] = []
        for m in msgs:
            out = s.send(m, logprobs=2)
            reply = out.samples[0].tokens
            assert (out.samples[0].stats.get("path") == "batch-graphs") == (name == "lanes")
            check_against_reference(eng.model, s.tokens[: len(s.tokens) - len(reply)], reply, out.logprobs[0], top=2)
            got[name].append(reply)
        assert s.send(msgs[0], max_new_tokens=2).logprobs is None  # (not asked: none; a prefill and one round)
    if ON_CPU:
        assert got["lanes"] == got["core"]
    with pytest.raises(ValueError, match="logprobs must be None or an integer >= 0"):
        lanes.session().send([3], logprobs=-1)
    assert len(core.session(max_new_tokens=2, ignore_eos=True).send([3], logprobs=0).logprobs[0]) == 2  # (no top-N)
