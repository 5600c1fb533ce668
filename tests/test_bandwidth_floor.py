"""The batch bench's bandwidth floor (hyspec.gpu.batch_bench.bandwidth_floor): the bytes a
plain decode step of B lanes must move, by hand for b2's shapes."""
import pytest
import torch

from hyspec.config import ModelConfig, with_ssm_dtype
from hyspec.gpu.batch_bench import bandwidth_floor, log_floor
from hyspec.presets import QWEN3_NEXT_2B_DENSE


def test_floor_counts_weights_once_and_each_lane_s_state_twice_and_its_kv():
    cfg = ModelConfig.from_dict(dict(QWEN3_NEXT_2B_DENSE))
    ctx, bw, wb = 640, 4000.0, 3_970_000_000
    conv = 3 * (2 * 16 * 128 + 32 * 128) * 2  # (W - 1) rows of the conv channels, bf16
    ssm = 32 * 128 * 128 * 4  # value heads x Dk x Dv, fp32 (the checkpoint-style default)
    lane = 2 * 18 * (conv + ssm) + 6 * 2 * 2 * 256 * 2 * ctx  # state read + written; K and V read
    tok_s = {1: 640.0, 64: 19_000.0}
    f = bandwidth_floor(cfg, torch.bfloat16, wb, bw, [1, 64], ctx, tok_s)
    assert f["lane_bytes"] == lane
    for B in (1, 64):
        r = f["runs"][B]
        assert r["floor_ms"] == pytest.approx((wb + B * lane) / (bw * 1e9) * 1e3)
        assert r["plain_ms"] == pytest.approx(B / tok_s[B] * 1e3)
        assert r["share_of_floor"] == pytest.approx(r["floor_ms"] / r["plain_ms"])
    assert f["runs"][64]["ratio_at_equal_share"] == pytest.approx(
        64 * f["runs"][1]["floor_ms"] / f["runs"][64]["floor_ms"])
    assert 27 < f["runs"][64]["ratio_at_equal_share"] < 29  # b2 at ~640 keys: well under x35
    # a bf16 state halves the Gated DeltaNet state's bytes (the conv windows stay bf16)
    h = bandwidth_floor(with_ssm_dtype(cfg, "bfloat16"), torch.bfloat16, wb, bw, [1, 64], ctx)
    assert f["lane_bytes"] - h["lane_bytes"] == 2 * 18 * ssm // 2
    assert "plain_ms" not in h["runs"][64]


def test_floor_lines_name_the_share_and_the_equal_share_ratio():
    cfg = ModelConfig.from_dict(dict(QWEN3_NEXT_2B_DENSE))
    runs = {1: {"plain_tok_s": 642.4}, 64: {"plain_tok_s": 19307.4}}
    f = bandwidth_floor(cfg, torch.bfloat16, 3_970_000_000, 4266.0, [1, 64], 640,
                        {B: r["plain_tok_s"] for B, r in runs.items()})
    lines = []
    log_floor(f, runs, lines.append)
    assert len(lines) == 2 and lines[1].startswith("B= 64: plain step floor 2.2")
    assert "measured x30.06" in lines[1] and "equal shares would give x27." in lines[1]
