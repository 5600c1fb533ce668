"""The Constraint object (hyspec.constraints) on its own, the CLI flags and the Engine plumbing.

* Masks equal a brute-force check: for a finite language L, token t is allowed after the
  committed tokens s iff bytes(s + t) is a prefix of a string of L; EOS iff bytes(s) is in L.
* allowed(prefix) does not move the state and equals commit(prefix) + allowed([]).
* rollback (including an EOS consumed after the grammar stopped, which llguidance does not
  keep in its own history) and clone independence.
* Bad constraints fail before generation with the library's message and the argument named.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess

import pytest
import torch

pytest.importorskip("llguidance")

from hyspec.constraints import Constraint, make_constraint, vocab_for  # noqa: E402
from hyspec.engine import DEFAULT_MODEL_DIR, Engine  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab():
    return vocab_for(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def token_bytes(vocab):
    return [vocab.lltok.decode_bytes([i]) for i in range(vocab.tok_vocab)]


@pytest.fixture(scope="module")
def engine():
    return Engine.load()


def brute_force(committed: list[int], language: list[bytes], token_bytes, eos: tuple[int, ...], V: int):
    cur = b"".join(token_bytes[t] for t in committed)
    out = torch.zeros(V, dtype=torch.bool)
    for t, tb in enumerate(token_bytes):
        if t in eos:
            out[t] = cur in language
        elif tb:
            cand = cur + tb
            out[t] = any(s.startswith(cand) for s in language)
    return out


FINITE = [
    ("choice", ["yes", "no", "maybe so", '{"a": 1}', "no way"], None),
    ("regex", "[0-9]{2}(px|em)?", [f"{i:02d}{u}".encode() for i in range(100) for u in ("", "px", "em")]),
    ("grammar", 'start: ("ab" | "cd" | "abc") "-" ("x" | "yz" | "x y")', [
        f"{a}-{b}".encode() for a in ("ab", "cd", "abc") for b in ("x", "yz", "x y")]),
]


@pytest.mark.parametrize("kind,value,language", FINITE, ids=[f[0] for f in FINITE])
def test_masks_match_brute_force(vocab, token_bytes, kind, value, language):
    """Sound: every allowed token keeps the output a prefix of a string of L (EOS: the output
    is in L). Live: something is allowed exactly when some continuation exists. Complete on
    the canonical tokenization: every string of L, tokenized by the tokenizer, is allowed
    token by token and then EOS. (llguidance admits only canonical tokens where the next
    bytes are forced -- after "m" of "maybe so" it allows "ay", not "a" -- so the mask is a
    subset of the brute-force set there, never a superset.)"""
    if language is None:
        language = [s.encode() for s in value]
    V, eos = vocab.vocab_size, vocab.eos_ids
    c = make_constraint(vocab, kind, value)
    rng = random.Random(0)
    states = equal = 0
    for walk in range(6):
        c.reset()
        path: list[int] = []
        while True:
            a = c.allowed([])
            want = brute_force(path, language, token_bytes, eos, V)
            assert not (a & ~want).any(), (kind, path, (a & ~want).nonzero().flatten().tolist()[:10])
            assert bool(a.any()) == bool(want.any()), (kind, path)
            equal += bool(torch.equal(a, want))
            # the same mask from the root, through allowed(prefix), without moving the state
            root = make_constraint(vocab, kind, value)
            assert torch.equal(root.allowed(path), a) and root.committed == 0
            states += 1
            choices = a.nonzero().flatten().tolist()
            if not choices:
                break
            t = rng.choice(choices)
            c.commit([t])
            path.append(t)
            if t in eos:
                assert c.finished and not c.allowed([]).any()
                break
    assert states > 15 and equal > states // 3  # the free choices are exact
    for s in language:
        c.reset()
        for t in vocab.lltok.tokenize_bytes(s):
            assert c.allowed([])[t], (s, t)
            c.commit([t])
        assert all(c.allowed([])[e] for e in eos), s


def test_allowed_does_not_move_the_state_and_matches_commit(engine):
    c = Constraint.json_schema(engine, SCHEMA)
    ids = engine.encode('{"name":"bob","n":42}')
    before = c.allowed([]).clone()
    for i in range(len(ids) + 1):
        a = c.allowed(ids[:i])
        d = c.clone()
        d.commit(ids[:i])
        assert torch.equal(a, d.allowed([])), i
    assert c.committed == 0 and torch.equal(c.allowed([]), before)
    # the full object: EOS (the model's id 0) is the only continuation, then nothing
    assert c.allowed(ids).nonzero().flatten().tolist() == [0]
    assert not c.allowed(ids + [0]).any()
    # an invalid prefix allows nothing; a wrong commit is an error that leaves the state alone
    bad = engine.encode("[1]")
    assert not c.allowed(bad).any()
    with pytest.raises(ValueError, match="not allowed"):
        c.commit(bad)
    assert c.committed == 0 and torch.equal(c.allowed([]), before)


def test_a_model_vocabulary_smaller_than_the_tokenizers(vocab):
    """V_model < the tokenizer's vocabulary, not a multiple of 32: the ids below V_model in
    the last (partial) mask word stay allowed, those at or past it are cleared in the
    packed words too, and a packed mask is ceil(V / 32) words."""
    V = vocab.tok_vocab - 5
    c = Constraint.regex(DEFAULT_MODEL_DIR, "[a-zA-Z]+", vocab_size=V)
    a = c.allowed([])
    full = Constraint.regex(DEFAULT_MODEL_DIR, "[a-zA-Z]+", vocab_size=vocab.tok_vocab).allowed([])
    last = V // 32 * 32
    assert a.shape == (V,) and a[last:].any() and torch.equal(a, full[:V])
    words = c.allowed_words([])
    assert words.shape == ((V + 31) // 32,) and full[V:].any()
    assert not (words.view("uint32")[-1] >> (V % 32)).any()  # (bits of ids >= V)
    assert Constraint.regex(vocab, "[a-z]+").allowed_words([]).shape == ((vocab.vocab_size + 31) // 32,)


def test_ids_past_the_tokenizer_are_never_allowed(engine):
    V_tok = vocab_for(engine).tok_vocab
    c = Constraint.regex(DEFAULT_MODEL_DIR, ".*", vocab_size=V_tok + 100)
    a = c.allowed([])
    assert a.shape == (V_tok + 100,) and a[:V_tok].any() and not a[V_tok:].any()
    assert not c.allowed([V_tok + 5]).any()


def test_eos_is_the_models_eos(tmp_path):
    """The grammar's end allows the model's EOS ids (config.json), not the tokenizer's guess."""
    c = Constraint.choice(DEFAULT_MODEL_DIR / "tokenizer.json", ["ok"], eos_ids=(7,))
    ids = [t for t in c.vocab.lltok.tokenize_str("ok")]
    assert c.allowed(ids).nonzero().flatten().tolist() == [7]
    with pytest.raises(ValueError, match="EOS"):
        Constraint.choice(DEFAULT_MODEL_DIR / "tokenizer.json", ["ok"], eos_ids=(99999,))
    # of several ids, those the tokenizer has (a padded vocabulary's id past it is dropped)
    c = Constraint.choice(DEFAULT_MODEL_DIR / "tokenizer.json", ["ok"], eos_ids=(7, 99999))
    assert c.eos_ids == (7,) and c.allowed(ids).nonzero().flatten().tolist() == [7]


def test_an_engines_vocabulary_is_cached_per_eos_ids(engine):
    """vocab_for(engine, eos_ids=...) gives those EOS ids, and the engine's own afterwards
    its own (one cache per tokenizer, keyed by the vocabulary size and the EOS ids)."""
    other = vocab_for(engine, eos_ids=(7,))
    assert other.eos_ids == (7,) and vocab_for(engine).eos_ids == tuple(engine.eos_ids)
    assert vocab_for(engine, eos_ids=(7,)) is other


@pytest.mark.parametrize("grammar,text,stopped", [("regex", "[0-9]{2}", True), ("regex", "[0-9]+", False)])
def test_rollback_and_clone(vocab, grammar, text, stopped):
    c = make_constraint(vocab, grammar, text)
    toks = vocab.lltok.tokenize_str("12")
    masks = [c.allowed([]).clone()]
    for t in toks:
        c.commit([t])
        masks.append(c.allowed([]).clone())
    assert c.finished == stopped and c.accepting
    snap = c.clone()
    c.commit([0])  # EOS, after the grammar stopped (regex {2}) or while it can still grow (+)
    assert c.finished and not c.allowed([]).any()
    assert snap.finished == stopped  # the clone did not move
    assert torch.equal(snap.allowed([]), masks[-1]) and snap.committed == len(toks)
    c.rollback(1)  # undoes the EOS only (llguidance alone would also drop the last digit)
    assert torch.equal(c.allowed([]), masks[-1]) and c.committed == len(toks)
    c.rollback(len(toks))
    assert torch.equal(c.allowed([]), masks[0]) and c.committed == 0
    # independence both ways
    d = snap.clone()
    d.commit([0])
    assert not snap.allowed([]).equal(d.allowed([]))
    assert torch.equal(snap.allowed([]), masks[-1])
    with pytest.raises(ValueError):
        c.rollback(1)


def test_reset_and_rollback_leave_a_dead_end(vocab):
    """A dead end (a grammar that cannot be completed after its tokens) marked a failure that
    reset() kept (the reset constraint allowed nothing: every generation under it failed), and
    rollback() then raised "rollback failed" (llguidance's matcher stops there)."""
    c = make_constraint(vocab, "grammar", 'start: "def" x | "class A"\nx: x "a"')
    start = c.allowed([]).clone()
    assert start.any()
    c.commit(vocab.lltok.tokenize_str("def"))
    assert c.dead_end() and not c.allowed([]).any()
    d = c.clone()
    c.reset()
    assert c.failure is None and c.committed == 0 and torch.equal(c.allowed([]), start)
    d.rollback(d.committed)
    assert d.failure is None and d.committed == 0 and torch.equal(d.allowed([]), start)
    d.commit(vocab.lltok.tokenize_str("class A"))
    assert d.accepting


def test_an_eos_before_the_output_is_complete_is_not_allowed(vocab):
    """commit([EOS]) where the output is not yet a match is refused as any other token the
    grammar forbids (ValueError, the state left alone), not consumed into a matcher error."""
    c = make_constraint(vocab, "regex", "[0-9]{3}")
    one = list(vocab.lltok.tokenize_str("1"))
    c.commit(one)
    before = c.allowed([]).clone()
    eos = vocab.eos_ids[0]
    assert not before[eos] and not c.allowed([eos]).any()
    with pytest.raises(ValueError, match="not allowed"):
        c.commit([eos])
    with pytest.raises(ValueError, match="not allowed"):
        c.commit(one + [eos])
    assert c.committed == 1 and c.error is None and torch.equal(c.allowed([]), before)


def test_a_failure_stays_in_clones_and_goes_with_a_rollback(vocab):
    """fail(): nothing is allowed from then on (masks computed before are dropped), the first
    reason is kept, a clone keeps it, and rolling back (or reset) goes back to a live state;
    a clone keeps after_text's close (wrapping the clone again is a fresh copy, not a second
    free part)."""
    c = make_constraint(vocab, "regex", "[0-9]+")
    c.commit(list(vocab.lltok.tokenize_str("12")))
    live = c.allowed([]).clone()
    assert live.any()
    c.fail("the first reason\nllguidance's state dump")
    c.fail("a later one")
    assert c.failure == "the first reason ..." and not c.allowed([]).any() and not c.allowed_words([]).any()
    d = c.clone()
    assert d.failure == c.failure and not d.allowed([]).any() and d.dead_end()
    c.rollback(0)
    assert c.failure is not None
    n = c.committed
    c.rollback(1)
    assert c.failure is None and c.committed == n - 1 and c.allowed([]).any()
    d.rollback(0)
    d.reset()
    assert d.failure is None and d.allowed([]).any()
    fresh = make_constraint(vocab, "regex", "[0-9]+")  # (its constructor caches the start's mask)
    fresh.fail("x")
    assert not fresh.allowed([]).any()
    wrapped = make_constraint(vocab, "regex", "[0-9]+").after_text("</think>")
    twin = wrapped.clone()
    assert twin.after == "</think>"
    assert twin.after_text("</think>").grammar_text == wrapped.grammar_text


def test_json_object_and_finished(engine):
    c = Constraint.json_object(engine)
    first = c.allowed([]).nonzero().flatten().tolist()
    assert engine.encode("{")[0] in first and all(engine.decode([t]).startswith("{") for t in first)
    ids = engine.encode('{"a":[1,2]}')
    c.commit(ids)
    assert c.accepting and c.finished
    assert c.allowed([]).nonzero().flatten().tolist() == list(engine.eos_ids)


BAD = [
    ("json_schema", '{"type": "foo"}', "json_schema", "Invalid type"),
    ("json_schema", '{"type": "array", "uniqueItems": true}', "json_schema", "uniqueItems"),
    ("json_schema", "{not json", "json_schema", "not valid JSON"),
    ("json_schema", "/no/such/schema.json", "json_schema", "not valid JSON"),  # a str is never a path
    ("json_schema", "false", "json_schema", "admits no value"),
    ("json_schema", "[1, 2]", "json_schema", "must be a JSON object"),
    ("regex", "[0-9", "regex", 'regex: invalid regex "[0-9": regex parse error: unclosed character class'),  # (no
    # position: it pointed into the Lark wrapper made around the regex)
    ("regex", "error: [A-Z", "regex", '"error: [A-Z": regex parse error: unclosed character class'),  # (the
    ("regex", "[x (in regex)", "regex", '"[x (in regex)": regex parse error'),  # user's text is kept whole)
    ("grammar", "start: foo(", "grammar", "Expected token"),
    ("grammar", "start: undefined_rule", "grammar", "undefined_rule"),
    ("choice", [], "choice", "non-empty strings"),
    ("choice", {"a": 1}, "choice", "non-empty strings"),
    ("choice", ["yes", ""], "choice", "non-empty strings"),
    ("json_object", {"type": "object"}, "json_object", "takes no value"),  # (a schema here was ignored)
]


@pytest.mark.parametrize("kind,value,arg,msg", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_constraints_name_the_argument(vocab, kind, value, arg, msg):
    with pytest.raises(ValueError) as e:
        make_constraint(vocab, kind, value)
    assert str(e.value).startswith(arg + ":") and msg in str(e.value), str(e.value)
    # one line, the cause in it (llguidance's message put it three lines down, under the quoted
    # source; a regex's position pointed into the Lark wrapper made around it)
    assert "\n" not in str(e.value) and '" (in regex)' not in str(e.value), str(e.value)


def test_a_schema_string_is_json_text_and_a_path_is_read(vocab, tmp_path):
    """A str is never opened as a file (the server hands request strings to the library: a
    client must not make it read the server's disk); a pathlib.Path is read; the schema true
    allows any JSON value."""
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMA))
    with pytest.raises(ValueError, match="not valid JSON"):
        make_constraint(vocab, "json_schema", str(f))
    assert make_constraint(vocab, "json_schema", f).kind == "json_schema"
    with pytest.raises(ValueError, match="no such file"):
        make_constraint(vocab, "json_schema", tmp_path / "none.json")
    assert make_constraint(vocab, "json_schema", True).kind == "json_schema"
    assert make_constraint(vocab, "json_schema", "true").kind == "json_schema"
    # JSON text as a file holds it: around it, whitespace (and a choice of one string)
    assert make_constraint(vocab, "json_schema", "\n " + json.dumps(SCHEMA) + "\n").kind == "json_schema"
    assert make_constraint(vocab, "json_schema", " true\n").kind == "json_schema"
    yes = list(vocab.lltok.tokenize_str("yes"))
    assert make_constraint(vocab, "choice", "yes").allowed(yes).nonzero().flatten().tolist() == list(vocab.eos_ids)


def test_json_is_compact_unless_the_schema_says_otherwise(vocab):
    """JSON grammars default to whitespace_flexible false (docs/constraints.md, "JSON
    whitespace"); a schema's own "x-guidance" overrides it."""
    ids = list(vocab.lltok.tokenize_str('{"a":1'))
    blanks = [vocab.lltok.tokenize_str(b)[0] for b in (" ", "\n")]
    for c in (Constraint.json_object(vocab), Constraint.json_schema(vocab, {"type": "object"})):
        assert not any(c.allowed(ids)[b] for b in blanks)
    flexible = Constraint.json_schema(vocab, {"type": "object", "x-guidance": {"whitespace_flexible": True}})
    assert all(flexible.allowed(ids)[b] for b in blanks)


def test_unknown_kind(vocab):
    with pytest.raises(ValueError, match="unknown constraint kind"):
        make_constraint(vocab, "xml", "x")


# --------------------------------------------------------------------------------------
# Engine plumbing and the CLI
# --------------------------------------------------------------------------------------


def test_engine_generate_constraint(engine):
    c = engine.constraint("choice", ["alpha", "beta", "gamma"])
    for draft in (0, 3):
        out = engine.generate("x = ", max_new_tokens=10, draft=draft, constraint=c)
        assert out.samples[0].stop_reason == "eos"
        assert out.text.replace("<|endoftext|>", "") in ("alpha", "beta", "gamma")
    assert c.committed == 0  # each sample runs on a clone
    from hyspec.sampling import SamplingParams

    out = engine.generate("x = ", max_new_tokens=10, draft=2, constraint=c, num_samples=4,
                          params=SamplingParams(temperature=1.0, seed=3))
    assert all(s.text.replace("<|endoftext|>", "") in ("alpha", "beta", "gamma") for s in out.samples)
    with pytest.raises(ValueError, match="constraint must be"):
        engine.generate("x", constraint="json")


def test_a_constraint_of_another_tokenizer_of_the_same_size_is_refused(engine, tmp_path):
    """The vocabulary sizes matched, so the other tokenizer's mask was applied to this model's
    ids and the output broke the constraint (' #lro' for a choice of 'hello' / 'world')."""
    from hyspec.tiny import make_tiny

    other = Engine.load(make_tiny("qwen3_5", tmp_path / "other", vocab_size=engine.model.cfg.vocab_size, hidden=32,
                                  layers=2, seed=1))
    theirs = other.constraint("choice", ["hello", "world"])
    assert theirs.vocab_size == engine.model.cfg.vocab_size
    with pytest.raises(ValueError, match="constraint was built for another tokenizer than this model's"):
        engine.generate("x = ", max_new_tokens=6, constraint=theirs)
    with pytest.raises(ValueError, match="another tokenizer"):
        engine.session(max_new_tokens=6).send("x", constraint=theirs)
    # the same tokenizer through its file (not the engine) is this model's
    ours = Constraint.choice(DEFAULT_MODEL_DIR / "tokenizer.json", ["hello", "world"])
    assert engine.generate("x = ", max_new_tokens=6, constraint=ours).text.replace("<|endoftext|>", "") in (
        "hello", "world")
    # this model's tokenizer, but built for a vocabulary of another size: refused, naming both sizes
    V = engine.model.cfg.vocab_size
    wider = Constraint.choice(DEFAULT_MODEL_DIR / "tokenizer.json", ["hello", "world"], vocab_size=V + 64)
    with pytest.raises(ValueError, match=f"built for a vocabulary of {V + 64} tokens; this model has {V}"):
        engine.generate("x = ", max_new_tokens=6, constraint=wider)


def test_a_tokenizer_file_rewritten_in_place_is_read_again(tmp_path):
    """The vocabulary of a tokenizer.json was cached by its path alone: a file rewritten in
    place (make-tiny into the same --out) kept the old vocabulary in this process, whose
    masks were then another tokenizer's."""
    import shutil

    from hyspec.tiny import make_tiny

    t = tmp_path / "tokenizer.json"
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.json", t)
    first = vocab_for(t)
    shutil.copy(make_tiny("qwen3_5", tmp_path / "tiny", hidden=32, layers=2, seed=1) / "tokenizer.json", t)
    assert vocab_for(t).fingerprint != first.fingerprint
    assert vocab_for(t) is vocab_for(t)  # (unchanged: the cached one)
    # rewritten to the same size (two pieces of a length swap their ids): another vocabulary too
    tok = json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text())
    t.write_text(json.dumps(tok))
    before = vocab_for(t)
    pieces = tok["model"]["vocab"]
    a, b = [k for k in pieces if len(k) == 3 and k.isalpha()][:2]
    pieces[a], pieces[b] = pieces[b], pieces[a]
    size, mtime = t.stat().st_size, t.stat().st_mtime_ns
    t.write_text(json.dumps(tok))
    os.utime(t, ns=(mtime + 10**9, mtime + 10**9))
    assert t.stat().st_size == size and vocab_for(t).fingerprint != before.fingerprint
    # an engine's constraints follow the tokenizer it encodes with, not its file rewritten since
    d = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, d)
    eng = Engine.load(d)
    shutil.copy(tmp_path / "tiny" / "tokenizer.json", d / "tokenizer.json")
    out = eng.generate("x = ", max_new_tokens=6, constraint=eng.constraint("choice", ["hello", "world"]))
    assert out.text.replace("<|endoftext|>", "") in ("hello", "world")


@pytest.mark.parametrize("lark", ['start: "x=" foo\nfoo[stop=";"]: /[a-z]+/\n',
                                  'start: foo\nfoo[max_tokens=4]: /[a-z]+/\n'])
def test_lexemes_llguidance_cannot_roll_back_decode_alike_with_drafts(engine, lark):
    """stop= and max_tokens= lexemes: llguidance cannot roll them back, and the draft masks
    consumed and rolled back each draft prefix, so draft >= 1 ended in a ConstraintFailure
    where draft 0 worked. The masks now come from a copy of the matcher."""
    outs = [engine.generate("value = ", max_new_tokens=12, draft=d, constraint=engine.constraint("grammar", lark))
            for d in (0, 1, 3)]
    assert outs[0].samples[0].stop_reason == "eos"
    assert outs[0].tokens == outs[1].tokens == outs[2].tokens


def test_tokens_past_the_end_of_a_stop_lexeme_commit_and_mask_as_one_by_one(vocab):
    """llguidance's validate_tokens stops at the end of a stop= lexeme (the "." below): the
    tokens after it were refused, so a speculative round that emitted "." and "!" together
    ended in a ConstraintFailure ("token ... is not allowed") and a draft prefix crossing the
    "." got an all-False mask (read as a dead end), where plain decoding, committing one
    token at a time, went on. commit(several) == commit one by one; allowed(prefix) ==
    commit(prefix) + allowed()."""
    c = make_constraint(vocab, "grammar", 'start: "x" body "!"\nbody[stop="."]: /[a-z ]*/')
    toks = [int(t) for t in vocab.lltok.tokenize_str("xab cd.!")]
    eos = vocab.eos_ids[0]
    one = c.clone()
    for t in toks:
        one.commit([t])
    assert one.accepting
    at_once = c.clone()
    at_once.commit(toks + [eos])  # (was: ValueError at the "!")
    assert at_once.ended and at_once.tokens == toks + [eos]
    for i in range(len(toks) + 1):
        ref = c.clone()
        ref.commit(toks[:i])
        assert torch.equal(c.allowed(toks[:i]), ref.allowed()), i
        assert c.allowed(toks[:i]).any(), i
    assert c.committed == 0
    with pytest.raises(ValueError, match="not allowed"):  # a token the grammar refuses is still refused
        c.clone().commit(toks[:-1] + [toks[0]])


def test_stop_reason_constraint_when_nothing_is_allowed(engine):
    """ignore_eos: once the grammar ended with EOS nothing may follow, so generation stops
    with stop_reason "constraint" and the output so far (plain and speculative alike)."""
    c = engine.constraint("regex", "[0-9]{3}")
    outs = [engine.generate("n = ", max_new_tokens=30, draft=d, constraint=c, ignore_eos=True) for d in (0, 1, 3)]
    for o in outs:
        assert o.samples[0].stop_reason == "constraint"
        assert o.tokens[-1] == 0 and len(o.text.replace("<|endoftext|>", "")) == 3
    assert outs[0].tokens == outs[1].tokens == outs[2].tokens


def _cli(capsys, *args):
    from hyspec.cli import main

    rc = main(["generate", "--prompt", "x = ", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def test_cli_flags_parse_into_constraints(tmp_path):
    from hyspec.cli import build_parser, constraint_from_args

    eng = Engine.load()
    schema_file = tmp_path / "s.json"
    schema_file.write_text(json.dumps(SCHEMA))
    lark = tmp_path / "g.lark"
    lark.write_text('start: "a" | "b"\n')
    cases = [(["--json-schema", str(schema_file)], "json_schema"), (["--json-schema", json.dumps(SCHEMA)], "json_schema"),
             (["--constrain-json"], "json_object"), (["--regex", "[a-z]+"], "regex"),
             (["--grammar", str(lark)], "grammar"), (["--choice", "a,b,c"], "choice"), ([], None)]
    for flags, kind in cases:
        args = build_parser().parse_args(["generate", "--prompt", "x", *flags])
        c = constraint_from_args(eng, args)
        assert (c.kind if c is not None else None) == kind, flags
    with pytest.raises(SystemExit):  # one constraint at a time
        build_parser().parse_args(["generate", "--prompt", "x", "--regex", "a", "--choice", "a,b"])


def test_cli_generate_and_bad_constraint_errors(tmp_path, capsys):
    r = _cli(capsys, "--choice", "yes,no", "--draft", "2", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["text"].replace("<|endoftext|>", "") in ("yes", "no") and d["stop_reason"] == "eos"
    bad = tmp_path / "bad.lark"
    bad.write_text("start: foo(\n")
    for flags, needle in [(["--json-schema", '{"type": "object", "not": {}}'], "--json-schema: Unimplemented keys"),
                          (["--regex", "(ab"], "--regex: "), (["--grammar", str(bad)], f"--grammar {bad}: "),
                          (["--grammar", str(tmp_path / "none.lark")], "--grammar: no such file"),
                          (["--json-schema", str(tmp_path / "none.json")],
                           "--json-schema: '" + str(tmp_path / "none.json") + "' is neither JSON text nor an existing file")]:
        r = _cli(capsys, *flags)
        assert r.returncode == 2 and needle in r.stderr and r.stdout == "", (flags, r.stderr)
    # a grammar no output can start is refused before generation (it failed at each sequence's first step)
    dead = tmp_path / "dead.lark"
    dead.write_text('start: x\nx: x "a"\n')
    r = _cli(capsys, "--grammar", str(dead))
    assert r.returncode == 2 and r.stdout == "" and f"--grammar {dead}: the grammar admits no output" in r.stderr
    # one that dies mid-output: the streamed text ends its line, the error is on its own line
    # (it was glued on: "x = abhyspec generate: error: ...")
    dead.write_text('start: "ab" x\nx: /[^\\s\\S]/\n')
    r = _cli(capsys, "--grammar", str(dead))
    assert r.returncode == 2 and r.stdout == "x = ab\n" and "cannot be completed" in r.stderr, (r.stdout, r.stderr)
    with pytest.raises(ValueError, match="admits no output"):  # the Python API alike; an empty match is fine
        Engine.load().constraint("grammar", 'start: x\nx: x "a"\n')
    assert Engine.load().constraint("regex", "a{0}").allowed().any()


def test_cli_prompts_file_with_a_constraint(tmp_path, capsys):
    from hyspec.cli import main

    f = tmp_path / "in.jsonl"
    lines = [{"prompt": "a = ", "draft": 3}, {"prompt": "b = ", "temperature": 1.0, "seed": 2},
             {"prompt_ids": [5, 6, 7], "draft": 2, "temperature": 1.0, "seed": 4}]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--prompts-file", str(f), "--out", str(out), "--max-new-tokens", "12",
                 "--choice", "red,green,blue"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["stop_reason"] == "eos" and row["text"].replace("<|endoftext|>", "") in ("red", "green", "blue")
    capsys.readouterr()
    # a grammar that cannot be completed: every line's result is written, with its "error", and the run exits 1
    # (it raised after the batch: the error line, exit 2, no reason per line)
    dead = tmp_path / "dead.lark"
    dead.write_text('start: "ab" x\nx: /[^\\x00-\\U0010FFFF]/\n')
    assert main(["generate", "--prompts-file", str(f), "--out", str(out), "--max-new-tokens", "12",
                 "--grammar", str(dead)]) == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["stop_reason"] for r in rows] == ["error"] * 3 and all("cannot be completed" in r["error"] for r in rows)
    assert "3 of 3 line(s) ended in error (line(s) 1, 2, 3" in capsys.readouterr().err


def test_a_prompts_file_line_carries_its_own_constraint(tmp_path, capsys):
    """A line's "json_schema" / "json_object" / "regex" / "grammar" / "choice" constrains that
    line (in place of the flag's), and its output is the one the same request gets alone
    (they were 'unknown field(s)': one constraint for the whole file only)."""
    from hyspec.cli import main

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
              "additionalProperties": False}
    lines = [{"prompt": "point = ", "json_schema": schema, "draft": 3, "max_new_tokens": 30},
             {"prompt": "answer = ", "choice": ["yes", "no"], "temperature": 1.0, "seed": 5},
             {"prompt": "date = ", "regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}", "draft": 2},
             {"prompt": "x = ", "max_new_tokens": 6},  # the flag's constraint
             {"prompt": "obj = ", "json_object": True, "max_new_tokens": 20},
             {"prompt": "op = ", "grammar": 'start: "add" | "sub"'}]
    f, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["generate", "--prompts-file", str(f), "--out", str(out), "--max-new-tokens", "16",
                 "--choice", "red,green"]) == 0
    texts = [json.loads(line)["text"].replace("<|endoftext|>", "") for line in out.read_text().splitlines()]
    import jsonschema

    jsonschema.validate(json.loads(texts[0]), schema)
    assert texts[1] in ("yes", "no") and texts[3] in ("red", "green") and texts[5] in ("add", "sub")
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", texts[2]) and isinstance(json.loads(texts[4]), dict)
    eng = Engine.load()
    from hyspec.sampling import SamplingParams

    alone = eng.generate("answer = ", max_new_tokens=16, constraint=eng.constraint("choice", ["yes", "no"]),
                         params=SamplingParams(temperature=1.0, seed=5))
    assert alone.text.replace("<|endoftext|>", "") == texts[1]
    alone = eng.generate("point = ", max_new_tokens=30, draft=0, constraint=eng.constraint("json_schema", schema))
    assert alone.text.replace("<|endoftext|>", "") == texts[0]
    # two schemas that differ only in their properties' order are two constraints (the order is the output's)
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}
    ba = {**ab, "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    f.write_text("".join(json.dumps({"prompt": "v = ", "json_schema": s, "max_new_tokens": 6}) + "\n" for s in (ab, ba)))
    assert main(["generate", "--prompts-file", str(f), "--out", str(out)]) == 0
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert texts[0].startswith('{"a"') and texts[1].startswith('{"b"'), texts
    capsys.readouterr()
    for line, needle in [({"prompt": "a", "regex": "[a-z]", "choice": ["a"]}, "one constraint per line"),
                         ({"prompt": "a", "json_object": 1}, '"json_object" must be true'),
                         ({"prompt": "a", "choice": []}, '"choice": expected one or more non-empty strings'),
                         ({"prompt": "a", "regex": "("}, '"regex": ')]:
        f.write_text(json.dumps(line) + "\n")
        assert main(["generate", "--prompts-file", str(f)]) == 2
        err = capsys.readouterr().err
        assert f"{f}:1: " in err and needle in err, err


def test_min_properties_over_keys_that_may_repeat_is_refused(vocab):
    """llguidance counts a repeated key toward minProperties, a JSON parser keeps it once: with
    patternProperties (or additionalProperties not false) the default model wrote {"b":0,"b":1}
    for minProperties 2, which fails the schema. Such a schema is refused, naming the place;
    minProperties over declared properties only (which cannot repeat) still builds."""
    import llguidance

    pattern = {"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}},
               "additionalProperties": False, "minProperties": 2}
    # (why: the grammar itself takes the repeated key as a complete object)
    m = llguidance.LLMatcher(vocab.lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(pattern)))
    assert m.consume_tokens(vocab.lltok.tokenize_str('{"a":1,"a":2}')) and m.is_accepting()
    for schema, where in ((pattern, "#"),
                          ({"$defs": {"m": {"type": "object", "additionalProperties": {"type": "integer"},
                                            "minProperties": 3}}, "$ref": "#/$defs/m"}, "#/$defs/m")):
        with pytest.raises(ValueError, match=f"minProperties .* at {re.escape(where)} cannot be enforced"):
            Constraint.json_schema(vocab, schema)
    declared = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"], "additionalProperties": False, "minProperties": 2}
    Constraint.json_schema(vocab, declared)
    Constraint.json_schema(vocab, {"type": "object", "minProperties": 1})  # (one key: a repeat still counts one)
    with pytest.raises(ValueError, match="minProperties 2 at # cannot be enforced"):  # (additionalProperties
        Constraint.json_schema(vocab, {"type": "object", "minProperties": 2})  # left out: any key allowed)
    Constraint.json_schema(vocab, {"const": {"minProperties": 5}})  # (data, not a schema)


def test_a_clone_keeps_its_own_rollback_record(vocab):
    """clone() copies which committed tokens llguidance holds in its rollback history: an EOS
    committed on a clone after its grammar stopped (kept outside that history) must not
    change how many tokens the original hands to the matcher's rollback, or the original's
    rollback leaves a token consumed and its masks come from the wrong state."""
    c = make_constraint(vocab, "regex", "[0-9]{2}")
    start = c.allowed([]).clone()
    toks = list(vocab.lltok.tokenize_str("12"))
    c.commit(toks)
    assert c.finished
    d = c.clone()
    d.commit([vocab.eos_ids[0]])  # (not in llguidance's history: the grammar had stopped)
    c.rollback(len(toks))
    assert c.committed == 0 and torch.equal(c.allowed([]), start)
    d.rollback(1)
    assert d.committed == len(toks) and d.finished and not d.ended


def test_ids_past_the_tokenizer_in_drafts_and_commits_leave_the_state_alone(vocab):
    """An id the tokenizer lacks (a padded model vocabulary's, or a negative one) is judged
    before llguidance sees it: as a draft prefix it allows nothing, in a commit it is a
    ValueError, and neither fails the constraint -- llguidance's validate_tokens puts the
    matcher itself in error on such an id, and an accepting state must not count it as an
    EOS-like end."""
    V_tok = vocab.tok_vocab
    c = Constraint.regex(DEFAULT_MODEL_DIR, "[0-9]*", vocab_size=V_tok + 64)
    assert c.accepting
    start = c.allowed([]).clone()
    one = list(vocab.lltok.tokenize_str("1"))
    for bad in ([V_tok + 5], one + [V_tok + 5], [-1]):
        assert not c.allowed(bad).any(), bad
        with pytest.raises(ValueError, match="not allowed"):
            c.commit(bad)
        assert c.failure is None and c.error is None and c.committed == 0, bad
        assert torch.equal(c.allowed([]), start), bad
    c.commit(one)
    assert c.allowed([]).any()


def test_after_text_again_for_the_same_close_is_at_its_start(vocab):
    """Wrapping an already wrapped constraint for the same close gives a fresh copy at its
    start (the engine and the chat route wrap the constraint they are handed), not a copy of
    its state: its first token may be any free text again."""
    c = make_constraint(vocab, "regex", "[0-9]{2}").after_text("</think>")
    start = c.allowed([]).clone()
    c.commit(list(vocab.lltok.tokenize_str("hmm</think>1")))
    again = c.after_text("</think>")
    assert again.committed == 0 and again.after == "</think>" and torch.equal(again.allowed([]), start)
    assert c.committed > 0


def test_a_commit_crossing_two_stop_lexemes_is_as_one_by_one(vocab):
    """validate_tokens stops at the end of each stop= lexeme, so _n_valid goes on from there
    as many times as the tokens cross one: a speculative round that emits both the "." and
    the ";" below commits (and masks) as plain decoding, one token at a time, does."""
    c = make_constraint(vocab, "grammar", 'start: "x" a "!" b "?"\na[stop="."]: /[a-z]*/\nb[stop=";"]: /[a-z]*/')
    toks = [int(t) for t in vocab.lltok.tokenize_str("xab.!cd;?")]
    at_once = c.clone()
    at_once.commit(toks + [vocab.eos_ids[0]])
    assert at_once.ended
    for i in range(len(toks) + 1):
        ref = c.clone()
        for t in toks[:i]:
            ref.commit([t])
        assert torch.equal(c.allowed(toks[:i]), ref.allowed()), i
    assert c.committed == 0
