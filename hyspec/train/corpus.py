"""Python-source training corpus built from this machine's CPython standard library.

The training machine may run a different Python version, so the corpus is
packaged here as ONE lzma-compressed JSON-lines file (``.jsonl.xz``), one entry
per source file::

    {"path": "json/decoder.py", "split": "train", "text": "..."}

Entries are sorted by relative path (POSIX separators).  The train/held-out
split is a pure function of the relative path: a file is held out iff
``int(sha256(relpath), 16) % 100 < HELDOUT_PERCENT`` (~5%), so it is stable across
machines, Python versions and re-runs.

Selection rules (``collect_stdlib_files``):
  * every ``*.py`` below ``sysconfig.get_paths()["stdlib"]`` (or ``root``);
  * skip any path with a directory component in ``EXCLUDED_DIRS``
    (``site-packages``, ``dist-packages``, ``test``, ``tests``, ``idle_test``,
    ``__pycache__``) -- this covers ``idlelib/idle_test`` and ``lib2to3/tests``;
  * skip files larger than ``MAX_FILE_BYTES`` (200 KB) and files that are not
    valid UTF-8 (BOM-free strict decode).

Size cap: if the compressed output exceeds ``max_compressed_bytes`` (20 MB),
the largest files are dropped deterministically (by descending byte size, ties
broken by path) until it fits; the dropped paths are reported and listed in
``dropped_files.txt``.

CLI::

    python -m hyspec.train.corpus --out DIR [--root STDLIB_DIR] [--name FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import sys
import sysconfig
from pathlib import Path

MAX_FILE_BYTES = 200 * 1024
HELDOUT_PERCENT = 5
MAX_COMPRESSED_BYTES = 20 * 1024 * 1024
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
DEFAULT_NAME = "pystdlib_corpus.jsonl.xz"
SPLITS = ("train", "heldout")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _relpath(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _is_excluded(rel: str) -> bool:
    parts = rel.split("/")
    if any(p in EXCLUDED_DIRS for p in parts[:-1]):
        return True
    # explicit (already covered by EXCLUDED_DIRS; kept for clarity)
    return rel.startswith(("idlelib/idle_test/", "lib2to3/tests/"))


def _read_utf8(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        return data.decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        return None


def collect_stdlib_files(root: str | os.PathLike | None = None,
                         max_file_bytes: int = MAX_FILE_BYTES) -> list[Path]:
    """All eligible ``*.py`` files under ``root`` (default: the CPython stdlib),
    sorted by relative POSIX path."""
    root = Path(root) if root is not None else stdlib_root()
    root = root.resolve()
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # prune excluded dirs early (also avoids descending into site-packages)
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            if not p.is_file():
                continue
            rel = _relpath(p, root)
            if _is_excluded(rel):
                continue
            try:
                if p.stat().st_size > max_file_bytes:
                    continue
            except OSError:
                continue
            if _read_utf8(p) is None:
                continue
            out.append((rel, p))
    out.sort(key=lambda t: t[0])
    return [p for _, p in out]


def split_of(relpath: str, heldout_percent: int = HELDOUT_PERCENT) -> str:
    """Deterministic split: 'heldout' iff sha256(relpath) mod 100 < heldout_percent."""
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest(), "big")
    return "heldout" if h % 100 < heldout_percent else "train"


def _encode_entries(entries: list[dict], preset: int) -> bytes:
    buf = io.BytesIO()
    for e in entries:
        buf.write(json.dumps(e, ensure_ascii=False).encode("utf-8"))
        buf.write(b"\n")
    # xz container, CRC64, no threading -> byte-for-byte deterministic output
    return lzma.compress(buf.getvalue(), format=lzma.FORMAT_XZ, preset=preset)


def build_corpus(out_path: str | os.PathLike,
                 root: str | os.PathLike | None = None,
                 heldout_percent: int = HELDOUT_PERCENT,
                 max_file_bytes: int = MAX_FILE_BYTES,
                 max_compressed_bytes: int = MAX_COMPRESSED_BYTES,
                 preset: int = 9 | lzma.PRESET_EXTREME,
                 verbose: bool = True) -> dict:
    """Write the corpus to ``out_path`` (a ``.jsonl.xz`` file) and, next to it,
    ``train_files.txt`` / ``heldout_files.txt`` (one relative path per line).

    Returns a stats dict (counts, raw/compressed bytes, dropped files)."""
    out_path = Path(out_path)
    root_p = (Path(root) if root is not None else stdlib_root()).resolve()
    files = collect_stdlib_files(root_p, max_file_bytes=max_file_bytes)
    if not files:  # (an empty corpus was written, exit status 0: the trainer then found no training text)
        raise ValueError(f"no *.py files of at most {max_file_bytes:,} bytes in UTF-8 under {root_p} (test folders "
                         "excluded): the corpus would be empty")

    entries = []
    for p in files:
        rel = _relpath(p, root_p)
        text = _read_utf8(p)
        assert text is not None
        entries.append({"path": rel, "split": split_of(rel, heldout_percent), "text": text})

    dropped: list[str] = []
    blob = _encode_entries(entries, preset)
    if len(blob) > max_compressed_bytes:
        # drop the biggest files deterministically until under the cap
        order = sorted(range(len(entries)),
                       key=lambda i: (-len(entries[i]["text"].encode("utf-8")), entries[i]["path"]))
        sizes = [len(e["text"].encode("utf-8")) for e in entries]
        raw_kept = sum(sizes)
        ratio = len(blob) / max(raw_kept, 1)
        drop: set[int] = set()
        for i in order:
            drop.add(i)
            dropped.append(entries[i]["path"])
            raw_kept -= sizes[i]
            # recompress only once the ratio estimate says we might fit
            if raw_kept * ratio <= max_compressed_bytes or len(drop) == len(order):
                kept = [e for j, e in enumerate(entries) if j not in drop]
                blob = _encode_entries(kept, preset)
                if len(blob) <= max_compressed_bytes:
                    break
        entries = [e for j, e in enumerate(entries) if j not in drop]
        blob = _encode_entries(entries, preset)

    by_split: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for e in entries:
        by_split[e["split"]].append(e)
    if not by_split["train"]:  # (every file held out or dropped for the size cap: nothing to train on)
        raise ValueError(f"no training documents would remain under {root_p} ({len(files)} file(s): "
                         f"{len(by_split['heldout'])} held out, {len(dropped)} dropped for the size cap): "
                         "the corpus would have no train split")
    out_path.parent.mkdir(parents=True, exist_ok=True)  # (only for a corpus that is written)
    out_path.write_bytes(blob)
    d = out_path.parent
    (d / "train_files.txt").write_text("".join(e["path"] + "\n" for e in by_split["train"]))
    (d / "heldout_files.txt").write_text("".join(e["path"] + "\n" for e in by_split["heldout"]))
    dropped_txt = d / "dropped_files.txt"
    if dropped:
        dropped_txt.write_text("".join(p + "\n" for p in dropped))
    elif dropped_txt.exists():
        dropped_txt.unlink()  # stale list from an earlier build

    stats = {
        "out_path": str(out_path),
        "root": str(root_p),
        "python": sys.version.split()[0],
        "n_files": len(entries),
        "n_train": len(by_split["train"]),
        "n_heldout": len(by_split["heldout"]),
        "bytes_train": sum(len(e["text"].encode("utf-8")) for e in by_split["train"]),
        "bytes_heldout": sum(len(e["text"].encode("utf-8")) for e in by_split["heldout"]),
        "compressed_bytes": len(blob),
        "dropped": dropped,
    }
    if verbose:
        print(f"corpus: {stats['n_files']} files from {root_p} (python {stats['python']})")
        print(f"  train:   {stats['n_train']:6d} files  {stats['bytes_train']:>12,d} bytes")
        print(f"  heldout: {stats['n_heldout']:6d} files  {stats['bytes_heldout']:>12,d} bytes")
        print(f"  compressed: {out_path} {stats['compressed_bytes']:,d} bytes")
        if dropped:
            print(f"  dropped {len(dropped)} largest files to fit {max_compressed_bytes:,d} bytes "
                  f"(see dropped_files.txt)")
    return stats


def iter_corpus(path: str | os.PathLike):
    """Yield entry dicts {path, split, text} from a ``.jsonl.xz`` corpus file; ValueError
    naming the file for another format (`python -m hyspec.train.corpus` writes one)."""
    want = "a .jsonl.xz of {path, split, text} lines (python -m hyspec.train.corpus writes one)"
    try:
        with lzma.open(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        e = json.loads(line)
                    except json.JSONDecodeError:
                        raise ValueError(f"--corpus {path}: line {n} is not JSON; expected {want}") from None
                    if not isinstance(e, dict) or not {"path", "split", "text"} <= set(e):
                        raise ValueError(f"--corpus {path}: line {n} lacks path / split / text; expected {want}")
                    bad = [k for k in ("path", "split", "text") if not isinstance(e[k], str)]
                    if bad:  # (a number or null text was a TypeError deep in the tokenizer)
                        raise ValueError(f"--corpus {path}: line {n}: {' / '.join(bad)} must be text (a JSON string); "
                                         f"expected {want}")
                    if e["split"] not in SPLITS:  # (another name's documents were dropped without a word)
                        raise ValueError(f"--corpus {path}: line {n}: split {e['split']!r} is not one of "
                                         f"{' / '.join(SPLITS)}")
                    for k in ("path", "text"):  # (a lone surrogate, "\\ud800" in JSON: a traceback in the tokenizer)
                        try:
                            e[k].encode("utf-8")
                        except UnicodeEncodeError as u:
                            raise ValueError(f"--corpus {path}: line {n}: {k} is not valid Unicode ({u.reason} at "
                                             f"character {u.start})") from None
                    yield e
    except (lzma.LZMAError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"--corpus {path}: not readable as xz-compressed UTF-8 text ({e}); expected {want}") from None


def load_corpus(path: str | os.PathLike) -> dict[str, list[tuple[str, str]]]:
    """Return ``{split: [(relpath, text), ...]}`` in file (= path-sorted) order.
    Both 'train' and 'heldout' keys are always present."""
    out: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    for e in iter_corpus(path):
        out[e["split"]].append((e["path"], e["text"]))
    return out


def main(argv: list[str] | None = None) -> int:
    from hyspec.cli.common import tool_main

    return tool_main("python -m hyspec.train.corpus", _main, argv)


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--name", default=DEFAULT_NAME, help="corpus file name (.jsonl.xz)")
    ap.add_argument("--root", default=None, help="source root (default: this Python's stdlib)")
    ap.add_argument("--heldout-percent", type=int, default=HELDOUT_PERCENT)
    ap.add_argument("--max-file-bytes", type=int, default=MAX_FILE_BYTES)
    ap.add_argument("--max-compressed-bytes", type=int, default=MAX_COMPRESSED_BYTES)
    args = ap.parse_args(argv)
    if args.root is not None and not Path(args.root).is_dir():
        raise ValueError(f"--root {args.root}: no such directory")
    from hyspec.cli.common import check_out_dir

    check_out_dir(args.out)
    build_corpus(Path(args.out) / args.name, root=args.root,
                 heldout_percent=args.heldout_percent,
                 max_file_bytes=args.max_file_bytes,
                 max_compressed_bytes=args.max_compressed_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
