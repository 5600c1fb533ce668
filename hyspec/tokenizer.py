"""Text <-> ids through a checkpoint's tokenizer.json (Hugging Face `tokenizers`)."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        try:
            self._tok = _Tok.from_file(str(p))
        except Exception as e:
            raise ValueError(f"{p}: cannot parse tokenizer ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
