"""Helpers for the session tests: engines over the zoo's tiny models, messages, state checks."""

from __future__ import annotations

import copy
import os

import torch

from hyspec.core.state import SeqState, same_state
from hyspec.engine import Engine

MAX_NEW = 9


# HYSPEC_TEST_DEVICE=cuda runs the session tests on the GPU (fp32 models there): the
# promises are tested on CPU in CI and on the H200 with the same code
DEVICE = os.environ.get("HYSPEC_TEST_DEVICE", "cpu")
_on_device: dict = {}


def engine(zoo, arch: str, variant: str = "coop", dtype: str = "float64") -> Engine:
    """A fresh Engine (its own prefix store and session slots) over a cached zoo model."""
    if DEVICE == "cpu":
        return Engine(zoo.model("tiny", arch, dtype, variant))
    key = (arch, variant)
    if key not in _on_device:
        _on_device[key] = copy.deepcopy(zoo.model("tiny", arch, "float32", variant)).to(DEVICE)
    eng = Engine(_on_device[key])
    eng.session_graphs = False  # these tests are the engine core's (the lanes': tests/test_sessions_graphs.py)
    return eng


def skip_unless_lanes_run() -> None:
    """The lanes' tests run on the CPU in the Triton interpreter, on a GPU compiled (with
    HYSPEC_TEST_DEVICE=cuda); a CPU run without the interpreter skips them."""
    import pytest

    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the lanes run compiled on the GPU: HYSPEC_TEST_DEVICE=cuda (bench/gpu_tests.sh)")


def messages(vocab: int, n: int = 4, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [7, 3, 5, 1, 4, 6, 2, 5, 3, 4][:n]
    return [torch.randint(1, vocab, (m,), generator=g).tolist() for m in lens]


def target_part(st: SeqState) -> SeqState:
    """The target's part of a state (no drafter rows): what plain and speculative share."""
    return SeqState(st.tokens, st.pos, st.conv, st.ssm, st.kv_k, st.kv_v, st.pending)


def assert_same(a: SeqState, b: SeqState, what: str = "") -> None:
    assert a is not None and b is not None
    assert a.tokens == b.tokens, what
    assert same_state(a, b), f"states differ {what}: " + ", ".join(
        k for k in a.tensors() if k in b.tensors() and not torch.equal(a.tensors()[k], b.tensors()[k]))
