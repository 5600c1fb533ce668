"""Text <-> ids through a checkpoint's tokenizer.json (Hugging Face `tokenizers`)."""

from __future__ import annotations

from pathlib import Path

LONG_TEXT = 4096  # characters: longer texts are encoded with the GIL released (Tokenizer.encode)


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
    def fingerprint(self) -> str:
        """Identifies the vocabulary (every token's text and id): two tokenizers with one
        fingerprint map text to the same ids. Computed once."""
        fp = getattr(self, "_fingerprint", None)
        if fp is None:
            fp = self._fingerprint = vocab_fingerprint(self._tok)
        return fp

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if len(text) > LONG_TEXT:  # (the same ids; tokenizers' encode holds the GIL, encode_batch lets it go:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids  # a server's event loop runs on
        return self._tok.encode(text, add_special_tokens=False).ids  # while another thread encodes a long prompt)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """An added token marked special (decode(skip_special_tokens=True) leaves it out)."""
        return token_id in self._bytes_table()[1]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for: for a byte-level vocabulary (GPT-2 / Qwen
        style) the bytes behind its symbols, for SentencePiece byte fallback ``<0xAB>`` the
        byte 0xAB, so that a character split over several tokens has its bytes on each
        (``decode([id])`` gives U+FFFD there). Added tokens give their text in UTF-8. Other
        decoders: the UTF-8 of ``decode([id])``."""
        kind, special, added, cache = self._bytes_table()
        b = cache.get(token_id)
        if b is not None:
            return b
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            b = b""
        elif token_id in added:
            b = piece.encode("utf-8")
        elif kind == "byte_level" and all(c in _UNICODE_TO_BYTE for c in piece):
            b = bytes(_UNICODE_TO_BYTE[c] for c in piece)
        elif kind == "byte_fallback" and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            b = bytes([int(piece[3:5], 16)])
        elif kind == "byte_fallback":
            b = piece.replace("\u2581", " ").encode("utf-8")
        else:
            b = self._tok.decode([int(token_id)]).encode("utf-8")
        cache[token_id] = b
        return b

    def _bytes_table(self):
        table = getattr(self, "_btable", None)
        if table is None:
            import json

            dec = json.loads(self._tok.to_str()).get("decoder") or {}
            parts = dec.get("decoders", [dec]) if dec.get("type") == "Sequence" else [dec]
            types = {d.get("type") for d in parts if isinstance(d, dict)}
            kind = "byte_level" if "ByteLevel" in types else "byte_fallback" if "ByteFallback" in types else "other"
            added = self._tok.get_added_tokens_decoder()
            special = frozenset(i for i, a in added.items() if a.special)
            table = self._btable = (kind, special, frozenset(added), {})
        return table


def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are
    shifted to code points from 256 on (symbol -> byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_UNICODE_TO_BYTE = _byte_symbols()


def vocab_fingerprint(tok) -> str:
    """A hash of a `tokenizers.Tokenizer`'s vocabulary, added tokens included."""
    import hashlib
    import json

    items = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.blake2b(json.dumps(items, ensure_ascii=False).encode("utf-8"), digest_size=12).hexdigest()
