"""The prefix store: full decoding states at turn boundaries, keyed by their token sequence.

A hybrid model's prefix cannot be reused from attention KV alone: the Gated-DeltaNet
layers' recurrent state at a position exists only if it was kept (it cannot be rebuilt
from KV rows or rewound like them). So the store keeps whole sequence states
(hyspec.core.state.SeqState: linear-layer conv + SSM states, attention KV rows, MTP draft
KV rows, last hidden, pending token, queued drafter rows, the next-token row) at the
points where a turn ended, and a request whose tokens extend a stored sequence resumes
from the longest one and prefills only the rest.

Identity, by construction:
  * the key is the token tuple itself (a dict lookup compares the whole tuple, not a hash);
  * every entry carries a digest of its metadata and tensor bytes, taken when stored and
    checked again when it is handed out (verify="always", the default) or when it comes
    back from host memory (verify="promote"): an entry that fails is dropped and counted
    in `identity_failures`, never used;
  * a speculative request only takes entries that hold drafter rows built with the same
    hidden ("post"/"pre"); an entry equal to the whole prompt is taken only when it has a
    pending token (there must be something to prefill).

Memory: two tiers. `budget_bytes` caps the entries on the model's device; the least
recently used ones beyond it are demoted to host memory (a copy on the CPU; on a CPU
engine the two tiers are the same memory, still accounted separately), and promoted back
on a hit, to the device the state was put from. `host_budget_bytes` caps the host tier; beyond it the least recently used are
evicted. stats() reports hits, misses, tokens saved and bytes in each tier.
"""

from __future__ import annotations

import functools
import numbers
import operator
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from hyspec.core.state import SeqState

DEVICE, HOST = "device", "host"


def _key(tokens) -> tuple:
    """The entries' key of a token sequence: a tuple of Python ints (a tensor's elements are
    0-d tensors, hashed by identity: `tensor in store` was always False)."""
    return tuple(operator.index(t) for t in tokens)


@dataclass
class _Entry:
    state: SeqState
    tier: str
    digest: str
    nbytes: int
    home: torch.device  # where the state was put from: a promotion goes back there


def _locked(method):
    """Runs the method under the store's lock: the server's engine thread puts and looks up
    while /health reads the stats on the event loop (an OrderedDict iterated there while the
    other thread moved an entry: "mutated during iteration", a 500)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class PrefixStore:
    def __init__(self, *, budget_bytes: int = 1 << 30, host_budget_bytes: int = 4 << 30,
                 verify: str = "always") -> None:
        if verify not in ("always", "promote", "never"):
            raise ValueError(f"verify must be 'always', 'promote' or 'never', got {verify!r}")
        for name, v in (("budget_bytes", budget_bytes), ("host_budget_bytes", host_budget_bytes)):
            # (a numpy integer or float is a number of bytes too)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v >= 0 or v == float("inf"):
                raise ValueError(f"{name} must be a number of bytes >= 0, got {v!r}")
        budget_bytes, host_budget_bytes = int(budget_bytes), int(host_budget_bytes)
        self.budget_bytes = budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.verify = verify
        self._lock = threading.RLock()
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()  # least recently used first
        self._lengths: Counter = Counter()
        self.hits = self.misses = self.tokens_saved = 0
        self.demotions = self.promotions = self.evictions = self.identity_failures = 0
        self._owner = None  # weakref to the Engine it serves (Engine.store: one engine's states, one model's)
        self._served = None  # weakref to the last Engine it served (its entries are that engine's model's)

    # -- contents ----------------------------------------------------------------------
    @_locked
    def __len__(self) -> int:
        return len(self._entries)

    @_locked
    def __contains__(self, tokens) -> bool:
        return _key(tokens) in self._entries

    @_locked
    def bytes_in(self, tier: str) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.tier == tier)

    @_locked
    def tier_of(self, tokens) -> str | None:
        e = self._entries.get(_key(tokens))
        return None if e is None else e.tier

    def put(self, state: SeqState) -> None:
        """Keep `state` under its token sequence (the most recently used entry). An entry with
        drafter rows is not replaced by one without."""
        # (the digest, a pass over the state's bytes, before the lock: /health waits for it)
        entry = _Entry(state, DEVICE, state.digest(), state.nbytes(), state.device)
        with self._lock:
            key = tuple(state.tokens)
            old = self._entries.get(key)
            if old is not None and old.state.drafter is not None and state.drafter is None:
                self._entries.move_to_end(key)
                return
            if old is None:
                self._lengths[len(key)] += 1
            self._entries[key] = entry
            self._entries.move_to_end(key)
            self._enforce()

    @_locked
    def remove(self, tokens) -> None:
        key = _key(tokens)
        if self._entries.pop(key, None) is not None:
            self._lengths[len(key)] -= 1
            if not self._lengths[len(key)]:
                del self._lengths[len(key)]

    @_locked
    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()

    # -- lookup ------------------------------------------------------------------------
    @_locked
    def extends(self, tokens) -> bool:
        """Whether `tokens` extend a stored sequence (a peek: no hit or miss counted, nothing
        moved; lookup may still refuse it for its drafter rows)."""
        tokens = tuple(int(t) for t in tokens)
        for L in self._lengths:
            e = self._entries.get(tokens[:L]) if L <= len(tokens) else None
            if e is not None and (L < len(tokens) or e.state.pending is not None):
                return True
        return False

    @_locked
    def lookup(self, tokens, drafter: str | None = None) -> SeqState | None:
        """The state of the longest stored sequence that `tokens` extends (None: a miss).
        drafter: the hidden a speculative request's drafter uses (None: plain decoding)."""
        tokens = tuple(int(t) for t in tokens)
        for L in sorted((n for n in self._lengths if n <= len(tokens)), reverse=True):
            key = tokens[:L]
            e = self._entries.get(key)
            if e is None:
                continue
            st = e.state
            if drafter is not None and st.drafter != drafter:
                continue
            if L == len(tokens) and st.pending is None:
                continue
            promoted = e.tier == HOST
            if promoted:
                st = st.to(e.home)
            if self.verify == "always" or (promoted and self.verify == "promote"):
                if st.digest() != e.digest:  # the state is not the one stored for these tokens
                    self.identity_failures += 1
                    self.remove(key)
                    continue
            if promoted:
                e.state, e.tier = st, DEVICE
                self.promotions += 1
            self._entries.move_to_end(key)
            self._enforce()
            self.hits += 1
            self.tokens_saved += st.pos
            return st
        self.misses += 1
        return None

    # -- tiers -------------------------------------------------------------------------
    @_locked
    def demote(self, tokens) -> None:
        """Move an entry to host memory now (tests, and the LRU policy below)."""
        e = self._entries[_key(tokens)]
        if e.tier == DEVICE:
            host = st_to_host(e.state)
            e.state, e.tier = host, HOST
            self.demotions += 1

    @_locked
    def _enforce(self) -> None:
        """Demote least recently used device entries until the device tier fits its budget,
        then evict host entries likewise. The entry just put or looked up is the most recent,
        so it goes last, but it goes too when it alone is over the budget (a state handed out
        by lookup stays valid: demoting copies the entry, the caller keeps its tensors)."""
        dev = self.bytes_in(DEVICE)
        for key, e in list(self._entries.items()):  # least recently used first
            if dev <= self.budget_bytes:
                break
            if e.tier == DEVICE:
                self.demote(key)
                dev -= e.nbytes
        host = self.bytes_in(HOST)
        for key, e in list(self._entries.items()):
            if host <= self.host_budget_bytes:
                break
            if e.tier == HOST:
                self.remove(key)
                self.evictions += 1
                host -= e.nbytes

    @_locked
    def stats(self) -> dict:
        looked = self.hits + self.misses
        return {"entries": len(self._entries), "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / looked if looked else 0.0, "tokens_saved": self.tokens_saved,
                "bytes_device": self.bytes_in(DEVICE), "bytes_host": self.bytes_in(HOST),
                "budget_bytes": self.budget_bytes, "host_budget_bytes": self.host_budget_bytes,
                "demotions": self.demotions, "promotions": self.promotions, "evictions": self.evictions,
                "identity_failures": self.identity_failures}


def st_to_host(st: SeqState) -> SeqState:
    host = st.to("cpu")
    if torch.cuda.is_available() and st.device.type == "cuda":  # pinned: faster promotion
        for name, t in host.tensors().items():
            t.data = t.pin_memory()
    return host
