"""The Gated-DeltaNet gated norm folded into the out projection's x-load
(``skinny_matmul(gnorm=...)``, used by the batched runner for calls of at most 16 rows)
gives bitwise the bits of the gated norm's own kernel followed by the plain matmul (which
taller calls run), so a lane's numbers do not depend on which of the two its batch took:
kernel level over the x-load's two branches (chunks of whole heads, chunks inside a head)
and K splits, and the runner (a lane alone folds, the same lane in a batch of 20 rows does
not; both match the reference model's log-probs).  Triton interpreter on the CPU, the
compiled kernels where CUDA is available (tests/test_gpu_batch.py checks a lane across
row-tile heights on the device)."""
from __future__ import annotations

import pytest
import torch

from kernel_grid import kernel_device, rnd

pytest.importorskip("triton")


def _gdn_inputs(dev, dtype, nk=2, nv=4, dk=16, dv=32, T=3):
    C = 2 * nk * dk + nv * dv
    y = rnd(T, C, seed=1, device=dev).to(dtype)
    proj = rnd(T, C + nv * dv + 2 * nv, seed=2, device=dev).to(dtype)
    A_log = torch.rand(nv, generator=torch.Generator().manual_seed(3)).mul(3).add(0.1).log().to(dev)
    dtb, nw = rnd(nv, seed=4, device=dev), (rnd(dv, seed=5, scale=0.1) + 1).to(dev).to(dtype)
    S0 = rnd(nv, dk, dv, seed=6, scale=0.1, device=dev)
    return C, y, proj, A_log, dtb, nw, S0, dict(nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_folded_gated_norm_equals_its_own_kernel(dtype):
    from hyspec.kernels.gdn import gdn_step
    from hyspec.kernels.matmul import skinny_matmul
    from hyspec.kernels.pdl import interpreting

    dev = kernel_device()
    if dtype == torch.bfloat16 and interpreting():
        pytest.skip("the interpreter's dots are tested in fp32 (tests/test_kernels_triton.py)")
    C, y, proj, A_log, dtb, nw, S0, kw = _gdn_inputs(dev, dtype)
    T, nv, dv = y.shape[0], kw["nv"], kw["dv"]
    normed, raw = torch.empty(T, nv * dv, device=dev, dtype=dtype), torch.empty(T, nv * dv, device=dev, dtype=dtype)
    sumsq = torch.full((T, nv * 4), float("nan"), device=dev)  # block_v 8: 4 partials per head
    gdn_step(y, proj, A_log, dtb, nw, S0.clone(), normed, rows=T, block_v=8, **kw)
    gdn_step(y, proj, A_log, dtb, nw, S0.clone(), raw, rows=T, block_v=8, sumsq=sumsq, gated_norm=False, **kw)
    assert not sumsq.isnan().any() and not torch.equal(raw, normed)
    z = proj[:, C: C + nv * dv]
    w = rnd(40, nv * dv, seed=7, scale=0.1, device=dev).to(dtype)
    # BK < Dv (chunks inside a head), BK >= Dv (whole heads), split and not
    for bk, sk in ((16, 2), (16, 1), (64, 1), (64, 2), (128, 1)):
        ref = skinny_matmul(normed, w, block_k=bk, split_k=sk)
        got = skinny_matmul(raw, w, block_k=bk, split_k=sk, gnorm=(z, nw, sumsq, 1e-6, dv))
        assert torch.equal(got, ref), (bk, sk)
    # the comparison sees a wrong gate: z of the neighbouring head
    bad = skinny_matmul(raw, w, block_k=64, split_k=1, gnorm=(z.roll(dv, 1), nw, sumsq, 1e-6, dv))
    assert not torch.equal(bad, skinny_matmul(normed, w, block_k=64, split_k=1))
    with pytest.raises(ValueError, match="gnorm"):
        skinny_matmul(raw[:, :120], w[:, :120], gnorm=(z, nw, sumsq, 1e-6, dv))


@pytest.mark.usefixtures("triton_interpreter", "fast_interpreter")
def test_runner_folds_for_few_rows_with_the_same_bits(tmp_path, monkeypatch):
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.loading import load_model
    from hyspec.model.ops import StepCtx
    from hyspec.tiny import make_tiny

    monkeypatch.setenv("HYSPEC_GDN_BLOCK_V", "8")  # Dv 32 in four blocks: the norm outside the scan
    m = load_model(make_tiny("qwen3_next", tmp_path / "m", seed=3, layers=4, hidden=32, vocab_size=128, std=0.2,
                             overrides={"linear_value_head_dim": 32}))
    prompts = [[(7 * i + j) % 128 for j in range(3 + i % 4)] for i in range(5)]
    verify = [[(11 * i + 3 * j + 1) % 128 for j in range(4)] for i in range(5)]
    import hyspec.gpu.runner_triton as rt

    folds = []
    real = rt.skinny_matmul
    monkeypatch.setattr(rt, "skinny_matmul", lambda *a, **k: (folds.append(k.get("gnorm") is not None),
                                                              real(*a, **k))[1])

    def lane0(lanes, fold=True, whole_heads=False):
        dec = BatchDecoder(m, 24, 3, slots=5, graphs=False)
        dec.runner.gnorm_fold = fold
        if whole_heads:  # one program per head, the gated norm inside the scan kernel
            dec.runner.gdn_block_v = None
        for lane in range(lanes):
            dec.prefill(lane, prompts[lane])
        folds.clear()
        ids = torch.tensor([t for v in verify[:lanes] for t in v])
        _, post = dec.runner.target(ids, 4 * lanes, dec.pos, True, lanes)
        return dec.runner.logits(post)[:4].clone(), sum(folds)

    alone, n_alone = lane0(1)
    batch, n_batch = lane0(5)
    unfolded, n_off = lane0(1, fold=False)
    assert (n_alone, n_batch, n_off) == (3, 0, 0)  # the three GDN layers of four fold alone only
    assert torch.equal(alone, batch) and torch.equal(alone, unfolded)
    # against the whole-head kernel (its norm's sum in one reduction: other last bits) and
    # the reference model; this model's last verify row is 1.1e-4 from the reference with
    # the whole-head kernel too (its other rows within 3e-6), hence 2e-4 there
    whole, _ = lane0(1, whole_heads=True)
    lp = torch.log_softmax(alone.double(), -1)
    assert float((lp - torch.log_softmax(whole.double(), -1)).abs().max()) <= 1e-5
    cache = m.new_cache(64)
    m.forward_states(torch.tensor(prompts[0]), cache, StepCtx(start=0, chunked=True))
    _, rp = m.forward_states(torch.tensor(verify[0]), cache, StepCtx(start=len(prompts[0]), exact=True))
    ref = torch.log_softmax(m.logits(rp).double(), -1)
    assert float((lp - ref).abs().max()) <= 2e-4
