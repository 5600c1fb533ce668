"""Kernel settings that move loads or add cache hints and must change no value, each
against the other setting, bitwise: RMSNorm's weight loaded before or after the row's
reduction (``w_first``), the Gated-DeltaNet step's state with or without its cache hints
(``STEP_LAUNCH["stream"]``).  In the Triton interpreter (CPU) load order and cache hints
do not exist, so there these only run both code paths; compiled on CUDA
(``bench/gpu_tests.sh``) they compare the two binaries.  Each default is also checked
against its torch reference (tests/test_op_rmsnorm.py, tests/test_op_gdn.py)."""
from __future__ import annotations

import pytest
import torch

from hyspec.kernels.common import SplitPartials, triton_available
from kernel_grid import kernel_device, rnd

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rmsnorm_weight_first_changes_no_value(dtype):
    from hyspec.kernels.pdl import interpreting
    from hyspec.kernels.rmsnorm import rmsnorm

    if dtype == torch.bfloat16 and interpreting():
        pytest.skip("the interpreter is tested in fp32 (tests/test_op_rmsnorm.py)")
    dev = kernel_device()
    T, N = 5, 2048
    x, w = rnd(T, N, seed=2, device=dev).to(dtype), rnd(N, seed=1, scale=0.1, device=dev).to(dtype)
    delta = SplitPartials(rnd(4, T, N, seed=3, device=dev), 4)  # a split-K matmul's partials, as in the runner
    got = {}
    for w_first in (True, False):
        out, res = torch.empty(T, N, device=dev, dtype=dtype), torch.empty(T, N, device=dev, dtype=dtype)
        rmsnorm(x, w, 1e-6, out=out, resid_out=res, delta=delta, w_first=w_first)
        got[w_first] = (out, res)
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])


@pytest.mark.parametrize("block_v", [None, 8], ids=["whole_head", "split_dv"])
def test_gdn_step_stream_hints_change_no_value(block_v, monkeypatch):
    from hyspec.kernels.gdn import gdn_step
    from hyspec.kernels.gdn import kernel as gk

    dev = kernel_device()
    nk, nv, dk, dv, T = 2, 4, 8, 16, 3  # exact tiles: the hinted branch
    C = 2 * nk * dk + nv * dv
    y, proj = rnd(T, C, seed=1, device=dev), rnd(T, C + nv * dv + 2 * nv, seed=2, device=dev)
    A_log = torch.rand(nv, generator=torch.Generator().manual_seed(3)).mul(3).add(0.1).log().to(dev)
    dtb, nw = rnd(nv, seed=4, device=dev), rnd(dv, seed=5, scale=0.1, device=dev) + 1
    S0 = rnd(nv, dk, dv, seed=6, scale=0.1, device=dev)
    got = {}
    for stream in (False, True):
        monkeypatch.setitem(gk.STEP_LAUNCH, "stream", stream)
        S, o = S0.clone(), torch.empty(T, nv * dv, device=dev)
        gdn_step(y, proj, A_log, dtb, nw, S, o, rows=T, block_v=block_v, nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6)
        got[stream] = (S, o)
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])


@pytest.mark.parametrize("dims", [(2, 4, 8, 16), (1, 3, 6, 10)], ids=["exact_tiles", "masked_tiles"])
@pytest.mark.parametrize("block_v", [None, 8], ids=["whole_head", "split_dv"])
def test_gdn_step_grid_order_and_prefetch_change_no_value(dims, block_v, monkeypatch):
    """STEP_LAUNCH's pv_first (the grid's axes swapped) and prefetch (the next row's vectors
    loaded during this row) against the other setting, bitwise: a verify's output and
    per-row states and a decode step's state in place.  The defaults are checked against
    the reference (tests/test_op_gdn.py); these are the ablation knobs' own code paths."""
    from hyspec.kernels.gdn import gdn_step
    from hyspec.kernels.gdn import kernel as gk

    dev = kernel_device()
    nk, nv, dk, dv = dims
    T = 3
    C = 2 * nk * dk + nv * dv
    y, proj = rnd(T, C, seed=1, device=dev), rnd(T, C + nv * dv + 2 * nv, seed=2, device=dev)
    A_log = torch.rand(nv, generator=torch.Generator().manual_seed(3)).mul(3).add(0.1).log().to(dev)
    dtb, nw = rnd(nv, seed=4, device=dev), rnd(dv, seed=5, scale=0.1, device=dev) + 1
    S0 = rnd(nv, dk, dv, seed=6, scale=0.1, device=dev)
    kw = dict(block_v=block_v, nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6)
    got = {}
    for pv_first, prefetch in ((True, True), (False, True), (True, False), (False, False)):
        monkeypatch.setitem(gk.STEP_LAUNCH, "pv_first", pv_first)
        monkeypatch.setitem(gk.STEP_LAUNCH, "prefetch", prefetch)
        o, states = torch.empty(T, nv * dv, device=dev), torch.empty(T, nv, dk, dv, device=dev)
        gdn_step(y, proj, A_log, dtb, nw, S0, o, rows=T, states=states, **kw)
        S, o1 = S0.clone(), torch.empty(1, nv * dv, device=dev)
        gdn_step(y[1:2], proj[1:2], A_log, dtb, nw, S, o1, rows=1, **kw)
        got[pv_first, prefetch] = (o, states, S, o1)
    want = got[True, True]
    for key, vals in got.items():
        assert all(torch.equal(a, b) for a, b in zip(vals, want)), key
