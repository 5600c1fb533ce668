"""Train a small byte-level BPE tokenizer (HF ``tokenizers``) on the corpus.

Design (GPT-2 / Qwen style byte-level BPE):
  * no normalizer (bytes in == bytes out);
  * ``ByteLevel(add_prefix_space=False)`` pre-tokenizer (GPT-2 split regex);
  * ``ByteLevel`` decoder, so ``decode(encode(t).ids) == t`` exactly for any text;
  * all 256 byte symbols are in the initial alphabet, so unseen bytes never fail;
  * special tokens: ``<|endoftext|>`` = id 0 (EOS and pad; documents are
    concatenated as ``doc <|endoftext|> doc <|endoftext|> ...``).  Extra special
    tokens (e.g. ``<|pad|>``) can be requested and get ids 1, 2, ...
    Note: like any HF tokenizer, a literal "<|endoftext|>" inside a text encodes
    to id 0 unless ``tok.encode_special_tokens = True`` is set (the stdlib corpus
    contains no such literal).

Training is on the TRAIN split only and is deterministic (same texts, same
order, same vocab size -> byte-identical ``tokenizer.json``).

CLI::

    python -m hyspec.train.tokenizer_train --corpus data/pystdlib_corpus.jsonl.xz \
        --out data/tokenizer --vocab-size 4096
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0
PAD_ID = EOS_ID


def build_empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())  # no unk token: byte-level covers everything
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str] | Sequence[str],
                    vocab_size: int = 4096,
                    out_path: str | os.PathLike | None = None,
                    extra_special_tokens: Sequence[str] = (),
                    min_frequency: int = 2,
                    show_progress: bool = False) -> Tokenizer:
    """Train byte-level BPE on ``texts``; save to ``out_path`` (a ``tokenizer.json``
    path, or a directory -> ``DIR/tokenizer.json``) if given. Returns the tokenizer.

    ``<|endoftext|>`` always has id 0."""
    texts = list(texts)
    specials = [EOS_TOKEN] + [t for t in extra_special_tokens if t != EOS_TOKEN]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(specials) + len(alphabet):
        raise ValueError(f"vocab_size must be >= {len(specials) + len(alphabet)}")
    tok = build_empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID, tok.token_to_id(EOS_TOKEN)
    if out_path is not None:
        save_tokenizer(tok, out_path)
    return tok


def save_tokenizer(tok: Tokenizer, out_path: str | os.PathLike) -> Path:
    out_path = Path(out_path)
    if out_path.suffix != ".json":
        out_path = out_path / "tokenizer.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path), pretty=False)
    # minimal HF-style config so transformers' PreTrainedTokenizerFast can load the dir
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (out_path.parent / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def decode(tok: Tokenizer, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), skip_special_tokens=False)


def check_roundtrip(tok: Tokenizer, texts: Sequence[str]) -> list[int]:
    """Indices of texts for which decode(encode(t)) != t (empty list == all exact)."""
    encs = tok.encode_batch(list(texts), add_special_tokens=False)
    bad = []
    for i, (t, e) in enumerate(zip(texts, encs)):
        if tok.decode(e.ids, skip_special_tokens=False) != t:
            bad.append(i)
    return bad


def count_tokens(tok: Tokenizer, texts: Sequence[str]) -> int:
    """Total tokens of ``texts`` (no EOS separators; add len(texts) for those)."""
    return sum(len(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=False))


def tokenizer_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    from hyspec.cli.common import tool_main

    return tool_main("python -m hyspec.train.tokenizer_train", _main, argv)


def _main(argv: list[str] | None = None) -> int:
    from hyspec.cli.common import check_out_dir
    from hyspec.config import input_file

    from .corpus import load_corpus

    ap = argparse.ArgumentParser(description="train a byte-level BPE tokenizer on the corpus")
    ap.add_argument("--corpus", required=True, help=".jsonl.xz corpus (hyspec.train.corpus)")
    ap.add_argument("--out", required=True, help="output dir (tokenizer.json written inside)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--extra-special", action="append", default=[],
                    help="extra special token(s), ids 1.. (e.g. '<|pad|>')")
    args = ap.parse_args(argv)
    check_out_dir(args.out)

    corpus = load_corpus(input_file(args.corpus, "--corpus"))
    train = [t for _, t in corpus["train"]]
    held = [t for _, t in corpus["heldout"]]
    if not train:
        raise ValueError(f"--corpus {args.corpus}: no training documents in it")
    t0 = time.perf_counter()
    tok = train_tokenizer(train, vocab_size=args.vocab_size, out_path=None,
                          extra_special_tokens=args.extra_special,
                          min_frequency=args.min_frequency)
    t_train = time.perf_counter() - t0
    path = save_tokenizer(tok, args.out)

    t1 = time.perf_counter()
    n_train = count_tokens(tok, train)
    n_held = count_tokens(tok, held)
    t_count = time.perf_counter() - t1
    bad = check_roundtrip(tok, held)
    b_train = sum(len(t.encode("utf-8")) for t in train)
    b_held = sum(len(t.encode("utf-8")) for t in held)
    stats = {
        "tokenizer": str(path),
        "sha256": tokenizer_sha256(path),
        "vocab_size": tok.get_vocab_size(),
        "eos_id": tok.token_to_id(EOS_TOKEN),
        "train_seconds": round(t_train, 2),
        "count_seconds": round(t_count, 2),
        "train_files": len(train),
        "heldout_files": len(held),
        "train_tokens": n_train,
        "train_tokens_with_eos": n_train + len(train),
        "heldout_tokens": n_held,
        "heldout_tokens_with_eos": n_held + len(held),
        "train_bytes_per_token": round(b_train / max(n_train, 1), 4),
        "heldout_bytes_per_token": round(b_held / max(n_held, 1), 4),
        "heldout_roundtrip_failures": len(bad),
    }
    (path.parent / "tokenizer_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    for k, v in stats.items():
        print(f"{k}: {v}")
    if bad:
        print("ROUND TRIP FAILED for heldout files:", [corpus["heldout"][i][0] for i in bad])
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
