"""State identity and faults: a session's state restored from the prefix store (also after
demotion to host memory and promotion back) or from a saved file is bitwise the live
state, and continues with identical tokens; an exception mid-round leaves a session at
its last committed state, usable, as if the round never started."""

from __future__ import annotations

import os

import pytest

from conftest import ARCHS
from hyspec.core.slots import SlotPool
from hyspec.core.state import capture, restore_into, same_state
from hyspec.engine import Engine
from hyspec.sampling import SamplingParams
from hyspec.session import Session
from session_helpers import MAX_NEW, assert_same, engine, messages

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=11)


def slot_equals(slot, st) -> bool:
    """The slot holds exactly the state's tensors in every row that is read later."""
    c = slot.cache
    if c.pos != st.pos:
        return False
    ok = all(a.conv.equal(cv) and a.ssm.equal(sm) for a, cv, sm in zip(c.linear_states, st.conv, st.ssm))
    ok &= all(b.k[:, : st.pos].equal(k) and b.v[:, : st.pos].equal(v)
              for b, k, v in zip(c.kv_buffers, st.kv_k, st.kv_v))
    if st.draft_k is not None:
        n = st.draft_k.shape[1]
        ok &= slot.draft_kv.k[:, :n].equal(st.draft_k) and slot.draft_kv.v[:, :n].equal(st.draft_v)
    return ok


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k,params", [(3, None), (2, SEEDED)])
def test_store_hit_and_demotion_are_bitwise(zoo, arch, k, params):
    eng = engine(zoo, arch)
    msgs = messages(eng.model.cfg.vocab_size, 4, seed=10)
    s = eng.session(draft=k, params=params, max_new_tokens=MAX_NEW)
    for m in msgs[:3]:
        s.send(m)
    live = s.live_state()
    drafter = "post"
    hit = eng.store.lookup(s.tokens + msgs[3], drafter=drafter)
    assert_same(hit, live, "store hit")
    eng.store.demote(s.tokens)
    assert eng.store.tier_of(s.tokens) == "host" and eng.store.stats()["bytes_host"] > 0
    back = eng.store.lookup(s.tokens + msgs[3], drafter=drafter)
    assert eng.store.tier_of(s.tokens) == "device" and eng.store.promotions == 1
    assert_same(back, live, "after demotion and promotion")
    slot = SlotPool(eng.model).alloc(back.pos + 40)
    restore_into(back, slot)
    assert slot_equals(slot, live)
    # continuing: the restored state (a fresh session, and a one-shot request) == the live session
    twin = Session.from_state(eng, back, draft=k, params=params, max_new_tokens=MAX_NEW, use_store=False)
    eng.store.demote(s.tokens)
    one = eng.generate(s.tokens + msgs[3], max_new_tokens=MAX_NEW, draft=k, params=params)
    want = s.send(msgs[3]).tokens
    assert twin.send(msgs[3]).tokens == want and one.tokens == want
    assert_same(twin.live_state(), s.live_state(), "continued")


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_is_bitwise(zoo, arch, tmp_path):
    eng = engine(zoo, arch)
    msgs = messages(eng.model.cfg.vocab_size, 4, seed=11)
    s = eng.session(draft=3, params=SEEDED, max_new_tokens=MAX_NEW)
    for m in msgs[:3]:
        s.send(m)
    s.save(tmp_path / "s.pt", extra={"note": "x"})
    other = Engine(eng.model)  # a new engine: empty store, no slots
    other.session_graphs = eng.session_graphs  # (the same path: the core's, session_helpers.engine)
    t = Session.load(other, tmp_path / "s.pt")
    assert t.extra == {"note": "x"}
    assert_same(t.state(), s.live_state(), "loaded")
    assert t.state().digest() == s.state().digest()
    for a, b in zip(t._points[1:], s._points[1:]):
        assert_same(a.state, b.state, "rewind points")
    assert t.send(msgs[3]).tokens == s.send(msgs[3]).tokens
    assert_same(t.live_state(), s.live_state(), "continued after load")
    t.rewind(2)
    s.rewind(2)
    assert_same(t.live_state(), s.live_state(), "rewound after load")
    other = next(a for a in ARCHS if a != arch)  # another family: another config and other weights
    with pytest.raises(ValueError, match="different model"):
        Session.load(Engine(zoo.model("tiny", other, "float32", "coop")), tmp_path / "s.pt")


class Boom(RuntimeError):
    pass


def inject(backend, name: str, at: int):
    """Make backend.<name> raise on its at-th call from now (1-based); returns an undo."""
    orig = getattr(backend, name)
    calls = {"n": 0}

    def f(*a, **kw):
        calls["n"] += 1
        if calls["n"] == at:
            raise Boom(f"injected in {name}")
        return orig(*a, **kw)

    setattr(backend, name, f)
    return lambda: setattr(backend, name, orig)


@pytest.mark.parametrize("arch", ARCHS)
def test_fault_in_the_drafter_mid_turn(zoo, arch):
    """An exception in an MTP call (the refill or a chained draft) of some round: the
    session is at the state after the round before, and continues from it."""
    eng = engine(zoo, arch)
    sched = eng.session_scheduler()
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=14)
    ref = eng.session(draft=3, max_new_tokens=MAX_NEW + 6, use_store=False)
    ref.send(msgs[0])
    after_round = []
    ref.send(msgs[1], on_tokens=lambda t: sched.active and after_round.append(capture(sched.active[0])))
    for at in (4, 7):
        s = eng.session(draft=3, max_new_tokens=MAX_NEW + 6, use_store=False)
        s.send(msgs[0])
        undo = inject(sched.backend, "mtp", at)
        try:
            with pytest.raises(Boom):
                s.send(msgs[1])
        finally:
            undo()
        match = [st for st in after_round if st.tokens == tuple(s.tokens)]
        assert len(match) == 1, at
        assert_same(s.live_state(), match[0], f"mtp call {at}")
        twin = Session.from_state(eng, match[0], draft=3, max_new_tokens=MAX_NEW, use_store=False)
        assert s.send(msgs[2], max_new_tokens=MAX_NEW).tokens == twin.send(msgs[2]).tokens


def _second_turn_rounds(eng, msgs, k):
    """A reference session's state after each round of its second turn (msgs[1]), and a
    session of the same settings after its first turn (the second is the one to fault)."""
    sched = eng.session_scheduler()
    ref = eng.session(draft=k, max_new_tokens=MAX_NEW + 6, use_store=False)
    ref.send(msgs[0])
    after_round = []
    ref.send(msgs[1], on_tokens=lambda t: sched.active and after_round.append(capture(sched.active[0])))
    s = eng.session(draft=k, max_new_tokens=MAX_NEW + 6, use_store=False)
    s.send(msgs[0])
    return ref, after_round, s


@pytest.mark.parametrize("arch", ARCHS)
def test_fault_mid_round_leaves_last_committed_state(zoo, arch):
    eng = engine(zoo, arch)
    sched = eng.session_scheduler()
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=12)
    for k in (3, 0):
        ref, after_round, s = _second_turn_rounds(eng, msgs, k)
        undo = inject(sched.backend, "verify", 3)
        try:
            with pytest.raises(Boom):
                s.send(msgs[1])
        finally:
            undo()
        assert_same(s.live_state(), after_round[1], f"k={k}: after the failed round")
        # the failed turn's stats are the last turn's (chat /stats reads its tokens from them)
        kept = len(s.tokens) - len(s._points[1].state.tokens) - len(msgs[1])
        assert s.num_turns == 2 and s.last_stats["turn"] == 2 and s.last_stats["finish_reason"] == "error"
        assert s.last_stats["generated_tokens"] == kept > 0 and "injected in verify" in s.last_stats["error"]
        assert_same(s.state(), after_round[1])
        twin = Session.from_state(eng, after_round[1], draft=k, max_new_tokens=MAX_NEW, use_store=False)
        assert s.send(msgs[2], max_new_tokens=MAX_NEW).tokens == twin.send(msgs[2]).tokens
        assert_same(s.live_state(), twin.live_state())
        s.rewind(2)  # the failed turn is a turn: rewinding it returns to before it
        assert len(s.tokens) == len(ref._points[1].state.tokens)
        assert_same(s.live_state(), ref._points[1].state)


@pytest.mark.parametrize("arch", ARCHS)
def test_fault_in_prefill_leaves_the_turn_unstarted(zoo, arch):
    eng = engine(zoo, arch)
    sched = eng.session_scheduler()
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=13)
    ref = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    want = [ref.send(m).tokens for m in msgs]
    s = eng.session(draft=2, max_new_tokens=MAX_NEW, use_store=False)
    s.send(msgs[0])
    s.send(msgs[1])
    before = s.state()
    for name in ("prefill", "prefill_draft"):
        undo = inject(sched.backend, name, 1)
        try:
            with pytest.raises(Boom):
                s.send(msgs[2])
        finally:
            undo()
        assert s.num_turns == 2 and s.state() is before
        assert_same(s.live_state(), before)
        assert list(sched.pool.used.values()) == [ref._seq.slot]  # the failed turn's slot went back (ref: its own)
    assert s.send(msgs[2]).tokens == want[2]
    assert same_state(s.live_state(), ref.live_state())


def test_a_truncated_session_file_is_a_value_error_naming_it(tmp_path):
    """A session file cut short is a ValueError naming the file, whatever torch's zip reader
    raises: at some lengths it raises OSError "[Errno 22] Invalid argument", naming no file,
    which Session.load passed on as it was (`hyspec chat` said "[error: [Errno 22] Invalid
    argument]")."""
    import torch

    torch.save({"format": "x", "t": torch.zeros(100_000)}, tmp_path / "whole.pt")
    data = (tmp_path / "whole.pt").read_bytes()
    for n in (100, 5000, 50_000, len(data) - 10):  # (5000, 50000: the OSError)
        (tmp_path / "cut.pt").write_bytes(data[:n])
        with pytest.raises(ValueError, match=r"cut\.pt: not a hyspec session file, or a damaged \(truncated\?\) one"):
            Session.load(None, tmp_path / "cut.pt")  # (fails reading the file, before the engine is used)


def test_a_damaged_or_edited_session_file_fails_at_load(zoo, tmp_path):
    """Session.load checks each state against the model (layer counts, tensor shapes and
    dtypes, token ids, pos vs tokens) and against the digest saved beside it: a flipped
    bit, a wrong shape, a missing tensor or tokens cut short is a ValueError naming the
    file (were: loaded, then wrong tokens or an error deep in the first send); an intact
    file written before digests were saved still loads; from_state checks a state too."""
    import torch

    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 2, seed=12)
    s = eng.session(draft=3, max_new_tokens=MAX_NEW)
    for m in msgs:
        s.send(m)
    good = tmp_path / "good.pt"
    s.save(good)
    d = torch.load(good, weights_only=True)

    def load_edited(edit):
        x = torch.load(good, weights_only=True)
        edit(x)
        torch.save(x, tmp_path / "bad.pt")
        return Session.load(eng, tmp_path / "bad.pt")

    def flip(x):
        t = x["state"]["tensors"]["ssm.0"]
        t.view(torch.int32)[0, 0, 0] ^= 1 << 30

    with pytest.raises(ValueError, match=r"bad\.pt: .*damaged.*current"):
        load_edited(flip)
    with pytest.raises(ValueError, match=r"bad\.pt: .*damaged.*rewind point 1"):
        load_edited(lambda x: x["history"][1]["tensors"]["conv.0"].mul_(2))
    with pytest.raises(ValueError, match=r"conv\.0 is \(2, 3\)"):
        load_edited(lambda x: x["state"]["tensors"].__setitem__("conv.0", torch.zeros(2, 3)))
    with pytest.raises(ValueError, match="no kv_k.0 tensor"):
        load_edited(lambda x: x["state"]["tensors"].pop("kv_k.0"))
    with pytest.raises(ValueError, match="position .* does not fit"):
        load_edited(lambda x: x["state"]["meta"].__setitem__("tokens", x["state"]["meta"]["tokens"][:-3]))
    with pytest.raises(ValueError, match="vocabulary"):
        load_edited(lambda x: x["state"]["meta"]["tokens"].__setitem__(0, 10 ** 9))
    for key in ("matchers", "telemetries", "drafts", "replies"):  # a rewind point's field missing
        with pytest.raises(ValueError, match=r"bad\.pt: .*damaged.*their digest differs"):
            load_edited(lambda x: x[key].pop())
        with pytest.raises(ValueError, match=r"bad\.pt: .*damaged.*differ in number"):  # (and without the record's
            load_edited(lambda x: (x[key].pop(), x["digests"].pop("record")))  # digest: an older file)
    # the rest of the file has its digest too: a changed seed or penalty, reply, telemetry or
    # extra loaded without a word and ran differently
    for edit in (lambda x: x["settings"]["params"].__setitem__("seed", 3),
                 lambda x: x["settings"]["params"].__setitem__("repetition_penalty", 1.0000000000000002),
                 lambda x: x["reply"].append(1), lambda x: x.__setitem__("last_draft", 2),
                 lambda x: x["extra"].__setitem__("k", torch.zeros(2))):
        with pytest.raises(ValueError, match=r"bad\.pt: .*damaged: its settings, replies, telemetry or extra"):
            load_edited(edit)
    assert Session.load(eng, good).state().digest() == s.state().digest()
    # the record's digest does not depend on the process: a set's order follows the hash seed, and a
    # sparse or conjugate tensor has no plain bytes (the one failed its load, the other its save)
    extra = {"tags": {"alpha", "beta", "gamma", "delta", "eps"},
             "sp": torch.eye(3).to_sparse(), "cj": torch.tensor([1 + 2j]).conj()}
    s.save(tmp_path / "extra.pt", extra=extra)
    back = Session.load(eng, tmp_path / "extra.pt").extra
    assert back["tags"] == extra["tags"] and torch.equal(back["sp"].to_dense(), torch.eye(3))
    import subprocess
    import sys

    from hyspec.session import _record_digest

    code = ("import sys, torch; from hyspec.session import _record_digest; "
            "print(_record_digest({'extra': {'k': {'a', 'b', 'c', 'd', 'e'}, 'f': {frozenset({'x', 'y'}): 1}}}))")
    seeds = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                            capture_output=True, text=True, check=True).stdout.strip() for seed in (1, 2, 3)}
    assert seeds == {_record_digest({"extra": {"k": {"a", "b", "c", "d", "e"}, "f": {frozenset({"x", "y"}): 1}}})}
    old = load_edited(lambda x: x.pop("digests"))  # an older file: no digests, the layout still checked
    assert old.state().digest() == s.state().digest() == d["digests"]["state"]
    st = s.state()
    with pytest.raises(ValueError, match="position"):
        Session.from_state(eng, type(st)(**{**st.__dict__, "pos": st.pos + 1}))


def test_session_file_robustness(zoo, tmp_path):
    """Saving and loading session files: two threads saving to one path never leave an
    unreadable file (nor fail: each save writes its own temporary file); an existing file's
    mode is kept; a huge declared layer count is a ValueError (was a list of that many
    Nones: out of memory); a pipe is refused, not waited on; a newer format and another
    dtype are named in the refusal."""
    import stat
    import threading

    import torch

    eng = engine(zoo, "qwen3_5")
    msgs = messages(eng.model.cfg.vocab_size, 2, seed=5)
    a, b = eng.session(draft=3, max_new_tokens=MAX_NEW), eng.session(max_new_tokens=MAX_NEW)
    a.send(msgs[0])
    b.send(msgs[1])
    f = tmp_path / "s.pt"
    errors = []

    def saver(s):
        for _ in range(4):
            try:
                s.save(f)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    for _ in range(6):
        threads = [threading.Thread(target=saver, args=(s,)) for s in (a, b)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert Session.load(eng, f).tokens in (a.tokens, b.tokens)
    assert errors == []
    assert not [x for x in os.listdir(tmp_path) if x.endswith(".tmp")]
    os.chmod(f, 0o600)
    a.save(f)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600

    def edited(edit, name):
        d = torch.load(f, weights_only=True)
        edit(d)
        torch.save(d, tmp_path / name)
        return tmp_path / name

    huge = edited(lambda d: d["state"]["meta"].__setitem__("n_linear", 10 ** 12), "huge.pt")
    with pytest.raises(ValueError, match=r"huge\.pt: .*declares 1000000000000 layers"):
        Session.load(eng, huge)
    newer = edited(lambda d: d.__setitem__("format", "hyspec-session/2"), "newer.pt")
    with pytest.raises(ValueError, match=r"newer\.pt: a session file of format 'hyspec-session/2'.*newer hyspec"):
        Session.load(eng, newer)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="not a regular file"):
        Session.load(eng, tmp_path / "fifo")
    other = engine(zoo, "qwen3_next")  # (another family: on a GPU the helper loads every zoo model in float32)
    with pytest.raises(ValueError, match=r"different model \(model_type '\w+' there, '\w+' here"):
        Session.load(other, f)
    if eng.model.dtype == torch.float64:  # (the CPU's zoo engines)
        with pytest.raises(ValueError, match=r"different model \(dtype 'float64' there, 'float32' here\)"):
            Session.load(engine(zoo, "qwen3_5", dtype="float32"), f)
    assert Session.load(eng, f).tokens == a.tokens


def test_a_session_of_another_tokenizer_is_refused(tmp_path):
    """The model's fingerprint covers config, dtype and weights: a session saved with one
    tokenizer.json loaded in silence beside another (its transcript then read as other text)."""
    import json
    import shutil

    from hyspec.tiny import make_tiny

    make_tiny("qwen3_5", tmp_path / "a")
    eng = Engine.load(str(tmp_path / "a"))
    s = eng.session(max_new_tokens=3)
    s.send("def f(x):")
    s.save(tmp_path / "s.pt")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    tj = json.loads((tmp_path / "b" / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    x, y = sorted(vocab, key=vocab.get)[100:102]
    vocab[x], vocab[y] = vocab[y], vocab[x]  # two tokens' ids swapped
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match="another tokenizer"):
        Session.load(Engine.load(str(tmp_path / "b")), tmp_path / "s.pt")
    assert Session.load(Engine.load(str(tmp_path / "a")), tmp_path / "s.pt").tokens == s.tokens


_FINGERPRINT_RSS = """
import resource, sys, types
import torch
import hyspec.session as S
S.FINGERPRINT_CHUNK = 1 << 20
p = torch.ones(1 << 25)  # 128 MiB of float32: its whole float64 copy would be 256 MiB
model = types.SimpleNamespace(cfg=types.SimpleNamespace(x=1), dtype=torch.float32, state_dict=lambda: {"w": p})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
fp = S.model_fingerprint(model)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024, fp)
"""


def test_the_model_fingerprint_sums_large_tensors_a_chunk_at_a_time(zoo):
    """A session's save / load fingerprints the weights with a float64 sum per tensor; the
    float64 copy of a whole tensor (Qwen3.5-27B's embedding: 10 GB) was made at once, on the
    device, beside the weights and the slots. Large tensors are now summed a chunk at a time
    (peak memory measured in a fresh process), and a model without such tensors keeps the
    fingerprint it had (session files saved before still load)."""
    import hashlib
    import subprocess
    import sys
    from pathlib import Path

    import torch

    import hyspec.session as S

    eng = engine(zoo, "qwen3_5")
    h = hashlib.blake2b(digest_size=12)  # the formula before: one float64 copy per tensor
    h.update(repr(sorted(eng.model.cfg.__dict__.items())).encode())
    h.update(str(eng.model.dtype).encode())
    for name, p in sorted(eng.model.state_dict().items()):
        h.update(name.encode())
        h.update(repr(float(p.double().sum())).encode())
    assert S.model_fingerprint(eng.model) == h.hexdigest()
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", _FINGERPRINT_RSS], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-2000:]
    grew_mib = int(r.stdout.split()[0])
    assert grew_mib < 64, f"the fingerprint took {grew_mib} MiB beside a 128 MiB tensor"
    big = torch.randn(3 << 24)
    assert abs(S._sum64(big) - float(big.double().sum())) < 1e-6 * float(big.abs().double().sum())


@pytest.mark.parametrize("k", [3, 0])
@pytest.mark.parametrize("fault", ["overflow", "raise"])
def test_a_round_failing_after_its_verify_forward_leaves_last_committed_state(zoo, k, fault):
    """A round whose verify forward has run (written the cache: KV rows, SSM state) and then
    fails mid-turn -- its target rows overflow ("overflow": NonFiniteLogits, the sequence's
    own error, not an exception out of the round) or an exception comes out of it ("raise":
    e.g. out of memory as the logits come back) -- is undone as one failing before the
    forward: the session is at the state after the round before, and continues from it as a
    session restored there."""
    import torch

    from hyspec.sampling import NonFiniteLogits

    eng = engine(zoo, "qwen3_5")
    sched = eng.session_scheduler()
    msgs = messages(eng.model.cfg.vocab_size, 3, seed=12)
    _, after_round, s = _second_turn_rounds(eng, msgs, k)
    orig, calls = sched.backend.verify, {"n": 0}

    def verify(items, **kw):  # the third verify runs, then its logits are NaN or it fails
        out = orig(items, **kw)
        calls["n"] += 1
        if calls["n"] != 3:
            return out
        if fault == "raise":
            raise Boom("after the verify forward")
        return [(a, b, torch.full_like(lg, float("nan"))) for a, b, lg in out]

    sched.backend.verify = verify
    try:
        with pytest.raises(NonFiniteLogits if fault == "overflow" else Boom):
            s.send(msgs[1])
    finally:
        sched.backend.verify = orig
    assert_same(s.live_state(), after_round[1], f"k={k}, {fault}: after the failed round")
    twin = Session.from_state(eng, after_round[1], draft=k, max_new_tokens=MAX_NEW, use_store=False)
    assert s.send(msgs[2], max_new_tokens=MAX_NEW).tokens == twin.send(msgs[2]).tokens


def _toy_state(**kw):
    import torch

    from hyspec.core.state import SeqState

    g = torch.Generator().manual_seed(0)
    r = (lambda *s: torch.randn(*s, generator=g))
    base = dict(tokens=(3, 4, 5), pos=2, conv=[r(2, 6)], ssm=[r(2, 3, 3)], kv_k=[r(1, 2, 4)], kv_v=[r(1, 2, 4)],
                pending=5, drafter="post", draft_k=r(1, 1, 4), draft_v=r(1, 1, 4), h_last=r(1, 8), fill_tokens=[4],
                fill_h=r(1, 8), fill_start=1, last_logits=r(1, 10), k_next=2)
    return SeqState(**{**base, **kw})


def test_a_state_copy_keeps_every_value_and_its_identity_sees_them():
    """SeqState.to (tiering: a copy elsewhere) and to_dict / from_dict (a session file) keep
    every tensor and every loop value (the adaptive K included): same_state and digest say
    equal; a state differing in a value alone (its k_next, its tokens) is another state for
    both; a file declaring more layers than it holds tensors is refused."""
    from hyspec.core.state import SeqState

    st = _toy_state()
    for copy in (st.to("cpu"), SeqState.from_dict(st.to_dict())):
        assert copy is not st and copy.conv[0] is not st.conv[0]
        assert same_state(copy, st) and copy.digest() == st.digest() and copy.meta() == st.meta()
    for other in (_toy_state(k_next=3), _toy_state(tokens=(3, 4, 6), pending=6)):
        assert not same_state(other, st) and other.digest() != st.digest()
    d = st.to_dict()
    d["meta"]["n_attn"] = 10 ** 6
    with pytest.raises(ValueError, match="declares 1000000 layers"):
        SeqState.from_dict(d)


def test_check_state_refuses_a_pending_token_or_drafter_rows_that_do_not_fit(zoo):
    """check_state (a state from outside: a session file, Session.from_state): the pending
    token is the transcript's last one (one that is not was run as the next input, in place
    of the token the transcript holds), and the drafter rows start at or below the position."""
    from hyspec.core.state import check_state

    eng = engine(zoo, "qwen3_5")
    s = eng.session(draft=3, max_new_tokens=4)
    s.send(messages(eng.model.cfg.vocab_size, 1, seed=3)[0])
    st = s.state()
    check_state(st, eng.model)
    V, last = eng.model.cfg.vocab_size, st.tokens[-1]
    edited = dict(st.__dict__, pos=len(st.tokens) - 1, pending=(last + 1) % V)
    with pytest.raises(ValueError, match="does not fit its"):
        check_state(type(st)(**edited), eng.model)
    assert st.drafter is not None
    with pytest.raises(ValueError, match="drafter rows start at"):
        check_state(type(st)(**{**st.__dict__, "fill_start": st.pos + 1}), eng.model)
    pool = SlotPool(eng.model)
    with pytest.raises(ValueError, match=f"a slot of {st.pos - 1} rows cannot hold a state of {st.pos} tokens"):
        restore_into(st, pool.alloc(st.pos - 1))
    slot = pool.alloc(st.pos)  # (exactly its rows: enough)
    restore_into(st, slot)
    assert slot_equals(slot, st)


def test_a_round_transaction_undoes_every_value_the_round_changed():
    """RoundTxn.restore puts back what a failed round of a kept sequence changed: the cache,
    the loop values, the drafter's queued tokens, the tokens and log-probabilities it had
    emitted (else the transcript held tokens the cache never committed) and its telemetry."""
    from types import SimpleNamespace

    from hyspec.core.state import RoundTxn

    class Cache:
        def __init__(self):
            self.pos = 5

        def snapshot(self):
            return self.pos

        def restore(self, snap):
            self.pos = snap

    seq = SimpleNamespace(cache=Cache(), fill_tokens=[7], out=[1, 2], req=SimpleNamespace(token_logprobs=[(-1.0, [])]),
                          tel=SimpleNamespace(rounds=3, accepted=[1, 0]), round="r",
                          **{f: f for f in RoundTxn.FIELDS})
    before = {f: getattr(seq, f) for f in RoundTxn.FIELDS}
    txn = RoundTxn(seq)
    seq.cache.pos = 9
    seq.fill_tokens.extend([8, 9])  # (in place, as a round queues drafter rows)
    seq.out.extend([3, 4])
    seq.req.token_logprobs.append((-2.0, []))
    seq.tel.rounds += 1
    seq.tel.accepted[0] += 1
    for f in RoundTxn.FIELDS:
        setattr(seq, f, None)
    txn.restore(seq)
    assert seq.cache.pos == 5 and seq.fill_tokens == [7] and seq.out == [1, 2] and seq.round is None
    assert seq.req.token_logprobs == [(-1.0, [])] and seq.tel.rounds == 3 and seq.tel.accepted == [1, 0]
    assert {f: getattr(seq, f) for f in RoundTxn.FIELDS} == before
