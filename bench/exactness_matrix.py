"""The full greedy exactness matrix of the speculative loop, outside the test suite.

    python bench/exactness_matrix.py --out bench/results/exactness_matrix.json [--workers 2]

Every combination of: family (qwen3_next, qwen3_5, qwen3_5_moe) x source (make-tiny,
transformers save_pretrained + mtp.*) x dtype (float64, float32) x K (1, 2, 3, 5) x
rollback (checkpoint, rescan, replay) x options (none, adaptive, p_min 0.05, both) x
drafter (MTP head, forced 1.0, forced 0.7, forced 0.0): 2,304 runs of 200 new tokens, each
compared token for token with plain greedy decoding, plus the telemetry identities
(accepted <= drafted, generated = 1 + accepted + rounds). The test suite runs a pairwise
covering subset of this (tests/test_spec_matrix.py); this script runs all of it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
SOURCES = ("make-tiny", "transformers")
DTYPES = ("float64", "float32")
KS = (1, 2, 3, 5)
ROLLBACKS = ("checkpoint", "rescan", "replay")
OPTIONS = ("none", "adaptive", "p_min", "adaptive+p_min")
DRAFTERS = ("mtp", "forced1.0", "forced0.7", "forced0.0")
PROMPT = list(range(5, 25))
NEW = 200


def build(workdir: Path) -> dict[tuple[str, str], str]:
    from hf_ref import make_hf_checkpoint
    from hyspec.tiny import make_tiny

    dirs = {}
    for fam in FAMILIES:
        d = workdir / f"tiny_{fam}"
        make_tiny(fam, d, seed=1)
        dirs[(fam, "make-tiny")] = str(d)
        d = workdir / f"hf_{fam}"
        make_hf_checkpoint(fam, d, seed=2)
        dirs[(fam, "transformers")] = str(d)
    return dirs


def run_group(args) -> list[dict]:
    """All runs of one (family, source, dtype): load once, one plain reference."""
    import torch

    torch.set_num_threads(1)
    from hyspec.decode import generate_plain
    from hyspec.loading import load_model
    from hyspec.speculative.loop import SpecOptions, generate_speculative

    path, fam, src, dtype = args
    m = load_model(path, dtype=dtype)
    ref = generate_plain(m, PROMPT, max_new_tokens=NEW).tokens
    ref_long = generate_plain(m, PROMPT, max_new_tokens=NEW + 8).tokens
    rows = []
    for k, rb, opt, drafter in itertools.product(KS, ROLLBACKS, OPTIONS, DRAFTERS):
        forced = None if drafter == "mtp" else (float(drafter[len("forced"):]),)
        so = SpecOptions(k=k, rollback=rb, adaptive="adaptive" in opt, p_min=0.05 if "p_min" in opt else 0.0,
                         forced_rates=forced)
        t = time.perf_counter()
        r = generate_speculative(m, PROMPT, max_new_tokens=NEW, opts=so, reference=ref_long)
        sp = r.stats["spec"]
        rows.append({
            "family": fam, "source": src, "dtype": dtype, "k": k, "rollback": rb, "options": opt,
            "drafter": drafter, "equal": r.tokens == ref, "rounds": sp["rounds"], "drafted": sp["drafted"],
            "accepted": sp["accepted"], "tau": sp["tau"],
            "identity": sp["accepted"] <= sp["drafted"]
            and len(r.tokens) <= r.stats["direct_tokens"] + sp["accepted"] + sp["rounds"],
            "seconds": time.perf_counter() - t,
        })
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench/results/exactness_matrix.json"))
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    from hyspec.provenance import git_state

    git = git_state()  # the code that runs, recorded before it runs
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = build(Path(tmp))
        groups = [(dirs[(f, s)], f, s, d) for f in FAMILIES for s in SOURCES for d in DTYPES]
        with ProcessPoolExecutor(a.workers) as ex:
            rows = [r for g in ex.map(run_group, groups) for r in g]
    bad = [r for r in rows if not (r["equal"] and r["identity"])]
    summary = {
        "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "git": git,
        "runs": len(rows), "all_equal": all(r["equal"] for r in rows),
        "all_identities": all(r["identity"] for r in rows), "failures": bad,
        "new_tokens": NEW, "seconds": time.perf_counter() - t0,
        "mean_tau_by_drafter": {d: sum(r["tau"] for r in rows if r["drafter"] == d) /
                                max(1, sum(r["drafter"] == d for r in rows)) for d in DRAFTERS},
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1), f"failures: {len(bad)}")
    Path(a.out).write_text(json.dumps({**summary, "rows": rows}))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
