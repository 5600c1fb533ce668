"""hyspec.kernels.commit.commit_round (the batched decoder's commit bookkeeping in one
launch) against its torch reference: every buffer it writes, bit for bit, over random
lanes -- greedy (the accept test on the device) and given accept results (sampled
rounds), drafts from 0 to 4, accepted stop drafts, idle lanes, more lanes in the buffers
than in the round.  Runs in the Triton interpreter on a CPU machine and on the device on a
GPU machine (tests/conftest.py picks the mode per process)."""
import os

import pytest
import torch

pytest.importorskip("triton")

from hyspec.kernels.commit import commit_round, commit_round_ref  # noqa: E402

GPU = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if GPU and not torch.cuda.is_available():
    pytest.skip("no CUDA and not interpreting", allow_module_level=True)
if GPU:
    pytestmark = pytest.mark.gpu
DEV = torch.device("cuda" if GPU else "cpu")
S, H, STOP, V = 7, 40, 8, 12  # lanes in the buffers, hidden, stop slots, vocabulary (small: many matches)


def _state(t: int, seed: int, stops: bool):
    g = torch.Generator().manual_seed(seed)
    k = t - 1
    ri = lambda *shape, hi=V: torch.randint(0, hi, shape, generator=g)  # noqa: E731
    vt = ri(S, t + 2)
    am = ri(S, t + 2)
    agree = torch.rand(S, t + 2, generator=g) < 0.6  # the target agrees with most drafts
    am[:, :t - 1] = torch.where(agree[:, :t - 1], vt[:, 1:t], am[:, :t - 1])
    stop_ids = torch.full((S, STOP), -1)
    if stops:
        stop_ids[:, :2] = ri(S, 2)
    st = dict(argmax=am, verify_tokens=vt, k_lane=ri(S, hi=k + 1), stop_ids=stop_ids,
              live=(torch.rand(S, generator=g) < 0.8).long(), pos=ri(S, hi=50), pending=ri(S),
              n_keep=ri(S), j=ri(S), result=ri(S, t + 3), fill_tokens=ri(S, t + 3), fill_start=ri(S),
              fill_rows=ri(S), fill_h=torch.randn(S, t + 2, H, generator=g),
              h_last=torch.randn(S, H, generator=g), seed_hidden=torch.randn(S, t + 1, H, generator=g))
    return {k: v.to(DEV) for k, v in st.items()}


def _accepted(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(0, t, (S,), generator=g)
    return n.to(DEV), torch.randint(0, V, (S,), generator=g).to(DEV)


@pytest.mark.parametrize("t", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("mode", ["greedy", "greedy_stops", "accepted", "accepted_stops"])
def test_commit_round_matches_reference(t, mode):
    for seed in range(4):
        nb = S - seed % 3  # rounds over fewer lanes than the buffers hold: the rest untouched
        a, b = _state(t, seed, "stops" in mode), _state(t, seed, "stops" in mode)
        acc = _accepted(t, 100 + seed) if mode.startswith("accepted") else None
        commit_round(**a, nb=nb, t=t, accepted=acc)
        commit_round_ref(**b, nb=nb, t=t, accepted=acc)
        for name in a:
            assert torch.equal(a[name], b[name]), (name, t, mode, seed)


def test_the_comparison_sees_a_planted_bug():
    """A reference that keeps one row too many (j = n_keep + 2) must differ somewhere."""
    t = 4
    a, b = _state(t, 7, True), _state(t, 7, True)
    commit_round(**a, nb=S, t=t)
    commit_round_ref(**b, nb=S, t=t)
    b2 = _state(t, 7, True)
    commit_round_ref(**b2, nb=S, t=t)
    b2["j"] += 1  # what a planted off-by-one in j would leave
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], b2[n]) for n in a)


def test_a_stop_draft_ends_the_kept_rows():
    """Lane 0: the target agrees with all 3 drafts, the second is a stop id: n = 3 (the host
    sees every accepted draft) but the state keeps rows up to the stop (n_keep 1, j 2) and
    the stop token stays pending."""
    t = 4
    st = _state(t, 3, False)
    st["verify_tokens"][0, :t] = torch.tensor([5, 6, 7, 8])
    st["argmax"][0, :t] = torch.tensor([6, 7, 8, 9])
    st["k_lane"][0] = 3
    st["stop_ids"][0, 0] = 7
    st["live"][0] = 1
    pos0 = int(st["pos"][0])
    commit_round(**st, nb=1, t=t)
    assert st["result"][0, :5].tolist() == [3, 9, 6, 7, 8]
    assert (int(st["n_keep"][0]), int(st["j"][0]), int(st["pending"][0])) == (1, 2, 7)
    assert int(st["pos"][0]) == pos0 + 2 and int(st["fill_rows"][0]) == 3
    assert st["fill_tokens"][0, :3].tolist() == [5, 6, 7]
