"""Grouped decode attention (hyspec.kernels.attn) vs fused.attn_decode_ref on CPU through
the Triton interpreter: small odd head shapes, empty splits, a nonzero row offset, bitwise
row invariance (a t-row call == t one-row calls), and bf16.

The interpreter's ``tl.dot`` multiplies bf16 operands as their raw uint16 bit patterns;
the bf16 test patches it (for that test only) to widen bf16 to fp32 first, which is exact
and matches what the tensor cores compute (bf16 products, fp32 accumulation).
"""


import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # kernels run in the CPU interpreter

from hyspec.kernels import fused
from hyspec.kernels.attn import GROUPED_SPLITS, attn_decode_grouped


def rnd(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def make(T, Hq, Hkv, D, L, seed=0, dtype=torch.float32):
    q = rnd(T, Hq, D, seed=seed, dtype=dtype)
    kc = rnd(Hkv, L, D, seed=seed + 1, dtype=dtype)
    vc = rnd(Hkv, L, D, seed=seed + 2, dtype=dtype)
    proj = rnd(T, Hq * 2 * D + 2 * Hkv * D, seed=seed + 3, dtype=dtype)
    return q, kc, vc, proj


def gate_of(proj, Hq, D):
    T = proj.shape[0]
    return proj[:, : Hq * 2 * D].view(T, Hq, 2 * D)[..., D:]


def run(q, kc, vc, pos, off, proj, rows=None):
    T, Hq, D = q.shape
    out = torch.empty(T, Hq * D, dtype=q.dtype)
    attn_decode_grouped(q, kc, vc, torch.tensor([pos]), off, proj, out, rows=T if rows is None else rows)
    return out


# (T, Hq, Hkv, D, L, pos, off): pos+off+r+1 keys for row r
CASES = [
    (1, 4, 2, 32, 8, 0, 0),  # one key: 15 of 16 splits empty
    (3, 4, 2, 32, 128, 100, 0),  # 101..103 keys: 4 blocks, last partial
    (3, 6, 2, 64, 128, 95, 2),  # REP = 3 (padded to 16 rows), nonzero off
    (2, 2, 2, 16, 40, 30, 0),  # REP = 1, D = 16, keys straddle a block edge
    (2, 4, 1, 20, 64, 33, 1),  # D not a power of two (BLOCK_D = 32), REP = 4
]


@pytest.mark.parametrize("T,Hq,Hkv,D,L,pos,off", CASES)
def test_grouped_matches_ref_fp32(T, Hq, Hkv, D, L, pos, off):
    q, kc, vc, proj = make(T, Hq, Hkv, D, L)
    out = run(q, kc, vc, pos, off, proj)
    ref = fused.attn_decode_ref(q, kc, vc, pos + off, gate_of(proj, Hq, D))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_grouped_row_invariant_and_workspace():
    T, Hq, Hkv, D, L, pos = 4, 6, 2, 32, 160, 60  # 61..64 keys: rows cross a block edge
    q, kc, vc, proj = make(T, Hq, Hkv, D, L, seed=5)
    ws = torch.full((T * Hq * GROUPED_SPLITS * (D + 2),), float("nan"))  # reused, stale contents
    out = torch.empty(T, Hq * D)
    attn_decode_grouped(q, kc, vc, torch.tensor([pos]), 0, proj, out, rows=T, ws=ws)
    for r in range(T):
        # a one-row call at pos + r (through off and through pos) gives the same bits
        assert torch.equal(run(q[r : r + 1].contiguous(), kc, vc, pos, r, proj[r : r + 1])[0], out[r])
        assert torch.equal(run(q[r : r + 1].contiguous(), kc, vc, pos + r, 0, proj[r : r + 1])[0], out[r])
    # the values of the other rows do not matter
    q2, proj2 = q.clone(), proj.clone()
    q2[1:], proj2[1:] = rnd(T - 1, Hq, D, seed=9), rnd(T - 1, proj.shape[1], seed=10)
    assert torch.equal(run(q2, kc, vc, pos, 0, proj2)[0], out[0])
    torch.testing.assert_close(out, fused.attn_decode_ref(q, kc, vc, pos, gate_of(proj, Hq, D)),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,pos", [(4, 62), (6, 29), (3, 0)])
def test_a_program_s_rows_straddling_a_block_edge(T, pos):
    """One program serves GROUPED_ROWS rows of a lane; rows that end in different key
    blocks (pos 62: rows 0-1 in blocks 0-1, rows 2-3 reach block 2, which split 2 holds
    alone), more rows than one program takes (T 6: two programs, the second half full),
    and a first row with one key: each row has the bits of its one-row call and the
    reference's values (a row must not move on a block that holds none of its keys)."""
    from hyspec.kernels.attn import GROUPED_ROWS

    assert GROUPED_ROWS < 6
    Hq, Hkv, D, L = 4, 2, 32, 96
    q, kc, vc, proj = make(T, Hq, Hkv, D, L, seed=11)
    out = run(q, kc, vc, pos, 0, proj)
    for r in range(T):
        assert torch.equal(run(q[r : r + 1].contiguous(), kc, vc, pos, r, proj[r : r + 1])[0], out[r]), r
    torch.testing.assert_close(out, fused.attn_decode_ref(q, kc, vc, pos, gate_of(proj, Hq, D)), atol=1e-5, rtol=1e-5)


@pytest.fixture
def bf16_dot(monkeypatch):
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    orig = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:  # raw uint16 -> fp32 with the same value
            data = (h.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def test_grouped_bf16(bf16_dot):
    T, Hq, Hkv, D, L, pos = 3, 8, 2, 64, 128, 70
    q, kc, vc, proj = make(T, Hq, Hkv, D, L, seed=7, dtype=torch.bfloat16)
    out = run(q, kc, vc, pos, 0, proj)
    assert out.dtype == torch.bfloat16
    ref = fused.attn_decode_ref(q, kc, vc, pos, gate_of(proj, Hq, D))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    for r in range(T):
        assert torch.equal(run(q[r : r + 1].contiguous(), kc, vc, pos, r, proj[r : r + 1])[0], out[r])


@pytest.mark.parametrize("pos,L", [
    (510, 640),  # rows 0-1: 16 blocks (level 0, one block per partial); rows 2-3: 17 (level 1, two)
    (2046, 2176),  # rows 0-1: 64 blocks (level 2); rows 2-3: 65 (level 3, chunks of 8 blocks)
    (4200, 4300),  # level 3 with 132 blocks: 17 partials, the combine takes them in two tiles
])
def test_grouped_chunk_levels_a_group_straddling_a_level_and_any_program_count(pos, L, monkeypatch):
    """The chunked partials (grouped.CHUNKED, an option): a row's chunks follow its own key count's level,
    so a verify group whose rows straddle a level's edge (its lower rows take each of the
    group's chunks as two halves) must give each row the bits of its one-row call; every
    program count gives the same bits (stale workspace contents), all match the reference."""
    from hyspec.kernels.attention import grouped

    monkeypatch.setattr(grouped, "CHUNKED", True)
    T, Hq, Hkv, D = 4, 4, 2, 16
    q, kc, vc, proj = make(T, Hq, Hkv, D, L, seed=21)
    ref = fused.attn_decode_ref(q, kc, vc, pos, gate_of(proj, Hq, D))
    outs = []
    for programs in (1, 3, 16):
        ws = torch.full((grouped.grouped_workspace_floats(T, Hq, D, L),), float("nan"))
        out = torch.empty(T, Hq * D)
        attn_decode_grouped(q, kc, vc, torch.tensor([pos]), 0, proj, out, rows=T, ws=ws, programs=programs)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    for r in range(T):
        assert torch.equal(run(q[r : r + 1].contiguous(), kc, vc, pos, r, proj[r : r + 1])[0], outs[0][r]), r


def test_grouped_interleaved_form_takes_one_program_per_split(monkeypatch):
    """The default form (CHUNKED = False: 16 interleaved splits per row) over several blocks
    per split: the reference's values, row invariant, and a program count is refused."""
    from hyspec.kernels.attention import grouped

    monkeypatch.setattr(grouped, "CHUNKED", False)  # the default, whatever HYSPEC_ATTN_CHUNKED says
    T, Hq, Hkv, D, L, pos = 3, 4, 2, 32, 200, 150
    q, kc, vc, proj = make(T, Hq, Hkv, D, L, seed=23)
    out = run(q, kc, vc, pos, 0, proj)
    torch.testing.assert_close(out, fused.attn_decode_ref(q, kc, vc, pos, gate_of(proj, Hq, D)), atol=1e-5, rtol=1e-5)
    for r in range(T):
        assert torch.equal(run(q[r : r + 1].contiguous(), kc, vc, pos, r, proj[r : r + 1])[0], out[r])
    with pytest.raises(ValueError, match="one program per split"):
        attn_decode_grouped(q, kc, vc, torch.tensor([pos]), 0, proj, out, rows=T, programs=2)
