"""The batched GPU decoder on a CUDA device (skipped without one): verify rows of every
lane against the reference model's log-probs for each family (fp32), and in bf16 with
CUDA graphs: greedy and seeded sampling, plain and speculative, each sequence in a
staggered batch bitwise equal to the same sequence alone."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, make_overflowing, spy_bad_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
LOGPROB_ATOL = 1e-4


def _model(tmp_path, arch, dtype, ssm_dtype=None):
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny(arch, tmp_path / arch, seed=3, layers=4, hidden=64, vocab_size=256, std=0.2)
    return load_model(d, dtype=dtype, device=torch.device("cuda"), ssm_dtype=ssm_dtype)


def _mixed_params(i: int):
    """Lane i's seeded sampling: coupled for every third lane, rejection for the others."""
    from hyspec.sampling import SamplingParams

    return SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, mode="coupled" if i % 3 == 0 else "rejection")


@pytest.mark.parametrize("arch,ssm_dtype", [(a, None) for a in ARCHS] + [("qwen3_next", "bfloat16")])
def test_batched_verify_rows_match_the_reference_on_cuda(tmp_path, arch, ssm_dtype):
    """ssm_dtype bfloat16: the state stored in bf16 on both sides, within bf16's rounding
    (1e-2: an element of the state may round to the neighbouring bf16 value; tests/test_ssm_dtype.py)."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.model.ops import StepCtx

    m = _model(tmp_path, arch, torch.float32, ssm_dtype)
    atol = LOGPROB_ATOL if ssm_dtype is None else 1e-2
    dec = BatchDecoder(m, 48, 3, slots=3, graphs=False, use_fla=False)
    prompts = [[5, 17, 99, 3, 7, 42], [8, 1], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
    verify = [[11, 23, 4, 60], [9, 9, 2, 1], [100, 3, 5, 7]]
    for lane, p in enumerate(prompts):
        dec.prefill(lane, p)
    ids = torch.tensor([t for v in verify for t in v], device="cuda")
    _, post = dec.runner.target(ids, 12, dec.pos, True, 3)
    got = torch.log_softmax(dec.runner.logits(post).double(), -1).view(3, 4, -1)
    for lane in range(3):
        cache = m.new_cache(64)
        m.forward_states(torch.tensor(prompts[lane], device="cuda"), cache, StepCtx(start=0, chunked=True))
        _, rp = m.forward_states(torch.tensor(verify[lane], device="cuda"), cache,
                                 StepCtx(start=len(prompts[lane]), exact=True))
        ref = torch.log_softmax(m.logits(rp).double(), -1)
        assert float((got[lane] - ref).abs().max()) <= atol, lane


@pytest.mark.parametrize("dtype,dv", [(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, 64)],
                         ids=["bf16", "fp32", "bf16_split_dv"])
def test_a_lane_has_the_same_bits_in_every_row_tile_height(tmp_path, dtype, dv):
    """On CUDA the batched runner picks each matmul's row-tile height from the call's rows
    (HYSPEC_BATCH_BLOCK_T=auto: 16, 32 or 64, for bf16 models; fp32 models keep 64, and
    here are switched to auto as well). Lane 0's verify logits are bitwise the same with 1
    lane (4 rows: 16-row tiles), 5 lanes (20 rows: 32) and 10 lanes (40 rows: 64). In fp32
    a height-dependent config (a planted K split at 16 rows) is caught; in bf16 the
    rounding of every matmul output to bf16 hides such a change of the fp32 sums almost
    always (seen on the H200 with hidden 64 and 512), which is why the kernel-level
    tests (tests/test_gpu_tile_heights.py) compare the large b2 shapes.
    bf16_split_dv: value heads of 64, so the scan runs in 16-wide Dv blocks with the gated
    norm in its own kernel (b2's layout; the tiny models' heads of 12 run whole)."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_next", tmp_path / "h512", seed=3, layers=4, hidden=512, vocab_size=256, std=0.2,
                  overrides={"linear_value_head_dim": dv} if dv else None)
    m = load_model(d, dtype=dtype, device=torch.device("cuda"))
    prompts = [[(7 * i + j) % 256 for j in range(3 + i % 4)] for i in range(10)]
    verify = [[(11 * i + 3 * j + 1) % 256 for j in range(4)] for i in range(10)]

    def lane0_logits(lanes, plant=False):
        dec = BatchDecoder(m, 24, 3, slots=10, graphs=False, use_fla=False)
        assert dec.runner.block_t == (None if dtype == torch.bfloat16 else 64)
        dec.runner.block_t = None  # auto heights (fp32: switched on for this test)
        if plant:
            tile = dec.runner._tile
            dec.runner._tile = lambda N, K, act, h, fp8=None: dict(tile(N, K, act, 64, fp8), split_k=2, block_k=16) \
                if h == 16 else tile(N, K, act, h, fp8)
        for lane in range(lanes):
            dec.prefill(lane, prompts[lane])
        ids = torch.tensor([t for v in verify[:lanes] for t in v], device="cuda")
        _, post = dec.runner.target(ids, 4 * lanes, dec.pos, True, lanes)
        return dec.runner.logits(post)[:4].clone()

    alone = lane0_logits(1)
    for lanes in (5, 10):
        assert torch.equal(lane0_logits(lanes), alone), lanes
    if dtype == torch.float32:
        assert not torch.equal(lane0_logits(1, plant=True), alone)


@pytest.mark.parametrize("ssm_dtype", [None, "bfloat16"], ids=["fp32_state", "bf16_state"])
@pytest.mark.parametrize("sampled", [False, True])
def test_batch_invariance_with_graphs_bf16(tmp_path, sampled, ssm_dtype):
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch

    m = _model(tmp_path, "qwen3_next", torch.bfloat16, ssm_dtype)
    assert m.cfg.mamba_ssm_dtype == ssm_dtype
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (L,), generator=g).tolist() for L in (5, 12, 3, 9, 20, 7, 4, 15)]
    N = 40
    dec = BatchDecoder(m, 20 + N + 8, 3, slots=4)

    def params(i):
        return _mixed_params(i) if sampled else None

    def reqs(arrivals=None):
        return [LaneRequest(prompt=p, max_new_tokens=N, k=(0, 3, 1, 2)[i % 4], params=params(i),
                            arrival=0 if arrivals is None else arrivals[i]) for i, p in enumerate(prompts)]

    batched = reqs([0, 0, 1, 3, 3, 5, 9, 9])
    run_batch(dec, batched, max_batch=4)
    for i, b in enumerate(batched):
        alone = reqs()[i]
        run_batch(dec, [alone], max_batch=1)
        assert alone.tokens == b.tokens, i
    assert not dec.step_graphs.failed and dec.step_graphs.graphs
    if not sampled:  # speculative lanes equal plain decoding of the same prompt
        for i, b in enumerate(batched):
            plain = LaneRequest(prompt=prompts[i], max_new_tokens=N)
            run_batch(dec, [plain], max_batch=1)
            assert plain.tokens == b.tokens, i


def test_engine_generate_equals_its_lane_in_a_batch(tmp_path):
    """On a GPU one greedy Engine.generate runs on the BatchDecoder (since the single-
    sequence decoder left the engine; a one-lane decoder for one request): bf16 with CUDA
    graphs, plain and speculative, its tokens are bitwise those of the same prompt inside a
    generate_batch of three (a 16-lane decoder: the entry points can no longer differ at
    near-ties), and path is batch-graphs."""
    from hyspec.engine import Engine

    m = _model(tmp_path, "qwen3_next", torch.bfloat16)
    eng = Engine(m)
    prompts = [[5, 17, 99, 3], [8, 1, 60, 61, 62], [40, 41]]
    tokens = {}
    for draft in (0, 3):
        one = eng.generate(prompts[1], max_new_tokens=40, draft=draft, ignore_eos=True)
        many = eng.generate_batch(prompts, max_new_tokens=40, draft=draft, ignore_eos=True)
        assert one.samples[0].stats["path"] == "batch-graphs"
        assert one.samples[0].tokens == many[1].samples[0].tokens, draft
        tokens[draft] = one.samples[0].tokens
    assert tokens[3] == tokens[0]  # speculative == plain


SLEEP_CYCLES = 200_000_000  # ~0.1 s of a spinning kernel on an H200: far longer than a launch takes on the host


def _launch_checked(launch, tag, dec=None):
    """Run launch() behind a long spinning kernel, under torch's sync debug mode (an
    implicit synchronisation torch knows of raises), then check the spinning kernel is
    still running: a launch that waited for the device by any means (a pageable copy
    torch does not report included) finds it done. -> (launch()'s result, checked): a
    launch that captured a new graph of dec (a new key: capturing synchronises, once per
    key) is not checked."""
    captures = dec.step_graphs.captures if dec is not None else None
    torch.cuda._sleep(SLEEP_CYCLES)
    marker = torch.cuda.Event()
    marker.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = launch()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if dec is not None and dec.step_graphs.captures != captures:
        return out, False
    assert not marker.query(), f"{tag}: the launch waited for the GPU"
    return out, True


@pytest.mark.parametrize("k,sampled", [(0, False), (2, False), (0, True), (2, True)],
                         ids=["plain", "spec", "plain-sampled", "spec-sampled"])
def test_a_round_is_launched_without_waiting_for_the_gpu(tmp_path, k, sampled):
    """BatchRunner queues round n+1 before it reads round n: launching a round (graph
    replay, the result's copy to pinned memory, the event) must not wait for the device.
    Every launch of plain (k=0) and speculative rounds of 3 lanes, greedy and sampled,
    including a lane's last rounds, which draft fewer tokens (k_lane rewritten), runs
    through _launch_checked."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import BatchRunner, LaneRequest
    from hyspec.gpu.sampling import SampledGraphKey

    m = _model(tmp_path, "qwen3_next", torch.bfloat16)
    dec = BatchDecoder(m, 64, 2, slots=4)
    params = [_mixed_params(i) if sampled else None for i in range(3)]
    # up front (a capture itself synchronises): the regime of every set of lanes that may
    # still be going as they leave, speculative rounds without plain lanes
    subsets = [[p for j, p in enumerate(params) if mask >> j & 1] for mask in range(1, 8)]
    regimes = {SampledGraphKey.of(sub) or False for sub in subsets}
    dec.capture(dec.sizes, [k], sampled=tuple(regimes), plain=(True, False))
    torch.cuda.synchronize()
    runner = BatchRunner(dec, max_batch=4)
    launch = runner._launch
    launches = []

    def checked():
        launches.append(_launch_checked(launch, f"round {len(launches)}", dec))
        return launches[-1][0]

    runner._launch = checked
    reqs = [LaneRequest(prompt=[5 + i, 17, 99, 3], max_new_tokens=24 + 3 * i, k=k, params=params[i])
            for i in range(3)]
    for r in reqs:
        runner.submit(r)
    runner.run()
    assert sum(ok for _, ok in launches) >= 5, [ok for _, ok in launches]
    assert all(ok for _, ok in launches), "graphs captured during the run (the up-front capture missed a key)"
    assert all(len(r.tokens) == r.max_new_tokens for r in reqs)


def test_the_launch_check_catches_waiting_copies(tmp_path):
    """The check above is able to fail, on the two waits found so far: copying a
    non-contiguous column slice of the result to pinned memory (the runner's old copy: it
    goes through an unpinned temporary and blocks, unseen by sync debug mode) and writing
    a Python int into a device tensor by item assignment (the old k_lane write: a pageable
    copy, which sync debug mode reports)."""
    from hyspec.gpu.batch import BatchDecoder

    m = _model(tmp_path, "qwen3_next", torch.bfloat16)
    dec = BatchDecoder(m, 64, 2, slots=4)
    host = torch.empty(dec.slots, 2 + dec.k_max, dtype=torch.long, pin_memory=True)
    torch.cuda.synchronize()
    with pytest.raises(AssertionError, match="waited"):
        _launch_checked(lambda: host[:3, :2].copy_(dec.result[:3, :2], non_blocking=True), "column slice", dec)
    torch.cuda.synchronize()

    def item_assignment():
        dec.k_lane[1] = 2

    with pytest.raises(RuntimeError):
        _launch_checked(item_assignment, "item assignment")
    torch.cuda.synchronize()
    _launch_checked(lambda: dec.k_lane[1].fill_(2), "fill_")  # the form the runner uses passes
    torch.cuda.synchronize()


@pytest.mark.parametrize("sampled", [False, True])
def test_constrained_lanes_with_graphs(tmp_path, sampled):
    """Constrained lanes (masks in the graphs) next to unconstrained ones, bf16 with CUDA
    graphs, staggered: every sequence equals itself alone (an unconstrained lane that
    shared masked rounds keeps its unmasked tokens), greedy constrained speculative lanes
    equal constrained plain decoding, every constrained output is valid; and in fp32 a
    constrained greedy and a seeded request equal the engine core."""
    pytest.importorskip("llguidance")
    from hyspec.constraints import make_constraint
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.loading import load_model
    from hyspec.sampling import SamplingParams
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_next", tmp_path / "m", seed=3, layers=4, hidden=64, vocab_size=320, std=0.2)
    m = load_model(d, dtype=torch.bfloat16, device=torch.device("cuda"))
    cons = [make_constraint(d, "regex", r"[a-z_ ]{3,40}\.?"),
            make_constraint(d, "json_schema", {"type": "object", "properties": {"x": {"type": "string", "maxLength": 9},
                                                                                "y": {"type": "integer"}},
                                               "required": ["x", "y"], "additionalProperties": False}),
            None, make_constraint(d, "choice", ["ab cd", "xy"])]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 320, (L,), generator=g).tolist() for L in (5, 12, 3, 9, 20, 7, 4, 15)]
    N = 30
    dec = BatchDecoder(m, 20 + N + 8, 3, slots=4)

    def params(i):
        return _mixed_params(i) if sampled else None

    def reqs(arrivals=None, ks=(0, 3, 1, 2)):
        return [LaneRequest(prompt=p, max_new_tokens=N, k=ks[i % 4], params=params(i), stop_ids=frozenset({0}),
                            constraint=None if cons[i % 4] is None else cons[i % 4].clone(),
                            arrival=0 if arrivals is None else arrivals[i]) for i, p in enumerate(prompts)]

    batched = reqs([0, 0, 1, 3, 3, 5, 9, 9])
    stats = run_batch(dec, batched, max_batch=4)
    assert stats["masked_rounds"] > 0
    for i, b in enumerate(batched):
        alone = reqs()[i]
        run_batch(dec, [alone], max_batch=1)
        assert (alone.tokens, alone.reason) == (b.tokens, b.reason), i
        if cons[i % 4] is not None:
            c = cons[i % 4].clone()
            c.commit(b.tokens)  # raises on a token the constraint forbids
    assert not dec.step_graphs.failed and dec.step_graphs.graphs
    if not sampled:
        plain = reqs(ks=(0, 0, 0, 0))
        run_batch(dec, plain, max_batch=4)
        assert [(p.tokens, p.reason) for p in plain] == [(b.tokens, b.reason) for b in batched]
    # fp32: the engine core's tokens
    m32 = load_model(d, dtype=torch.float32, device=torch.device("cuda"))
    dec32 = BatchDecoder(m32, 20 + N + 8, 3, slots=2)
    sp = SamplingParams(temperature=0.9, seed=7) if sampled else SamplingParams(temperature=0.0)
    for c, k in ((cons[0], 3), (cons[1], 0)):
        sched = Scheduler(m32, max_batch=1)
        core = Request(prompt_ids=prompts[0], max_new_tokens=N, params=sp, draft=k, stop_ids=(0,), constraint=c.clone())
        sched.submit(core)
        sched.run()
        lane = LaneRequest(prompt=prompts[0], max_new_tokens=N, k=k, params=sp, stop_ids=frozenset({0}),
                           constraint=c.clone())
        run_batch(dec32, [lane])
        assert (lane.tokens, lane.reason) == (list(core.tokens), core.stop_reason), k



@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_lanes_whose_rows_overflow_end_in_error_alone(tmp_path, sampled, monkeypatch):
    """fp32 with CUDA graphs: token 100 drives layer 0's MLP past float32's range when fed
    (its row: NaN / +inf) and is chosen now and then. No lane goes on past a 100 it fed
    (before: greedy lanes took argmax's first NaN id, sampled ones drew from NaN rows, in
    silence): a lane whose round needs such a row ends in error (NonFiniteLogits) there
    while the others go on (lanes end at many lengths); bad rows past a rejected draft were
    met and changed nothing (the spy); greedy: the engine core's tokens and ends, and
    speculative decoding's tokens a prefix of plain decoding's (its failing round emits
    nothing); sampled: every lane's tokens and end in the batch are its own alone."""
    from hyspec.core.request import Request
    from hyspec.core.scheduler import Scheduler
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.loading import load_model
    from hyspec.sampling import SamplingParams
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "m", seed=3, layers=4, hidden=64, vocab_size=256, std=0.2)
    m = load_model(d, dtype=torch.float32, device=torch.device("cuda"))
    make_overflowing(m, 3.0)  # token 100 overflows when fed
    seen = spy_bad_rows(monkeypatch)  # bad rows used / past a rejected draft
    prompts = [[i, (7 * i) % 97 + 1, 3] for i in range(1, 17)]
    N = 24
    dec = BatchDecoder(m, 3 + N + 8, 3, slots=16)
    sp = [SamplingParams(temperature=0.9, seed=4 + i) if sampled else SamplingParams(temperature=0.0)
          for i in range(len(prompts))]
    out = {}
    for k in (0, 3):
        lanes = [LaneRequest(prompt=p, max_new_tokens=N, k=k, params=sp[i]) for i, p in enumerate(prompts)]
        run_batch(dec, lanes, max_batch=16)
        for lane in lanes:
            assert 100 not in lane.tokens[:-1], lane.tokens
            assert (type(lane.exception).__name__ == "NonFiniteLogits") == (lane.reason == "error"), lane.reason
            assert lane.reason == "error" or len(lane.tokens) == N
        out[k] = [(list(lane.tokens), lane.reason) for lane in lanes]
        if sampled:
            for i in (0, 5, 11):
                alone = LaneRequest(prompt=prompts[i], max_new_tokens=N, k=k, params=sp[i])
                run_batch(dec, [alone], max_batch=1)
                assert (alone.tokens, alone.reason) == out[k][i], (k, i)
        else:
            sched = Scheduler(m, max_batch=16)
            core = [Request(prompt_ids=p, max_new_tokens=N, params=sp[i], draft=k) for i, p in enumerate(prompts)]
            for r in core:
                sched.submit(r)
            sched.run()
            assert [(list(c.tokens), c.stop_reason) for c in core] == out[k], k
    errored = [t for k in out for t, reason in out[k] if reason == "error"]
    assert len({len(t) for t in errored}) > 1 and seen["used"] and seen["unused"], (out, seen)
    if not sampled:
        for (plain, r0), (spec, r3) in zip(out[0], out[3]):
            assert r3 == r0 and plain[: len(spec)] == spec and (r0 == "error" or spec == plain)
    assert dec.step_graphs.graphs and not dec.step_graphs.failed


def test_sampled_lanes_draft_nothing_from_a_drafter_of_nan(tmp_path):
    """An MTP head whose every row is NaN (a damaged checkpoint): a sampled lane drafts
    nothing (as on the engine core), each round the bonus of an empty round -- the tokens
    of the same lanes on the undamaged model whose p_min (0.999999) stops every draft.
    Before, the lanes drew drafts from the NaN rows and ran the rejection test against a
    q of NaN: tokens the target never gave."""
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "m", seed=3, layers=4, hidden=64, vocab_size=256, std=0.2)
    damaged, clean = (load_model(d, dtype=torch.float32, device=torch.device("cuda")) for _ in range(2))
    with torch.no_grad():
        damaged.mtp.fc.weight.fill_(float("nan"))  # every draft row: NaN
    prompts = [[i, (7 * i) % 97 + 1, 3] for i in range(1, 7)]
    N = 16
    out = []
    for m, p_min in ((damaged, 0.0), (clean, 0.999999)):
        dec = BatchDecoder(m, 3 + N + 8, 3, slots=8)
        lanes = [LaneRequest(prompt=p, max_new_tokens=N, k=3, params=_mixed_params(i), p_min=p_min)
                 for i, p in enumerate(prompts)]
        run_batch(dec, lanes, max_batch=8)
        assert all(lane.reason == "length" and lane.telemetry.drafted == 0 for lane in lanes), p_min
        out.append([lane.tokens for lane in lanes])
    assert out[0] == out[1]



def test_logit_bias_lanes_with_graphs(tmp_path):
    """logit_bias on the CUDA-graph lanes (bf16, graphs): biased and unbiased lanes, greedy
    and sampled, staggered in 4 lanes, each with its tokens alone; greedy speculative
    lanes equal plain decoding of the same biased request; a -100 bias bans the token the
    unbiased greedy lane emits most, a +5 one raises another."""
    from collections import Counter

    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import LaneRequest, run_batch
    from hyspec.sampling import SamplingParams

    m = _model(tmp_path, "qwen3_next", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (L,), generator=g).tolist() for L in (5, 12, 3, 9, 20, 7)]
    N = 32
    dec = BatchDecoder(m, 20 + N + 8, 3, slots=4)
    free = LaneRequest(prompt=prompts[0], max_new_tokens=N)
    run_batch(dec, [free], max_batch=1)
    ban = Counter(free.tokens).most_common(1)[0][0]
    bias = {ban: -100.0, (ban + 1) % 256: 5.0}
    params = [SamplingParams(temperature=0.0, logit_bias=bias), None, _mixed_params(2),
              SamplingParams(temperature=0.8, seed=9, logit_bias=bias), SamplingParams(temperature=0.0, logit_bias=bias),
              SamplingParams(temperature=0.9, seed=3, top_p=0.9, repetition_penalty=1.2, logit_bias=bias, mode="coupled")]

    def reqs(arrivals=None):
        return [LaneRequest(prompt=p, max_new_tokens=N, k=(3, 0, 2, 3, 0, 2)[i], params=params[i],
                            arrival=0 if arrivals is None else arrivals[i]) for i, p in enumerate(prompts)]

    batched = reqs([0, 0, 1, 1, 3, 5])
    run_batch(dec, batched, max_batch=4)
    for i, b in enumerate(batched):
        alone = reqs()[i]
        run_batch(dec, [alone], max_batch=1)
        assert alone.tokens == b.tokens, i
    for i in (0, 3, 4, 5):
        assert ban not in batched[i].tokens, i
    assert batched[0].tokens != free.tokens and (ban + 1) % 256 in batched[0].tokens
    plain = LaneRequest(prompt=prompts[0], max_new_tokens=N, params=params[0])
    run_batch(dec, [plain], max_batch=1)
    assert plain.tokens == batched[0].tokens
    assert not dec.step_graphs.failed and dec.step_graphs.graphs
