"""Constrained decoding: output that matches a JSON schema, any JSON object, a regex, a
Lark grammar or one of a few choices, through llguidance (``pip install hyspec[constraints]``).

A :class:`Constraint` wraps one ``llguidance.LLMatcher`` whose state is the tokens
committed so far. The decoding loops ask it, for each row they sample from, which tokens
are allowed, and mask the others to ``-inf`` before any sampling transform::

    c = Constraint.json_schema(engine, {"type": "object", "properties": {"a": {"type": "integer"}}})
    c.allowed([])          # bool [V_model]: allowed next tokens after the committed ones
    c.allowed([d1, d2])    # ... after the committed ones + the drafts d1, d2 (not consumed)
    c.commit([d1, bonus])  # the round's emitted tokens
    c.clone()              # an independent copy (fork / session checkpoint)
    c.finished             # the grammar is complete: only EOS can follow

The model's EOS ids (``config.json`` / ``generation_config.json``) are the matcher's EOS
tokens: the grammar's end allows exactly them. Ids the tokenizer does not have (the model's
vocabulary is often padded past the tokenizer's) are never allowed. See docs/constraints.md.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyspec.sampling import as_int

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")

# JSON: compact output unless the schema's "x-guidance" says otherwise (a flexible-whitespace
# grammar lets a small model fill its token budget with blanks)
JSON_DEFAULTS = {"whitespace_flexible": False}


def _llg():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - depends on the install
        raise ImportError("constrained decoding needs llguidance: pip install 'hyspec[constraints]' "
                          "(or pip install llguidance)") from None
    return llguidance


@dataclass(frozen=True)
class Vocab:
    """What a constraint needs to know about a model: the llguidance tokenizer, the model's
    vocabulary size (rows of the logits) and its EOS ids."""

    lltok: Any
    vocab_size: int  # V_model
    eos_ids: tuple[int, ...]
    fingerprint: str = ""  # the tokenizer's vocabulary (hyspec.tokenizer.vocab_fingerprint): which model it fits

    @property
    def tok_vocab(self) -> int:
        return int(self.lltok.vocab_size)


_VOCAB_CACHE: dict = {}  # (a file's path, size and mtime, vocab_size, eos ids) -> Vocab
# an engine's tokenizer -> {(vocab_size, eos ids): Vocab}; weak, so a freed tokenizer's entry
# goes with it (keyed by id(), a new tokenizer at a reused id got its Vocab)
_TOKENIZER_VOCABS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def vocab_for(source, *, vocab_size: int | None = None, eos_ids=None) -> Vocab:
    """A :class:`Vocab` from an Engine, a checkpoint directory, a tokenizer.json path, or a
    Vocab. For a file or directory without config.json, vocab_size defaults to the
    tokenizer's and eos_ids to the tokenizer's EOS guess."""
    if isinstance(source, Vocab):
        return source
    path = None
    if hasattr(source, "model") and hasattr(source, "tokenizer"):  # an Engine
        cfg = source.model.cfg
        vocab_size = cfg.vocab_size if vocab_size is None else vocab_size
        eos_ids = cfg.eos_token_ids if eos_ids is None else eos_ids
        if source.tokenizer is not None:  # the tokenizer it encodes with (its file may have been rewritten)
            cache = _TOKENIZER_VOCABS.setdefault(source.tokenizer, {})
            key = (vocab_size, tuple(eos_ids or ()))
            if key not in cache:
                cache[key] = _make_vocab(source.tokenizer._tok.to_str(), vocab_size, eos_ids)
            return cache[key]
        if source.model_dir is None or not (Path(source.model_dir) / "tokenizer.json").is_file():
            raise ValueError("constraints need the checkpoint's tokenizer.json (this model has none)")
        path = Path(source.model_dir) / "tokenizer.json"  # (a model without its tokenizer loaded: the file's)
    else:
        p = Path(source)
        if p.is_dir():
            if vocab_size is None or eos_ids is None:
                if (p / "config.json").is_file():
                    from hyspec.config import ModelConfig

                    cfg = ModelConfig.from_dir(p)
                    vocab_size = cfg.vocab_size if vocab_size is None else vocab_size
                    eos_ids = cfg.eos_token_ids if eos_ids is None else eos_ids
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ValueError(f"constraints need a tokenizer.json; there is none at {p}")
        path = p
    st = Path(path).stat()  # (a file rewritten in place, e.g. make-tiny into the same --out, is another vocabulary)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, vocab_size,
           None if eos_ids is None else tuple(eos_ids))
    if key not in _VOCAB_CACHE:
        _VOCAB_CACHE[key] = _make_vocab(Path(path).read_text(encoding="utf-8"), vocab_size, eos_ids)
    return _VOCAB_CACHE[key]


def _make_vocab(tokenizer_json: str, vocab_size: int | None, eos_ids) -> Vocab:
    llg = _llg()
    probe = llg.LLTokenizer(tokenizer_json)
    n_tok = int(probe.vocab_size)
    if eos_ids is None or len(tuple(eos_ids)) == 0:
        eos = [int(t) for t in probe.eos_tokens]
    else:
        eos = [int(t) for t in eos_ids if 0 <= int(t) < n_tok]
        if not eos:
            raise ValueError(f"the model's EOS id(s) {list(eos_ids)} are outside the tokenizer's vocabulary "
                             f"({n_tok} tokens), so a constrained output could never end")
    lltok = llg.LLTokenizer(tokenizer_json, eos_token=eos)
    from tokenizers import Tokenizer as _Tok

    from hyspec.tokenizer import vocab_fingerprint

    return Vocab(lltok, int(vocab_size) if vocab_size is not None else n_tok, tuple(eos),
                 vocab_fingerprint(_Tok.from_str(tokenizer_json)))


# --------------------------------------------------------------------------------------
# Grammars
# --------------------------------------------------------------------------------------


def _json_text(schema, arg: str) -> str:
    """A schema given as a dict, a bool, JSON text or a ``pathlib.Path`` to a .json file ->
    JSON text. A plain string is always JSON text, never a path: a server passes request
    strings here, and must not open files on a client's behalf (the CLI reads
    ``--json-schema FILE`` itself, :func:`hyspec.cli.common.constraint_from_args`)."""
    if isinstance(schema, (dict, bool)):
        return json.dumps(schema)
    if isinstance(schema, Path):
        from hyspec.config import read_text_file

        schema = read_text_file(schema, arg)
    if not isinstance(schema, str):
        raise ValueError(f"{arg}: expected a JSON schema (dict, JSON text or a pathlib.Path), "
                         f"got {type(schema).__name__}")
    try:
        json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"{arg}: not valid JSON ({e})") from None
    return schema.strip()


def _repeatable_key_min_properties(node, where: str = "#"):
    """(path, n) of the first object schema whose minProperties n >= 2 counts keys that the
    grammar cannot keep from repeating (patternProperties, or additionalProperties not
    false: llguidance counts a repeated key twice, a JSON parser keeps it once, so the
    output could fail the schema), or None."""
    if isinstance(node, dict):
        n = node.get("minProperties")
        open_keys = "patternProperties" in node or node.get("additionalProperties", True) is not False
        if isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 2 and open_keys:
            return where, n
        items = [(k, v) for k, v in node.items() if k not in ("const", "enum", "default", "examples")]  # (data)
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return None
    for k, v in items:
        found = _repeatable_key_min_properties(v, f"{where}/{k}")
        if found:
            return found
    return None


def grammar_for(kind: str, value, arg: str | None = None) -> str:
    """The llguidance grammar (a string) for a constraint of `kind`; ValueError naming `arg`
    on a malformed value (validity of the grammar itself is checked by :func:`_validated`)."""
    llg = _llg()
    arg = arg or kind  # errors name the argument: the Python kind, or the CLI flag passed in
    if kind == "json_schema":
        text = _json_text(value, arg)
        if text == "true":  # the schema every JSON value satisfies
            text = "{}"
        elif text == "false":
            raise ValueError(f"{arg}: the schema false admits no value, so nothing could be generated")
        elif not text.startswith("{"):
            raise ValueError(f"{arg}: a JSON schema must be a JSON object (or true), got {text[:40]!r}")
        found = _repeatable_key_min_properties(json.loads(text))
        if found:
            raise ValueError(f"{arg}: minProperties {found[1]:g} at {found[0]} cannot be enforced where keys beyond "
                             "`properties` are allowed (patternProperties, or additionalProperties not false): "
                             "the grammar cannot keep such a key from repeating, and a repeated key counts once "
                             "when the output is parsed; list the keys in `properties`, or drop minProperties")
        try:
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=dict(JSON_DEFAULTS))
        except ValueError as e:
            raise ValueError(f"{arg}: {e}") from None
    if kind == "json_object":
        if value is not None:  # (a schema given here was ignored in silence)
            raise ValueError(f"{arg}: json_object takes no value (any JSON object); for a schema use json_schema")
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=dict(JSON_DEFAULTS))
    if kind == "regex":
        if not isinstance(value, str) or value == "":
            raise ValueError(f"{arg}: expected a non-empty regular expression")
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{arg}: expected Lark grammar text")
        return llg.LLMatcher.grammar_from_lark(value)
    if kind == "choice":
        if isinstance(value, str):
            value = [value]
        choices = list(value) if isinstance(value, (list, tuple)) else []
        if not choices or any(not isinstance(c, str) or c == "" for c in choices):
            raise ValueError(f"{arg}: expected one or more non-empty strings, got {value!r}")
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    raise ValueError(f"unknown constraint kind {kind!r}; choose one of {', '.join(KINDS)}")


def grammar_error_line(message: str, kind: str = "grammar") -> str:
    """llguidance's error as one line: its first line with the cause it gives further down
    ("error: unclosed character class") and without the quoted source under carets. For a
    regex, the position and the "(in regex)" note are dropped: they point into the Lark
    wrapper made around it (``start: /.../``), which the user never wrote."""
    lines = [ln.strip() for ln in str(message).strip().splitlines()]
    head = lines[0] if lines and lines[0] else "invalid grammar"
    # the cause is the last "error:" line (the quoted source above it may hold that text too)
    cause = next((ln[len("error:"):].strip() for ln in reversed(lines[1:]) if ln.startswith("error:")), "")
    if cause:
        head = f"{head.rstrip(':')}: {cause}"
    if kind == "regex":
        head = re.sub(r"^(at )?\d+\(\d+\): ", "", head)
        note = head.rfind('" (in regex)')  # (after the quoted regex: the user's own text is left as it is)
        if note >= 0:
            head = head[:note + 1] + head[note + len('" (in regex)'):]
    return head


def _validated(grammar: str, vocab: Vocab, arg: str, kind: str = "grammar") -> str:
    llg = _llg()
    is_err, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar, vocab.lltok)
    if is_err:
        raise ValueError(f"{arg}: {grammar_error_line(msgs[0], kind) if msgs else 'invalid grammar'}")
    return grammar


# --------------------------------------------------------------------------------------
# The constraint
# --------------------------------------------------------------------------------------


class Constraint:
    """One sequence's grammar state. Build with a factory (:meth:`json_schema`,
    :meth:`json_object`, :meth:`regex`, :meth:`grammar`, :meth:`choice`) or
    :func:`make_constraint`; every factory validates the grammar and raises ValueError
    naming the offending argument before any generation."""

    def __init__(self, vocab: Vocab, grammar: str, *, kind: str = "grammar", arg: str | None = None,
                 _matcher=None) -> None:
        llg = _llg()
        self.vocab = vocab
        self.kind = kind
        self.grammar_text = grammar
        _matcher_given = _matcher is not None
        if _matcher is None:
            _validated(grammar, vocab, arg or kind, kind)
            _matcher = llg.LLMatcher(vocab.lltok, grammar, log_level=0)
            if _matcher.is_error():
                raise ValueError(f"{arg or kind}: {grammar_error_line(_matcher.get_error(), kind)}")
        self._m = _matcher
        self._cache: dict[tuple[int, ...], np.ndarray] = {}  # prefix -> packed mask words (mask_words)
        self._bools: dict[tuple[int, ...], torch.Tensor] = {}  # prefix -> allowed() (unpacked from the words)
        self.tokens: list[int] = []  # the tokens consumed so far
        self._recorded: list[bool] = []  # per token: in the matcher's rollback history
        self.after: str | None = None  # after_text's close, for a wrapped grammar
        self.failure: str | None = None  # why this constraint cannot go on (fail): its sequence ends in error
        if not _matcher_given:  # a grammar no output can even start (`start: x` / `x: x "a"`): refused here,
            # before any generation, not at the first step of each sequence
            words = self._words_now()
            if not words.any() and not self._m.is_accepting():
                raise ValueError(f"{arg or kind}: the grammar admits no output (no token may start it and the empty "
                                 "output is not a match)")
            self._cache[()] = words

    # -- factories ---------------------------------------------------------------------
    @classmethod
    def json_schema(cls, source, schema, *, arg: str = "json_schema", **kw) -> "Constraint":
        return cls(vocab_for(source, **kw), grammar_for("json_schema", schema, arg), kind="json_schema", arg=arg)

    @classmethod
    def json_object(cls, source, *, arg: str = "json_object", **kw) -> "Constraint":
        return cls(vocab_for(source, **kw), grammar_for("json_object", None, arg), kind="json_object", arg=arg)

    @classmethod
    def regex(cls, source, pattern: str, *, arg: str = "regex", **kw) -> "Constraint":
        return cls(vocab_for(source, **kw), grammar_for("regex", pattern, arg), kind="regex", arg=arg)

    @classmethod
    def grammar(cls, source, lark_text: str, *, arg: str = "grammar", **kw) -> "Constraint":
        return cls(vocab_for(source, **kw), grammar_for("grammar", lark_text, arg), kind="grammar", arg=arg)

    @classmethod
    def choice(cls, source, choices, *, arg: str = "choice", **kw) -> "Constraint":
        return cls(vocab_for(source, **kw), grammar_for("choice", choices, arg), kind="choice", arg=arg)

    # -- the interface the decoding loops use -------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.vocab.eos_ids

    @property
    def mask_words(self) -> int:
        """int32 words of a packed mask over the model's vocabulary: ceil(V_model / 32)."""
        return (self.vocab.vocab_size + 31) // 32

    def _words_now(self, matcher=None) -> np.ndarray:
        """The bitmask of `matcher` (default: this constraint's) now (llguidance's layout:
        token t is bit t % 32 of word t // 32) over the model's vocabulary: int32
        [mask_words], ids >= min(tokenizer vocabulary, V_model) cleared."""
        matcher = self._m if matcher is None else matcher
        V = self.vocab.vocab_size
        n = min(self.vocab.tok_vocab, V)
        words = np.frombuffer(matcher.compute_bitmask(), dtype="<i4")
        out = np.zeros(self.mask_words, dtype=np.int32)
        m = min(words.shape[0], (n + 31) // 32)
        out[:m] = words[:m]
        if n % 32:  # bits past the last valid id in its word
            out[n // 32] &= np.int32((1 << (n % 32)) - 1)
        if not matcher.is_accepting():  # an EOS only where commit takes it (_n_valid): a matcher with no
            for t in self.vocab.eos_ids:  # way forward may offer EOS though the output is incomplete
                if 0 <= t < n:
                    out.view(np.uint32)[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        return out

    def fail(self, why: str) -> None:
        """Mark the constraint unable to go on (a grammar that cannot be completed, a matcher
        error): from now on it allows nothing, and its sequence ends in error (the other
        sequences of the batch are not touched). The first reason is kept."""
        if self.failure is None:
            lines = str(why).strip().splitlines() or ["unknown"]
            self.failure = lines[0] + (" ..." if len(lines) > 1 else "")  # (llguidance appends its state dump)
        self._clear()

    def dead_end(self) -> bool:
        """Whether the committed tokens are a dead end: nothing may follow them though no EOS
        ended them (the grammar cannot be completed). Marks the failure (:meth:`fail`), as
        :meth:`allowed_words` does when it finds one at the committed state: a sequence that
        stopped because its mask allowed nothing ends in error unless an EOS ended it."""
        if self.failure is None and not self._ended():
            self.allowed_words(())
        return self.failure is not None

    def allowed_words(self, prefix=()) -> np.ndarray:
        """The mask of :meth:`allowed` packed as llguidance does (int32 [mask_words], bit
        t % 32 of word t // 32 set when token t is allowed): what the CUDA-graph decoder
        uploads and applies on the device. Cached per prefix until the next commit /
        rollback: do not modify the returned array."""
        key = tuple(int(t) for t in prefix)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        m = self._m
        zeros = np.zeros(self.mask_words, dtype=np.int32)
        if m.is_error() and self.failure is None:
            self.fail(f"the {self.kind} constraint failed: {m.get_error()}")
        try:
            if self.failure is not None or self._ended() or (
                    key and (self._n_valid(key) < len(key) or key[-1] in self.vocab.eos_ids)):
                words = zeros  # nothing follows an EOS or an invalid prefix
            elif key:
                # key is valid and has no EOS (an EOS is always the last valid token): a copy
                # consumes it (llguidance cannot roll back stop= / max_tokens= lexemes, and the
                # copy is the faster of the two: ~27 vs ~52 us for a 3-token prefix)
                ahead = m.deep_copy()
                if not ahead.consume_tokens(list(key)):  # cannot happen after _n_valid
                    raise RuntimeError(f"consuming validated tokens failed: {ahead.get_error()}")
                words = self._words_now(ahead)
            else:
                words = self._words_now()
                if not words.any() and not m.is_accepting():
                    self.fail(f"the {self.kind} constraint cannot be completed: after {self.committed} token(s) "
                              f"no token may follow and the output is not a complete match")
        except RuntimeError as e:  # the matcher's own failure: this sequence's, not the batch's
            self.fail(f"the {self.kind} constraint failed: {e}")
            return zeros
        self._cache[key] = words
        return words

    def allowed(self, prefix=()) -> torch.Tensor:
        """bool [V_model]: the tokens allowed after the committed tokens + `prefix` (earlier
        drafts of this round; they are validated and consumed by a copy of the matcher, never
        kept).
        All False when nothing may follow: the grammar is dead or already ended with EOS,
        or `prefix` itself is not allowed. The returned tensor is cached: do not modify it."""
        key = tuple(int(t) for t in prefix)
        hit = self._bools.get(key)
        if hit is not None:
            return hit
        words = self.allowed_words(key)
        bits = np.unpackbits(words.view(np.uint8), count=self.vocab.vocab_size, bitorder="little")
        mask = torch.from_numpy(bits.view(np.bool_))
        self._bools[key] = mask
        return mask

    def _n_valid(self, toks) -> int:
        """How many of `toks` (from the current state) the grammar allows, not consuming them.
        llguidance's validate_tokens refuses an EOS once the grammar has stopped (though
        consume_token takes it there), so an EOS is judged here: valid exactly when the state
        before it accepts; nothing is valid after it. validate_tokens also stops at the end of
        a stop= lexeme, so the tokens after it are validated again from the state there."""
        toks = list(toks)
        if self._ended():
            return 0
        n_tok, eos = self.vocab.tok_vocab, self.vocab.eos_ids
        stop = next((i for i, t in enumerate(toks) if t in eos or not 0 <= t < n_tok), len(toks))
        m, done = self._m, 0  # done: how many of toks the copy `m` has consumed (0: m is self._m itself)
        n = m.validate_tokens(toks[:stop]) if stop else 0
        while 0 < n < stop:
            # validate_tokens also stops at the end of a stop= lexeme (`body[stop="."]`: the tokens
            # after the "." are refused, though consume_token takes them, one at a time, as plain
            # decoding commits them): go on from the state there, on a copy, until a token is
            # refused at its own state (that one is not allowed)
            m, done = self._advanced(m, toks, done, n), n
            more = m.validate_tokens(toks[n:stop])
            if not more:
                break
            n += more
        if n == stop < len(toks) and toks[stop] in eos:
            if n:  # the state after toks[:n], on a copy (nothing to roll back)
                m, done = self._advanced(m, toks, done, n), n
            n += 1 if m.is_accepting() else 0
        return n

    def _advanced(self, m, toks, done: int, n: int):
        """`m` (self._m itself when done = 0, else a copy that consumed toks[:done]) moved on to
        the state after toks[:n], never moving self._m."""
        if done == 0:
            m = m.deep_copy()
        if n > done and not m.consume_tokens(toks[done:n]):
            raise RuntimeError(f"constraint: consuming validated tokens failed: {m.get_error()}")
        return m

    def _ended(self) -> bool:
        """An EOS was committed: nothing (not even another EOS) may follow."""
        return bool(self.tokens) and self.tokens[-1] in self.vocab.eos_ids

    def commit(self, tokens) -> None:
        """Consume the round's emitted tokens (accepted drafts + bonus). A token the grammar
        does not allow is an error (the loops only emit masked choices)."""
        toks = [None] if isinstance(tokens, (str, bytes)) else [as_int(t) for t in tokens]
        if None in toks:  # ("12" or 1.9 were committed as ids 1, 2 / 1)
            raise TypeError(f"constraint: commit takes a list of integer token ids, got {str(tokens)[:80]!r}")
        if not toks:
            return
        m = self._m
        n_ok = self._n_valid(toks)
        if n_ok < len(toks):
            raise ValueError(f"constraint: token {toks[n_ok]} (position {self.committed + n_ok}) is not allowed "
                             f"by the {self.kind} constraint")
        for t in toks:
            # an EOS consumed after the grammar stopped is not in llguidance's history (its
            # rollback would undo the token before it), so such an EOS is kept here only
            recorded = not (t in self.vocab.eos_ids and m.is_stopped())
            if not m.consume_token(t):
                raise RuntimeError(f"constraint: {m.get_error()}")
            self._recorded.append(recorded)
        self.tokens.extend(toks)
        self._clear()

    def rollback(self, n: int) -> None:
        """Undo the last n committed tokens."""
        k = as_int(n)
        if k is None:
            raise TypeError(f"constraint: rollback takes a number of tokens, got {n!r}")
        n = k
        if n < 0 or n > self.committed:
            raise ValueError(f"cannot roll back {n} of {self.committed} committed tokens")
        if n == 0:
            return
        real = sum(self._recorded[len(self._recorded) - n:])
        if self.failure is None and (not real or self._m.rollback(real)):
            del self.tokens[len(self.tokens) - n:]
            del self._recorded[len(self._recorded) - n:]
            self._clear()
            return
        # a failed state (llguidance's matcher stops at a dead end and refuses to roll back) or
        # a refused rollback: the grammar from its start, the tokens before the n again
        keep = self.tokens[: len(self.tokens) - n]
        self.reset()
        self.commit(keep)

    def clone(self) -> "Constraint":
        """An independent copy at the same state (the matcher's deep_copy: microseconds)."""
        c = Constraint.__new__(Constraint)
        c.vocab, c.kind, c.grammar_text = self.vocab, self.kind, self.grammar_text
        c._m = self._m.deep_copy()
        c._cache = dict(self._cache)  # masks are never modified in place
        c._bools = dict(self._bools)
        c.tokens = list(self.tokens)
        c._recorded = list(self._recorded)
        c.after = self.after
        c.failure = self.failure
        return c

    snapshot = clone

    def after_text(self, close: str) -> "Constraint":
        """A new constraint (at its start) that first lets any text through up to and including
        `close`, then optional whitespace, then this grammar: a thinking model reasons freely
        and only its answer is constrained (``after_text("</think>")``; vLLM's "structured
        output after reasoning"). The free part ends at the first `close`: written as the
        tokenizer's own token for it (Qwen's ``</think>``, which llguidance counts as a special
        token, so no text lexeme can match it) or spelled out in text pieces. EOS is not
        allowed before the answer's grammar completes. A constraint already wrapped for the
        same `close` is not wrapped again (a fresh copy of it comes back)."""
        if not isinstance(close, str) or not close:
            raise ValueError("after_text needs the non-empty text that ends the free part")
        if self.after == close:
            c = Constraint(self.vocab, self.grammar_text, kind=self.kind, arg=f"{self.kind} (after {close})")
            c.after = close
            return c
        text = self.grammar_text
        inner = json.loads(text) if text.lstrip().startswith("{") else {"grammars": [{"lark_grammar": text}]}
        grammars = [dict(g) for g in inner["grammars"]]
        taken = {g.get("name") for g in grammars[1:]}  # (a grammar wrapped for another close holds an "answer")
        answer = "answer"
        while answer in taken:
            answer += "_"
        grammars[0]["name"] = answer
        spelled = f"spelled[suffix={json.dumps(close)}]: /(.|\\n)*/\n"
        ids = list(self.vocab.lltok.tokenize_str(close))
        if len(ids) == 1 and self.vocab.lltok.is_special_token(ids[0]):  # the token, or spelled
            rx = re.escape(close).replace("/", "\\/")
            main = (f"start: free WS @{answer}\nfree: TEXT <[{ids[0]}]> | spelled\n"
                    f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{rx}(.|\\n)*/\n{spelled}")
        else:
            main = f"start: spelled WS @{answer}\n{spelled}"
        main += "WS: /[ \\t\\r\\n]*/\n"
        outer = json.dumps({"grammars": [{"lark_grammar": main}] + grammars})
        c = Constraint(self.vocab, outer, kind=self.kind, arg=f"{self.kind} (after {close})")
        c.after = close
        return c

    def reset(self) -> None:
        """Back to the start of the grammar (a failure marked on the way is gone with it)."""
        if self.failure is not None or self._m.is_error():  # (llguidance's reset keeps a stopped
            self._m = _llg().LLMatcher(self.vocab.lltok, self.grammar_text, log_level=0)  # matcher's error)
        else:
            self._m.reset()
        self.tokens = []
        self._recorded = []
        self.failure = None
        self._clear()

    def _clear(self) -> None:
        self._cache.clear()
        self._bools.clear()

    @property
    def committed(self) -> int:
        return len(self.tokens)

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing but EOS may follow (or EOS was consumed)."""
        return bool(self._m.is_stopped())

    @property
    def ended(self) -> bool:
        """An EOS was consumed: the output is over (``finished`` alone may still need its EOS)."""
        return self._ended()

    @property
    def accepting(self) -> bool:
        """The tokens so far form a complete match (EOS is allowed now)."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def __repr__(self) -> str:
        return f"Constraint({self.kind}, committed={self.committed}, finished={self.finished})"


def make_constraint(source, kind: str, value=None, *, arg: str | None = None, **kw) -> Constraint:
    """One entry point: kind in json_schema | json_object | regex | grammar | choice.
    `source`: an Engine, a checkpoint directory or a tokenizer.json path. `arg` names the
    argument in error messages (the CLI passes its flag, e.g. "--json-schema")."""
    if kind not in KINDS:
        raise ValueError(f"unknown constraint kind {kind!r}; choose one of {', '.join(KINDS)}")
    arg = arg or kind
    vocab = vocab_for(source, **kw)
    return Constraint(vocab, grammar_for(kind, value, arg), kind=kind, arg=arg)
