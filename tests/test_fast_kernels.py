"""Fused fast-path kernels (hyspec.kernels.fused, the SiLU*mul skinny GEMM) vs their torch
references on CPU through the Triton interpreter: small odd shapes, fp32 (the interpreter's
tl.dot mishandles bf16), and bitwise row invariance (t rows == t single-row calls)."""


import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from hyspec.kernels import fused
from hyspec.kernels.gemm import skinny_matmul


def rnd(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def close(a, b, tol=2e-5):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item() < tol


def test_rmsnorm_add_gather_row_invariant():
    T, N = 5, 37
    x, d, w = rnd(T, N), rnd(T, N, seed=1), rnd(N, scale=0.1, seed=2)
    out, res = torch.empty(T, N), torch.empty(T, N)
    fused.rmsnorm(x, w, 1e-6, out=out, delta=d, resid_out=res)
    rr, ry = fused.rmsnorm_ref(x, w, 1e-6, delta=d)
    assert torch.equal(res, rr) and close(out, ry)
    for r in range(T):
        o1 = torch.empty(1, N)
        fused.rmsnorm(x[r : r + 1], w, 1e-6, out=o1, delta=d[r : r + 1], resid_out=torch.empty(1, N))
        assert torch.equal(o1[0], out[r])
    table, ids = rnd(11, N, seed=3), torch.tensor([3, 10, 0])
    o2, r2 = torch.empty(3, N), torch.empty(3, N)
    fused.rmsnorm(table, w, 1e-6, out=o2, ids=ids, resid_out=r2)
    assert torch.equal(r2, table[ids]) and close(o2, fused.rmsnorm_ref(table, w, 1e-6, ids=ids)[1])


def test_attention_prep_and_decode_row_invariant():
    Hq, Hkv, D, rot = 4, 2, 20, 8  # D not a power of two
    L, pos, T = 90, 37, 3  # 38..40 keys: several 32-key blocks, some splits empty
    proj = rnd(T, Hq * 2 * D + 2 * Hkv * D)
    qw, kw = rnd(D, scale=0.1, seed=1), rnd(D, scale=0.1, seed=2)
    invf = fused.rope_inv_freq(rot, 1e4, "cpu")
    kc0, vc0 = rnd(Hkv, L, D, seed=3), rnd(Hkv, L, D, seed=4)
    kc, vc, kr, vr = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
    posd = torch.tensor([pos])
    q = torch.empty(T, Hq, D)
    fused.attn_prep(proj, qw, kw, invf, posd, 0, q, kc, vc, n_heads=Hq, n_kv=Hkv, head_dim=D, eps=1e-6, rows=T)
    qr = fused.attn_prep_ref(proj, qw, kw, invf, pos, kr, vr, n_heads=Hq, n_kv=Hkv, head_dim=D, eps=1e-6)
    assert close(q, qr, 1e-5) and close(kc, kr, 1e-5) and torch.equal(vc, vr)
    o = torch.empty(T, Hq * D)
    fused.attn_decode(q, kc, vc, posd, 0, proj, o, rows=T)
    gate = proj[:, : Hq * 2 * D].view(T, Hq, 2 * D)[..., D:]
    assert close(o, fused.attn_decode_ref(q, kc, vc, pos, gate), 1e-5)
    for r in range(T):
        o1 = torch.empty(1, Hq * D)
        fused.attn_decode(q[r : r + 1].contiguous(), kc, vc, posd, r, proj[r : r + 1], o1, rows=1)
        assert torch.equal(o1[0], o[r])


def test_gdn_conv_and_step_row_invariant():
    nk, nv, dk, dv, W, T = 2, 4, 12, 10, 4, 3
    C = 2 * nk * dk + nv * dv
    proj = rnd(T, C + nv * dv + 2 * nv)
    st0, wc = rnd(W - 1, C, seed=1), rnd(C, W, scale=0.5, seed=2)
    y, xin = torch.empty(T, C), torch.empty(T, C)
    fused.gdn_conv(proj, st0, wc, y, rows=T, update=False, xin=xin)
    yr, ns = fused.gdn_conv_ref(proj[:, :C], st0, wc)
    assert close(y, yr, 1e-5) and torch.equal(xin, proj[:, :C])
    st = st0.clone()
    for r in range(T):
        y1 = torch.empty(1, C)
        fused.gdn_conv(proj[r : r + 1], st, wc, y1, rows=1, update=True)
        assert torch.equal(y1[0], y[r])
    assert torch.equal(st, ns)
    A_log = torch.rand(nv, generator=torch.Generator().manual_seed(7)).mul(3).add(0.1).log()
    dtb, nw = rnd(nv, seed=3), rnd(dv, seed=4) * 0.1 + 1
    S0 = rnd(nv, dk, dv, seed=5, scale=0.1)
    o, states = torch.empty(T, nv * dv), torch.empty(T, nv, dk, dv)
    fused.gdn_step(y, proj, A_log, dtb, nw, S0, o, nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6, rows=T, states=states)
    orf, _, sts = fused.gdn_step_ref(y, proj, A_log, dtb, nw, S0, nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6,
                                     return_states=True)
    assert close(o, orf, 1e-5) and close(states, sts, 1e-5)
    S = S0.clone()
    for r in range(T):
        o1 = torch.empty(1, nv * dv)
        fused.gdn_step(y[r : r + 1], proj[r : r + 1], A_log, dtb, nw, S, o1, nk=nk, nv=nv, dk=dk, dv=dv,
                       eps=1e-6, rows=1)
        assert torch.equal(o1[0], o[r]) and torch.equal(S, states[r])
    # split-Dv variant (gated norm in its own kernel): same function, row-invariant too
    o2, st2 = torch.empty(T, nv * dv), torch.empty(T, nv, dk, dv)
    fused.gdn_step(y, proj, A_log, dtb, nw, S0, o2, nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6, rows=T, states=st2,
                   block_v=8)
    assert close(o2, orf, 1e-5) and torch.equal(st2, states)
    o3 = torch.empty(1, nv * dv)
    fused.gdn_step(y[2:3], proj[2:3], A_log, dtb, nw, states[1].clone(), o3, nk=nk, nv=nv, dk=dk, dv=dv,
                   eps=1e-6, rows=1, block_v=8)
    assert torch.equal(o3[0], o2[2])


def test_skinny_silu_mul_input_row_invariant():
    N, K = 40, 72
    w, x = rnd(N, K, scale=K ** -0.5), rnd(4, 2 * K, seed=1)
    y = skinny_matmul(x, w, act=True, split_k=2, block_k=32, block_n=16)
    xa = torch.nn.functional.silu(x[:, :K]) * x[:, K:]
    assert close(y, xa @ w.t(), 1e-5)
    for r in range(4):
        assert torch.equal(skinny_matmul(x[r : r + 1], w, act=True, split_k=2, block_k=32, block_n=16)[0], y[r])


def test_expert_gemv_matches_ref():
    E, N, K, T, k = 3, 20, 24, 2, 2
    w, x = rnd(E, N, K), rnd(T, K, seed=1)
    ids = torch.tensor([0, 2, 2, 1])
    out = torch.empty(T * k, N)
    fused.expert_gemv(x, w, ids, k, out)
    assert close(out, fused.expert_gemv_ref(x, w, ids, k), 1e-5)
    gu = rnd(T * k, 2 * K, seed=2)
    out2 = torch.empty(T * k, N)
    fused.expert_gemv(gu, w, ids, 1, out2, act=True)
    assert close(out2, fused.expert_gemv_ref(gu, w, ids, 1, act=True), 1e-5)


def test_triton_runner_interpreted_spec_equals_plain(tmp_path):
    """The GPU runner's logic (packed weights, fused kernels, the commit of the accepted
    rows' state) on CPU through the Triton interpreter, fp32, a 4-layer model, one sequence
    on the BatchDecoder (one lane, hyspec.gpu.batch_loop.decode_one): spec == plain ==
    reference, with speculative rounds that accepted drafts."""
    from hyspec.decode import generate_plain
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.batch_loop import decode_one
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    # std 0.2: the linear layers' state moves the tokens (with make_tiny's default 0.02 a
    # commit that kept the wrong row's state still gave the same tokens here)
    m = load_model(make_tiny("qwen3_next", tmp_path / "m", seed=2, layers=4, hidden=32, vocab_size=128, std=0.2))
    N = 8
    prompt = [5, 17, 99, 3, 7]
    ref = generate_plain(m, prompt, max_new_tokens=N)
    dec = BatchDecoder(m, 5 + N + 8, 2, slots=1, graphs=False)
    p = decode_one(dec, prompt, N)
    assert p.tokens == ref.tokens
    s = decode_one(dec, prompt, N, k=2, forced_rates=(0.9, 0.7), reference=p.tokens)
    assert s.tokens == p.tokens
    assert s.stats["spec"]["rounds"] > 0 and s.stats["spec"]["accepted"] > 0


def test_deferred_split_k_reduced_inside_rmsnorm():
    """skinny_matmul(defer=True) hands its fp32 split-K partials to rmsnorm, which sums them
    in the same order as the reduce kernel: bitwise the same as reduce-then-norm, any T."""
    N, K = 24, 1024
    w, wn = rnd(N, K, scale=0.05, seed=5), rnd(N, scale=0.1, seed=6)
    for T in (1, 3):
        x, res0 = rnd(T, K, seed=7), rnd(T, N, seed=8)
        ws = torch.empty(4, 16, N)
        part = skinny_matmul(x, w, split_k=4, ws=ws, defer=True)
        assert isinstance(part, fused.SplitPartials) and part.S == 4
        h = skinny_matmul(x, w, split_k=4)
        assert torch.equal(part.value(T, x.dtype), h)
        o1, r1, o2, r2 = torch.empty(T, N), torch.empty(T, N), torch.empty(T, N), torch.empty(T, N)
        fused.rmsnorm(res0, wn, 1e-6, out=o1, delta=part, resid_out=r1, rows=T)
        fused.rmsnorm(res0, wn, 1e-6, out=o2, delta=h, resid_out=r2, rows=T)
        assert torch.equal(o1, o2) and torch.equal(r1, r2)
    # one split: nothing to defer, the product comes back
    assert isinstance(skinny_matmul(rnd(1, 256), rnd(8, 256), split_k=1, defer=True), torch.Tensor)
    with pytest.raises(ValueError, match="split partials"):
        fused.rmsnorm(res0, wn, 1e-6, out=o1, delta=fused.SplitPartials(torch.empty(4, 16, N + 1), 4), rows=T)


def test_pdl_is_off_without_a_hopper_gpu():
    from hyspec.kernels import pdl

    assert pdl.launch_kwargs() == {"PDL": False}
    pdl.set_pdl(True)  # forcing cannot turn it on where it is unsupported
    try:
        assert not pdl.pdl_enabled()
    finally:
        pdl.set_pdl(None)


def test_pdl_scope_and_step_default(monkeypatch):
    """A decoder's step graphs run in its runner's PDL scope: pdl.scoped sets the choice (and
    the kernel families left out) for the block and puts the one before back (None: leaves
    it); step_default is PDL with the skinny matmuls left out unless HYSPEC_PDL says
    otherwise (dense models: the matmuls too, their dependents launched late); StepGraphs
    runs its bodies in that scope."""
    from hyspec.gpu.graphs import StepGraphs
    from hyspec.kernels import pdl

    assert pdl.current()[0] is None
    with pdl.scoped(True):
        assert pdl.current()[0] is True
        with pdl.scoped(None):
            assert pdl.current()[0] is True
        with pdl.scoped(False):
            assert pdl.current()[0] is False
        assert pdl.current()[0] is True
    assert pdl.current()[0] is None
    with pytest.raises(RuntimeError):
        with pdl.scoped(True):
            raise RuntimeError("a failing body")
    assert pdl.current()[0] is None
    # the scope is the calling thread's: another thread's launches keep their own choice
    import threading

    other = []
    with pdl.scoped(True, skip="matmul"):
        th = threading.Thread(target=lambda: other.append(pdl.current()))
        th.start()
        th.join()
    assert other == [(None, frozenset())]
    monkeypatch.delenv("HYSPEC_PDL", raising=False)
    monkeypatch.delenv("HYSPEC_PDL_SKIP", raising=False)
    assert pdl.step_default() == (True, "matmul", False)  # (an MoE / block-FP8 model)
    assert pdl.step_default(dense=True) == (True, "", True)  # the matmuls too, late trigger
    monkeypatch.setenv("HYSPEC_PDL_SKIP", "")
    assert pdl.step_default() == (True, "", False)  # the override keeps the rule's trigger
    assert pdl.step_default(dense=True) == (True, "", True)
    monkeypatch.setenv("HYSPEC_PDL_SKIP", "matmul,attention")  # a bad name: an error naming it
    with pytest.raises(ValueError, match="HYSPEC_PDL_SKIP: unknown kernel families \\['attention'\\]"):
        pdl.step_default()
    monkeypatch.setenv("HYSPEC_PDL_SKIP", "")
    for env in ("0", "1"):  # an explicit HYSPEC_PDL hands the choice to the process-wide setting
        monkeypatch.setenv("HYSPEC_PDL", env)
        assert pdl.step_default() == pdl.step_default(dense=True) == (None, "", False)
    # the matmuls' trigger is the scope's too (and the thread's)
    with pdl.scoped(True, late=True):
        assert pdl.matmul_late() is True
    assert pdl.matmul_late() is False
    # a family left out: its launches say PDL=False while the others' follow the flag
    # (here unsupported, so all are off; the skip set itself is what the scope sets)
    with pdl.scoped(True, skip="matmul,moe_gemm"):
        assert pdl.current()[1] == {"matmul", "moe_gemm"} and pdl.launch_kwargs("matmul") == {"PDL": False}
        with pdl.scoped(None):
            assert pdl.current()[1] == {"matmul", "moe_gemm"}
    assert pdl.current()[1] == frozenset()
    monkeypatch.delenv("HYSPEC_PDL")
    monkeypatch.setattr(pdl, "_supported", lambda: True)  # as on a Hopper GPU
    with pdl.scoped(True, skip="matmul"):
        on = {"PDL": True, "launch_pdl": True}
        assert pdl.launch_kwargs() == on and pdl.launch_kwargs("moe_gemm") == on
        assert pdl.launch_kwargs("matmul") == {"PDL": False}
    # the matmuls' trigger reaches their launches (LATE) and no other family's
    with pdl.scoped(True, late=True):
        assert pdl.launch_kwargs("matmul") == {**on, "LATE": True}
        assert pdl.launch_kwargs() == on == pdl.launch_kwargs("moe_gemm")
    with pdl.scoped(True):
        assert pdl.launch_kwargs("matmul") == {**on, "LATE": False}
    assert pdl.launch_kwargs("matmul") == {"PDL": False} == pdl.launch_kwargs()  # off by default
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unknown kernel families"):
        with pdl.scoped(True, skip="matmull"):
            pass
    seen = []
    for choice in ((True, ""), (False, ""), (None, ""), (True, "moe_gemm")):
        graphs = StepGraphs(False, torch.device("cpu"), list, pdl=lambda c=choice: c)
        graphs.run(("decode", 1), lambda: seen.append((pdl.current()[0], set(pdl.current()[1]))))
    assert seen == [(True, set()), (False, set()), (None, set()), (True, {"moe_gemm"})]
    assert pdl.current() == (None, frozenset())


def test_gdn_replay_equals_recorded_states():
    from gdn_replay_check import check_replay_equals_recorded_states

    check_replay_equals_recorded_states()
    check_replay_equals_recorded_states(block_v=8)
