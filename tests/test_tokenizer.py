"""hyspec.tokenizer.Tokenizer on small tokenizer.json files written here (no model): text is
encoded without the post-processor's special tokens, a token's raw bytes for byte-level and
SentencePiece byte-fallback vocabularies and for added tokens, which added tokens are
special, the vocabulary's fingerprint, and errors naming the file."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, decoders, models, processors
from tokenizers import Tokenizer as HFTokenizer

from hyspec.engine import DEFAULT_MODEL_DIR
from hyspec.tokenizer import LONG_TEXT, Tokenizer


def _save(tok: HFTokenizer, path) -> Tokenizer:
    tok.save(str(path))
    return Tokenizer(path)


SP_VOCAB = ["<unk>", "<s>", "\u2581hello", "\u2581world", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0x0A>", "!"]


def _sentencepiece(tmp_path, bos: bool = False) -> Tokenizer:
    """A Llama / Mistral-style vocabulary: byte fallback, a Sequence decoder that turns U+2581
    into a space; with bos, a post-processor that would put <s> before every text."""
    tok = HFTokenizer(models.WordLevel({p: i for i, p in enumerate(SP_VOCAB)}, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return _save(tok, tmp_path / "tokenizer.json")


def test_text_is_encoded_without_the_post_processors_special_tokens(tmp_path):
    """docs/models.md: a prompt gets no BOS / EOS from the tokenizer's post-processor
    (add_special_tokens=False), short texts and long ones (encoded with the GIL let go) alike;
    a special token written in the text is still parsed as that token."""
    from tokenizers import pre_tokenizers

    tok = HFTokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "a": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    t = _save(tok, tmp_path / "tokenizer.json")
    assert tok.encode("a a").ids == [1, 2, 2]  # (the post-processor would add one)
    assert t.encode("a a") == [2, 2] and t.encode("<s>a") == [1, 2]
    n = LONG_TEXT // 2 + 1
    assert t.encode("a " * n) == [2] * n


def test_token_bytes_of_a_sentencepiece_byte_fallback_vocabulary(tmp_path):
    """<0xAB> is the byte 0xAB (a character split over byte tokens has its bytes on each, where
    decode([id]) gives U+FFFD), U+2581 is a space, an added token is its text."""
    t = _sentencepiece(tmp_path)
    assert [t.token_bytes(i) for i in range(2, 10)] == [b" hello", b" world", b"\xf0", b"\x9f", b"\x98", b"\x80",
                                                        b"\n", b"!"]
    assert b"".join(t.token_bytes(i) for i in (2, 4, 5, 6, 7)).decode() == " hello\U0001f600"
    assert t.token_bytes(1) == b"<s>" and t.is_special(1) and not t.is_special(2)
    assert t.token_bytes(10_000) == b""  # an id past the vocabulary


def test_added_tokens_special_or_not_in_a_byte_level_vocabulary(tmp_path):
    """An added token's bytes are its text in UTF-8 (not read through the byte-level alphabet,
    in which "é" is the byte 0xE9); only those marked special are special (Qwen's <think> is
    added but not special); the vocabulary's size and fingerprint count added tokens."""
    base = HFTokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    before = _save(base, tmp_path / "a.json")
    base.add_tokens([AddedToken("<think>", special=False), AddedToken("<é>", special=False)])
    base.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    t = _save(base, tmp_path / "b.json")
    think, e, end = (t.encode(s)[0] for s in ("<think>", "<é>", "<|im_end|>"))
    assert t.vocab_size == before.vocab_size + 3 and sorted((think, e, end)) == list(range(4096, 4099))
    assert t.token_bytes(e) == "<é>".encode() and t.token_bytes(think) == b"<think>"
    assert t.is_special(0) and t.is_special(end) and not t.is_special(think) and not t.is_special(e)
    assert t.decode([think, end], skip_special_tokens=True) == "<think>"
    assert t.fingerprint != before.fingerprint and Tokenizer(tmp_path / "b.json").fingerprint == t.fingerprint


def test_a_tokenizer_json_missing_or_not_parsed_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json at .*tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot parse tokenizer"):
        Tokenizer(tmp_path)
