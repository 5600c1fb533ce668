"""The GPU decoder's Triton runner (hyspec.gpu.runner_triton, as the BatchDecoder builds it:
one sequence in lane 0) vs the reference model at the logit level.

For each family, from the same prefilled state: a decode step and every row of a t-row
verify through the runner's fused kernels (here in the Triton interpreter, fp32; on a GPU
the same checks run in tests/test_gpu_fast.py's device suite) give log-probabilities
within LOGPROB_ATOL of the reference model's (hyspec/model, exact mode). A runner whose
packed weights have two blocks swapped must fail the same check.
"""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

LOGPROB_ATOL = 1e-4  # fp32, |log p| differences over the whole vocabulary
PROMPT = [5, 17, 99, 3, 7, 42]
VERIFY = [11, 23, 4, 60]


def _setup(tmp_path, arch):
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    m = load_model(make_tiny(arch, tmp_path / arch, seed=3, layers=4, hidden=32, vocab_size=128, std=0.2))
    dec = BatchDecoder(m, 32, 3, slots=1, graphs=False)  # one lane: lane 0
    return m, dec


def _reference(m, tokens):
    """Reference log-probs [len(tokens), V] of each row after the prompt's prefill."""
    from hyspec.model.ops import StepCtx

    cache = m.new_cache(64)
    m.forward_states(torch.tensor(PROMPT), cache, StepCtx(start=0, chunked=True))
    _, post = m.forward_states(torch.tensor(tokens), cache, StepCtx(start=len(PROMPT), exact=True))
    return torch.log_softmax(m.logits(post).double(), -1)


def _runner(dec, tokens, record):
    """The runner's log-probs [len(tokens), V]: lane 0 prefilled with the prompt (the model's
    own modules), then the tokens as one decode step (record=False) or one verify."""
    dec.prefill(0, PROMPT)
    ids = torch.tensor(tokens, dtype=torch.long)
    _, post = dec.runner.target(ids, len(tokens), dec.pos, record, 1)
    return torch.log_softmax(dec.runner.logits(post).double(), -1)


def _worst(a, b) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_and_verify_rows_match_the_reference(tmp_path, arch):
    m, dec = _setup(tmp_path, arch)
    ref1 = _reference(m, VERIFY[:1])
    assert _worst(_runner(dec, VERIFY[:1], False), ref1) <= LOGPROB_ATOL  # decode step
    refv = _reference(m, VERIFY)
    got = _runner(dec, VERIFY, True)  # a verify: every row
    assert got.shape == refv.shape
    for r in range(len(VERIFY)):
        assert _worst(got[r], refv[r]) <= LOGPROB_ATOL, (arch, r)
    assert _worst(got[0], ref1[0]) <= LOGPROB_ATOL


@pytest.mark.parametrize("swap", ["gdn_in_qk", "ffn_gate_up", "attn_qkv"])
def test_swapped_weight_blocks_are_caught(tmp_path, swap):
    m, dec = _setup(tmp_path, "qwen3_5")
    layers = dec.runner.layers
    # the packed weights are the model's own storage (pack_views): plant the bug in a copy
    # the runner alone reads, so the reference keeps the right weights
    if swap == "gdn_in_qk":  # q and k rows of a Gated-DeltaNet layer's packed input projection
        L = next(x for x in layers if x.kind == "gdn")
        kd = m.cfg.linear_num_key_heads * m.cfg.linear_key_head_dim
        w = L.w_in = L.w_in.clone()
        w[:kd], w[kd: 2 * kd] = w[kd: 2 * kd].clone(), w[:kd].clone()
    elif swap == "ffn_gate_up":  # gate and up halves of a dense FFN's packed weight
        L = next(x for x in layers if x.w_gu is not None)
        half = L.w_gu.shape[0] // 2
        w = L.w_gu = L.w_gu.clone()
        w[:half], w[half:] = w[half:].clone(), w[:half].clone()
    else:  # keys and values of an attention layer's packed q|k|v
        L = next(x for x in layers if x.kind == "attn")
        nq = m.cfg.num_attention_heads * m.cfg.head_dim * 2
        kv = m.cfg.num_key_value_heads * m.cfg.head_dim
        w = L.w_in = L.w_in.clone()
        w[nq: nq + kv], w[nq + kv: nq + 2 * kv] = w[nq + kv: nq + 2 * kv].clone(), w[nq: nq + kv].clone()
    assert _worst(_runner(dec, VERIFY, True), _reference(m, VERIFY)) > LOGPROB_ATOL


def test_yarn_rope_scaling_on_the_runner(tmp_path):
    """A YaRN config (scaled frequencies, cos / sin times 0.1 ln(factor) + 1) on the runner's
    attention kernel equals the reference model; the same runner with the kernel's scale
    left at 1 does not (the check sees the scale)."""
    import json

    from hyspec.gpu.batch import BatchDecoder
    from hyspec.loading import load_model
    from hyspec.tiny import make_tiny

    d = make_tiny("qwen3_5", tmp_path / "yarn", seed=3, layers=4, hidden=32, vocab_size=128, std=0.2)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    m = load_model(d)
    assert m.cfg.rope_type == "yarn"
    dec = BatchDecoder(m, 32, 3, slots=1, graphs=False)
    assert dec.runner.rope_scale > 1.2
    ref = _reference(m, VERIFY)
    got = _runner(dec, VERIFY, True)
    for r in range(len(VERIFY)):
        assert _worst(got[r], ref[r]) <= LOGPROB_ATOL, r
    dec.runner.rope_scale = 1.0
    assert _worst(_runner(dec, VERIFY, True), ref) > 10 * LOGPROB_ATOL
