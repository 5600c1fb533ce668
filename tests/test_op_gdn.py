"""hyspec.kernels.gdn over a grid of odd head shapes (Triton interpreter on CPU): the
causal conv (verify: save the new rows; decode: advance the window) and the fused step
(whole-head and split-Dv programs) vs the torch references, and bitwise row invariance
(a t-row call == t one-row calls, states included).  fp32 only (see test_kernels_triton)."""
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from kernel_grid import assert_rel, rnd  # noqa: E402

from hyspec.kernels.gdn import gdn_conv, gdn_conv_ref, gdn_step, gdn_step_ref  # noqa: E402

# (nk, nv, dk, dv, W, T): key / value heads and dims, conv width, rows
CASES = [
    (1, 1, 4, 4, 2, 1),
    (1, 3, 6, 5, 3, 2),  # three value heads per key head, odd dims
    (2, 4, 12, 10, 4, 3),  # T < W - 1: the window's older rows still feed the last row
    (2, 2, 9, 17, 4, 5),  # T > W - 1; Dv past a power of two (block_v 8: three programs)
    (2, 4, 8, 16, 4, 3),  # tiles that cover Dk and Dv exactly: the state without masks
]


@pytest.mark.parametrize("nk,nv,dk,dv,W,T", CASES)
def test_gdn_conv_grid(nk, nv, dk, dv, W, T):
    C = 2 * nk * dk + nv * dv
    x = rnd(T, C + 3, seed=1)  # extra columns: only the first C are read
    st0, wc = rnd(W - 1, C, seed=2), rnd(C, W, seed=3, scale=0.5)
    y, xin = torch.empty(T, C), torch.empty(T, C)
    gdn_conv(x, st0, wc, y, rows=T, update=False, xin=xin)
    yr, new_state = gdn_conv_ref(x[:, :C], st0, wc)
    assert_rel("conv", y, yr, 1e-6)
    assert torch.equal(xin, x[:, :C])
    st = st0.clone()
    for r in range(T):
        y1 = torch.empty(1, C)
        gdn_conv(x[r: r + 1], st, wc, y1, rows=1, update=True)
        assert torch.equal(y1[0], y[r]), r
    assert torch.equal(st, new_state)


def _step_inputs(nk, nv, dk, dv, T, seed):
    """A step's inputs: conv output y, projections, A_log, dt_bias, norm weight, fp32 state."""
    C = 2 * nk * dk + nv * dv
    y = rnd(T, C, seed=seed + 1)
    proj = rnd(T, C + nv * dv + 2 * nv, seed=seed + 2)
    A_log = torch.rand(nv, generator=torch.Generator().manual_seed(seed + 3)).mul(3).add(0.1).log()
    dtb, nw = rnd(nv, seed=seed + 4), rnd(dv, seed=seed + 5, scale=0.1) + 1
    return y, proj, A_log, dtb, nw, rnd(nv, dk, dv, seed=seed + 6, scale=0.1)


@pytest.mark.parametrize("one_reduction", [True, False], ids=["one_red", "ref_order"])
@pytest.mark.parametrize("block_v", [None, 8], ids=["whole_head", "split_dv"])
@pytest.mark.parametrize("nk,nv,dk,dv,W,T", CASES)
def test_gdn_step_grid(nk, nv, dk, dv, W, T, block_v, one_reduction, monkeypatch):
    """Both row forms of the step kernel (one state reduction per row, the default; the
    reference's order, kept for the ablation) against the torch reference."""
    from hyspec.kernels.gdn import kernel as gk

    monkeypatch.setitem(gk.STEP_LAUNCH, "one_reduction", one_reduction)
    y, proj, A_log, dtb, nw, S0 = _step_inputs(nk, nv, dk, dv, T, seed=0)
    kw = dict(nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6)
    o, states = torch.empty(T, nv * dv), torch.empty(T, nv, dk, dv)
    gdn_step(y, proj, A_log, dtb, nw, S0, o, rows=T, states=states, block_v=block_v, **kw)
    o_ref, S_ref, states_ref = gdn_step_ref(y, proj, A_log, dtb, nw, S0, return_states=True, **kw)
    assert_rel("output", o, o_ref, 1e-5)
    assert_rel("states", states, states_ref, 1e-5)
    S = S0.clone()
    for r in range(T):  # decode steps: the state in place
        o1 = torch.empty(1, nv * dv)
        gdn_step(y[r: r + 1], proj[r: r + 1], A_log, dtb, nw, S, o1, rows=1, block_v=block_v, **kw)
        assert torch.equal(o1[0], o[r]) and torch.equal(S, states[r]), r
        nvb = -(-dv // block_v) if block_v else 1
        for nbp in [d for d in range(2, nvb + 1) if nvb % d == 0]:  # several Dv blocks per program: same bits
            Sb, ob = (states[r - 1] if r else S0).clone(), torch.empty(1, nv * dv)
            gdn_step(y[r: r + 1], proj[r: r + 1], A_log, dtb, nw, Sb, ob, rows=1, block_v=block_v,
                     blocks_per_program=nbp, **kw)
            assert torch.equal(ob[0], o[r]) and torch.equal(Sb, states[r]), (r, nbp)
    assert_rel("final state", S, S_ref, 1e-5)
    keep = S0.clone()  # keep_state: output only, the state untouched
    o2 = torch.empty(T, nv * dv)
    gdn_step(y, proj, A_log, dtb, nw, keep, o2, rows=T, keep_state=True, block_v=block_v, **kw)
    assert torch.equal(o2, o) and torch.equal(keep, S0)


def test_blocks_per_program_must_divide_the_blocks():
    """Blocks per program that do not divide a head's Dv blocks are refused (every program's
    blocks stay inside the head, so decode, verify and replay compile the same masking)."""
    nk, nv, dk, dv = 1, 1, 4, 17  # block_v 8: three blocks
    C = 2 * nk * dk + nv * dv
    y, proj = rnd(1, C, seed=1), rnd(1, C + nv * dv + 2 * nv, seed=2)
    S, o = rnd(nv, dk, dv, seed=3), torch.empty(1, nv * dv)
    with pytest.raises(ValueError, match="must divide the head's 3 Dv blocks"):
        gdn_step(y, proj, torch.zeros(nv), torch.zeros(nv), torch.ones(dv), S, o, rows=1, block_v=8,
                 blocks_per_program=2, nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6)



@pytest.mark.parametrize("one_reduction", [True, False], ids=["one_red", "ref_order"])
@pytest.mark.parametrize("block_v", [None, 8], ids=["whole_head", "split_dv"])
@pytest.mark.parametrize("nk,nv,dk,dv,W,T", [CASES[3], CASES[4]])
def test_gdn_step_bf16_state(nk, nv, dk, dv, W, T, block_v, one_reduction, monkeypatch):
    """A bf16-stored state (the `ssm_dtype` option): computed in fp32 and rounded to bf16
    after every row, so a T-row verify's per-row states, T decode steps writing the state
    back, and the torch reference (the same rounding) agree: kernel forms bitwise, the
    reference within bf16's rounding.  A verify that kept the state in fp32 across its rows
    (no per-row rounding) would differ from the decode steps here."""
    from hyspec.kernels.gdn import kernel as gk

    monkeypatch.setitem(gk.STEP_LAUNCH, "one_reduction", one_reduction)
    y, proj, A_log, dtb, nw, S0 = _step_inputs(nk, nv, dk, dv, T, seed=10)
    S0 = S0.bfloat16()
    kw = dict(nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6)
    o, states = torch.empty(T, nv * dv), torch.empty(T, nv, dk, dv, dtype=torch.bfloat16)
    gdn_step(y, proj, A_log, dtb, nw, S0, o, rows=T, states=states, block_v=block_v, **kw)
    o_ref, S_ref, states_ref = gdn_step_ref(y, proj, A_log, dtb, nw, S0, return_states=True, **kw)
    assert S_ref.dtype == states_ref.dtype == torch.bfloat16
    assert_rel("output", o, o_ref, 2e-2)
    assert_rel("states", states.float(), states_ref.float(), 2e-2)
    S = S0.clone()
    for r in range(T):  # decode steps: the bf16 state written back after each row
        o1 = torch.empty(1, nv * dv)
        gdn_step(y[r: r + 1], proj[r: r + 1], A_log, dtb, nw, S, o1, rows=1, block_v=block_v, **kw)
        assert torch.equal(o1[0], o[r]) and torch.equal(S, states[r]), r
    keep = S0.clone()
    o2 = torch.empty(T, nv * dv)
    gdn_step(y, proj, A_log, dtb, nw, keep, o2, rows=T, keep_state=True, block_v=block_v, **kw)
    assert torch.equal(o2, o) and torch.equal(keep, S0)
