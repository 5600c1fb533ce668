"""Fast tests for hyspec.train.corpus and hyspec.train.tokenizer_train."""

from __future__ import annotations

import json
import lzma

import pytest

pytest.importorskip("tokenizers")

from hyspec.train.corpus import (  # noqa: E402
    build_corpus,
    collect_stdlib_files,
    load_corpus,
    split_of,
)
from hyspec.train.tokenizer_train import (  # noqa: E402
    EOS_ID,
    EOS_TOKEN,
    check_roundtrip,
    count_tokens,
    decode,
    encode,
    load_tokenizer,
    train_tokenizer,
)

SMALL_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Foo:\n    def __init__(self, x):\n        self.x = x\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tprint(i)\n",
    "x = {'k': [1, 2, 3], \"s\": None}  # comment\n",
    "async def main():\n    await asyncio.sleep(0.1)\n",
]


def test_split_determinism_and_ratio():
    paths = [f"pkg{i // 50}/mod_{i}.py" for i in range(4000)]
    a = [split_of(p) for p in paths]
    b = [split_of(p) for p in paths]
    assert a == b
    assert set(a) <= {"train", "heldout"}
    frac = a.count("heldout") / len(a)
    assert 0.03 < frac < 0.07, frac
    # known values pin the hash function (sha256 of the POSIX relative path)
    assert split_of("argparse.py") == "heldout"
    assert split_of("os.py") == "train"


def _fake_root(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "a.py").write_text("print('a')\n")
    (root / "pkg" / "__init__.py").write_text("# héllo 🐍\nX = 1\n", encoding="utf-8")
    (root / "pkg" / "b.py").write_text("def f():\n    return 2\n")
    # excluded: test dirs, site-packages, non-.py, non-UTF-8, too large
    for d in ("test", "tests", "site-packages", "idlelib/idle_test"):
        (root / d).mkdir(parents=True)
        (root / d / "x.py").write_text("pass\n")
    (root / "notes.txt").write_text("nope\n")
    (root / "latin1.py").write_bytes(b"# caf\xe9\n")
    (root / "big.py").write_text("#" * (200 * 1024 + 1))
    return root


def test_collect_and_load_roundtrip(tmp_path):
    root = _fake_root(tmp_path)
    files = collect_stdlib_files(root)
    rels = [p.relative_to(root.resolve()).as_posix() for p in files]
    assert rels == ["a.py", "pkg/__init__.py", "pkg/b.py"]

    out = tmp_path / "out" / "c.jsonl.xz"
    stats = build_corpus(out, root=root, verbose=False)
    assert stats["n_files"] == 3 and stats["dropped"] == []
    with lzma.open(out, "rt", encoding="utf-8") as f:
        entries = [json.loads(line) for line in f]
    assert [e["path"] for e in entries] == rels
    assert all(e["split"] == split_of(e["path"]) for e in entries)

    corpus = load_corpus(out)
    assert set(corpus) == {"train", "heldout"}
    got = {p: t for s in corpus.values() for p, t in s}
    for rel in rels:
        assert got[rel] == (root / rel).read_text(encoding="utf-8")
    listed = (out.parent / "train_files.txt").read_text().split() + \
        (out.parent / "heldout_files.txt").read_text().split()
    assert sorted(listed) == rels
    # deterministic bytes
    out2 = tmp_path / "out2" / "c.jsonl.xz"
    build_corpus(out2, root=root, verbose=False)
    assert out.read_bytes() == out2.read_bytes()


def test_tokenizer_tiny_roundtrip_and_eos(tmp_path):
    tok = train_tokenizer(SMALL_TEXTS, vocab_size=300, out_path=tmp_path / "tok")
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID == 0
    assert tok.get_vocab_size() <= 300
    unseen = [
        "while True:\n    break\n",
        "s = 'ünïcödé — 日本語 🐍'\r\n\ttab\x00\x7f",
        "   leading and trailing   \n\n",
        "",
    ]
    assert check_roundtrip(tok, SMALL_TEXTS + unseen) == []
    for t in unseen:
        assert decode(tok, encode(tok, t)) == t
    assert count_tokens(tok, unseen) == sum(len(encode(tok, t)) for t in unseen)
    # EOS is a single special token and decodes back to its literal
    ids = encode(tok, SMALL_TEXTS[0]) + [EOS_ID]
    assert decode(tok, ids) == SMALL_TEXTS[0] + EOS_TOKEN

    # saved file reloads identically; training is deterministic
    tok2 = load_tokenizer(tmp_path / "tok")
    assert encode(tok2, SMALL_TEXTS[1]) == encode(tok, SMALL_TEXTS[1])
    train_tokenizer(SMALL_TEXTS, vocab_size=300, out_path=tmp_path / "tok_b")
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == \
        (tmp_path / "tok_b" / "tokenizer.json").read_bytes()


def test_tokenizer_extra_special(tmp_path):
    tok = train_tokenizer(SMALL_TEXTS, vocab_size=300, extra_special_tokens=["<|pad|>"])
    assert tok.token_to_id(EOS_TOKEN) == 0
    assert tok.token_to_id("<|pad|>") == 1


def test_build_corpus_drops_largest_to_fit(tmp_path):
    import random

    root = tmp_path / "lib"
    root.mkdir()
    rng = random.Random(0)
    for i, n in enumerate([100, 3000, 20000, 8000]):
        # incompressible-ish content so size order == compressed contribution
        txt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(n))
        (root / f"m{i}.py").write_text(f"s = '{txt}'\n")
    out = tmp_path / "o" / "c.jsonl.xz"
    stats = build_corpus(out, root=root, max_compressed_bytes=9000, verbose=False)
    assert stats["dropped"] == ["m2.py"]
    assert stats["compressed_bytes"] <= 9000
    assert (out.parent / "dropped_files.txt").read_text().split() == ["m2.py"]
    assert sorted(p for s in load_corpus(out).values() for p, _ in s) == ["m0.py", "m1.py", "m3.py"]


def test_bad_corpus_fields_tokenizer_files_and_argument_text_are_named(tmp_path):
    """What a CLI walkthrough found as tracebacks: a corpus line whose text / path is not a
    string, a --tokenizer file the tokenizers library cannot read, prompt text holding bytes
    that are not UTF-8 (a shell argument's, as Python decodes argv), and a bench --batch
    with an empty item (it failed after the whole run)."""
    from hyspec.bench.cli import _int_list
    from hyspec.engine import Engine
    from hyspec.train.corpus import iter_corpus
    from hyspec.train.config import TrainConfig
    from hyspec.train.loop import train

    p = tmp_path / "c.jsonl.xz"
    with lzma.open(p, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"path": "a.py", "split": "train", "text": 5}) + "\n")
    with pytest.raises(ValueError, match="line 1: text must be text"):
        list(iter_corpus(p))
    bad = tmp_path / "tok.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="--tokenizer .*tok.json: not a tokenizer.json"):
        train(TrainConfig(corpus=str(p), tokenizer=str(bad), out=str(tmp_path / "o"), device="cpu"))
    with pytest.raises(ValueError, match="prompt.*not valid text"):
        Engine.load().encode("abc\udcff")
    with pytest.raises(ValueError, match="--batch"):
        _int_list("batch", "1,,2", 1)


def test_a_corpus_line_with_an_unknown_split_or_invalid_unicode_is_refused_by_line(tmp_path):
    """A document whose split is neither train nor heldout ("test", "Train") was dropped
    without a word (a corpus of such lines trained on nothing and said the train split was
    too short); a lone surrogate in the text (valid JSON: "\\ud800") was a traceback deep in
    the tokenizer. Both now name the file, the line and the problem."""
    from hyspec.train.corpus import iter_corpus, load_corpus

    for i, (entry, msg) in enumerate((({"path": "a.py", "split": "test", "text": "x"}, "line 2: split 'test' is not"),
                                      ({"path": "a.py", "split": "Train", "text": "x"}, "line 2: split 'Train'"),
                                      ({"path": "a.py", "split": "train", "text": "a\ud800b"},
                                       "line 2: text is not valid Unicode"))):
        p = tmp_path / f"c{i}.jsonl.xz"
        with lzma.open(p, "wt", encoding="utf-8") as f:
            f.write(json.dumps({"path": "ok.py", "split": "train", "text": "fine"}) + "\n")
            f.write(json.dumps(entry) + "\n")
        with pytest.raises(ValueError, match=f"--corpus .*c{i}.jsonl.xz: {msg}"):
            load_corpus(p)
        with pytest.raises(ValueError, match=msg):
            list(iter_corpus(p))


def test_corpus_size_limits_stale_lists_and_blank_lines(tmp_path, capsys):
    """A file of exactly --max-file-bytes is kept (the limit is "at most"), the CLI's
    --max-file-bytes is applied, a rebuild that drops nothing removes the earlier
    dropped_files.txt, and a blank line in a corpus file is skipped."""
    from hyspec.train import corpus

    root = tmp_path / "lib"
    root.mkdir()
    (root / "a.py").write_text("x = 1\n")
    (root / "b.py").write_text("#" * 99 + "\n")  # 100 bytes
    assert [p.name for p in collect_stdlib_files(root, max_file_bytes=100)] == ["a.py", "b.py"]
    assert [p.name for p in collect_stdlib_files(root, max_file_bytes=99)] == ["a.py"]
    out = tmp_path / "o"
    assert corpus.main(["--out", str(out), "--root", str(root), "--max-file-bytes", "99", "--heldout-percent", "0"]) == 0
    assert [p for p, _ in load_corpus(out / corpus.DEFAULT_NAME)["train"]] == ["a.py"]
    (out / "dropped_files.txt").write_text("old.py\n")  # an earlier build's list
    build_corpus(out / corpus.DEFAULT_NAME, root=root, verbose=False)
    assert not (out / "dropped_files.txt").exists()
    capsys.readouterr()
    p = tmp_path / "blank.jsonl.xz"
    with lzma.open(p, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"path": "a.py", "split": "train", "text": "x"}) + "\n\n")
    assert load_corpus(p)["train"] == [("a.py", "x")]


def test_tokenizer_vocab_floor_and_json_path(tmp_path):
    """vocab_size must hold the 256 byte symbols and the special tokens; an out_path ending
    in .json is the file written (a folder gets tokenizer.json)."""
    with pytest.raises(ValueError, match="vocab_size must be >= 257"):
        train_tokenizer(SMALL_TEXTS, vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size must be >= 258"):
        train_tokenizer(SMALL_TEXTS, vocab_size=257, extra_special_tokens=["<|pad|>"])
    train_tokenizer(SMALL_TEXTS, vocab_size=300, out_path=tmp_path / "t" / "my.json")
    assert (tmp_path / "t" / "my.json").is_file() and not (tmp_path / "t" / "my.json" / "tokenizer.json").exists()


def test_tokenizer_tool_trains_on_the_train_split_only(tmp_path, capsys, monkeypatch):
    """The tokenizer tool learns merges from the train split only (held-out text never shapes
    the vocabulary), applies --min-frequency, exits 1 naming the files a held-out text does
    not round-trip, and refuses a corpus with no train split."""
    from hyspec.train import tokenizer_train

    def write(name, entries):
        p = tmp_path / name
        with lzma.open(p, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"path": f"m{i}.py", "split": s, "text": t}) + "\n" for i, (s, t) in enumerate(entries))
        return p

    c = write("c.jsonl.xz", [("train", "ab ab ab ab cd"), ("heldout", "qz qz qz qz qz qz")])
    for minf, want_cd in ((2, False), (1, True)):
        out = tmp_path / f"t{minf}"
        assert tokenizer_train.main(["--corpus", str(c), "--out", str(out), "--vocab-size", "300",
                                     "--min-frequency", str(minf)]) == 0
        vocab = load_tokenizer(out).get_vocab()
        assert "ab" in vocab and "qz" not in vocab and ("cd" in vocab) == want_cd, minf
    capsys.readouterr()
    monkeypatch.setattr(tokenizer_train, "check_roundtrip", lambda tok, texts: [0])
    assert tokenizer_train.main(["--corpus", str(c), "--out", str(tmp_path / "tr"), "--vocab-size", "300"]) == 1
    assert "ROUND TRIP FAILED for heldout files: ['m1.py']" in capsys.readouterr().out
    monkeypatch.undo()
    c = write("h.jsonl.xz", [("heldout", "qz qz qz")])
    assert tokenizer_train.main(["--corpus", str(c), "--out", str(tmp_path / "th")]) == 2
    assert "no training documents" in capsys.readouterr().err


def test_the_shipped_split_lists_match_split_of():
    """data/train_files.txt and data/heldout_files.txt (the default model's corpus: its
    held-out figures are of these files) are what split_of gives their paths."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "data"
    train = (data / "train_files.txt").read_text().split()
    held = (data / "heldout_files.txt").read_text().split()
    assert (len(train), len(held)) == (702, 30)
    assert [split_of(p) for p in train] == ["train"] * 702
    assert [split_of(p) for p in held] == ["heldout"] * 30
