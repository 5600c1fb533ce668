"""The target's decode cache: preallocated KV per attention layer plus conv/SSM state per
Gated-DeltaNet layer, with cheap snapshot / restore and rollback to a verified prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyspec.config import FULL, ModelConfig
from hyspec.model.attention import KVBuffer
from hyspec.model.gdn import LinearState, recurrent_scan


@dataclass
class CacheSnapshot:
    """Everything needed to return the cache to a point: the token count and the linear
    layers' states (attention rows past `pos` are simply ignored and later overwritten)."""

    pos: int
    conv: list[torch.Tensor]  # per linear layer [W-1, C]
    ssm: list[torch.Tensor]  # per linear layer [Hv, Dk, Dv]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)


class HybridCache:
    """layers: the decoder layers this cache holds state for (default: all). A pipeline
    stage (hyspec/parallel) holds only its own layers; layer_state(i) of another stage's
    layer is None, and snapshot / restore / rollback act on the held layers only."""

    def __init__(self, cfg: ModelConfig, max_len: int, device, dtype, layers: range | None = None) -> None:
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        self.cfg = cfg
        self.max_len = max_len
        self.pos = 0
        self.layers = range(cfg.num_hidden_layers) if layers is None else layers
        self._states: list[KVBuffer | LinearState | None] = []
        for i, t in enumerate(cfg.layer_types):
            if i not in self.layers:
                self._states.append(None)
            elif t == FULL:
                self._states.append(KVBuffer(cfg.num_key_value_heads, max_len, cfg.head_dim, device, dtype))
            else:
                self._states.append(LinearState(cfg, device, dtype))

    def layer_state(self, i: int) -> KVBuffer | LinearState | None:
        return self._states[i]

    @property
    def linear_states(self) -> list[LinearState]:
        return [s for s in self._states if isinstance(s, LinearState)]

    @property
    def kv_buffers(self) -> list[KVBuffer]:
        return [s for s in self._states if isinstance(s, KVBuffer)]

    # -- snapshot / restore -----------------------------------------------------------
    def snapshot(self) -> CacheSnapshot:
        ls = self.linear_states
        return CacheSnapshot(self.pos, [s.conv.clone() for s in ls], [s.ssm.clone() for s in ls])

    def restore(self, snap: CacheSnapshot) -> None:
        for s, c, m in zip(self.linear_states, snap.conv, snap.ssm):
            s.conv = c.clone()
            s.ssm = m.clone()
            s.record = None
        self.pos = snap.pos

    def state_nbytes(self) -> int:
        """Bytes of the linear layers' state (what a snapshot copies)."""
        return sum(s.conv.numel() * s.conv.element_size() + s.ssm.numel() * s.ssm.element_size()
                   for s in self.linear_states)

    def record_nbytes(self) -> int:
        return sum(s.record.nbytes() for s in self.linear_states if s.record is not None)

    def clear_records(self) -> None:
        for s in self.linear_states:
            s.record = None

    # -- rollback after a verify ------------------------------------------------------
    def keep_from_records(self, snap: CacheSnapshot, j: int) -> None:
        """After a verify of T rows that started at snap.pos, keep the first j rows (1 <= j <= T).

        Attention: just the length. Linear layers: conv window = rows j..j+W-2 of the
        recorded window; SSM state = recorded state after row j-1 ("states") or a re-scan of
        the first j stashed rows from the snapshot state ("inputs")."""
        W = self.cfg.linear_conv_kernel_dim
        for s, ssm0 in zip(self.linear_states, snap.ssm):
            rec = s.record
            if rec is None:
                raise RuntimeError("no verify record to roll back from (verify ran without record=...)")
            s.conv = rec.xcat[j : j + W - 1].clone()
            if rec.states is not None:
                s.ssm = rec.states[j - 1].clone()
            else:
                q, k, v, g, beta = (t[:j] for t in rec.inputs)
                _, s.ssm, _ = recurrent_scan(q, k, v, g, beta, ssm0)
            s.record = None
        self.pos = snap.pos + j
