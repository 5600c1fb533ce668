"""Rolling a hybrid cache back to the verified prefix: three strategies, one interface.

After a verify of T rows that started at snapshot position s, keep the first j rows.
Attention layers only need their length cut (rows past it are overwritten later); the
Gated-DeltaNet layers must get the conv window and SSM state they had after row j-1.

- CheckpointRollback: verify saves every row's SSM state (T x state per layer); commit
  picks one. Extra memory per round: T * Hv*Dk*Dv*4 bytes per linear layer (+ conv rows).
- RescanRollback: verify stashes the recurrence inputs (q, k, v, g, beta; ~T*(2*Hv*Dk + Hv*Dv)
  floats per layer); commit re-runs j rows of the scan from the snapshot state.
- ReplayRollback: nothing extra; commit restores the snapshot and runs the target again
  over the j kept tokens (one more forward: simplest and slowest).
All three leave the cache bit-identical to plain decoding of the same tokens (tested).
"""

from __future__ import annotations

import torch

from hyspec.cache import CacheSnapshot, HybridCache
from hyspec.model.hybrid import HybridLM
from hyspec.model.ops import StepCtx


class Rollback:
    name: str = ""
    record: str = "none"  # what the verify forward keeps (StepCtx.record)

    def keep(self, model: HybridLM, cache: HybridCache, snap: CacheSnapshot, j: int, tokens: list[int]) -> None:
        """Make the cache hold the snapshot's tokens plus tokens[:j] (1 <= j < len(tokens))."""
        raise NotImplementedError


class CheckpointRollback(Rollback):
    name, record = "checkpoint", "states"

    def keep(self, model, cache, snap, j, tokens):
        cache.keep_from_records(snap, j)


class RescanRollback(Rollback):
    name, record = "rescan", "inputs"

    def keep(self, model, cache, snap, j, tokens):
        cache.keep_from_records(snap, j)


class ReplayRollback(Rollback):
    name, record = "replay", "none"

    def keep(self, model, cache, snap, j, tokens):
        cache.restore(snap)
        ids = torch.tensor(tokens[:j], device=model.device)
        model.forward_hidden(ids, cache, StepCtx(start=snap.pos, exact=True))


ROLLBACKS = {c.name: c for c in (CheckpointRollback, RescanRollback, ReplayRollback)}


def make_rollback(name: str) -> Rollback:
    if not isinstance(name, str) or name not in ROLLBACKS:  # (a list raised "unhashable type: 'list'")
        raise ValueError(f"unknown rollback strategy {name!r}; choose one of {', '.join(ROLLBACKS)}")
    return ROLLBACKS[name]()
