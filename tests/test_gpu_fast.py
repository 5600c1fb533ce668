"""GPU fast path on CUDA: fused kernels vs their torch references (bf16 and fp32) with
bitwise row invariance, and one sequence on the BatchDecoder (one lane, CUDA graphs):
greedy exactness (speculative == plain, bitwise) and the Triton runner's log-probs vs the
reference model. Skipped without CUDA. HYSPEC_B2_EXACT="tokens,prompts" sizes the b2
exactness test (default 2000,4; it is also part of `hyspec bench`)."""
import os

import functools

import kernel_grid
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from hyspec.kernels import fused  # noqa: E402
from hyspec.kernels.gemm import skinny_matmul  # noqa: E402

DEV = torch.device("cuda")
TOL = kernel_grid.GPU_TOL


rnd = functools.partial(kernel_grid.rnd, device=DEV)  # seeded inputs drawn on the GPU
rel = kernel_grid.rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm(dtype):
    T, N = 7, 1000
    x, d, w = rnd(T, N, dtype=dtype), rnd(T, N, dtype=dtype, seed=1), rnd(N, dtype=dtype, scale=0.1, seed=2)
    out, res = torch.empty_like(x), torch.empty_like(x)
    fused.rmsnorm(x, w, 1e-6, out=out, delta=d, resid_out=res)
    rr, ry = fused.rmsnorm_ref(x, w, 1e-6, delta=d)
    assert torch.equal(res, rr) and rel(out, ry) < TOL[dtype]
    for r in range(T):
        o1, r1 = torch.empty_like(x[:1]), torch.empty_like(x[:1])
        fused.rmsnorm(x[r : r + 1], w, 1e-6, out=o1, delta=d[r : r + 1], resid_out=r1)
        assert torch.equal(o1[0], out[r])
    table, ids = rnd(50, N, dtype=dtype, seed=3), torch.tensor([3, 49, 0, 7], device=DEV)
    o2, r2 = torch.empty(4, N, device=DEV, dtype=dtype), torch.empty(4, N, device=DEV, dtype=dtype)
    fused.rmsnorm(table, w, 1e-6, out=o2, ids=ids, resid_out=r2)
    assert torch.equal(r2, table[ids]) and rel(o2, fused.rmsnorm_ref(table, w, 1e-6, ids=ids)[1]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 2, 64, 16), (16, 2, 256, 64)])
def test_attention_prep_and_decode(dtype, shape):
    Hq, Hkv, D, rot = shape
    L, pos, T = 300, 97, 5
    proj = rnd(T, Hq * 2 * D + 2 * Hkv * D, dtype=dtype)
    qw, kw = rnd(D, dtype=dtype, scale=0.1, seed=1), rnd(D, dtype=dtype, scale=0.1, seed=2)
    invf = fused.rope_inv_freq(rot, 1e6, DEV)
    kc0, vc0 = rnd(Hkv, L, D, dtype=dtype, seed=3), rnd(Hkv, L, D, dtype=dtype, seed=4)
    kc, vc, kr, vr = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
    posd = torch.tensor([pos], device=DEV)
    q = torch.empty(T, Hq, D, device=DEV, dtype=dtype)
    fused.attn_prep(proj, qw, kw, invf, posd, 0, q, kc, vc, n_heads=Hq, n_kv=Hkv, head_dim=D, eps=1e-6, rows=T)
    qr = fused.attn_prep_ref(proj, qw, kw, invf, pos, kr, vr, n_heads=Hq, n_kv=Hkv, head_dim=D, eps=1e-6)
    assert rel(q, qr) < TOL[dtype] * 2 and rel(kc, kr) < TOL[dtype] and torch.equal(vc, vr)
    o = torch.empty(T, Hq * D, device=DEV, dtype=dtype)
    fused.attn_decode(q, kc, vc, posd, 0, proj, o, rows=T)
    gate = proj[:, : Hq * 2 * D].view(T, Hq, 2 * D)[..., D:]
    assert rel(o, fused.attn_decode_ref(q, kc, vc, pos, gate)) < TOL[dtype] * 2
    for r in range(T):  # row r alone, at its own position, gives the same bits
        o1 = torch.empty(1, Hq * D, device=DEV, dtype=dtype)
        fused.attn_decode(q[r : r + 1].contiguous(), kc, vc, posd + r, 0, proj[r : r + 1], o1, rows=1)
        assert torch.equal(o1[0], o[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 2, 64), (16, 2, 256), (6, 2, 128)])
def test_grouped_attention(dtype, shape):
    from hyspec.kernels.attn import attn_decode_grouped

    Hq, Hkv, D = shape
    L, pos, T = 900, 611, 5
    proj = rnd(T, Hq * 2 * D + 2 * Hkv * D, dtype=dtype)
    q = rnd(T, Hq, D, dtype=dtype, seed=1)
    kc, vc = rnd(Hkv, L, D, dtype=dtype, seed=3), rnd(Hkv, L, D, dtype=dtype, seed=4)
    posd = torch.tensor([pos], device=DEV)
    o = torch.empty(T, Hq * D, device=DEV, dtype=dtype)
    attn_decode_grouped(q, kc, vc, posd, 0, proj, o, rows=T)
    gate = proj[:, : Hq * 2 * D].view(T, Hq, 2 * D)[..., D:]
    assert rel(o, fused.attn_decode_ref(q, kc, vc, pos, gate)) < TOL[dtype] * 2
    for r in range(T):
        o1 = torch.empty(1, Hq * D, device=DEV, dtype=dtype)
        attn_decode_grouped(q[r : r + 1].contiguous(), kc, vc, posd + r, 0, proj[r : r + 1], o1, rows=1)
        assert torch.equal(o1[0], o[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_partials_into_rmsnorm(dtype):
    N, K = 2048, 4096
    w, wn = rnd(N, K, dtype=dtype, scale=0.02, seed=5), rnd(N, dtype=dtype, scale=0.1, seed=6)
    for T in (1, 4):
        x, res0 = rnd(T, K, dtype=dtype, seed=7), rnd(T, N, dtype=dtype, seed=8)
        part = skinny_matmul(x, w, split_k=4, ws=torch.empty(4, 16, N, device=DEV), defer=True)
        h = skinny_matmul(x, w, split_k=4)
        o1, r1, o2, r2 = (torch.empty(T, N, device=DEV, dtype=dtype) for _ in range(4))
        fused.rmsnorm(res0, wn, 1e-6, out=o1, delta=part, resid_out=r1, rows=T)
        fused.rmsnorm(res0, wn, 1e-6, out=o2, delta=h, resid_out=r2, rows=T)
        assert torch.equal(o1, o2) and torch.equal(r1, r2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_conv_and_step(dtype):
    nk, nv, dk, dv, W, T = 2, 4, 32, 24, 4, 5
    C = 2 * nk * dk + nv * dv
    proj = rnd(T, C + nv * dv + 2 * nv, dtype=dtype)
    st0 = rnd(W - 1, C, dtype=dtype, seed=1)
    wc = rnd(C, W, dtype=dtype, scale=0.5, seed=2)
    y = torch.empty(T, C, device=DEV, dtype=dtype)
    xin = torch.empty(T, C, device=DEV, dtype=dtype)
    fused.gdn_conv(proj, st0, wc, y, rows=T, update=False, xin=xin)
    yr, ns = fused.gdn_conv_ref(proj[:, :C], st0, wc)
    assert rel(y, yr) < TOL[dtype] and torch.equal(xin, proj[:, :C])
    st = st0.clone()  # decode-style: one row at a time, window updated in place
    for r in range(T):
        y1 = torch.empty(1, C, device=DEV, dtype=dtype)
        fused.gdn_conv(proj[r : r + 1], st, wc, y1, rows=1, update=True)
        assert torch.equal(y1[0], y[r])
    assert torch.equal(st, ns)
    A_log = torch.rand(nv, device=DEV).mul(3).add(0.1).log()
    dtb, nw = rnd(nv, seed=3), rnd(dv, dtype=dtype, seed=4) * 0.1 + 1
    S0 = rnd(nv, dk, dv, seed=5, scale=0.1)
    o = torch.empty(T, nv * dv, device=DEV, dtype=dtype)
    states = torch.empty(T, nv, dk, dv, device=DEV)
    fused.gdn_step(y, proj, A_log, dtb, nw, S0, o, nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6, rows=T, states=states)
    orf, sf, sts = fused.gdn_step_ref(y, proj, A_log, dtb, nw, S0, nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6,
                                      return_states=True)
    assert rel(o, orf) < TOL[dtype] * 2 and rel(states, sts) < 1e-5
    S = S0.clone()
    for r in range(T):
        o1 = torch.empty(1, nv * dv, device=DEV, dtype=dtype)
        fused.gdn_step(y[r : r + 1], proj[r : r + 1], A_log, dtb, nw, S, o1, nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6,
                       rows=1)
        assert torch.equal(o1[0], o[r]) and torch.equal(S, states[r])
    # Dv split over programs + separate gated norm (the b2 default): close to the reference
    # (another tiling may round the k.S sums differently) and row-invariant for its own tiling
    o2, st2 = torch.empty_like(o), torch.empty_like(states)
    fused.gdn_step(y, proj, A_log, dtb, nw, S0, o2, nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6, rows=T, states=st2,
                   block_v=8)
    assert rel(st2, sts) < 1e-5 and rel(o2, orf) < TOL[dtype] * 2
    S = S0.clone()
    for r in range(T):
        o3 = torch.empty(1, nv * dv, device=DEV, dtype=dtype)
        fused.gdn_step(y[r : r + 1], proj[r : r + 1], A_log, dtb, nw, S, o3, nk=nk, nv=nv, dk=dk, dv=dv,
                       eps=1e-6, rows=1, block_v=8)
        assert torch.equal(o3[0], o2[r]) and torch.equal(S, st2[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_v", [None, 32])
def test_gdn_replay_commit(dtype, block_v):
    from gdn_replay_check import check_replay_equals_recorded_states

    check_replay_equals_recorded_states("cuda", dtype, block_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_act_and_rows(dtype):
    N, K = 96, 200
    w = rnd(N, K, dtype=dtype, scale=K ** -0.5)
    x = rnd(9, 2 * K, dtype=dtype)
    y = skinny_matmul(x, w, act=True)
    xa = torch.nn.functional.silu(x[:, :K]) * x[:, K:]
    assert rel(y, xa.float() @ w.float().t()) < TOL[dtype]
    for r in range(9):
        assert torch.equal(skinny_matmul(x[r : r + 1], w, act=True)[0], y[r])


def test_expert_gemv():
    E, N, K, T, k = 4, 40, 24, 3, 2
    w = rnd(E, N, K)
    x = rnd(T, K, seed=1)
    ids = torch.tensor([0, 3, 2, 2, 1, 0], device=DEV)
    out = torch.empty(T * k, N, device=DEV)
    fused.expert_gemv(x, w, ids, k, out)
    assert rel(out, fused.expert_gemv_ref(x, w, ids, k)) < 1e-5


# ------------------------------------------------------------------------- the decoder
def _tiny(arch, dtype, tmp_path):
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    return load_model(make_tiny(arch, tmp_path / arch, seed=3), dtype=dtype, device="cuda")


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_lane_spec_equals_plain(arch, dtype, tmp_path, monkeypatch):
    """One sequence alone on the BatchDecoder (decode_one: one lane, CUDA graphs): greedy
    speculative decoding (K 1 and 3, the forced and the MTP drafter) == plain, bitwise;
    plain vs the reference loop (fp32: the first 16 tokens agree); programmatic dependent
    launch gives the same bits; the non-exact (cuBLAS) variant runs."""
    from hyspec.decode import generate_plain
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import decode_one

    m = _tiny(arch, dtype, tmp_path)
    prompt = list(range(3, 40, 3))
    N = 64
    monkeypatch.delenv("HYSPEC_PDL", raising=False)  # the shipped PDL choice as the reference arm
    monkeypatch.delenv("HYSPEC_PDL_SKIP", raising=False)
    dec = BatchDecoder(m, len(prompt) + N + 8, 3, slots=1)
    dense = dec.runner.moe_buf is None  # (step_default: the matmuls under PDL, late trigger, on dense models;
    # the tiny qwen3_next and qwen3_5_moe models have MoE layers)
    assert dense == (arch == "qwen3_5")
    assert (dec.runner.pdl, dec.runner.pdl_skip, dec.runner.pdl_late) == (True, "" if dense else "matmul", dense)
    p = decode_one(dec, prompt, N)
    assert p.stats["graphs"], "CUDA graphs fell back to eager"
    ref = generate_plain(m, prompt, max_new_tokens=N)
    agree = next((i for i, (a, b) in enumerate(zip(p.tokens, ref.tokens)) if a != b), N)
    print(f"{arch} {dtype}: fast plain agrees with the reference loop for {agree}/{N} tokens")
    if dtype == torch.float32:
        assert agree >= 16
    for K in (1, 3):
        for rates in ((0.9, 0.8, 0.7, 0.6), None):
            s = decode_one(dec, prompt, N, k=K, forced_rates=rates, reference=p.tokens)
            assert s.tokens == p.tokens, (arch, dtype, K, rates)
    # programmatic dependent launch (the step graphs': hyspec.kernels.pdl.step_default) only
    # moves the schedule: the same bits without it, with it on every kernel (the matmuls'
    # dependents launched at their start or after their K loop) and with the matmuls left out
    for flag, skip, late in ((False, "", False), (True, "", False), (True, "", True), (True, "matmul", True)):
        dec0 = BatchDecoder(m, len(prompt) + N + 8, 3, slots=1)
        dec0.runner.pdl, dec0.runner.pdl_skip, dec0.runner.pdl_late = flag, skip, late
        p0 = decode_one(dec0, prompt, N)
        s0 = decode_one(dec0, prompt, N, k=3)
        assert p0.tokens == p.tokens and s0.tokens == p.tokens, (flag, skip, late)
    # the non-exact (cuBLAS) variant runs too
    dec2 = BatchDecoder(m, len(prompt) + N + 8, 3, slots=1, exact=False)
    decode_one(dec2, prompt, N)


def test_b2_exactness_bf16():
    """hyspec bench's exactness check on the b2 bench model (bf16, random weights): one
    sequence alone on the BatchDecoder (decode_one: one lane, CUDA graphs), speculative
    (K=3, the forced and the MTP drafter) == plain, bitwise, for each prompt."""
    from hyspec.bench import B2, build_config_model
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import decode_one

    n_tok, n_prompts = (int(v) for v in os.environ.get("HYSPEC_B2_EXACT", "2000,4").split(","))
    m = build_config_model(B2, DEV, torch.bfloat16)
    dec = BatchDecoder(m, 512 + n_tok + 8, 3, slots=1)
    for i in range(n_prompts):
        prompt = torch.randint(0, m.cfg.vocab_size, (512,), generator=torch.Generator().manual_seed(1000 + i)).tolist()
        p = decode_one(dec, prompt, n_tok)
        for rates in ((0.9, 0.8, 0.7, 0.6), None):
            s = decode_one(dec, prompt, n_tok, k=3, forced_rates=rates, reference=p.tokens)
            assert s.tokens == p.tokens, (i, rates)


# logit level: the runner (CUDA graphs off, so every call is inspectable) vs the reference model
LOGIT_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.05}  # max |log p| difference over the vocabulary
LOGIT_PROMPT, LOGIT_VERIFY = list(range(3, 60, 5)), [11, 23, 4, 60]


def _reference_logprobs(m):
    from hyspec.model.ops import StepCtx

    cache = m.new_cache(96)
    _, post = m.forward_states(torch.tensor(LOGIT_PROMPT, device=DEV), cache, StepCtx(start=0, chunked=True))
    pre = torch.log_softmax(m.logits(post[-1:]).double(), -1)
    _, vpost = m.forward_states(torch.tensor(LOGIT_VERIFY, device=DEV), cache,
                                StepCtx(start=len(LOGIT_PROMPT), exact=True))
    return pre, torch.log_softmax(m.logits(vpost).double(), -1)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_logits_match_the_reference(arch, dtype, tmp_path):
    """A decode step and every verify row of the Triton runner (a one-lane BatchDecoder's,
    lane 0) vs the reference model (hyspec/model, exact mode) on the device, from the same
    prefilled state (the decoder's torch prefill, which is the reference's own)."""
    from hyspec.gpu.batch import BatchDecoder

    m = _tiny(arch, dtype, tmp_path)
    _, ref = _reference_logprobs(m)
    dec = BatchDecoder(m, 96, 3, slots=1, graphs=False, use_fla=False)
    worst = {}
    for t in (1, len(LOGIT_VERIFY)):
        dec.prefill(0, LOGIT_PROMPT)
        _, p = dec.runner.target(torch.tensor(LOGIT_VERIFY[:t], device=DEV), t, dec.pos, t > 1, 1)
        got = torch.log_softmax(dec.runner.logits(p).double(), -1)
        worst[f"t={t}"] = float((got - ref[:t]).abs().max())
    print(f"runner {arch} {dtype}: max |dlogp| {worst}")
    assert all(v <= LOGIT_ATOL[dtype] for v in worst.values()), worst


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_prefill_logits_match_the_reference(arch, dtype, tmp_path):
    """The BatchDecoder's prefill (lane 0) through flash-linear-attention's chunked kernel
    vs the reference model's torch chunked form: last-row log-probs."""
    pytest.importorskip("fla")
    from hyspec.gpu.batch import BatchDecoder

    m = _tiny(arch, dtype, tmp_path)
    ref, _ = _reference_logprobs(m)
    dec = BatchDecoder(m, 96, 3, slots=1, graphs=False, use_fla=True)
    _, _, logits = dec.prefill(0, LOGIT_PROMPT)
    assert dec.use_fla  # (a failing fla call turns it off for the decoder: hyspec.gpu.prefill.fla_off)
    worst = float((torch.log_softmax(logits.double(), -1) - ref).abs().max())
    print(f"fla prefill {arch} {dtype}: max |dlogp| {worst}")
    if dtype == torch.float32 and worst > LOGIT_ATOL[dtype]:
        pytest.xfail(f"fla's chunked kernel in fp32 is {worst:.1e} from the reference (> {LOGIT_ATOL[dtype]}); "
                     "2026-12-01 H200 run: 2e-4..4e-4 (its fp32 dots are not IEEE)")
    assert worst <= LOGIT_ATOL[dtype], worst


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_core_batch_invariance_on_cuda(dtype, tmp_path):
    """The engine core on CUDA tensors (reference backend: row-invariant Triton matmuls, 16
    rows at a time): each sequence's tokens alone == in a batch of 6 (more than 16 verify
    rows), greedy and seeded sampling, K 0..3."""
    from hyspec.core import Request, Scheduler
    from hyspec.sampling import SamplingParams

    m = _tiny("qwen3_5_moe", dtype, tmp_path)
    mix = [(0, SamplingParams(temperature=0.0)), (3, SamplingParams(temperature=0.0)),
           (2, SamplingParams(temperature=0.9, seed=4)), (3, SamplingParams(temperature=1.0, seed=1, mode="coupled")),
           (1, SamplingParams(temperature=0.7, top_p=0.9, seed=2)), (3, SamplingParams(temperature=0.0))]
    prompts = [list(range(3 + i, 40 + 2 * i, 3)) for i in range(len(mix))]

    def reqs():
        return [Request(prompt_ids=p, max_new_tokens=24, draft=k, params=sp) for p, (k, sp) in zip(prompts, mix)]

    alone = []
    for r in reqs():
        s = Scheduler(m, max_batch=1)
        s.submit(r)
        s.run()
        alone.append(r.tokens)
    batch = reqs()
    s = Scheduler(m, max_batch=6)
    for r in batch:
        s.submit(r)
    s.run()
    assert [r.tokens for r in batch] == alone
