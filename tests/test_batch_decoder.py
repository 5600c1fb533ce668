"""The batched GPU decoder (hyspec.gpu.batch) on CPU through the Triton interpreter, fp32.

* logits: every verify row of every lane of a batched forward matches the reference
  model's log-probs (hyspec/model, exact mode) within LOGPROB_ATOL;
* exactness and batch invariance: requests with mixed prompt lengths, mixed k (0 = plain,
  speculative with the MTP head or the forced drafter), staggered arrivals and lane reuse
  give exactly the reference engine's greedy tokens, and the same tokens as alone;
* one sequence alone (decode_one, one lane), every family: the engine core's tokens,
  speculative telemetry and MTP drafts round by round.
"""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, make_drafter_overflowing, make_infinite, make_overflowing, spy_bad_rows

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

LOGPROB_ATOL = 1e-4


def _model(tmp_path, arch, **kw):
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    return load_model(make_tiny(arch, tmp_path / arch, seed=3, layers=4, hidden=32, vocab_size=128, std=0.2, **kw))


def _ref_logprobs(m, prompt, tokens):
    from hyspec.model.ops import StepCtx

    cache = m.new_cache(64)
    m.forward_states(torch.tensor(prompt), cache, StepCtx(start=0, chunked=True))
    _, post = m.forward_states(torch.tensor(tokens), cache, StepCtx(start=len(prompt), exact=True))
    return torch.log_softmax(m.logits(post).double(), -1)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_verify_rows_match_the_reference(tmp_path, arch):
    from hyspec.gpu.batch import BatchDecoder

    m = _model(tmp_path, arch)
    dec = BatchDecoder(m, 48, 3, slots=3, graphs=False)
    prompts = [[5, 17, 99, 3, 7, 42], [8, 1], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
    verify = [[11, 23, 4, 60], [9, 9, 2, 1], [100, 3, 5, 7]]
    for lane, p in enumerate(prompts):
        dec.prefill(lane, p)
    ids = torch.tensor([t for v in verify for t in v])
    _, post = dec.runner.target(ids, 12, dec.pos, True, 3)
    got = torch.log_softmax(dec.runner.logits(post).double(), -1).view(3, 4, -1)
    for lane in range(3):
        ref = _ref_logprobs(m, prompts[lane], verify[lane])
        assert float((got[lane] - ref).abs().max()) <= LOGPROB_ATOL, lane
    # a planted bug: lane 1 reading lane 0's KV / state (a wrong lane stride) must be caught
    # (lanes 0 and 1, one verify row each, are enough to show it)
    dec2 = BatchDecoder(m, 48, 3, slots=3, graphs=False)
    for lane, p in enumerate(prompts[:2]):
        dec2.prefill(lane, p)
    dec2.runner._lane0 = lambda slab: (slab[0], 0)
    _, post2 = dec2.runner.target(torch.tensor([verify[0][0], verify[1][0]]), 2, dec2.pos, True, 2)
    bad = torch.log_softmax(dec2.runner.logits(post2).double(), -1).view(2, 1, -1)
    ref1 = _ref_logprobs(m, prompts[1], verify[1][:1])
    assert float((bad[1] - ref1).abs().max()) > LOGPROB_ATOL


def test_step_bodies_launch_in_the_runners_pdl_scope(tmp_path, monkeypatch):
    """The decoder's step bodies run in its runner's PDL choice (hyspec.kernels.pdl.scoped;
    by default on, for a dense model with the skinny matmuls under it and their trigger
    late): every skinny matmul of a decode step asks for its launch kwargs as family
    "matmul" inside the runner's scope (here one that leaves that family out, as MoE and
    block-FP8 models do), and a changed runner attribute is what the next step runs with.  (PDL itself is off
    in the interpreter; the recorder sees the choice the kernels would launch with.)"""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.kernels import pdl
    from hyspec.kernels.matmul import kernel as mm_kernel

    monkeypatch.delenv("HYSPEC_PDL", raising=False)
    monkeypatch.delenv("HYSPEC_PDL_SKIP", raising=False)
    m = _model(tmp_path, "qwen3_5")
    dec = BatchDecoder(m, 32, 2, slots=2, graphs=False)
    # a dense model: PDL on the matmuls too, their dependents launched after their K loop
    assert (dec.runner.pdl, dec.runner.pdl_skip, dec.runner.pdl_late) == (True, "", True) == dec.step_graphs.pdl()
    dec.runner.pdl_skip = "matmul"  # (the MoE / block-FP8 models' choice)
    dec.prefill(0, [5, 17, 99, 3])
    seen = []
    real = mm_kernel.launch_kwargs

    def record(family=None):
        seen.append((family, pdl.current()))
        return real(family)

    monkeypatch.setattr(mm_kernel, "launch_kwargs", record)
    dec.decode(1)
    mm = [cur for fam, cur in seen if fam == "matmul"]
    assert mm and all(cur == (True, frozenset({"matmul"})) for cur in mm)
    assert pdl.current() == (None, frozenset())  # the scope ended with the step
    seen.clear()
    dec.runner.pdl, dec.runner.pdl_skip = False, ""
    dec.decode(1)
    assert seen and all(cur == (False, frozenset()) for _, cur in seen)
    # the matmuls' trigger under PDL reaches their launches too
    for late in (False, True):
        seen.clear()
        monkeypatch.setattr(mm_kernel, "launch_kwargs", lambda family=None: seen.append(pdl.matmul_late()) or real(family))
        dec.runner.pdl, dec.runner.pdl_late = True, late
        dec.decode(1)
        assert seen and all(form == late for form in seen)
    assert pdl.matmul_late() is False
    dec.runner.pdl_skip = "matmul,gemm"  # a bad family: an error naming it, before any launch
    with pytest.raises(ValueError, match="pdl_skip: unknown kernel families \\['gemm'\\]"):
        dec.decode(1)


def test_pdl_default_leaves_the_matmuls_out_of_moe_and_fp8_models(tmp_path, monkeypatch):
    """step_default's rule (measured, hyspec.kernels.pdl.step_default): a model with MoE
    layers or block-FP8 weights launches its skinny matmuls without PDL; HYSPEC_PDL_SKIP
    overrides the rule; HYSPEC_PDL=0/1 hands the choice to the process-wide setting."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.kernels import pdl

    monkeypatch.delenv("HYSPEC_PDL", raising=False)
    monkeypatch.delenv("HYSPEC_PDL_SKIP", raising=False)
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    moe = _model(tmp_path, "qwen3_5_moe")
    fp8 = load_model(make_tiny("qwen3_5", tmp_path / "f", seed=3, layers=4, hidden=32, vocab_size=128, fp8=True,
                               fp8_block=(16, 16)), fp8="keep")  # (the default on CUDA)
    for m in (moe, fp8):
        r = BatchDecoder(m, 32, 1, slots=1, graphs=False).runner
        assert (r.pdl, r.pdl_skip, r.pdl_late) == (True, "matmul", False)
    monkeypatch.setenv("HYSPEC_PDL_SKIP", "moe_gemm")
    r = BatchDecoder(moe, 32, 1, slots=1, graphs=False).runner
    assert (r.pdl, r.pdl_skip) == (True, "moe_gemm")
    monkeypatch.setenv("HYSPEC_PDL", "1")
    assert pdl.step_default(dense=True) == pdl.step_default(dense=False) == (None, "", False)


def test_row_tile_height_policy(tmp_path, monkeypatch):
    """HYSPEC_BATCH_BLOCK_T: auto picks the matmul row-tile height from a call's rows for
    bf16 models on a compute-capability 9.x GPU only (16 / 32 / 64; the GPU test tests/test_gpu_batch.py checks a lane's bits
    across them); off CUDA (the interpreter's numpy dots change bits with the tile width)
    auto means 64; a fixed value holds for every call; a bad value is a clear error."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.runner_triton import _fixed_height

    m = _model(tmp_path, "qwen3_next")
    assert BatchDecoder(m, 16, 1, slots=2, graphs=False).runner.height(3) == 64
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))  # an H200's
    assert _fixed_height("auto", torch.device("cuda")) is None
    assert _fixed_height("auto", torch.device("cuda"), torch.float32) == 64
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))  # not measured
    assert _fixed_height("auto", torch.device("cuda")) == 64
    monkeypatch.undo()
    monkeypatch.setenv("HYSPEC_BATCH_BLOCK_T", "32")
    r = BatchDecoder(m, 16, 1, slots=2, graphs=False).runner
    assert [r.height(n) for n in (1, 40)] == [32, 32]
    r.block_t = None  # what auto sets on CUDA
    assert [r.height(n) for n in (1, 16, 17, 32, 33, 200)] == [16, 16, 32, 32, 64, 64]
    monkeypatch.setenv("HYSPEC_BATCH_BLOCK_T", "48")
    with pytest.raises(ValueError, match="HYSPEC_BATCH_BLOCK_T='48'"):
        BatchDecoder(m, 16, 1, slots=2, graphs=False)


def _requests(prompts, ks, n, arrivals, refs=None):
    from hyspec.gpu.batch_loop import LaneRequest

    return [LaneRequest(prompt=p, max_new_tokens=n, k=k, arrival=a, reference=None if refs is None else refs[i])
            for i, (p, k, a) in enumerate(zip(prompts, ks, arrivals))]


@pytest.mark.parametrize("arch,drafter", [("qwen3_next", "forced")])  # the MTP drafter: the tests below
def test_batch_equals_reference_and_alone(tmp_path, arch, drafter):
    from hyspec.decode import generate_plain
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import run_batch

    m = _model(tmp_path, arch)
    N = 4
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (L,), generator=g).tolist() for L in (5, 2, 7, 4)]
    ref = [generate_plain(m, p, max_new_tokens=N).tokens for p in prompts]
    ks = [0, 2, 3, 1]
    forced = (0.9, 0.8, 0.6) if drafter == "forced" else None
    dec = BatchDecoder(m, 7 + N + 8, 3, slots=2, graphs=False)
    # 4 requests through 2 lanes: staggered arrivals, lanes freed and reused, compaction
    reqs = _requests(prompts, ks, N, [0, 0, 1, 2], ref)
    stats = run_batch(dec, reqs, forced_rates=forced)
    for r, want in zip(reqs, ref):
        assert r.tokens == want and r.reason == "length"
    if drafter == "forced":
        assert sum(r.telemetry.accepted for r in reqs) > 0
    assert stats["rounds"] > 0
    # each alone (one lane) gives the same tokens
    for i in (2,):
        alone = _requests([prompts[i]], [ks[i]], N, [0], [ref[i]])
        run_batch(dec, alone, forced_rates=forced)
        assert alone[0].tokens == ref[i]


@pytest.mark.parametrize("arch", ARCHS)
def test_one_lane_equals_the_engine_core_with_its_telemetry_and_drafts(tmp_path, arch, monkeypatch):
    """One sequence alone on the BatchDecoder (hyspec.gpu.batch_loop.decode_one: one lane)
    against the engine core's loops (hyspec.decode.generate_plain, hyspec.speculative.loop.
    generate_speculative), every family: plain decoding gives the reference tokens;
    speculative decoding (k = 3) with the forced drafter and with the MTP drafter gives the
    same tokens, the same telemetry and the same drafts round by round (greedy tokens do
    not depend on the drafts: the drafts are compared themselves); short budgets (0, 1, 2
    tokens: no round, a round that may draft nothing, one draft) end where the core ends
    (checked on the first family only: that is the loop's logic, not the model's)."""
    from hyspec.core import round as round_mod
    from hyspec.decode import generate_plain
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import BatchRunner, decode_one
    from hyspec.speculative.loop import SpecOptions, generate_speculative

    m = _model(tmp_path, arch)
    prompt, N = [5, 17, 99, 3, 7, 42], 6
    ref = generate_plain(m, prompt, max_new_tokens=N).tokens
    dec = BatchDecoder(m, len(prompt) + N + 8, 3, slots=1, graphs=False)
    assert decode_one(dec, prompt, N).tokens == ref
    core_drafts, lane_drafts = [], []
    draft, take = round_mod.draft, BatchRunner._take

    def spy_draft(backend, seqs):  # the core's drafts of each round
        out = draft(backend, seqs)
        core_drafts.append(list(seqs[0].round.drafts))
        return out

    def spy_take(self, rows, *rest):  # the lane's: (accepted n, bonus, d1..dk) per round, k_now of them used
        lane_drafts.append(list(rows[0][2: 2 + self.active[0].k_now]))
        return take(self, rows, *rest)

    monkeypatch.setattr(round_mod, "draft", spy_draft)
    monkeypatch.setattr(BatchRunner, "_take", spy_take)
    for rates in ((0.9, 0.8, 0.7), None):
        core_drafts.clear()
        lane_drafts.clear()
        core = generate_speculative(m, prompt, max_new_tokens=N, opts=SpecOptions(k=3, forced_rates=rates),
                                    reference=ref)
        lane = decode_one(dec, prompt, N, k=3, forced_rates=rates, reference=ref)
        assert lane.tokens == core.tokens == ref, rates
        assert lane.stats["spec"] == core.stats["spec"] and lane.stats["spec"]["rounds"] > 0, rates
        # the runner's own round count and time (hyspec bench's phases per round divide them)
        st = lane.stats["runner"]
        assert st["rounds"] == lane.stats["spec"]["rounds"] and 0 < st["rounds_s"] <= lane.stats["decode_s"], rates
        if rates is None:  # (the forced drafter replaces the MTP's tokens)
            assert [d for d in lane_drafts if d] == [d for d in core_drafts if d] != []
    if arch == ARCHS[0]:  # short budgets: the loop's logic, the same for every family (~7 s each, interpreted)
        for n in (0, 1, 2):
            assert decode_one(dec, prompt, n).tokens == ref[:n]
            assert decode_one(dec, prompt, n, k=3).tokens == ref[:n]


def test_stop_ids_and_errors(tmp_path):
    from hyspec.decode import generate_plain
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch

    m = _model(tmp_path, "qwen3_5")
    prompt = [5, 17, 99, 3]
    ref = generate_plain(m, prompt, max_new_tokens=6).tokens
    dec = BatchDecoder(m, 24, 2, slots=2, graphs=False)
    stop = ref[3]
    r = LaneRequest(prompt=prompt, max_new_tokens=6, k=2, stop_ids=frozenset({stop}))
    run_batch(dec, [r])
    assert r.tokens == ref[: ref.index(stop) + 1] and r.reason == "eos"
    with pytest.raises(ValueError, match="k_max"):
        run_batch(dec, [LaneRequest(prompt=prompt, max_new_tokens=4, k=3)])
    with pytest.raises(ValueError, match="max_len"):
        run_batch(dec, [LaneRequest(prompt=prompt, max_new_tokens=40)])


def test_pipelined_rounds_equal_unpipelined(tmp_path, monkeypatch):
    """Queuing the next round before reading this one (and draining it when a lane stops:
    here on a stop id while the next round is queued) changes nothing: the same tokens as
    the reference, which is what the round-by-round loop gives (no round of
    test_batch_equals_reference_and_alone is queued ahead)."""
    from hyspec.decode import generate_plain
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import BatchRunner, LaneRequest, run_batch

    queued, reads = [], []  # _may_queue_next's answers; rounds read per step (2: a queued one drained)
    may, step, take = BatchRunner._may_queue_next, BatchRunner.step, BatchRunner._take

    def spy_may(self, k):
        queued.append(may(self, k))
        return queued[-1]

    def spy_step(self):
        reads.append(0)
        return step(self)

    def spy_take(self, rows, *rest):
        reads[-1] += 1
        return take(self, rows, *rest)

    monkeypatch.setattr(BatchRunner, "_may_queue_next", spy_may)
    monkeypatch.setattr(BatchRunner, "step", spy_step)
    monkeypatch.setattr(BatchRunner, "_take", spy_take)
    m = _model(tmp_path, "qwen3_5")
    prompts = [[5, 17, 99, 3], [8, 1, 2], [4, 4]]
    Ns = [5, 3, 4]
    ref = [generate_plain(m, p, max_new_tokens=n).tokens for p, n in zip(prompts, Ns)]
    stop = ref[0][3]  # the first lane stops on its 4th token, in a round with the next one queued
    assert stop not in ref[0][:3]
    ref[0] = ref[0][:4]
    dec = BatchDecoder(m, 20, 1, slots=2, graphs=False)
    reqs = [LaneRequest(prompt=p, max_new_tokens=n, k=k, stop_ids=frozenset({stop}) if i == 0 else frozenset())
            for i, (p, n, k) in enumerate(zip(prompts, Ns, (0, 1, 0)))]
    run_batch(dec, reqs)
    assert [r.tokens for r in reqs] == ref and reqs[0].reason == "eos"
    assert any(queued) and 2 in reads, (queued, reads)  # rounds were queued ahead, and one was drained


def test_engine_generate_batch_on_the_graph_path(tmp_path):
    """Engine.generate_batch routes greedy batches to the BatchDecoder (forced here off
    CUDA through the interpreter): same outputs as the engine core, streaming and stats."""
    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_next", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=128, std=0.2)
    ref_eng = Engine(load_model(d))
    prompts = [[5, 17, 99, 3], [8, 1]]
    want = ref_eng.generate_batch(prompts, max_new_tokens=3, draft=[0, 2], ignore_eos=True)
    eng = Engine(load_model(d))
    eng.batch_graphs = True
    seen = {}
    got = eng.generate_batch(prompts, max_new_tokens=3, draft=[0, 2], ignore_eos=True,
                             on_tokens=lambda i, t: seen.setdefault(i, []).extend(t))
    assert eng._batch_dec is not None
    for w, g, i in zip(want, got, range(2)):
        assert g.samples[0].tokens == w.samples[0].tokens == seen[i]
        assert g.samples[0].stats["path"] == "batch-graphs"
    assert got[1].samples[0].stats["spec"]["rounds"] > 0
    # sampled requests run on the graph path too (same tokens as the engine core), and so
    # do requests with penalties
    from hyspec.gpu.batch_loop import graph_eligible
    from hyspec.sampling import SamplingParams

    sp = SamplingParams(temperature=0.8, seed=1)
    out = eng.generate_batch(prompts[:2], max_new_tokens=3, params=sp, draft=[0, 1])
    want = ref_eng.generate_batch(prompts[:2], max_new_tokens=3, params=sp, draft=[0, 1])
    assert out[0].samples[0].stats["path"] == "batch-graphs"
    assert [o.samples[0].tokens for o in out] == [w.samples[0].tokens for w in want]
    from hyspec.core.request import Request

    pen = SamplingParams(temperature=0.8, seed=1, repetition_penalty=1.3)
    assert graph_eligible([Request(prompt_ids=prompts[0], max_new_tokens=3, params=pen)]) is None


def test_generate_batch_on_finish_fires_as_each_prompt_ends_on_the_graph_path(tmp_path):
    """Engine.generate_batch's on_finish(i, output) runs "as each one ends" on the graph path
    too, as on the engine core: a prompt that ends early is reported before the rounds of the
    ones still running (`hyspec generate --prompts-file` writes its lines, moves its progress
    bar and keeps the finished lines at a Ctrl-C through it). It ran only once the whole
    batch had ended, in prompt order."""
    from hyspec.engine import Engine

    m = _model(tmp_path, "qwen3_5")
    prompts, limits = [[5, 17, 99, 3], [8, 1], [60, 61]], [1, 6, 2]
    for graphs in (False, True):
        eng = Engine(m)
        eng.batch_graphs = graphs
        events, outs = [], {}

        early = {}

        def finished(i, out):
            events.append(("fin", i))
            outs[i] = (out.samples[0].tokens, out.samples[0].stop_reason)
            early[i] = out.samples[0].stats.get("batch_runner")

        got = eng.generate_batch(prompts, max_new_tokens=limits, draft=[0, 1, 0], max_batch=2, ignore_eos=True,
                                 on_tokens=lambda i, t: events.extend(("tok", i) for _ in t), on_finish=finished)
        assert (got[0].samples[0].stats.get("path") == "batch-graphs") == graphs
        assert outs == {i: (o.samples[0].tokens, o.samples[0].stop_reason) for i, o in enumerate(got)}
        last_tok = {i: max(j for j, e in enumerate(events) if e == ("tok", i)) for i in range(3)}
        # each on_finish right after its prompt's last token, before the next token of the longest
        for i in (0, 2):
            fin = events.index(("fin", i))
            assert last_tok[i] < fin < last_tok[1], (graphs, i, events)
        assert events[-1] == ("fin", 1), (graphs, events)
        if graphs:  # the figures handed over early count the round in progress: its tokens and its time
            st = early[2]  # (they counted its tokens only: no rate after one round, then inflated ones)
            assert st["rounds"] >= 1 and st["round_tokens"] > 0, st  # (prompt 0 ends at its prefill: no round)
            assert st["rounds_s"] > 0 and st["round_tok_s"] == st["round_tokens"] / st["rounds_s"], st


def test_engine_generate_one_greedy_request_on_the_graph_path(tmp_path):
    """Engine.generate of one greedy request (plain and speculative) runs on the BatchDecoder
    too where graphs are available (every request a GPU can take has one decoder; forced
    here off CUDA through the interpreter): the engine core's tokens, path batch-graphs."""
    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_next", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=128, std=0.2)
    ref_eng = Engine(load_model(d))
    eng = Engine(load_model(d))
    eng.batch_graphs = True
    for draft in (0, 2):
        want = ref_eng.generate([5, 17, 99, 3], max_new_tokens=5, draft=draft, ignore_eos=True)
        got = eng.generate([5, 17, 99, 3], max_new_tokens=5, draft=draft, ignore_eos=True)
        assert got.samples[0].tokens == want.samples[0].tokens, draft
        assert got.samples[0].stats["path"] == "batch-graphs" and want.samples[0].stats.get("path") != "batch-graphs"
    assert got.samples[0].stats["spec"]["rounds"] > 0


def test_graph_path_stats_have_the_engine_cores_ttft_and_direct_tokens(tmp_path):
    """A lane's stats carry time_to_first_token_s (docs/sessions.md: a turn's stats; `hyspec
    chat` /stats turn_ttft_s) and, speculative, direct_tokens (docs/speculative.md: tokens =
    direct_tokens + accepted + rounds), as the engine core's do: on a GPU every request runs
    on the lanes, and both were missing there (turn_ttft_s always null)."""
    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_next", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=128, std=0.2)
    ref_eng = Engine(load_model(d))
    eng = Engine(load_model(d))
    eng.batch_graphs = True
    for draft in (0, 2):
        want = ref_eng.generate([5, 17, 99, 3], max_new_tokens=6, draft=draft, ignore_eos=True).samples[0].stats
        got = eng.generate([5, 17, 99, 3], max_new_tokens=6, draft=draft, ignore_eos=True).samples[0].stats
        assert got["path"] == "batch-graphs"
        assert got["time_to_first_token_s"] is not None and got["time_to_first_token_s"] > 0, got
        if draft:
            assert got["direct_tokens"] == want["direct_tokens"] == 1
            assert got["direct_tokens"] + got["spec"]["accepted"] + got["spec"]["rounds"] == got["generated_tokens"]
    s = eng.session(draft=2, max_new_tokens=4)
    s.send([5, 17, 99, 3])
    out = s.send([8, 1])
    assert out.stats["path"] == "batch-graphs" and out.stats["time_to_first_token_s"] is not None


def test_packed_weights_are_held_once(tmp_path):
    """The runner's packed matmul weights are the model's own storage (the modules read
    views into them), and a second runner on the same model (another BatchDecoder, with
    another number of lanes) reuses them."""
    from hyspec.gpu.batch import BatchDecoder

    m = _model(tmp_path, "qwen3_5")
    before = [p.detach().clone() for p in m.parameters()]
    d1 = BatchDecoder(m, 16, 2, slots=1, graphs=False)
    d2 = BatchDecoder(m, 16, 2, slots=2, graphs=False)
    for a, b in zip(d1.runner.layers, d2.runner.layers):
        assert a.w_in is b.w_in and (a.w_gu is b.w_gu)
    lay = m.model.layers[0]
    w_gu = d1.runner.layers[0].w_gu
    assert lay.mlp.gate_proj.weight.data_ptr() == w_gu.data_ptr()
    assert lay.mlp.up_proj.weight.data_ptr() == w_gu[lay.mlp.gate_proj.weight.shape[0]:].data_ptr()
    for p, q in zip(m.parameters(), before):  # values unchanged
        assert torch.equal(p, q)


def test_sampled_lanes_equal_the_engine_core_and_alone(tmp_path):
    """Sampling on the device inside the batched round: seeded rejection-mode and coupled
    lanes, plain and speculative, mixed with greedy lanes, with penalties (greedy and
    sampled speculative lanes with 2- and 3-token windows that evict while drafting, a
    whole-history frequency penalty on a plain lane), give the engine core's tokens (the same
    positions, counter streams and penalty windows), and each lane alone gives the same."""
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.sampling import SamplingParams

    m = _model(tmp_path, "qwen3_next")
    N = 4
    prompts = [[5, 17, 99, 3], [8, 1], [60, 61, 62], [7, 7, 7, 7, 7]]
    # (lane 0 accepts drafts, so its later drafts and verify rows see the earlier drafts in
    # their windows; a negative frequency penalty pulls lane 1 towards its last two tokens)
    params = [SamplingParams(temperature=1.5, seed=12, presence_penalty=3.0, penalty_last_n=3),
              SamplingParams(temperature=0.0, repetition_penalty=0.5, frequency_penalty=-1.0, penalty_last_n=2),
              SamplingParams(temperature=1.2, top_k=20, seed=5, mode="coupled"),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3, frequency_penalty=3.0, penalty_last_n=-1)]
    ks = [2, 1, 2, 0]
    sched = Scheduler(m, max_batch=4)
    core = [Request(prompt_ids=p, max_new_tokens=N, params=sp, draft=k) for p, sp, k in zip(prompts, params, ks)]
    for r in core:
        sched.submit(r)
    sched.run()
    dec = BatchDecoder(m, 5 + N + 8, 2, slots=2, graphs=False)
    reqs = [LaneRequest(prompt=p, max_new_tokens=N, k=k, params=sp, arrival=a)
            for p, sp, k, a in zip(prompts, params, ks, (0, 0, 1, 1))]
    run_batch(dec, reqs)
    for r, c in zip(reqs, core):
        assert r.tokens == c.tokens
    for i in (0, 2):  # alone, each runs its own regime (penalised; coupled only: no blocks)
        alone = LaneRequest(prompt=prompts[i], max_new_tokens=N, k=ks[i], params=params[i])
        run_batch(dec, [alone])
        assert alone.tokens == reqs[i].tokens, i


def test_plain_lanes_in_a_sampled_speculative_round(tmp_path):
    """Plain lanes (k = 0) in the rounds of a speculative sampled lane: a seeded rejection
    lane and a greedy lane decoding plainly take their row-0 token as plain decoding does
    (stream PLAIN, the argmax of row 0), the speculative lane its accept test's token; each
    gives the engine core's tokens."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.sampling import SamplingParams

    m = _model(tmp_path, "qwen3_5")
    N = 5
    lanes = [LaneRequest(prompt=[5, 17, 99, 3], max_new_tokens=N, k=2, params=SamplingParams(temperature=1.5, seed=21)),
             LaneRequest(prompt=[8, 1], max_new_tokens=N, k=0, params=SamplingParams(temperature=1.5, seed=22)),
             LaneRequest(prompt=[60, 61, 62], max_new_tokens=N, k=0, params=SamplingParams(temperature=0.0))]
    dec = BatchDecoder(m, 4 + N + 8, 2, slots=3, graphs=False)
    run_batch(dec, lanes)
    assert [r.tokens for r in lanes] == _core_tokens(m, lanes)


def test_decode_and_verify_give_the_kernels_the_same_strides(tmp_path, monkeypatch):
    """Triton compiles one binary per stride divisibility (by 16): a decode step whose conv
    input had another row stride than a verify's ran a second binary, and on the H200 its
    bf16 output differed by an ulp (speculative != plain on tiny models).  Every tensor a
    row-wise GDN kernel reads or writes must have the same strides and 16-byte alignment
    in a decode step and in a verify."""
    import hyspec.gpu.runner_triton as rt
    from hyspec.gpu.batch import BatchDecoder

    seen = []

    def spy(name, fn):
        def call(*a, **k):
            seen.append((name, tuple((x.stride(), x.data_ptr() % 16) for x in a if isinstance(x, torch.Tensor))))
            return fn(*a, **k)
        return call

    monkeypatch.setattr(rt, "gdn_conv", spy("conv", rt.gdn_conv))
    monkeypatch.setattr(rt, "gdn_step", spy("step", rt.gdn_step))
    m = _model(tmp_path, "qwen3_5")
    dec = BatchDecoder(m, 32, 3, slots=2, graphs=False)
    for lane in range(2):
        dec.prefill(lane, [5, 6, 7])
    calls = {}
    for record, t in ((False, 2), (True, 8)):
        seen.clear()
        dec.runner.target(torch.tensor([1] * t), t, dec.pos, record, 2)
        calls[record] = list(seen)
    assert calls[False] and calls[False] == calls[True]


def _core_tokens(m, lanes) -> list[list[int]]:
    """Each LaneRequest's tokens from the engine core (each request's own computation: the
    same tokens whatever else runs with it)."""
    from hyspec.core.request import GREEDY, Request
    from hyspec.core.scheduler import Scheduler

    sched = Scheduler(m, max_batch=len(lanes))
    reqs = [sched.submit(Request(prompt_ids=r.prompt, max_new_tokens=r.max_new_tokens, draft=r.k,
                                 params=r.params or GREEDY, stop_ids=r.stop_ids)) for r in lanes]
    sched.run()
    return [r.tokens for r in reqs]


def test_open_queue_joins_between_rounds(tmp_path):
    """BatchRunner: requests submitted while another runs (seeded sampling, plain and
    speculative) join between rounds, one waiting for a free lane, and each gives its own
    tokens (the engine core's, alone), streamed round by round."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import BatchRunner, LaneRequest
    from hyspec.sampling import SamplingParams

    m = _model(tmp_path, "qwen3_5")
    seen, finished = {}, []

    def lane(i, prompt, n, k, params=None):
        return LaneRequest(prompt=prompt, max_new_tokens=n, k=k, params=params,
                           on_tokens=lambda t: seen.setdefault(i, []).extend(t), on_finish=finished.append)

    reqs = [lane(0, [5, 17, 99, 3], 4, 1), lane(1, [8, 1], 2, 0, SamplingParams(temperature=0.9, seed=11)),
            lane(2, [60, 61, 62], 3, 1, SamplingParams(temperature=1.1, top_k=20, seed=5))]
    dec = BatchDecoder(m, 12, 1, slots=2, graphs=False)
    runner = BatchRunner(dec)
    runner.submit(reqs[0])
    runner.step()
    runner.submit(reqs[1])  # joins the running batch
    runner.submit(reqs[2])  # both lanes taken: waits for one to leave
    runner.step()
    assert reqs[1].t_admit is not None and reqs[2].t_admit is None and reqs[0].reason is None
    runner.run()
    assert [r.tokens for r in reqs] == _core_tokens(m, reqs)
    assert [seen[i] for i in range(3)] == [r.tokens for r in reqs]
    assert sorted(id(r) for r in finished) == sorted(id(r) for r in reqs)
    assert all(r.reason == "length" for r in reqs) and not runner.active and not dec.live.any()


def test_cancel_frees_the_lane_within_a_round(tmp_path):
    """A cancelled request leaves at the next round boundary (here while a pipelined round
    is in flight): its lane is refilled by the last one, on_finish reports "cancelled", and
    the others' tokens are unchanged; a cancelled waiting request never starts."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import BatchRunner, LaneRequest

    m = _model(tmp_path, "qwen3_5")
    finished = []
    reqs = [LaneRequest(prompt=p, max_new_tokens=6, on_finish=finished.append) for p in ([5, 17, 99, 3], [8, 1, 2])]
    later = LaneRequest(prompt=[4, 4], max_new_tokens=6, on_finish=finished.append)
    dec = BatchDecoder(m, 12, 1, slots=2, graphs=False)
    runner = BatchRunner(dec)
    for r in reqs + [later]:
        runner.submit(r)
    runner.step()
    assert runner._inflight is not None  # the next round was queued before this one was read
    runner.cancel(reqs[0])  # lane 0: lane 1 moves into it
    runner.cancel(later)
    runner.step()
    assert reqs[0].reason == later.reason == "cancelled" and finished[:2] == [later, reqs[0]]
    assert runner.active == [reqs[1]] and int(dec.live[1]) == 0 and later.tokens == []
    n_cut = len(reqs[0].tokens)
    runner.run()
    assert len(reqs[0].tokens) == n_cut < 6
    assert reqs[1].tokens == _core_tokens(m, reqs[1:])[0] and reqs[1].reason == "length"


def test_sampled_rounds_run_the_row_kernels_on_their_rows(tmp_path, monkeypatch):
    """The sampled draws of the batched rounds go through the row kernels
    (hyspec.kernels.probs) over the round's own rows (no 16-row blocks), with a vocabulary
    of two chunks: coupled lanes (top-p, top-k, min-p) drafting the plain continuation
    (forced drafts: most are accepted) give plain decoding's tokens alone, in a batch of
    3 (speculative == plain, batch invariance); a rejection lane gives its tokens alone."""
    import hyspec.gpu.sampling as dsamp
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.loading import load_model
    from hyspec.sampling import SamplingParams
    from hyspec.tiny import make_tiny

    m = load_model(make_tiny("qwen3_next", tmp_path / "m", seed=3, layers=2, hidden=32, vocab_size=1500, std=0.2))
    rows = []

    def spy(fn):
        def call(x, *a, **k):
            rows.append(x.shape[0])
            return fn(x, *a, **k)
        return call

    monkeypatch.setattr(dsamp, "softmax_rows", spy(dsamp.softmax_rows))
    monkeypatch.setattr(dsamp, "inverse_cdf_rows", spy(dsamp.inverse_cdf_rows))
    N = 4
    prompts = [[5, 17, 99, 3], [8, 1], [60, 61, 62]]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=1, mode="coupled"),
              SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=2, mode="coupled"),
              SamplingParams(temperature=0.9, top_p=0.9, seed=3)]
    dec = BatchDecoder(m, 4 + N + 8, 2, slots=3, graphs=False)
    plain = []
    for p, sp in zip(prompts, params):
        r = LaneRequest(prompt=p, max_new_tokens=N, k=0, params=sp)
        run_batch(dec, [r])
        plain.append(r.tokens)
    assert rows and set(rows) == {1}  # plain steps of one lane: one row per call
    rows.clear()

    def spec(i):
        return LaneRequest(prompt=prompts[i], max_new_tokens=N, k=2, params=params[i], reference=plain[i])

    batch = [spec(i) for i in range(3)]
    run_batch(dec, batch, forced_rates=(0.9, 0.9))
    assert 16 not in rows and 3 in rows and 9 in rows  # 3 lanes' draft rows, 3 x 3 verify rows
    assert sum(r.telemetry.accepted for r in batch[:2]) > 0
    for i in (0, 1):  # coupled: speculative == plain
        assert batch[i].tokens == plain[i], i
    alone = spec(2)
    run_batch(dec, [alone], forced_rates=(0.9, 0.9))
    assert alone.tokens == batch[2].tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_row_prefill_matches_the_modules_prefill_and_the_reference(tmp_path, arch):
    """BatchDecoder.prefill through the runner (T rows of one lane in one forward, the
    GPU's choice for short feeds: fast_prefill_max) against the model modules' prefill on
    another lane: the last row's logits, pre / post hiddens, and the state it leaves (every
    verify row's log-probs after it against the reference model), fresh and resumed after a
    loaded state; lane 2 is prefilled while lane 0 holds another sequence (lane_base)."""
    from hyspec.gpu.batch import BatchDecoder

    m = _model(tmp_path, arch)
    dec = BatchDecoder(m, 48, 3, slots=3, graphs=False)
    prompt, more, verify = [5, 17, 99, 3, 7, 42, 8], [1, 60, 61], [11, 23, 4, 60]
    dec.fast_prefill_max = 0
    ref = dec.prefill(1, prompt)  # the modules (lane 1)
    dec.prefill(0, [9, 9, 9])  # another sequence in lane 0
    dec.fast_prefill_max = 64
    got = dec.prefill(2, prompt)  # the runner's rows (lane 2)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and float((a.double() - b.double()).abs().max()) <= 1e-4
    assert int(dec.pos[2]) == len(prompt) and int(dec.pos[0]) == 3
    for g in range(dec.conv.shape[0]):
        assert torch.allclose(dec.ssm[g, 2], dec.ssm[g, 1], atol=1e-5)
        assert torch.allclose(dec.conv[g, 2], dec.conv[g, 1], atol=1e-5)  # (the projections: other kernels)
    dec.prefill(2, more, start=len(prompt))  # resumed: rows after the lane's own state
    # lane 1: the prompt's rows again, then `more` one row per call (the decode step's shape)
    dec.prefill(1, prompt)
    for i, t in enumerate(more):
        dec.prefill(1, [t], start=len(prompt) + i)
    assert torch.equal(dec.ssm[:, 1], dec.ssm[:, 2]) and torch.equal(dec.conv[:, 1], dec.conv[:, 2])
    # a verify over lanes 0..2 in one call (lane 0 verifies rows of its own sequence)
    _, post = dec.runner.target(torch.tensor(verify * 3), 12, dec.pos, True, 3)
    lp = torch.log_softmax(dec.runner.logits(post).double(), -1).view(3, 4, -1)
    assert torch.equal(lp[1], lp[2])  # T rows in one call == T single rows, bitwise
    # the reference, its prompt run row by row as the rows path runs it (exact=True)
    from hyspec.model.ops import StepCtx

    cache = m.new_cache(64)
    m.forward_states(torch.tensor(prompt + more), cache, StepCtx(start=0, exact=True))
    _, rp = m.forward_states(torch.tensor(verify), cache, StepCtx(start=len(prompt + more), exact=True))
    want = torch.log_softmax(m.logits(rp).double(), -1)
    # 2e-4 for the MoE model: its decode-step kernels themselves (T rows == T single rows, above)
    # sit 1.7e-4 from the reference at two of these positions in fp32, 1e-5 or less at the others
    # (the dense families stay under 2e-5). Not a kernel error: this tiny MoE model amplifies
    # rounding ~10x per MoE block. At position 10 the GDN mixer's output of layer 0 is 3.5e-6
    # from the reference's (recurrent steps summed in another order), and the *reference's own*
    # MoE block maps the two mid-layer residuals to outputs 3.6e-5 apart (the kernels' layer-0
    # output is 3.5e-5 off); the grouped MoE kernel alone, fed the same input, is within 1.4e-6
    # of the reference block (relative 3e-7) on 20 random rows. LOGPROB_ATOL for the dense ones.
    tol = 2e-4 if m.cfg.num_experts else LOGPROB_ATOL
    assert float((lp[2] - want).abs().max()) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_prefill_is_the_reference_chunked_forward_with_attention_between_linear_layers(tmp_path, dtype):
    """The modules' prefill with the torch scan (hyspec.gpu.prefill.prefill_into: every prompt
    on the CPU; on a GPU fp32 models' and long prompts') is the reference model's chunked forward, bit for bit
    (in bf16 too: the mixer's fp32 output goes back to the model's dtype): pre / post hiddens, the
    last row's logits and the state it leaves (conv windows, SSM states, KV rows), fresh
    (70 tokens: two 64-row chunks; lane 0 holds another sequence) and resumed after it.
    Attention layers sit between the Gated-DeltaNet layers (full_attention_interval 2), so
    the g-th linear layer's state is not layer g's (layer_indices)."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.prefill import layer_indices
    from hyspec.loading import load_model
    from hyspec.model.ops import StepCtx
    from hyspec.tiny import make_tiny

    m = load_model(make_tiny("qwen3_next", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=128, std=0.2,
                             overrides={"full_attention_interval": 2}), dtype=dtype)
    gi, ai = layer_indices(m.cfg)
    assert (gi, ai) == ({0: 0, 2: 1}, {1: 0, 3: 1})
    dec = BatchDecoder(m, 96, 3, slots=2, graphs=False)
    assert dec.fast_prefill_max == 0  # (the modules, not the runner's rows)
    prompt, more = [(7 * j + 3) % 128 for j in range(70)], [1, 60, 61]
    dec.prefill(0, [9, 9, 9])
    cache = m.new_cache(96)
    for start, feed in ((0, prompt), (len(prompt), more)):
        got = dec.prefill(1, feed, start=start)
        rpre, rpost = m.forward_states(torch.tensor(feed), cache, StepCtx(start=start, chunked=True))
        for a, b in zip(got, (rpre, rpost, m.logits(rpost[-1:]))):
            assert torch.equal(a, b), start
        for i, g in gi.items():
            st = cache.layer_state(i)
            assert torch.equal(dec.ssm[g, 1], st.ssm) and torch.equal(dec.conv[g, 1], st.conv), (start, i)
        P = start + len(feed)
        for i, a in ai.items():
            kvb = cache.layer_state(i)
            assert torch.equal(dec.kv_k[a][1][:, :P], kvb.k[:, :P]) and torch.equal(dec.kv_v[a][1][:, :P], kvb.v[:, :P])
    assert int(dec.pos[1]) == len(prompt + more) and int(dec.pos[0]) == 3


def _fake_fla(calls):
    """A stand-in for fla's chunk_gated_delta_rule with its conventions (q, k [1, T, Hk, Dk]
    l2-normed in the kernel, value head h reading key head h // (Hv // Hk), g the log decay,
    the state [1, Hv, Dk, Dv] fp32), computed with the torch chunked scan."""
    from hyspec.model.gdn import chunked_scan, l2norm

    def fn(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        calls.append(1)
        assert output_final_state and use_qk_l2norm_in_kernel
        r = v.shape[2] // q.shape[2]
        if initial_state is None:
            initial_state = torch.zeros(1, v.shape[2], q.shape[3], v.shape[3])
        assert initial_state.dtype == torch.float32
        qn = l2norm(q[0].float()).repeat_interleave(r, dim=1) * scale
        kn = l2norm(k[0].float()).repeat_interleave(r, dim=1)
        o, s = chunked_scan(qn, kn, v[0].float(), g[0].float(), beta[0].float(), initial_state[0].clone())
        return o[None].to(v.dtype), s[None]
    return fn


def test_fla_prefill_glue_and_its_fallback(tmp_path, monkeypatch, capsys):
    """hyspec.gpu.prefill's call of fla's chunked kernel (CUDA only; here on one layer's
    inputs with a torch stand-in of the kernel): its output and the final state written
    into the lane equal GatedDeltaNet.prepare + the chunked scan from a nonzero (resumed)
    state. Without fla, or with a kernel that raises, it returns None, leaves the state,
    says so once on stderr and turns fla off for the decoder; an import of fla that fails
    with another error than ImportError (a triton it does not support) is "not importable"
    too. A CPU decoder asked for fla never calls it."""
    import sys
    import types

    from hyspec.config import FULL
    from hyspec.gpu import prefill as P
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.model.gdn import chunked_scan
    from hyspec.model.ops import StepCtx

    class BrokenFla:  # a meta-path finder: importing fla raises
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "fla":
                raise RuntimeError("fla: unsupported triton")
    with monkeypatch.context() as mp:
        for name in [n for n in sys.modules if n.split(".")[0] == "fla"]:
            mp.delitem(sys.modules, name)
        mp.setattr(sys, "meta_path", [BrokenFla()] + sys.meta_path)
        assert P._fla_chunk() is None

    m = _model(tmp_path, "qwen3_next")
    calls = []
    monkeypatch.setattr(P, "_fla_chunk", lambda: _fake_fla(calls))
    dec = BatchDecoder(m, 48, 3, slots=1, graphs=False, use_fla=True)
    dec.prefill(0, [5, 17, 99, 3])
    assert calls == [] and dec.use_fla  # (CPU tensors: the torch scan)
    i = next(i for i, layer in enumerate(m.model.layers) if layer.layer_type != FULL)
    mod = m.model.layers[i].linear_attn
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, m.cfg.hidden_size, generator=g)
    with torch.no_grad():
        qkv, _, b, a = mod.project(x, StepCtx())
        y = mod.conv(torch.cat([torch.randn(mod.W - 1, qkv.shape[1], generator=g), qkv]))
        s0 = 0.3 * torch.randn(mod.nv, mod.dk, mod.dv, generator=g)
        q, k, v, gg, beta = mod.prepare(y, b, a)
        want_o, want_s = chunked_scan(q, k, v, gg, beta, s0.clone())
        ssm = s0.clone()
        o = P._fla_prefill(dec, mod, y, b, a, ssm)
    assert calls == [1] and dec.use_fla
    assert float((o - want_o).abs().max()) <= 1e-5 and float((ssm - want_s).abs().max()) <= 1e-5
    capsys.readouterr()

    def boom(*a, **kw):
        raise RuntimeError("no kernel")
    for fn, why in ((None, "not importable"), (boom, "failed: RuntimeError: no kernel")):
        d = types.SimpleNamespace(use_fla=True)
        monkeypatch.setattr(P, "_fla_chunk", lambda fn=fn: fn)
        ssm = s0.clone()
        assert P._fla_prefill(d, mod, y, b, a, ssm) is None
        assert not d.use_fla and torch.equal(ssm, s0)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "falls back to the torch chunked" in err[0] and why in err[0], err


@pytest.mark.parametrize("draft", [0, 2])
def test_a_lane_whose_prompt_overflows_ends_in_error_alone(tmp_path, draft):
    """A prompt whose first row's logits overflow (NaN / +inf) on the graph lanes: a sampled
    one raised NonFiniteLogits out of the runner's admission, which failed every lane of the
    round (the server: each running request a 500), and a greedy one took argmax's first NaN
    id in silence. Now that request alone ends in error, as on the engine core, and the
    others' tokens are the engine core's."""
    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.sampling import SamplingParams
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=128, std=0.2)
    engines = []
    for graphs in (False, True):
        eng = Engine(load_model(d))
        m = eng.model
        make_overflowing(m)  # token 100 overflows when fed
        eng.batch_graphs = graphs
        engines.append(eng)
    prompts = [[5, 17, 99, 3], [5, 100, 3], [7, 8, 9]]
    for params in (None, SamplingParams(temperature=0.9, seed=4)):
        kw = dict(max_new_tokens=5, draft=draft, ignore_eos=True, params=params)
        want, got = (eng.generate_batch(prompts, **kw) for eng in engines)
        assert got[0].stats["path"] == "batch-graphs" and want[0].stats.get("path") != "batch-graphs"
        for w, g in zip(want, got):
            assert (g.tokens, g.stop_reason) == (w.tokens, w.stop_reason), (params, draft)
        assert got[1].stop_reason == "error" and got[1].stats["error"].startswith("NonFiniteLogits: "), got[1].stats
        assert got[0].stop_reason == got[2].stop_reason == "length"
        with pytest.raises(ValueError, match="NaN"):  # alone: the error itself, as on the engine core
            engines[1].generate(prompts[1], **kw)
        s = engines[1].session(draft=draft, max_new_tokens=3, params=params)
        first = s.send([5, 17]).tokens
        assert s.last_stats["path"] == "batch-graphs"
        with pytest.raises(ValueError, match="NaN"):  # a session turn: undone, the session goes on exactly
            s.send([100, 3])
        assert s.num_turns == 1 and s.tokens[2:] == first
        s2 = engines[0].session(draft=draft, max_new_tokens=3, params=params)
        s2.send([5, 17])
        assert s.send([7]).tokens == s2.send([7]).tokens


def _overflowing_engines(tmp_path, lm_bias: float = 0.0):
    """(engine core, graph lanes) of one tiny model whose token 100 drives layer 0's MLP
    past float32's range when it is fed (its row's logits: NaN / +inf), no other token;
    lm_bias > 0 scales the head's row 100 up so that the model chooses (and drafts) 100
    now and then mid-generation."""
    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=128, std=0.2)
    engines = []
    for graphs in (False, True):
        eng = Engine(load_model(d))
        m = eng.model
        make_overflowing(m, lm_bias)  # token 100 overflows when fed
        eng.batch_graphs = graphs
        engines.append(eng)
    return engines


def test_a_lane_whose_rows_overflow_mid_generation_ends_in_error_alone(tmp_path, monkeypatch):
    """The graph rounds' rows are checked as the engine core checks its rows: a lane
    whose round needs a row with NaN / +inf (fed token 100: its pending token, or a draft
    every draft before it was accepted with) ends in error there, the round emitting
    nothing for it, with the engine core's tokens before; a bad row past a rejected draft
    is not needed and changes nothing. Before, greedy lanes took argmax's first NaN id and
    sampled ones drew from NaN rows, in silence. Each case checked to occur (the spy)."""
    from hyspec.sampling import SamplingParams

    core, lanes = _overflowing_engines(tmp_path, lm_bias=3.0)
    seen = spy_bad_rows(monkeypatch)  # bad rows used / past a rejected draft
    # two lanes (one captured batch size of 2): [8, 57, 3] runs to its length in every
    # case, [12, 85, 3] is fed 100 after 3 / 6 / 2 tokens (greedy / sampled plain / sampled
    # speculative) -- mid-generation, before 8
    prompts = [[8, 57, 3], [12, 85, 3]]
    for params in (None, SamplingParams(temperature=0.9, seed=4)):
        for draft in (0, 3):
            kw = dict(max_new_tokens=8, draft=draft, ignore_eos=True, params=params)
            want, got = core.generate_batch(prompts, **kw), lanes.generate_batch(prompts, **kw)
            assert got[0].stats["path"] == "batch-graphs" and want[0].stats.get("path") != "batch-graphs"
            for w, g in zip(want, got):
                assert (g.tokens, g.stop_reason) == (w.tokens, w.stop_reason), (params, draft)
                assert (g.stats.get("error") or "").startswith("NonFiniteLogits: ") == (g.stop_reason == "error")
            mid = [g for g in got if g.stop_reason == "error" and g.tokens]
            assert mid and any(g.stop_reason == "length" for g in got), (params, draft)
    assert seen["used"] and seen["unused"], seen


def test_drafter_rows_that_overflow_end_a_sampled_lanes_drafts_as_on_the_engine_core(tmp_path, monkeypatch):
    """A damaged MTP head: once token 100 is fed to the drafter, its rows hold NaN / +inf
    (the target's stay finite). The engine core drafts nothing from such a row; the graph
    lanes drew sampled drafts from it and ran the rejection test against a q of NaN,
    emitting tokens the target never gave (token 0 again and again). Now a sampled round's
    drafts end there too: the engine core's tokens and drafted / accepted counts, whether
    the bad row comes mid-round or at depth 0, rejection (with top-p) or coupled. (A greedy
    round keeps such drafts: its output, verified against the target's argmax, does not
    depend on them.)"""
    from hyspec.engine import Engine
    from hyspec.gpu import batch_loop
    from hyspec.loading import load_model
    from hyspec.sampling import SamplingParams
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=128, std=0.2)
    core, lanes = (Engine(load_model(d)) for _ in range(2))
    for eng, graphs in ((core, False), (lanes, True)):
        make_drafter_overflowing(eng.model, 3.0)  # token 100 fed to the drafter overflows it
        eng.batch_graphs = graphs
    # two lanes, six tokens: [4, 29, 3] has its drafts end at depth 0 (top-p), [5, 100, 3]
    # (100 fed to the drafter from the start) mid-round (coupled)
    prompts = [[4, 29, 3], [5, 100, 3]]
    cuts = {"mid": 0, "at 0": 0}
    take = batch_loop.BatchRunner._take

    def spy(self, rows, k, lp=None, kept=None):
        for r, row, kr in zip(self.active, rows, kept or ()):
            if r.reason is None and kr < r.k_now:  # (no p_min, no mask: a bad drafter row)
                cuts["mid" if kr else "at 0"] += 1
        return take(self, rows, k, lp, kept)

    monkeypatch.setattr(batch_loop.BatchRunner, "_take", spy)
    for params in (SamplingParams(temperature=0.9, seed=4, top_p=0.9),
                   SamplingParams(temperature=0.9, seed=5, mode="coupled")):
        kw = dict(max_new_tokens=6, draft=3, ignore_eos=True, params=params)
        want, got = core.generate_batch(prompts, **kw), lanes.generate_batch(prompts, **kw)
        assert got[0].stats["path"] == "batch-graphs" and want[0].stats.get("path") != "batch-graphs"
        assert [g.tokens for g in got] == [w.tokens for w in want], params
        assert all(g.stop_reason == "length" for g in got)
        assert [g.stats["spec"]["drafted_at"] for g in got] == [w.stats["spec"]["drafted_at"] for w in want]
        assert [g.stats["spec"]["accepted"] for g in got] == [w.stats["spec"]["accepted"] for w in want]
    assert cuts["mid"] and cuts["at 0"], cuts  # (sampled rounds whose drafts a bad row ended)


@pytest.mark.parametrize("where", ["target", "drafter"])
def test_rows_with_one_infinite_logit_are_checked_as_on_the_engine_core(tmp_path, where):
    """Rows whose one logit (token 50's) is +inf now and then, the others finite (where
    NaN rows hold NaN at every index, this tells a check at the row's argmax from one at
    any other index): the target's rows end a lane in error where the core ends it
    (plain steps and rounds, greedy and sampled: the check at the argmax the sampled draws
    made), the drafter's end a sampled round's drafts where the core's end -- the engine
    core's tokens, ends and drafted counts."""
    from hyspec.engine import Engine
    from hyspec.loading import load_model
    from hyspec.sampling import SamplingParams
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=128, std=0.2)
    core, lanes = (Engine(load_model(d)) for _ in range(2))
    for eng, graphs in ((core, False), (lanes, True)):
        make_infinite(eng.model, 50, drafter=where == "drafter")
        eng.batch_graphs = graphs
    # two lanes: on the target's rows [1, 8, 3] ends in error at its first token, [5, 36, 3]
    # mid-generation (3-4 tokens); on the drafter's both have rounds whose drafts end early
    prompts = [[1, 8, 3], [5, 36, 3]]
    sampled = SamplingParams(temperature=0.9, seed=4)
    runs = [(3, sampled)] if where == "drafter" else [(0, None), (0, sampled), (3, None), (3, sampled)]
    for draft, params in runs:
        kw = dict(max_new_tokens=10, draft=draft, ignore_eos=True, params=params)
        want, got = core.generate_batch(prompts, **kw), lanes.generate_batch(prompts, **kw)
        assert got[0].stats["path"] == "batch-graphs"
        assert [(g.tokens, g.stop_reason) for g in got] == [(w.tokens, w.stop_reason) for w in want], (draft, params)
        if draft:
            drafted = [w.stats["spec"]["drafted_at"] for w in want]
            assert [g.stats["spec"]["drafted_at"] for g in got] == drafted
        if where == "target":  # (errors mid-generation and at the first token)
            assert {bool(g.tokens) for g in got if g.stop_reason == "error"} == {True, False}
        else:  # (drafts ended early)
            assert all(dr[-1] < dr[0] for dr in drafted) and all(g.stop_reason == "length" for g in got)


@pytest.mark.parametrize("draft", [0, 3])
def test_a_session_turn_that_overflows_mid_way_keeps_its_rounds_on_the_graph_lanes(tmp_path, draft):
    """A session turn whose later round needs an overflowing row raises NonFiniteLogits on
    the graph lanes as on the engine core, and both keep the turn's tokens before it (the
    lanes' end state rebuilt from the transcript, not exported from the failed round):
    the same tokens, the same turns, and after a rewind the same next reply."""
    core, lanes = _overflowing_engines(tmp_path, lm_bias=3.0)
    sessions = [eng.session(draft=draft, max_new_tokens=8) for eng in (core, lanes)]  # (100: the 7th token)
    for s in sessions:
        with pytest.raises(ValueError, match="NaN"):
            s.send([4, 29, 3])  # (greedy: 100 after a few tokens, then fed)
    a, b = sessions
    assert a.num_turns == b.num_turns == 1 and a.tokens == b.tokens and len(a.tokens) > 4
    for s in sessions:
        s.rewind(1)
    assert a.send([8, 57, 3]).tokens == b.send([8, 57, 3]).tokens  # (no 100 in its 8 tokens)
    assert b.last_stats["path"] == "batch-graphs"


def test_a_row_after_an_accepted_stop_draft_that_overflows_changes_nothing(tmp_path):
    """A round whose drafts up to a stop id are all accepted ends at that stop, as plain
    decoding does, which never runs the row after it: that row overflowing (the stop token
    100 fed) is no error, on the engine core as on the graph lanes. Before, both ended the
    sequence in error (NonFiniteLogits) where plain decoding ends it with "eos": greedy (a
    forced drafter proposing the reference: 76, 47, 100) as sampled."""
    from hyspec.sampling import SamplingParams
    from hyspec.speculative.loop import SpecOptions

    core, lanes = _overflowing_engines(tmp_path, lm_bias=3.0)
    p, kw = [3, 22, 3], dict(max_new_tokens=12, ignore_eos=True, stop_ids=[100])
    plain = core.generate(p, draft=0, **kw)
    assert (plain.tokens, plain.stop_reason) == ([76, 47, 100], "eos")
    spec = SpecOptions(k=3, forced_rates=(1.0,))
    for eng in (core, lanes):
        out = eng.generate(p, spec=spec, reference=[76, 47, 100] + [0] * 20, **kw)
        assert (out.tokens, out.stop_reason) == (plain.tokens, "eos")
    assert out.stats["path"] == "batch-graphs"
    prompts = [[1, 8, 3], [4, 29, 3]]  # (two lanes: both end on 100, after 8 and 2 tokens)
    kw.update(draft=3, params=SamplingParams(temperature=0.9, seed=4))
    want, got = core.generate_batch(prompts, **kw), lanes.generate_batch(prompts, **kw)
    assert [(w.tokens, w.stop_reason) for w in want] == [(g.tokens, g.stop_reason) for g in got]
    assert all(w.stop_reason != "error" for w in want) and want[0].tokens[-1] == 100


def test_a_moved_drafting_lane_drafts_as_alone(tmp_path):
    """A drafting lane moved into a freed lane (the last lane fills the hole) carries its
    whole drafter state (h_last: the hidden its next fill row pairs with): a seeded
    rejection lane whose draws read its drafts gives the tokens and telemetry it gives
    alone."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.sampling import SamplingParams

    m = _model(tmp_path, "qwen3_5")
    sp = SamplingParams(temperature=1.5, seed=21)

    def spec():
        return LaneRequest(prompt=[5, 17, 99, 3], max_new_tokens=10, k=2, params=sp)

    dec = BatchDecoder(m, 4 + 10 + 8, 2, slots=2, graphs=False)
    alone = spec()
    run_batch(dec, [alone])
    first, moved = LaneRequest(prompt=[8, 1, 2], max_new_tokens=2), spec()  # lane 0 leaves after a round
    run_batch(dec, [first, moved])
    assert moved.tokens == alone.tokens and moved.telemetry.to_dict() == alone.telemetry.to_dict()
    assert alone.telemetry.rounds >= 3  # (the move: after its first round; its h_last is read in the third)


def test_a_freed_lane_forgets_its_p_min(tmp_path):
    """A lane freed by a request with p_min, taken by one without (while another lane's
    p_min keeps the rounds' p_min test on): the new request drafts as it does alone."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch

    m = _model(tmp_path, "qwen3_5")
    dec = BatchDecoder(m, 4 + 6 + 8, 2, slots=2, graphs=False)

    def later():
        return LaneRequest(prompt=[60, 61, 62], max_new_tokens=4, k=2, arrival=1)

    alone = later()
    run_batch(dec, [alone])
    reqs = [LaneRequest(prompt=[5, 17, 99, 3], max_new_tokens=6, k=2, p_min=1e-9),  # never cuts
            LaneRequest(prompt=[8, 1, 2], max_new_tokens=2, k=2, p_min=0.99),  # cuts every draft; leaves lane 1
            later()]  # joins lane 1 (p_min 0)
    run_batch(dec, reqs)
    assert reqs[1].telemetry.drafted == 0
    assert reqs[2].tokens == alone.tokens and reqs[2].telemetry.to_dict() == alone.telemetry.to_dict()
    assert alone.telemetry.drafted > 0


def test_padding_lanes_do_not_advance(tmp_path):
    """A round pads its lanes up to a captured batch size: the padding lanes compute on idle
    state and stay at position 0 (an idle lane advancing every step would run past its
    cache in a long batch)."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import BatchRunner, LaneRequest

    m = _model(tmp_path, "qwen3_5")
    dec = BatchDecoder(m, 12, 1, slots=4, graphs=False)
    runner = BatchRunner(dec, pipeline=False)
    for p in ([5, 17, 99, 3], [8, 1], [4, 4, 4]):  # 3 plain lanes: steps of 4
        runner.submit(LaneRequest(prompt=p, max_new_tokens=3))
    steps = 0
    while runner.has_work():
        runner.step()
        steps += 1
        assert int(dec.pos[3]) == 0 and int(dec.live[3]) == 0
    assert steps >= 2


def test_logit_bias_on_the_graph_lanes_equals_the_engine_core(tmp_path):
    """A logit_bias runs on the graph lanes (before, graph_eligible sent such a request to
    the engine core, and the lanes refused it): added to the target's rows and the
    drafter's before the penalties, greedy and sampled (rejection and coupled), plain and
    speculative, with a p_min whose test reads the biased drafter row: the engine core's
    tokens and drafted counts. Two lanes for five requests: biased and unbiased requests
    leave, move into the freed lane and take a lane a biased one left (its bias row
    cleared), each with the tokens it has alone; a bias on an id past the vocabulary is
    refused by name."""
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import BatchRunner, LaneRequest, graph_eligible, run_batch
    from hyspec.sampling import SamplingParams
    from hyspec.speculative.loop import SpecOptions
    from hyspec.speculative.telemetry import SpecTelemetry

    m = _model(tmp_path, "qwen3_5")
    bias = {7: 4.0, 8: -100, 50: 2.5, 0: 0.0}
    params = [SamplingParams(temperature=0.0, logit_bias=bias),
              SamplingParams(temperature=0.9, seed=4, logit_bias={50: 3.0, 9: -2.0}),
              SamplingParams(temperature=0.9, seed=5),  # (none: joins a lane a biased request left)
              SamplingParams(temperature=0.8, seed=6, top_p=0.8, repetition_penalty=1.3, presence_penalty=0.5,
                             logit_bias=bias, mode="coupled"),
              SamplingParams(temperature=0.0, logit_bias={7: 3.0}, frequency_penalty=0.7)]
    prompts = [[5, 17, 99, 3], [8, 1, 2], [60, 61, 62], [7, 7, 7, 7], [11, 12]]
    ks, ns, arrivals, p_mins = [3, 2, 3, 0, 2], [9, 4, 7, 6, 8], [0, 0, 1, 2, 2], [0.0, 0.0, 0.0, 0.0, 0.05]
    assert graph_eligible([Request(prompt_ids=[1, 2], max_new_tokens=2, params=params[0])]) is None
    sched = Scheduler(m, max_batch=5)
    core = [sched.submit(Request(prompt_ids=p, max_new_tokens=n, params=sp, draft=k,
                                 spec=SpecOptions(k=k, p_min=pm) if k else None, telemetry=SpecTelemetry()))
            for p, sp, k, n, pm in zip(prompts, params, ks, ns, p_mins)]
    sched.run()
    dec = BatchDecoder(m, 4 + 9 + 8, 3, slots=2, graphs=False)

    def lanes(idx):
        return [LaneRequest(prompt=prompts[i], max_new_tokens=ns[i], k=ks[i], params=params[i], p_min=p_mins[i],
                            arrival=arrivals[i]) for i in idx]

    reqs = lanes(range(5))
    run_batch(dec, reqs)
    for i, (r, c) in enumerate(zip(reqs, core)):
        assert r.tokens == c.tokens, i
        assert r.telemetry.drafted == c.telemetry.drafted, i
    assert 8 not in [t for r in reqs[:1] + reqs[3:4] for t in r.tokens] and reqs[0].tokens.count(7) >= 2
    for i in (2, 4):  # (each lane's tokens are the engine core's above: the unbiased one that took a biased
        alone = lanes([i])[0]  # one's lane, and the penalised greedy one, alone on the lanes too)
        alone.arrival = 0
        run_batch(dec, [alone])
        assert alone.tokens == reqs[i].tokens, i
    with pytest.raises(ValueError, match="logit_bias: token id"):
        BatchRunner(dec).submit(LaneRequest(prompt=[5, 17], max_new_tokens=4,
                                            params=SamplingParams(temperature=0.0, logit_bias={500: 1.0})))
