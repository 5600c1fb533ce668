"""Reduced draft vocabulary (`mtp.d2t`): the drafter scores a subset of ids, mapped back."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyspec.decode import GREEDY, generate_plain
from hyspec.loading import CheckpointError, load_model
from hyspec.sampling import SamplingParams
from hyspec.speculative.drafter import draft_logits, draft_vocab
from hyspec.speculative.loop import SpecOptions, generate_speculative
from hyspec.tiny import make_tiny

PROMPT = list(range(3, 19))


@pytest.fixture(scope="module")
def d2t_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("d2t")
    make_tiny("qwen3_5", d, seed=5, draft_vocab=96)
    return d


def test_loader_reads_d2t_and_drafter_scores_only_the_subset(d2t_dir):
    m = load_model(d2t_dir, dtype="float64")
    assert m.d2t is not None and m.d2t.shape == (96,)
    ids = torch.arange(96) + m.d2t
    assert bool((ids[1:] > ids[:-1]).all())  # distinct target ids
    h = torch.randn(2, m.cfg.hidden_size, dtype=torch.float64)
    logits = draft_logits(m, h, draft_vocab(m))
    outside = torch.ones(m.cfg.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, ids]).all()
    full = m.logits(h)
    assert torch.allclose(logits[:, ids], full[:, ids])  # the subset rows of the shared head


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_greedy_and_coupled_speculation_with_d2t_equal_plain(d2t_dir, dtype):
    m = load_model(d2t_dir, dtype=dtype)
    ref = generate_plain(m, PROMPT, max_new_tokens=120, params=GREEDY).tokens
    for k in (1, 3):
        out = generate_speculative(m, PROMPT, max_new_tokens=120, opts=SpecOptions(k=k))
        assert out.tokens == ref
    sp = SamplingParams(temperature=0.9, top_k=50, seed=11, mode="coupled")
    plain = generate_plain(m, PROMPT, max_new_tokens=60, params=sp).tokens
    spec = generate_speculative(m, PROMPT, max_new_tokens=60, opts=SpecOptions(k=3), params=sp)
    assert spec.tokens == plain


def test_bad_d2t_is_a_clear_error(d2t_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(d2t_dir, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["mtp.d2t"] = t["mtp.d2t"] + 10_000  # maps past the vocabulary
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="mtp.d2t"):
        load_model(bad)


def test_build_d2t_first_ids_and_most_frequent():
    from hyspec.speculative.drafter import build_d2t

    assert torch.equal(build_d2t(4, 10), torch.zeros(4, dtype=torch.long))  # the first 4 ids
    counts = torch.tensor([0, 9, 1, 7, 0, 8, 0, 0, 3, 0])
    d2t = build_d2t(3, 10, counts)
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 5]  # the 3 most frequent, ascending
    for size in (0, 11):
        with pytest.raises(ValueError, match="1..10"):
            build_d2t(size, 10)
    with pytest.raises(ValueError, match=r"shape \[10\], got \[9\]"):  # (counts of another vocabulary)
        build_d2t(3, 10, torch.ones(9))
    m = load_model(make_tiny("qwen3_5", __import__("tempfile").mkdtemp(), seed=5), dtype="float32")
    m.d2t = build_d2t(8, m.cfg.vocab_size)
    ids, rows = draft_vocab(m)
    assert rows.data_ptr() == m.head_weight.data_ptr() and rows.shape[0] == 8  # a view, not a copy


def test_draft_argmax_of_the_gpu_runner_equals_the_full_row_argmax(d2t_dir, triton_interpreter):
    """The batched runner's greedy draft over a reduced vocabulary (argmax over the Vd scores,
    mapped) equals the argmax of the full [V] draft row (reference: draft_logits)."""
    pytest.importorskip("triton")
    from hyspec.gpu.batch import BatchDecoder

    m = load_model(d2t_dir, dtype="float32")
    dec = BatchDecoder(m, 16, 1, slots=1, graphs=False)
    assert dec.runner.d2t_ascending
    h = torch.randn(5, m.cfg.hidden_size)
    h[0] = 0.0  # all scores tie: the first id wins in both
    want = draft_logits(m, h, draft_vocab(m)).argmax(-1)
    assert torch.equal(dec.runner.draft_argmax(h), want)


def test_first_ids_draft_vocab_is_put_back(tmp_path):
    """The bench's reduced draft vocabulary (first ids) holds inside the block only, also
    when the block raises."""
    from hyspec.loading import load_model
    from hyspec.speculative.drafter import draft_vocab, first_ids_draft_vocab
    from hyspec.tiny import make_tiny

    m = load_model(make_tiny("qwen3_next", tmp_path / "m", seed=3, layers=2, hidden=32, vocab_size=128))
    before = m.d2t
    with pytest.raises(RuntimeError):
        with first_ids_draft_vocab(m, 16):
            ids, head = draft_vocab(m)
            assert torch.equal(ids, torch.arange(16)) and head.shape[0] == 16
            raise RuntimeError("inside")
    assert m.d2t is before
