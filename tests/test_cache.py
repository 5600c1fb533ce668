"""HybridCache: snapshot / restore returns the cache bitwise to the saved state; keeping a
verified prefix from the verify records equals decoding that prefix; bounds are checked."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS
from hyspec.model.ops import StepCtx

IDS = torch.tensor([5, 300, 17, 42, 99, 7, 250, 3, 88, 121, 64, 9, 400, 2, 33, 18, 77, 501, 6, 60])
NEW = torch.tensor([11, 12, 13, 14, 15])


def full_state(cache) -> dict:
    """Every tensor of the cache (whole KV buffers, not just the valid rows)."""
    return {
        "pos": cache.pos,
        "conv": [s.conv.clone() for s in cache.linear_states],
        "ssm": [s.ssm.clone() for s in cache.linear_states],
        "k": [b.k.clone() for b in cache.kv_buffers],
        "v": [b.v.clone() for b in cache.kv_buffers],
    }


def assert_state(cache, st: dict, kv_rows: int | None = None) -> None:
    """The cache equals st bitwise (KV: rows < kv_rows, all rows if None)."""
    assert cache.pos == st["pos"]
    for s, c, m in zip(cache.linear_states, st["conv"], st["ssm"], strict=True):
        assert torch.equal(s.conv, c) and torch.equal(s.ssm, m)
    n = kv_rows
    for b, k, v in zip(cache.kv_buffers, st["k"], st["v"], strict=True):
        assert torch.equal(b.k[:, :n], k[:, :n]) and torch.equal(b.v[:, :n], v[:, :n])


def prefill(m, ids=IDS, max_len=64):
    cache = m.new_cache(max_len)
    m.forward_hidden(ids, cache, StepCtx(start=0, chunked=True))
    return cache


def decode(m, cache, toks) -> torch.Tensor:
    hs = [m.forward_hidden(toks[i : i + 1], cache, StepCtx(start=cache.pos, exact=True)) for i in range(len(toks))]
    return torch.cat(hs)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_snapshot_restore_is_bitwise(zoo, arch, dtype):
    m = zoo.model("tiny", arch, dtype)
    with torch.no_grad():
        cache = prefill(m)
        before = full_state(cache)
        snap = cache.snapshot()
        assert snap.pos == len(IDS) and snap.nbytes() == cache.state_nbytes() > 0
        h1 = decode(m, cache, NEW)  # decode steps ...
        m.forward_hidden(IDS[:7], cache, StepCtx(start=cache.pos, chunked=True))  # ... and a chunk
        m.forward_hidden(NEW, cache, StepCtx(start=cache.pos, exact=True, record="states"))
        assert cache.pos == len(IDS) + 17 and cache.record_nbytes() > 0
        # the snapshot is a copy: what happened since did not touch it
        for c, c0 in zip(snap.conv + snap.ssm, before["conv"] + before["ssm"]):
            assert torch.equal(c, c0)
        cache.restore(snap)
        assert_state(cache, before, kv_rows=len(IDS))
        assert cache.record_nbytes() == 0
        # and decoding again from there repeats the first pass bit for bit (twice: restore
        # leaves the snapshot reusable)
        for _ in range(2):
            assert torch.equal(decode(m, cache, NEW), h1)
            cache.restore(snap)
        assert_state(cache, before, kv_rows=len(IDS))


@pytest.mark.parametrize("record", ["states", "inputs"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_keep_prefix_from_verify_records(zoo, arch, dtype, record):
    """Verify 5 tokens in one forward, keep the first j: the cache equals prefill + j decode
    steps, bitwise, for every j (the SSM state from the saved per-row states or a re-scan
    of the stashed inputs; the conv window from the recorded rows)."""
    m = zoo.model("tiny", arch, dtype)
    with torch.no_grad():
        plain = prefill(m)
        expect = [full_state(plain)]
        for t in range(len(NEW)):
            decode(m, plain, NEW[t : t + 1])
            expect.append(full_state(plain))
        cache = prefill(m)
        for j in range(1, len(NEW) + 1):
            snap = cache.snapshot()
            m.forward_hidden(NEW, cache, StepCtx(start=cache.pos, exact=True, record=record))
            rec = cache.linear_states[0].record
            assert (rec.states is not None) == (record == "states") and (rec.inputs is not None) == (record == "inputs")
            cache.keep_from_records(snap, j)
            assert_state(cache, expect[j], kv_rows=len(IDS) + j)
            assert cache.record_nbytes() == 0
            cache.restore(snap)
            assert_state(cache, expect[0], kv_rows=len(IDS))


def test_keep_without_records_and_record_sizes(zoo):
    m = zoo.model("tiny", "qwen3_5", "float32")
    c = m.cfg
    with torch.no_grad():
        cache = prefill(m)
        snap = cache.snapshot()
        m.forward_hidden(NEW, cache, StepCtx(start=cache.pos, exact=True))
        with pytest.raises(RuntimeError, match="no verify record"):
            cache.keep_from_records(snap, 2)
        cache.restore(snap)
        n_lin = len(cache.linear_states)
        T, W = len(NEW), c.linear_conv_kernel_dim
        xcat = n_lin * (W - 1 + T) * c.conv_dim * 4
        m.forward_hidden(NEW, cache, StepCtx(start=cache.pos, exact=True, record="states"))
        state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        assert cache.record_nbytes() == xcat + n_lin * T * state
        cache.clear_records()
        assert cache.record_nbytes() == 0
        # the stashed inputs hold only their own bytes: v was a view of the [T, C] conv
        # output in a float32 model, so the record pinned more than record_nbytes said
        m.forward_hidden(NEW, cache, StepCtx(start=cache.pos, exact=True, record="inputs"))
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for s in cache.linear_states for t in (s.record.xcat, *s.record.inputs)}
        assert cache.record_nbytes() == sum(held.values())


def test_bounds_and_positions(zoo):
    m = zoo.model("tiny", "qwen3_next", "float32")
    with pytest.raises(ValueError, match="max_len must be positive"):
        m.new_cache(0)
    with torch.no_grad():
        cache = prefill(m, max_len=22)
        with pytest.raises(ValueError, match="forward at position 3 but the cache holds 20"):
            m.forward_hidden(NEW[:1], cache, StepCtx(start=3, exact=True))
        with pytest.raises(ValueError, match="context full: 25 tokens exceed the cache's max length 22"):
            m.forward_hidden(NEW, cache, StepCtx(start=cache.pos, exact=True))
        assert cache.pos == 20  # a refused forward leaves the cache alone
        decode(m, cache, NEW[:2])
        assert cache.pos == 22
    kv = m.new_draft_kv(10)
    assert kv.capacity == 10 and kv.k.shape == (m.cfg.num_key_value_heads, 10, m.cfg.head_dim)
