"""A sequence's whole decoding state at a round boundary, as values: what a session keeps
between turns, what the prefix store holds, what `/save` writes.

SeqState = the slot's contents that are final (linear-layer conv + SSM states, the
attention KV rows below pos, the draft KV rows below the next refill start) plus the
Sequence's loop variables (pending token, last hidden, the drafter rows still queued,
the row predicting the next position, the adaptive K). RNG needs nothing: draws are keyed
by (seed, stream, absolute position), and positions continue with the transcript.

Invariant (hyspec/core/round.py commits only emitted tokens): `tokens` is the transcript
(every token so far); cache.pos == len(tokens) - 1 when a token is pending (it is then
tokens[-1]) and == len(tokens) when none is.

RoundTxn makes a round transactional for one sequence: taken before the round, restored
when the round raises, so a kept sequence is left exactly at its last committed state.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field

import torch


CHECKSUM_CHUNK = 1 << 21  # 16-bit words per reduction: a chunk's sums stay below 2**58
_WEIGHTS: dict[torch.device, torch.Tensor] = {}  # the position weights of a chunk, per device


def _chunk_weights(dev: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(dev)
    if w is None:
        idx = torch.arange(CHECKSUM_CHUNK, dtype=torch.int64, device=dev)
        w = _WEIGHTS[dev] = (((idx * 40503) ^ (idx >> 11)) & 0xFFFFF) + 1  # [CHUNK] in [1, 2**20]
    return w


def _words(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as 16-bit words (a view; a padded copy when t's byte length is odd or
    its bytes start at an odd offset, as a 1-byte tensor's slice can)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 2 or b.storage_offset() % 2:
        b = torch.cat([b, b.new_zeros(b.numel() % 2)])
    return b.view(torch.int16)


def bytes_checksum(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(sum of words, weighted sum of words) mod 2**64 over the bytes of `tensors`, read as
    little-endian 16-bit words, chunk by chunk: a word's weight is in [1, 2**20] and
    depends on its place in its chunk (CHECKSUM_CHUNK words from the start of its tensor),
    a chunk's weighted sum is multiplied by an odd number that grows with the chunk's place
    in the whole list. Exact integer arithmetic on the tensors' own devices (no copy of the
    state; one small read back per device), so equal bytes give equal checksums wherever
    they live; a change of any one word always changes the weighted sum, and moved or
    swapped rows show too (their weights differ)."""
    parts: dict[torch.device, list[torch.Tensor]] = {}
    order: list[torch.device] = []  # the device of each chunk, in order
    for t in tensors:
        words = _words(t)
        dev = words.device
        for lo in range(0, words.numel(), CHECKSUM_CHUNK):
            w = words[lo: lo + CHECKSUM_CHUNK].to(torch.int64) & 0xFFFF  # [n] in [0, 65535]
            parts.setdefault(dev, []).append(torch.stack([w.sum(), (w * _chunk_weights(dev)[: w.numel()]).sum()]))
            order.append(dev)
    got = {dev: iter(torch.stack(p).tolist()) for dev, p in parts.items()}  # one read back per device
    a = c = 0
    for k, dev in enumerate(order):
        x, y = next(got[dev])
        a, c = a + x, c + y * (2 * k + 1)
    mask = (1 << 64) - 1
    return (a & mask, c & mask)


@dataclass(eq=False)
class SeqState:
    tokens: tuple[int, ...]
    pos: int
    conv: list[torch.Tensor]  # per linear layer [W-1, C]
    ssm: list[torch.Tensor]  # per linear layer [Hv, Dk, Dv]
    kv_k: list[torch.Tensor]  # per attention layer [Hkv, pos, D]
    kv_v: list[torch.Tensor]
    pending: int | None
    drafter: str | None = None  # SpecOptions.hidden the draft rows were built with; None: no draft rows
    draft_k: torch.Tensor | None = None  # [Hkv, fill_start, D]
    draft_v: torch.Tensor | None = None
    h_last: torch.Tensor | None = None  # [1, H] target hidden at pos - 1
    fill_tokens: list[int] = field(default_factory=list)  # drafter rows queued from fill_start
    fill_h: torch.Tensor | None = None  # [len(fill_tokens), H]
    fill_start: int = 0
    last_logits: torch.Tensor | None = None  # [1, V] the row predicting position pos
    k_next: int = 0

    # -- views -------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor by name (for identity checks, saving, moving)."""
        out = {}
        for i, t in enumerate(self.conv):
            out[f"conv.{i}"] = t
        for i, t in enumerate(self.ssm):
            out[f"ssm.{i}"] = t
        for i, t in enumerate(self.kv_k):
            out[f"kv_k.{i}"] = t
        for i, t in enumerate(self.kv_v):
            out[f"kv_v.{i}"] = t
        for name in ("draft_k", "draft_v", "h_last", "fill_h", "last_logits"):
            t = getattr(self, name)
            if t is not None:
                out[name] = t
        return out

    def meta(self) -> dict:
        return {"tokens": list(self.tokens), "pos": self.pos, "pending": self.pending, "drafter": self.drafter,
                "fill_tokens": list(self.fill_tokens), "fill_start": self.fill_start, "k_next": self.k_next,
                "n_linear": len(self.conv), "n_attn": len(self.kv_k)}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def device(self) -> torch.device:
        return self.conv[0].device if self.conv else self.kv_k[0].device

    def digest(self) -> str:
        """The state's identity: a hash of the metadata, every tensor's name, dtype and
        shape, and a checksum of all tensor bytes computed where they live (bytes_checksum:
        a few reductions on the device and one small read back, not a copy of the state
        to the host; equal on every device, so a state demoted to host memory keeps it)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(sorted(self.meta().items())).encode())
        tensors = self.tensors()
        for name, t in tensors.items():
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(repr(bytes_checksum(list(tensors.values()))).encode())  # the same on every device
        return h.hexdigest()

    def to(self, device) -> "SeqState":
        """A copy with every tensor on `device` (tiering: demote to host, promote back)."""
        mv = (lambda t: None if t is None else t.to(device, copy=True))
        return SeqState(tuple(self.tokens), self.pos, [mv(t) for t in self.conv], [mv(t) for t in self.ssm],
                        [mv(t) for t in self.kv_k], [mv(t) for t in self.kv_v], self.pending, self.drafter,
                        mv(self.draft_k), mv(self.draft_v), mv(self.h_last), list(self.fill_tokens), mv(self.fill_h),
                        self.fill_start, mv(self.last_logits), self.k_next)

    # -- to / from plain values (torch.save with weights_only loading) ----------------------
    def to_dict(self) -> dict:
        return {"meta": self.meta(), "tensors": {k: t.detach().cpu() for k, t in self.tensors().items()}}

    @classmethod
    def from_dict(cls, d: dict, device="cpu") -> "SeqState":
        m, t = d["meta"], d["tensors"]
        for key in ("n_linear", "n_attn"):  # (a huge count built a list of that many Nones: out of memory)
            if not 0 <= int(m[key]) <= len(t):
                raise ValueError(f"the state declares {m[key]} layers ({key}) but holds {len(t)} tensors")
        g = (lambda k: t[k].to(device) if k in t else None)
        return cls(tuple(int(x) for x in m["tokens"]), int(m["pos"]),
                   [g(f"conv.{i}") for i in range(m["n_linear"])], [g(f"ssm.{i}") for i in range(m["n_linear"])],
                   [g(f"kv_k.{i}") for i in range(m["n_attn"])], [g(f"kv_v.{i}") for i in range(m["n_attn"])],
                   m["pending"], m["drafter"], g("draft_k"), g("draft_v"), g("h_last"),
                   [int(x) for x in m["fill_tokens"]], g("fill_h"), int(m["fill_start"]), g("last_logits"),
                   int(m["k_next"]))


def check_state(st: SeqState, model) -> None:
    """ValueError naming what does not fit when a state from outside (a session file) is
    given to `model`: the layer counts, each tensor's shape and dtype (the model's cache
    layout: conv [W-1, C], SSM [Hv, Dk, Dv], KV [Hkv, pos, D]; the drafter's rows), the
    token ids, and the invariant between tokens, pos and the pending token."""
    from hyspec.cache import HybridCache

    cfg = model.cfg
    ref = HybridCache(cfg, 1, "meta", model.dtype)  # the layout, no memory
    ls, kv = ref.linear_states, ref.kv_buffers
    if (len(st.conv), len(st.ssm), len(st.kv_k), len(st.kv_v)) != (len(ls), len(ls), len(kv), len(kv)):
        raise ValueError(f"the state has {len(st.conv)} linear-attention and {len(st.kv_k)} attention layers; "
                         f"this model has {len(ls)} and {len(kv)}")
    n, V = len(st.tokens), cfg.vocab_size
    if not all(0 <= t < V for t in st.tokens) or not all(0 <= t < V for t in st.fill_tokens):
        raise ValueError(f"the state has token ids outside this model's vocabulary of {V}")
    pending_ok = st.pending is None or (n > 0 and st.pending == st.tokens[-1])
    if not pending_ok or st.pos != n - (st.pending is not None):
        raise ValueError(f"the state's position {st.pos} does not fit its {n} tokens (pending {st.pending}): "
                         f"pos must be len(tokens) - 1 with the last token pending, len(tokens) without")

    def want(name, t, shape, dtype) -> None:
        if t is None:
            raise ValueError(f"the state has no {name} tensor")
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"the state's {name} is {got}; this model needs {tuple(shape)} {dtype}")

    for i, r in enumerate(ls):
        want(f"conv.{i}", st.conv[i], r.conv.shape, r.conv.dtype)
        want(f"ssm.{i}", st.ssm[i], r.ssm.shape, r.ssm.dtype)
    for i, r in enumerate(kv):
        shape = (r.k.shape[0], st.pos, r.k.shape[2])
        want(f"kv_k.{i}", st.kv_k[i], shape, r.k.dtype)
        want(f"kv_v.{i}", st.kv_v[i], shape, r.v.dtype)
    H = cfg.hidden_size
    if st.last_logits is not None:
        want("last_logits", st.last_logits, (1, V), st.last_logits.dtype)
    if st.drafter is not None:
        if st.drafter not in ("post", "pre") or not getattr(model, "has_mtp", False):
            raise ValueError(f"the state has drafter rows ({st.drafter!r}) this model cannot use")
        if not 0 <= st.fill_start <= st.pos:
            raise ValueError(f"the state's drafter rows start at {st.fill_start}, beyond its position {st.pos}")
        dkv = model.new_draft_kv(1)  # the drafter's KV layout (one row)
        shape = (dkv.k.shape[0], st.fill_start, dkv.k.shape[2])
        want("draft_k", st.draft_k, shape, dkv.k.dtype)
        want("draft_v", st.draft_v, shape, dkv.v.dtype)
        want("h_last", st.h_last, (1, H), st.h_last.dtype if isinstance(st.h_last, torch.Tensor) else model.dtype)
        want("fill_h", st.fill_h, (len(st.fill_tokens), H),
             st.fill_h.dtype if isinstance(st.fill_h, torch.Tensor) else model.dtype)


def drafter_of(seq) -> str | None:
    return seq.opts.hidden if seq.speculative else None


def capture(seq) -> SeqState:
    """The state of a Sequence between rounds (a copy: later rounds do not change it)."""
    c = seq.cache
    ls = c.linear_states
    cl = (lambda t: None if t is None else t.clone())
    st = SeqState(tuple(seq.history), c.pos, [s.conv.clone() for s in ls], [s.ssm.clone() for s in ls],
                  [b.k[:, : c.pos].clone() for b in c.kv_buffers], [b.v[:, : c.pos].clone() for b in c.kv_buffers],
                  seq.pending, drafter_of(seq), k_next=seq.k_next, last_logits=cl(seq.last_logits))
    if st.drafter is not None:
        dkv = seq.slot.draft_kv
        n = len(seq.fill_tokens)
        st.draft_k, st.draft_v = dkv.k[:, : seq.fill_start].clone(), dkv.v[:, : seq.fill_start].clone()
        st.h_last, st.fill_tokens, st.fill_start = cl(seq.h_last), list(seq.fill_tokens), seq.fill_start
        st.fill_h = seq.fill_h[:n].clone()  # a constraint end leaves one hidden more than tokens (it is h_last)
    return st


def restore_into(st: SeqState, slot) -> None:
    """Write a state into a slot (of at least st.pos rows): the slot's cache then holds
    exactly the captured contents in every row that is read later."""
    c = slot.cache
    if c.max_len < st.pos:
        raise ValueError(f"a slot of {c.max_len} rows cannot hold a state of {st.pos} tokens")
    dev = c.kv_buffers[0].k.device if c.kv_buffers else c.linear_states[0].conv.device
    for s, cv, sm in zip(c.linear_states, st.conv, st.ssm):
        s.conv, s.ssm, s.record = cv.to(dev, copy=True), sm.to(dev, copy=True), None
    for b, k, v in zip(c.kv_buffers, st.kv_k, st.kv_v):
        b.k[:, : st.pos] = k
        b.v[:, : st.pos] = v
    c.pos = st.pos
    if st.draft_k is not None and slot.draft_kv is not None:
        n = st.draft_k.shape[1]
        slot.draft_kv.k[:, :n] = st.draft_k
        slot.draft_kv.v[:, :n] = st.draft_v


@dataclass
class Carry:
    """The drafter rows a resumed turn writes before its first round: the queued pairs
    (tokens, hiddens [m, H]) from row `start`, and whether the first fed token already
    has its pair queued (it was pending) or still pairs with h_last."""

    tokens: list[int]
    h: torch.Tensor
    start: int
    h_last: torch.Tensor
    first_queued: bool


def carry_of(src) -> Carry | None:
    """From a live Sequence or a SeqState (None when it has no drafter rows)."""
    if isinstance(src, SeqState):
        if src.drafter is None:
            return None
        n = len(src.fill_tokens)
        return Carry(list(src.fill_tokens), src.fill_h[:n], src.fill_start, src.h_last, src.pending is not None)
    if not src.speculative:
        return None
    n = len(src.fill_tokens)
    return Carry(list(src.fill_tokens), src.fill_h[:n], src.fill_start, src.h_last, src.pending is not None)


class RoundTxn:
    """A sequence's loop state and cache before a round; restore() undoes a failed round."""

    FIELDS = ("pending", "h_last", "fill_h", "fill_start", "last_logits", "k_next", "mtp_forwards", "direct",
              "extra_bytes", "reason", "t_first")

    def __init__(self, seq) -> None:
        self.snap = seq.cache.snapshot()
        self.vals = {f: getattr(seq, f) for f in self.FIELDS}
        self.fill_tokens = list(seq.fill_tokens)
        self.n_out = len(seq.out)
        self.n_lp = len(seq.req.token_logprobs)
        self.tel = copy.deepcopy(seq.tel.__dict__)

    def restore(self, seq) -> None:
        seq.cache.restore(self.snap)
        for f, v in self.vals.items():
            setattr(seq, f, v)
        seq.fill_tokens = self.fill_tokens
        del seq.out[self.n_out:]
        del seq.req.token_logprobs[self.n_lp:]
        seq.tel.__dict__.update(self.tel)
        seq.round = None


def same_state(a: SeqState, b: SeqState) -> bool:
    """Bitwise equality of every tensor and every value."""
    if a.meta() != b.meta():
        return False
    ta, tb = a.tensors(), b.tensors()
    if ta.keys() != tb.keys():
        return False
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bytes(x), _bytes(y)) for x, y in
               ((ta[k], tb[k]) for k in ta))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
