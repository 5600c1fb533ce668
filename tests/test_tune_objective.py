"""The in-step tuner's objective (hyspec.gpu.tune.tune_in_step) without a GPU.

The tuner captures the decode step (and, with verify_rows, a verify of t rows) for each
candidate tile and keeps a move only when the timed figure drops. Here the graphs are
stand-ins whose replay time is a function of the installed expert-matmul tile, so the
test checks what is timed and what is kept, not the GPU.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import hyspec.gpu.tune as tune
from hyspec.kernels.moe.grouped import MOE_TUNED, set_moe_tuned

KEY = ("moe", 1024, 2048, False, None)


def _cost(kind: str, cfg: dict) -> float:
    """Replay ms of a stand-in graph: the decode step gains from BK=256; the verify loses a
    lot with BK=256 and gains from 8 warps."""
    ms = 3.0 if kind == "decode" else 4.5
    if cfg.get("BK") == 256:
        ms += -0.02 if kind == "decode" else 0.10
    if cfg.get("num_warps") == 8 and kind == "verify":
        ms -= 0.05
    return ms


class _Graphs:
    def __init__(self):
        self.graphs, self.failed, self.captured = {}, False, []

    def snapshot(self):
        return []

    def restore(self, saved):
        pass

    def ensure(self, key, body):
        body()
        cfg = dict(MOE_TUNED.get(KEY[1:], {}))
        self.captured.append(key[0])
        self.graphs[key] = SimpleNamespace(kind=key[0], cfg=cfg)


class _Decoder:
    def __init__(self, k_max: int):
        self.k_max = k_max
        self.step_graphs = _Graphs()
        self.runner = SimpleNamespace(layers=[], mtp_layer=None, _workspaces={},
                                      cfg=SimpleNamespace(num_experts=4, num_experts_per_tok=2))
        self.bodies = []

    def _decode_body(self, nb, regime):
        self.bodies.append(("decode", nb))

    def _verify_body(self, nb, t):
        self.bodies.append(("verify", nb, t))


@pytest.fixture
def fake_timing(monkeypatch):
    monkeypatch.setattr(tune, "replay_ms", lambda g, reps=30: _cost(g.kind, g.cfg))
    saved = dict(MOE_TUNED)
    yield
    set_moe_tuned(saved)


def test_step_objective_keeps_what_speeds_the_decode_step(fake_timing):
    dec = _Decoder(k_max=1)
    out = tune.tune_in_step(dec, [KEY], budget_s=60, log=lambda *a: None)
    assert out[KEY]["config"]["BK"] == 256  # the decode step alone prefers it
    assert set(dec.step_graphs.captured) == {"decode"}


def test_verify_objective_weighs_the_verify_too(fake_timing):
    dec = _Decoder(k_max=3)
    out = tune.tune_in_step(dec, [KEY], budget_s=60, log=lambda *a: None, verify_rows=4)
    cfg = out[KEY]["config"]
    assert cfg["BK"] != 256  # -0.02 on the step, +0.10 on the verify: not kept
    assert cfg["num_warps"] == 8  # the verify's gain is kept
    assert ("verify", 1, 4) in dec.bodies and ("decode", 1) in dec.bodies
    assert out[KEY]["step_ms"] == pytest.approx(3.0 + 4.5 - 0.05)
    assert out[KEY]["objective"] == "decode step + verify of 4 rows"
    assert MOE_TUNED[KEY[1:]] == cfg  # installed


def test_verify_objective_needs_room_for_the_rows(fake_timing):
    with pytest.raises(ValueError, match="k_max >= 3"):
        tune.tune_in_step(_Decoder(k_max=1), [KEY], budget_s=60, log=lambda *a: None, verify_rows=4)
