"""Sequence slots: where one sequence's decoding state lives, and a pool of them.

A slot holds the target's cache (attention KV rows for every full-attention layer, conv
window + SSM state for every Gated-DeltaNet layer) and the MTP head's draft KV. The
per-round values (pending token, last hidden, drafter refill rows, RNG positions,
penalty history) live on the Sequence that owns the slot (hyspec/core/round.py).

KV layout: contiguous per slot ([Hkv, L, D] per attention layer, L = the slot's
length). Why not paged blocks: in a hybrid model only 1 layer in 4 has KV (the other
three hold a fixed-size recurrent state), so KV is a small share of a slot; prefix reuse
cannot share KV blocks across sequences anyway, because the recurrent state at a block
boundary is not shareable the way attention KV is (sessions keep whole-slot snapshots);
and one contiguous buffer per slot is what a row-invariant attention kernel indexes most
simply. A slot that must hold more tokens grows (copy into a bigger buffer).
"""

from __future__ import annotations

import numbers

import torch

from hyspec.cache import HybridCache
from hyspec.config import FULL, ModelConfig
from hyspec.model.attention import KVBuffer
from hyspec.model.gdn import ssm_store_dtype
from hyspec.sampling import int_in


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def slot_bytes(cfg: ModelConfig, dtype: torch.dtype, length: int, with_mtp: bool = True) -> dict:
    """Bytes of one slot holding `length` tokens: {"kv", "draft_kv", "linear", "total"}."""
    n = int_in(length, 0)
    if n is None:  # (a negative length gave negative KV bytes, a fractional one fractional bytes)
        raise ValueError(f"length must be an integer >= 0 (tokens), got {length!r}")
    length = n
    e = _elt(dtype)
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * e  # keys + values of one token in one layer
    n_attn = sum(1 for t in cfg.layer_types if t == FULL)
    n_lin = cfg.num_hidden_layers - n_attn
    lin = n_lin * ((cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * e
                   + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
                   * _elt(ssm_store_dtype(cfg, dtype)))
    out = {"kv": n_attn * kv_row * length, "draft_kv": kv_row * length if with_mtp else 0, "linear": lin}
    out["total"] = out["kv"] + out["draft_kv"] + out["linear"]
    return out


class Slot:
    """One sequence's state: target cache + draft KV of `length` tokens."""

    def __init__(self, index: int, model, length: int) -> None:
        self.index = index
        self.cache: HybridCache = model.new_cache(length)
        self.draft_kv: KVBuffer | None = model.new_draft_kv(length) if model.has_mtp else None

    @property
    def length(self) -> int:
        return self.cache.max_len

    def reset(self) -> None:
        """Back to an empty sequence. Attention rows past the length are never read, so only
        the recurrent state needs zeroing."""
        c = self.cache
        c.pos = 0
        for s in c.linear_states:
            s.conv = torch.zeros_like(s.conv)
            s.ssm = torch.zeros_like(s.ssm)
            s.record = None

    def grow(self, model, length: int) -> None:
        """Make room for `length` tokens, keeping everything held so far."""
        if length <= self.length:
            return
        old, old_dkv = self.cache, self.draft_kv
        new = model.new_cache(length)
        new.pos = old.pos
        for i in range(len(model.cfg.layer_types)):
            a, b = old.layer_state(i), new.layer_state(i)
            if isinstance(a, KVBuffer):
                b.k[:, : old.max_len] = a.k
                b.v[:, : old.max_len] = a.v
            else:
                b.conv, b.ssm, b.record = a.conv.clone(), a.ssm.clone(), None
        self.cache = new
        if old_dkv is not None:
            self.draft_kv = model.new_draft_kv(length)
            self.draft_kv.k[:, : old_dkv.capacity] = old_dkv.k
            self.draft_kv.v[:, : old_dkv.capacity] = old_dkv.v

    def nbytes(self) -> int:
        n = sum(s.k.numel() * s.k.element_size() * 2 for s in self.cache.kv_buffers)
        n += self.cache.state_nbytes()
        if self.draft_kv is not None:
            n += self.draft_kv.k.numel() * self.draft_kv.k.element_size() * 2
        return n


def bytes_arg(name: str, value) -> int | None:
    """None, or a number of bytes >= 0 as an int (a float counts, as 8e9; a numpy integer or
    float too, as PrefixStore's budgets)."""
    # (a negative or NaN budget refused every slot later, a string one raised a TypeError at the first alloc)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be None or a number of bytes >= 0, got {value!r}")
    return int(value)


class SlotPool:
    """Allocates slots, reuses freed ones, and accounts for their memory.

    A freed slot keeps its buffers and is handed out again (reset) to a request that fits
    in it, so a server does not reallocate per request; at most `max_slots` slots are held,
    free ones included (a new slot that needs room lets the shortest free one go), and at
    most `max_free` (default: max_slots) of them free (a released slot beyond that lets the
    shortest free one go). `budget_bytes` (None = no limit) caps the bytes held by all
    slots, free ones included; `max_free_bytes` (None = no limit) the bytes held by the free
    ones (a released slot beyond it lets the shortest free ones go until they fit: a slot
    longer than it is not kept)."""

    def __init__(self, model, *, max_slots: int = 64, budget_bytes: int | None = None,
                 max_free: int | None = None, max_free_bytes: int | None = None) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if max_free is not None and max_free < 0:
            raise ValueError(f"max_free must be >= 0, got {max_free}")
        self.model = model
        self.max_slots = max_slots
        self.max_free = max_slots if max_free is None else max_free
        self.budget_bytes = bytes_arg("budget_bytes", budget_bytes)
        self.free: list[Slot] = []
        self.used: dict[int, Slot] = {}
        self._next = 0
        self.max_free_bytes = max_free_bytes  # (the setter validates it)

    def bytes_per_slot(self, length: int) -> dict:
        return slot_bytes(self.model.cfg, self.model.dtype, length, self.model.has_mtp)

    def slots_that_fit(self, budget_bytes: int, length: int) -> int:
        return max(0, int(budget_bytes // self.bytes_per_slot(length)["total"]))  # (a negative budget: none)

    @property
    def held_bytes(self) -> int:
        return sum(s.nbytes() for s in list(self.free) + list(self.used.values()))

    @property
    def free_bytes(self) -> int:
        """Bytes held by the free slots (kept for reuse, no sequence in them)."""
        return sum(s.nbytes() for s in self.free)

    @property
    def max_free_bytes(self) -> int | None:
        return self._max_free_bytes

    @max_free_bytes.setter
    def max_free_bytes(self, value: int | None) -> None:
        """A new cap lets the shortest free slots go at once until the others fit it."""
        self._max_free_bytes = bytes_arg("max_free_bytes", value)
        self._keep_free(self.max_free)

    def alloc(self, length: int) -> Slot:
        if len(self.used) >= self.max_slots:
            raise RuntimeError(f"all {self.max_slots} slots are in use")
        fits = [s for s in self.free if s.length >= length]
        if fits:
            slot = min(fits, key=lambda s: s.length)
            self.free.remove(slot)
            slot.reset()
        else:
            # at most max_slots slots held, free ones included: none of the free ones fits, so the
            # shortest go (a server's pool kept one more free slot for every longer prompt, e.g.
            # each turn of a growing chat: never freed, far beyond its max_batch)
            self._keep_free(self.max_slots - len(self.used) - 1)
            need = self.bytes_per_slot(length)["total"]
            if not self._room_for(need):
                raise MemoryError(f"a slot of {length} tokens needs {need} bytes; {self.held_bytes} of the "
                                  f"{self.budget_bytes}-byte slot budget are held")
            slot = Slot(self._next, self.model, length)
            self._next += 1
        self.used[slot.index] = slot
        return slot

    def _room_for(self, extra: int, drop_free: bool = True) -> bool:
        """Whether `extra` more bytes fit the budget, free slots dropped (oldest first) to make
        room when drop_free."""
        while drop_free and self.free and self.budget_bytes is not None and \
                self.held_bytes + extra > self.budget_bytes:
            self.free.pop(0)  # drop a too-small free slot to make room
        return self.budget_bytes is None or self.held_bytes + extra <= self.budget_bytes

    def grow(self, slot: Slot, need: int, most: int | None = None) -> None:
        """Make a held slot room for `need` tokens, keeping its rows, within the budget (as
        alloc: free slots are dropped to make room). Headroom for later turns (1.5x its
        length, at most `most`: the most any turn can need, the model's context plus a
        round's extra rows) where the budget has it without dropping any; else exactly `need`."""
        if need <= slot.length:
            return
        roomy = slot.length + slot.length // 2
        roomy = max(need, roomy if most is None else min(roomy, most))
        for length, drop_free in ((roomy, False), (need, True)):
            extra = self.bytes_per_slot(length)["total"] - slot.nbytes()
            if self._room_for(extra, drop_free):
                slot.grow(self.model, length)
                return
        raise MemoryError(f"growing a slot to {need} tokens needs {extra} more bytes; {self.held_bytes} of the "
                          f"{self.budget_bytes}-byte slot budget are held")

    def release(self, slot: Slot, keep: bool = True) -> None:
        """Give a slot back: kept for reuse, or (keep False) let go of with its buffers."""
        if self.used.pop(slot.index, None) is not None and keep:
            self.free.append(slot)
            self._keep_free(self.max_free)  # (the sessions' pool: many held, few kept once closed, by count and bytes)

    def _keep_free(self, n: int) -> None:
        """At most n free slots, and at most max_free_bytes in them: the shortest others go
        (the longest fit the most requests)."""
        cap = self._max_free_bytes
        while len(self.free) > max(n, 0) or (self.free and cap is not None and self.free_bytes > cap):
            self.free.remove(min(self.free, key=lambda s: s.length))

    def stats(self) -> dict:
        return {"slots_in_use": len(self.used), "slots_free": len(self.free), "held_bytes": self.held_bytes,
                "free_bytes": self.free_bytes, "max_slots": self.max_slots, "max_free": self.max_free,
                "max_free_bytes": self.max_free_bytes, "budget_bytes": self.budget_bytes}
