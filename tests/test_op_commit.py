"""hyspec.kernels.commit.commit_round (the batched decoder's commit bookkeeping in one
launch) against its torch reference: every buffer it writes, bit for bit, over random
lanes -- greedy (the accept test on the device) and given accept results (sampled
rounds), drafts from 0 to 4, accepted stop drafts, idle lanes, more lanes in the buffers
than in the round, one and three hidden chunks per lane -- and BatchDecoder._commit_body
with the kernel against the torch form for greedy, sampled, penalised and masked rounds.
Runs in the Triton interpreter on a CPU machine and on the device on a GPU machine
(tests/conftest.py picks the mode per process)."""
import itertools
import os
import types

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
S, STOP, V = 7, 8, 12  # lanes in the buffers, stop slots, vocabulary (small: many matches)
H = 40  # hidden size (one 64-wide chunk per lane; HS: three 1024-wide chunks)
HS = 2100


def _state(t: int, seed: int, stops: bool, H: int = H):
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
@pytest.mark.parametrize("mode", ["greedy", "greedy_stops", "accepted", "accepted_stops", "greedy_stops_wide"])
def test_commit_round_matches_reference(t, mode):
    hidden = HS if "wide" in mode else H
    for seed in range(4 if hidden == H else 2):
        nb = S - seed % 3  # rounds over fewer lanes than the buffers hold: the rest untouched
        a, b = _state(t, seed, "stops" in mode, hidden), _state(t, seed, "stops" in mode, hidden)
        acc = _accepted(t, 100 + seed) if mode.startswith("accepted") else None
        commit_round(**a, nb=nb, t=t, accepted=acc)
        commit_round_ref(**b, nb=nb, t=t, accepted=acc)
        for name in a:
            assert torch.equal(a[name], b[name]), (name, t, mode, seed)



def _padded(st):
    """The state with its hidden buffers as views of wider rows (fill_h's and seed_hidden's
    rows, h_last's lanes H + 5 apart; the padding -7), and the backing tensors."""
    backing = {}
    for name in ("fill_h", "seed_hidden", "h_last"):
        x = st[name]
        wide = torch.full((*x.shape[:-1], x.shape[-1] + 5), -7.0, device=x.device)
        wide[..., : x.shape[-1]] = x
        backing[name] = wide
        st[name] = wide[..., : x.shape[-1]]
    return st, backing


@pytest.mark.parametrize("t", [2, 4])
def test_commit_round_last_stop_slot_and_strided_hidden_rows(t):
    """A lane's stop ids in its last slot only (every slot is read), and hidden buffers
    whose rows are views of wider ones (each read and written through its strides, the
    padding untouched): the kernel equals the reference."""
    for seed in range(3):
        a, b = _state(t, 20 + seed, False), _state(t, 20 + seed, False)
        for st in (a, b):
            st["stop_ids"][:, STOP - 1] = st["verify_tokens"][:, 1 + seed % (t - 1)]  # an accepted draft, often
        a, wa = _padded(a)
        b, wb = _padded(b)
        commit_round(**a, nb=S, t=t)
        commit_round_ref(**b, nb=S, t=t)
        for name in a:
            assert torch.equal(a[name], b[name]), (name, t, seed)
        for name in wa:
            assert torch.equal(wa[name], wb[name]), (name, t, seed)
        assert bool((a["n_keep"] < a["result"][:, 0]).any()), seed  # a stop cut some lane's kept rows


def test_commit_round_refuses_buffers_too_narrow_for_t():
    """result and the fill rows need t + 1 columns (n, bonus and the k drafts; the verify
    rows and the kept token): narrower ones are refused, not written past."""
    t = 3
    for name in ("result", "fill_tokens", "fill_h"):
        st = _state(t, 1, False)
        st[name] = st[name][:, :t]
        with pytest.raises(ValueError, match="commit_round"):
            commit_round(**st, nb=S, t=t)

@pytest.mark.parametrize("plant", ["no k_lane cap", "stops ignored", "one row more"])
def test_the_comparison_sees_a_planted_bug(plant):
    """The random lanes exercise what a bug would break: the reference with a planted bug
    (the k_lane cap dropped, the stop ids ignored, or a lane keeping one verify row more)
    must differ from the kernel somewhere."""
    t = 4
    a, b = _state(t, 7, True), _state(t, 7, True)
    commit_round(**a, nb=S, t=t)
    if plant == "no k_lane cap":
        b["k_lane"].fill_(t - 1)
        commit_round_ref(**b, nb=S, t=t)
    elif plant == "stops ignored":
        commit_round_ref(**dict(b, stop_ids=torch.full_like(b["stop_ids"], -1)), nb=S, t=t)
    else:  # n_keep + 1 rows kept: the reference run on the accept results of one more accepted draft
        n = a["result"][:, 0].clone()
        commit_round_ref(**b, nb=S, t=t, accepted=((n + 1).clamp(max=t - 1), a["result"][:, 1].clone()))
    assert not all(torch.equal(a[n], b[n]) for n in a if n != "k_lane")


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


# -- BatchDecoder._commit_body with the kernel vs the torch form, on a stand-in decoder -----

KMAX = 4


def _decoder(seed: int, hidden: int, kernel: bool):
    from hyspec.gpu.batch import BatchDecoder
    from hyspec.gpu.penalties import PenaltyWindow

    t_max = KMAX + 1
    st = _state(t_max, seed, True, hidden)
    d = types.SimpleNamespace(**st)
    d.dev, d.lane_ids = DEV, torch.arange(S, device=DEV)
    d.j_keep = d.__dict__.pop("j")
    g = torch.Generator().manual_seed(seed)
    d.k_lane = torch.randint(0, KMAX + 2, (S,), generator=g).to(DEV)  # some above the round's k
    d.k_round = torch.randint(0, KMAX + 1, (S,), generator=g).to(DEV)
    d.logits = torch.randn(S * t_max, V, generator=g).to(DEV)
    d.mask = torch.zeros(t_max, S, 1, dtype=torch.int32, device=DEV)
    dead = (torch.rand(S * t_max, generator=g) < 0.3).to(DEV)
    bad_rows = (torch.rand(S * t_max, generator=g) < 0.2).to(DEV)
    d._masked = lambda logits, words, bad=False: (logits * 2, None, dead[: logits.shape[0]]) + (
        (bad_rows[: logits.shape[0]],) if bad else ())
    d._bad_rows = types.MethodType(BatchDecoder._bad_rows, d)  # (each lane's first NaN / +inf row -> result)
    d.window = PenaltyWindow(S, V, capacity=8, device=DEV)
    d.window.last_n[:] = torch.tensor([0, 3, -1, 5, 2, -1, 4])  # off, windows of 2-5 tokens, everything
    d.acc = (torch.randint(0, t_max, (S,), generator=g).to(DEV), torch.randint(0, V, (S,), generator=g).to(DEV))
    d.calls = []
    d.runner = types.SimpleNamespace(bufs=types.SimpleNamespace(logits=d.logits), commit_kernel=kernel,
                                     commit_linear=lambda n, t, nb: d.calls.append(("linear", n.clone())))
    d._penalised = lambda regime: regime is not None and regime.penalties
    return d


@pytest.mark.parametrize("t", [1, 3, 5])
@pytest.mark.parametrize("regime,masked", list(itertools.product([None, "sampled", "penalised"], [False, True])))
def test_commit_body_kernel_equals_torch_form(t, regime, masked, monkeypatch):
    """The decoder's commit (hyspec.gpu.batch.BatchDecoder._commit_body) with the kernel and
    with its torch form: every buffer, the penalty window and what the GDN replay and the
    conv-window commit receive, for greedy, sampled, penalised and masked rounds."""
    import hyspec.gpu.batch as batch

    reg = None if regime is None else types.SimpleNamespace(penalties=regime == "penalised", sampled=regime == "sampled")
    for seed in range(2):
        nb = S - seed
        arms = [_decoder(seed, H, kernel) for kernel in (True, False)]
        for d in arms:
            monkeypatch.setattr(batch, "accept_sampled", lambda dec, nb_, t_, rg, plain, k_lane, d=d: (
                torch.minimum(d.acc[0][:nb_], k_lane).clamp(max=t_ - 1), d.acc[1][:nb_].clone()))
            monkeypatch.setattr(batch, "gdn_window_commit", lambda conv, conv_in, j, nb_, t_, d=d: d.calls.append(
                ("window", j.clone())))
            d.conv = d.conv_in = None
            batch.BatchDecoder._commit_body(d, nb, t, regime=reg, plain=True, masked=masked)
        a, b = arms
        for name in ("argmax", "pos", "pending", "fill_tokens", "fill_start", "fill_rows", "fill_h", "h_last",
                     "result", "logits", "n_keep", "j_keep"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (name, seed)
        for name in ("last_n", "length", "ring", "counts"):
            assert torch.equal(getattr(a.window, name), getattr(b.window, name)), ("window." + name, seed)
        assert [c[0] for c in a.calls] == [c[0] for c in b.calls] == ["linear", "window"]
        assert all(torch.equal(x[1], y[1]) for x, y in zip(a.calls, b.calls))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 4])
def test_bad_rows_kernel_matches_reference(t, dtype):
    """hyspec.kernels.commit.bad_rows (one launch) == bad_rows_ref: each lane's first verify
    row holding NaN or +inf, read at the row's argmax (torch's: its first NaN, else its
    maximum), into a strided column (the batched decoder's result[:, -1]); argmax a strided
    slice of a wider buffer; -inf entries and finite rows are not bad; lanes past nb are
    not written. Checked against the definition (a whole-row scan) too, and a planted bug
    (the last bad row instead of the first) differs."""
    from hyspec.kernels.commit import bad_rows, bad_rows_ref

    g = torch.Generator().manual_seed(t)
    nb, Vb, NO = 5, 37, 2**31 - 1
    x = torch.randn(nb * t + 2, Vb, generator=g).to(dtype)
    x[0, 3] = float("-inf")  # not bad
    x[1, 5] = float("nan")
    x[1, 9] = float("inf")
    x[2 * t - 1, 0] = float("inf")
    x[3 * t, 7] = float("nan")
    x[3 * t + t - 1, 2] = float("nan")
    x[4 * t + t - 1, 1] = float("-inf")
    x = x.to(DEV)
    wide = torch.zeros(nb + 2, t + 3, dtype=torch.long, device=DEV)
    wide[:nb * 1, :t] = x[: nb * t].argmax(-1).view(nb, t)
    argmax = wide[:, :t]
    res = [torch.full((nb + 2, 6), -5, dtype=torch.long, device=DEV) for _ in range(2)]
    bad_rows(x, argmax, res[0][:, -1], nb, t, NO)
    bad_rows_ref(x, argmax, res[1][:, -1], nb, t, NO)
    assert torch.equal(res[0], res[1])
    xs = x[: nb * t].float().view(nb, t, Vb)
    want = [next((j for j in range(t) if bool(torch.isnan(xs[b, j]).any() or (xs[b, j] == float("inf")).any())), NO)
            for b in range(nb)]
    assert res[0][:nb, -1].tolist() == want and res[0][nb:, -1].tolist() == [-5, -5]
    assert want != [NO] * nb and NO in want
    last = [max((j for j in range(t) if bool((~(xs[b, j] < float("inf"))).any())), default=NO) for b in range(nb)]
    assert t == 1 or last != want  # (the planted bug's answer: the comparison would see it)
