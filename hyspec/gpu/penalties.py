"""The penalty window on the device: per-lane token counts of the last ``penalty_last_n``
history tokens, and the counts every row of a round is penalised with (the history plus
the round's drafts before the row).

Exactly the reference's ``hyspec.sampling._window`` / ``apply_penalties`` lane by lane
(tests/test_gpu_sampling.py). The BatchDecoder keeps one window per lane and advances it
inside its graphs (hyspec/gpu/batch.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyspec.envknobs import switch
from hyspec.gpu.sampling import SamplingTable, probs_batch
from hyspec.sampling import SamplingParams, _window

__all__ = ["PenaltyWindow", "window_counts", "row_counts", "verify_probs"]

# a window's pushes as one Triton launch (hyspec.kernels.window) where the sampling row
# kernels run (CUDA, or the Triton interpreter); HYSPEC_WINDOW_KERNEL=0 (or False here,
# before a graph is captured) keeps the torch ops (PenaltyWindow.push_ref)
WINDOW_KERNEL = switch("HYSPEC_WINDOW_KERNEL")


def _kernel_for(t: torch.Tensor) -> bool:
    from hyspec.gpu.batch_sampling import row_kernels

    return WINDOW_KERNEL and row_kernels(t.device)


def window_counts(history: Sequence[int] | torch.Tensor, last_n: int, vocab: int) -> torch.Tensor:
    """Host helper: int32 [vocab] counts of the tokens in the reference's penalty window
    (the last ``last_n`` history tokens, -1 = all, 0 = none; ids outside [0, vocab)
    occupy window places but are not counted)."""
    window = [t for t in _window(history, last_n) if 0 <= t < vocab] if last_n != 0 else []
    return torch.bincount(torch.tensor(window, dtype=torch.int64), minlength=vocab).to(torch.int32)


class PenaltyWindow:
    """Per-lane token counts of the penalty window, updated on the device.

    The window of a lane is exactly the reference's ``_window(history, penalty_last_n)``:
    the last ``N = penalty_last_n`` tokens of the history (all of it for -1, none for 0;
    the whole history while it is shorter than N), counting only ids in [0, V).  A lane with a finite window keeps its last N tokens in
    a ring buffer: history token ``h`` lives in ``ring[lane, h % N]``, so appending token
    number ``L`` evicts ``ring[lane, L % N]`` (history token ``L - N``) once ``L >= N``.
    A whole-history lane (-1) only ever adds.  All updates are integer scatter-adds, so
    the counts are exact on every device.

    Lanes whose params have no penalties get N = 0 (nothing counted, nothing needed).
    """

    def __init__(
        self, batch: int, vocab: int, capacity: int = 256, device: torch.device | str | None = None
    ) -> None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.batch, self.vocab, self.capacity, self.device = batch, vocab, capacity, dev
        self.last_n = torch.zeros(batch, dtype=torch.int64, device=dev)  # [B] N: -1 all, 0 off
        self.length = torch.zeros(batch, dtype=torch.int64, device=dev)  # [B] history tokens seen
        self.ring = torch.full((batch, capacity), -1, dtype=torch.int64, device=dev)  # [B, C]
        self.counts = torch.zeros(batch, vocab, dtype=torch.int32, device=dev)  # [B, V]

    # host side ------------------------------------------------------------------------
    def load(self, lane: int, history: Sequence[int] | torch.Tensor, params: SamplingParams | int) -> None:
        """Rebuild a lane from its whole history (a list on the host) and its params (or
        an explicit penalty_last_n).  Host work plus one copy per field; not for capture."""
        if isinstance(history, torch.Tensor):
            history = history.reshape(-1).tolist()
        hist = [int(t) for t in history]
        if isinstance(params, SamplingParams):
            n = params.penalty_last_n if params.has_penalties else 0
        else:
            n = int(params)
        if n > self.capacity:
            raise ValueError(f"penalty_last_n={n} exceeds the window capacity {self.capacity}")
        if n < -1:
            raise ValueError(f"penalty_last_n must be >= -1, got {n}")
        ring = torch.full((self.capacity,), -1, dtype=torch.int64)
        if n > 0:
            for h in range(max(0, len(hist) - n), len(hist)):
                ring[h % n] = hist[h]
        self.last_n[lane] = n
        self.length[lane] = len(hist)
        self.ring[lane].copy_(ring)
        self.counts[lane].copy_(window_counts(hist, n, self.vocab))

    # device side ----------------------------------------------------------------------
    def push(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> None:
        """Append one token per lane: tokens [B] int64; active [B] bool (None = all)."""
        if _kernel_for(tokens):
            from hyspec.kernels.window import window_push

            nv = torch.ones_like(self.length) if active is None else active.to(torch.int64)
            window_push(self.last_n, self.length, self.ring, self.counts, tokens.view(-1, 1), nv)
            return
        self.push_ref(tokens, active)

    def push_ref(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> None:
        """push as torch ops (the reference of hyspec.kernels.window.window_push)."""
        B, V = self.batch, self.vocab
        t = tokens.to(torch.int64)  # [B]
        act = torch.ones(B, dtype=torch.bool, device=self.device) if active is None else active  # [B]
        n, L = self.last_n, self.length  # [B]
        ring_lane = act & (n > 0)  # [B] finite window
        slot = (L % n.clamp(min=1)).unsqueeze(1)  # [B, 1]
        old = self.ring.gather(1, slot).squeeze(1)  # [B] history token L - N (or -1)
        evict = ring_lane & (L >= n) & (old >= 0) & (old < V)  # [B]
        add = act & (n != 0) & (t >= 0) & (t < V)  # [B]
        self.counts.scatter_add_(1, old.clamp(0, V - 1).unsqueeze(1), -evict.to(torch.int32).unsqueeze(1))
        self.counts.scatter_add_(1, t.clamp(0, V - 1).unsqueeze(1), add.to(torch.int32).unsqueeze(1))
        self.ring.scatter_(1, slot, torch.where(ring_lane, t, old).unsqueeze(1))
        self.length.add_(act.to(torch.int64))

    def push_many(self, tokens: torch.Tensor, n_valid: torch.Tensor) -> None:
        """Append tokens[b, :n_valid[b]] per lane (tokens [B, m], n_valid [B]): the tokens a
        round emitted, e.g. ``drafts[:n]`` then ``next_token``."""
        if _kernel_for(tokens):
            from hyspec.kernels.window import window_push

            window_push(self.last_n, self.length, self.ring, self.counts, tokens, n_valid)
            return
        for i in range(tokens.shape[1]):  # m is a static shape
            self.push_ref(tokens[:, i], n_valid > i)

    def head(self, lanes: int) -> PenaltyWindow:
        """The first ``lanes`` lanes as a window of views (its updates write through)."""
        w = PenaltyWindow.__new__(PenaltyWindow)
        w.batch, w.vocab, w.capacity, w.device = lanes, self.vocab, self.capacity, self.device
        w.last_n, w.length = self.last_n[:lanes], self.length[:lanes]
        w.ring, w.counts = self.ring[:lanes], self.counts[:lanes]
        return w

    def copy_(self, other: PenaltyWindow) -> PenaltyWindow:
        """In-place copy of another window's state (static addresses: graph friendly)."""
        self.last_n.copy_(other.last_n)
        self.length.copy_(other.length)
        self.ring.copy_(other.ring)
        self.counts.copy_(other.counts)
        return self

    def clone(self) -> PenaltyWindow:
        w = PenaltyWindow.__new__(PenaltyWindow)
        w.batch, w.vocab, w.capacity, w.device = self.batch, self.vocab, self.capacity, self.device
        w.last_n, w.length = self.last_n.clone(), self.length.clone()
        w.ring, w.counts = self.ring.clone(), self.counts.clone()
        return w


def row_counts(window: PenaltyWindow, drafts: torch.Tensor, scratch: PenaltyWindow | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [B, R, V]: row j's counts = the window after ``drafts[:, :j]`` (drafts [B, R-1]),
    the counts the reference penalises a round's row j with (``hist + drafts[:j]``).
    ``scratch`` (same lanes; None: a clone) advances; ``window`` is not modified."""
    R = drafts.shape[1] + 1
    scratch = window.clone() if scratch is None else scratch.copy_(window)
    if out is None:
        out = torch.empty(window.batch, R, window.vocab, dtype=window.counts.dtype, device=window.device)
    for j in range(R):  # R = k + 1 is a static shape
        out[:, j].copy_(scratch.counts)
        if j < R - 1:
            scratch.push(drafts[:, j])
    return out


def verify_probs(
    logits: torch.Tensor,
    table: SamplingTable,
    window: PenaltyWindow | None,
    drafts: torch.Tensor,
    with_best: bool = False,
):
    """Probabilities of a round's verify rows: logits [B, R, V], drafts [B, R-1] ->
    float64 [B, R, V], row j penalised with the history plus ``drafts[:, :j]`` (the
    reference's ``row_probs(rows[j], hist + drafts[:j], params)``).  ``window`` is not
    modified (a scratch copy advances).  The drafter's rows need the same: advance a
    scratch window with :meth:`PenaltyWindow.push` after each draft. with_best: also
    probs_batch's best per row, [B, R]."""
    R = logits.shape[1]
    scratch = window.clone() if window is not None else None
    rows, best = [], []
    for j in range(R):  # R = k + 1 is a static shape
        p, b = probs_batch(logits[:, j], table, scratch.counts if scratch is not None else None, with_best=True)
        rows.append(p)
        best.append(b)
        if scratch is not None and j < R - 1:
            scratch.push(drafts[:, j])
    probs = torch.stack(rows, dim=1)
    return (probs, torch.stack(best, dim=1)) if with_best else probs
