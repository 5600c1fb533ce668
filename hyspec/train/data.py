"""Training data: the corpus tokenized into train / val / heldout token streams, the
training window sampler and the evaluation windows."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from hyspec.train.model import EOS_ID

VAL_PERCENT = 3  # train-split documents kept out of training to pick the best checkpoint


def is_val_doc(path: str) -> bool:
    h = int.from_bytes(hashlib.sha256(("val:" + path).encode()).digest(), "big")
    return h % 100 < VAL_PERCENT


def load_streams(corpus: str | Path, tokenizer: str | Path) -> dict[str, torch.Tensor]:
    """{'train', 'val', 'heldout'}: int64 token streams, documents (in corpus order) each
    followed by EOS. 'val' = ~3% of the corpus's train split, kept out of training."""
    from tokenizers import Tokenizer

    from hyspec.train.corpus import load_corpus

    tok = Tokenizer.from_file(str(tokenizer))
    splits = load_corpus(corpus)
    docs = {"train": [], "val": [], "heldout": [t for _, t in splits["heldout"]]}
    for p, t in splits["train"]:
        docs["val" if is_val_doc(p) else "train"].append(t)
    out = {}
    for name, texts in docs.items():
        enc = tok.encode_batch(texts, add_special_tokens=False) if texts else []
        ids: list[int] = []
        for e in enc:
            ids.extend(e.ids)
            ids.append(EOS_ID)
        out[name] = torch.tensor(ids, dtype=torch.long)
    return out


class WindowSampler:
    """Deterministic epochs of windows of `win` tokens: each epoch draws a random offset in
    [0, stride) and a random order of the windows starting at offset + k*stride."""

    def __init__(self, stream: torch.Tensor, win: int, stride: int, batch: int, seed: int) -> None:
        if stream.numel() < win + batch * stride:
            raise ValueError(f"the corpus's train split ({stream.numel()} tokens) is too short for one step: "
                             f"--batch-size {batch} windows of --seq-len {stride} tokens need {win + batch * stride}; "
                             f"lower them or give a larger --corpus")
        self.stream, self.win, self.stride, self.batch = stream, win, stride, batch
        self.g = torch.Generator().manual_seed(seed)
        self.epoch, self.starts, self.pos = 0, None, 0
        self.ar = torch.arange(win, device=stream.device)
        self._new_epoch()

    def _new_epoch(self) -> None:
        off = int(torch.randint(0, self.stride, (1,), generator=self.g))
        starts = torch.arange(off, self.stream.numel() - self.win + 1, self.stride)
        self.starts = starts[torch.randperm(starts.numel(), generator=self.g)]
        self.pos = 0
        self.epoch += 1

    def next(self) -> torch.Tensor:
        if self.pos + self.batch > self.starts.numel():
            self._new_epoch()
        s = self.starts[self.pos:self.pos + self.batch].to(self.stream.device)
        self.pos += self.batch
        return self.stream[s[:, None] + self.ar]

    @property
    def epochs_done(self) -> float:
        return self.epoch - 1 + self.pos / self.starts.numel()


def eval_windows(stream: torch.Tensor, T: int, max_tokens: int | None = None):
    """Non-overlapping coverage of `stream`: windows [s, s+T+2) for s = 0, T, 2T, ... with
    a mask (0 past the end). Each target token is counted once per head."""
    n = stream.numel() if max_tokens is None else min(stream.numel(), max_tokens)
    stream = stream[:n]
    wins, masks = [], []
    for s in range(0, n - 1, T):
        w = stream[s:s + T + 2]
        m = torch.ones(T + 2, dtype=torch.bool)
        if w.numel() < T + 2:
            m[w.numel():] = False
            w = torch.cat([w, w.new_full((T + 2 - w.numel(),), EOS_ID)])
        wins.append(w)
        masks.append(m)
    return torch.stack(wins), torch.stack(masks)
