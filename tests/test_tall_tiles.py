"""The measured tall-tile table (hyspec.gpu.runner_triton.TALL): its entries may tune a
32/64-row tile's shape but never the K split (split-K and K columns per split), which is
what keeps a row's bits the same at every tile height; tall_tile refuses an entry that
would change it, and FP8 and fp32 weights never take the table.  CPU only (no kernel runs)."""
import pytest
import torch

pytest.importorskip("triton")

from hyspec.gpu import runner_triton  # noqa: E402
from hyspec.gpu.runner_triton import TALL, tall_tile  # noqa: E402
from hyspec.kernels.matmul.config import _config_cached  # noqa: E402


@pytest.mark.parametrize("key", sorted(TALL), ids=lambda k: f"{k[0]}x{k[1]}{'_act' if k[2] else ''}")
def test_every_entry_keeps_the_k_split(key):
    N, K, act = key
    own = _config_cached(N, K, None, None, None, None, None, None, act)
    t = tall_tile(N, K, act)
    for name, value in TALL[key].items():
        assert t[name] == value, name
    c = _config_cached(N, K, *t.values())
    assert (c.split_k, c.k_per_split) == (own.split_k, own.k_per_split)


def test_fp8_and_the_ablation_switch_ignore_the_table(monkeypatch):
    monkeypatch.setattr(runner_triton, "FP8_TALL", {})  # FP8 weights' own table aside
    (N, K, act), entry = next(iter(TALL.items()))
    base = tall_tile(N, K, act, fp8=True)
    assert tall_tile(N, K, act) != base  # the entry changes something
    assert tall_tile(N, K, act, dtype=torch.float32) == base  # measured in bf16 only
    monkeypatch.setenv("HYSPEC_TALL_TUNED", "0")
    assert tall_tile(N, K, act) == base


def test_an_entry_that_would_change_the_split_is_refused(monkeypatch):
    # 2048 x 4096 splits K in 4 ranges of 1024 columns: BK 2048 would cut them differently
    monkeypatch.setitem(runner_triton.TALL, (2048, 4096, False), dict(block_k=2048))
    with pytest.raises(ValueError, match="K split"):
        tall_tile(2048, 4096)
    # K 4500 in 4 splits: 1152 columns each at BK 128, 1280 at BK 256 (divisible by 128,
    # yet another split)
    monkeypatch.setitem(runner_triton.TALL, (64, 4500, False), dict(block_k=256))
    with pytest.raises(ValueError, match="K split"):
        tall_tile(64, 4500)
    monkeypatch.setitem(runner_triton.TALL, (2048, 4096, False), dict(split_k=2))
    with pytest.raises(ValueError, match="only"):
        tall_tile(2048, 4096)


def test_fp8_tiles_keep_the_shapes_stages_within_shared_memory(monkeypatch):
    """Block-FP8 weights run one config at every height: the shape's own stage count (not
    the bf16 tall tile's cap of 3), cut to what a 64-row tile's shared memory holds;
    FP8_TALL's entry applies unless TUNED has the shape (a tuner's table wins)."""
    from hyspec.kernels.matmul import set_tuned

    monkeypatch.setattr(runner_triton, "FP8_TALL", {})
    try:
        set_tuned({(4096, 2048): dict(block_n=32, block_k=128, split_k=1, num_stages=6)})
        t = tall_tile(4096, 2048, fp8=True)
        assert t["num_stages"] == 6 and t["block_k"] == 128  # 6 x (16 KB of x + 4 KB of w) fits
        assert tall_tile(4096, 2048)["num_stages"] == 3  # bf16 keeps the cap
        set_tuned({(4096, 2048): dict(block_n=256, block_k=128, split_k=1, num_stages=8)})
        assert tall_tile(4096, 2048, fp8=True)["num_stages"] == 3  # 48 KB per stage: 3 fit in 160 KB
        runner_triton.FP8_TALL[(4096, 2048, False)] = dict(num_stages=2, block_n=64)
        assert tall_tile(4096, 2048, fp8=True)["num_stages"] == 3  # TUNED wins over FP8_TALL
        set_tuned({})
        t = tall_tile(4096, 2048, fp8=True)
        assert (t["num_stages"], t["block_n"]) == (2, 64)
    finally:
        set_tuned({})
