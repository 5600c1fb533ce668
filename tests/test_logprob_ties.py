"""Top-N log-probability lists order tied values by ascending id, the tie rule of greedy
decoding (the lowest id wins) and of top-k: a greedy token is the first entry of its own
top list, and score's lists agree with generate's. (torch.topk leaves ties in any order:
on the CPU the highest id came first.)"""

from __future__ import annotations

import pytest
import torch

from hyspec.engine import Engine
from hyspec.sampling import SamplingParams, top_ids
from hyspec.tiny import make_tiny


def _reference(row: list[float], n: int) -> list[int]:
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:n]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_top_ids_is_value_then_ascending_id(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(-6, 7, (5, 700), generator=g).to(dtype) / 4)  # many ties, both signs
    x[0, :4] = torch.tensor([-0.0, 0.0, float("-inf"), 1.5])
    x[1] = float("-inf")
    x[1, 650] = -3.0
    x[2, 3] = 1e30 if dtype != torch.float16 else 6e4
    for n in (1, 3, 17, 700):
        got = top_ids(x, n)
        assert got.shape == (5, n)
        for r in range(5):
            want = _reference([float(v) for v in x[r]], n)
            assert got[r].tolist() == want, (dtype, n, r)
    assert top_ids(x[0], 4).tolist() == _reference([float(v) for v in x[0]], 4)  # one row


def test_greedy_token_leads_its_top_logprobs_under_a_tie(tmp_path):
    make_tiny("qwen3_5", tmp_path / "m")
    eng = Engine.load(str(tmp_path / "m"))
    m = eng.model
    prompt = [5, 17, 99, 3, 41]
    with torch.no_grad():
        top = int(m(torch.tensor(prompt))[-1].argmax())
        low = 0 if top != 0 else 1
        w = dict(m.named_parameters())["lm_head.weight"]
        w[low].copy_(w[top])  # two tokens with bitwise equal logits everywhere
    out = eng.generate(prompt, max_new_tokens=1, logprobs=2)
    assert out.tokens == [low]  # greedy: the lowest id of the tie
    lp, alts = out.logprobs[0][0]
    assert [i for i, _ in alts] == [low, top] and alts[0][1] == lp
    one = eng.generate(prompt, max_new_tokens=1, logprobs=1, params=SamplingParams(temperature=1.0, top_k=1))
    assert one.tokens == [low] and [i for i, _ in one.logprobs[0][0][1]] == [low]  # top-1 is what top_k=1 keeps
    scored = eng.score(prompt + [low], top_logprobs=2)
    assert [row[0] for row in scored["top_logprobs"][-1]] == [low, top]
