"""bench/tables.py: the results tables in README.md and docs/ are what the JSON in
bench/results says (so the docs cannot drift from the measurements), every results JSON
names the commit it ran at, and a changed result changes the tables."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "bench" / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_match_the_results(tables, capsys):
    """`python bench/tables.py --check` on this checkout: no table out of date."""
    rc = tables.main(["--check"])
    out = capsys.readouterr().out
    assert rc == 0, "run `python bench/tables.py` (the docs' tables differ from bench/results):\n" + out[-4000:]
    marked = [p for p in tables.docs() if "<!-- tables:" in p.read_text()]
    assert {"README.md", "docs/gpu.md"} <= {str(p.relative_to(ROOT)) for p in marked}


def test_every_results_json_names_its_commit(tables):
    res = tables.Results()
    assert tables.missing_provenance(res) == [], (
        "results without a git commit: record hyspec.provenance.git_state() in the script that writes them "
        "(or, for a file from before that, add it to bench/results/provenance_notes.json)")
    for name in tables.Results().notes():  # a note for a file that records its commit (or is gone) is stale
        assert res.exists(name), f"provenance_notes.json names {name}, which is not in bench/results"
        assert tables.git_of(res(name)) is None, f"{name} records its commit: drop its provenance note"


def test_every_marker_names_a_table(tables):
    res = tables.Results()
    for p in tables.docs():
        for m in tables.MARKER.finditer(p.read_text()):
            tables.render(m.group("name"), res)  # raises for an unknown name or a missing file


def _copy_repo(tmp_path: Path) -> Path:
    """The docs and results of this checkout under tmp_path (the layout bench/tables.py reads)."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", root / "README.md")
    for p in (ROOT / "docs").glob("*.md"):
        shutil.copy(p, root / "docs" / p.name)
    shutil.copytree(ROOT / "bench" / "results", root / "bench" / "results")
    return root


def test_a_changed_result_changes_the_tables(tables, tmp_path, capsys):
    root = _copy_repo(tmp_path)
    path = root / "bench" / "results" / "b2_h200.json"
    d = json.loads(path.read_text())
    d["variants"]["exact"]["plain"]["tok_s"] = 812.25
    # the figures the targets are judged from (tables.py judges them again with today's goals)
    d["variants"]["exact"]["plain"]["roofline_frac"] = 0.7596
    d["variants"]["exact"]["verify_rel"]["4"] = 1.25
    d["meta"]["git"] = {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": True}
    path.write_text(json.dumps(d))

    assert tables.main(["--check", "--root", str(root)]) == 1  # the docs are now out of date
    assert "812 tok/s" in capsys.readouterr().out
    assert tables.main(["--root", str(root)]) == 0  # rewrite them
    readme = (root / "README.md").read_text()
    gpu = (root / "docs" / "gpu.md").read_text()
    roof = f"{d['roofline_tok_s']:,.0f}"
    assert f"812 tok/s = **76.0 %** of the {roof} tok/s roofline | ≥ 75 % (stretch 85 %) | met | `0123456` dirty |" \
        in readme
    assert "| verify of 4 tokens ÷ 1 token | 1.25 | ≤ 1.08 | **missed** | `0123456` dirty |" in readme
    assert "| plain decode, exact | 812 tok/s" in gpu
    assert "595 tok/s" not in readme  # the old value is gone from the table
    capsys.readouterr()
    assert tables.main(["--check", "--root", str(root)]) == 0  # and the check passes again


def test_a_new_batch_run_and_new_targets_render(tables, tmp_path):
    """The GPU batch bench's shape (runs by batch size, invariance, targets under "batch")
    and a target this file has no words for: the generic table shows them all."""
    res_dir = tmp_path / "results"
    res_dir.mkdir()
    runs = {B: {"plain_tok_s": 580.0 * r, "spec_tok_s": 1100.0 * r, "spec_vs_plain": 1.9, "spec_equals_plain": True,
                "mean_accepted": 2.1, "plain_vs_B1": r} for B, r in ((1, 1.0), (16, 12.5), (64, 30.0))}
    batch = {"backend": "cuda-graphs", "runs": runs,
             "invariance": {"prompts": 64, "tokens": 500, "batch": 16, "plain": {"equal": 64, "all_equal": True},
                            "k3": {"equal": 63, "all_equal": False}},
             "targets": {"plain_B16_vs_B1": {"value": 12.5, "target": 12.0, "met": True},
                         "plain_B64_vs_B1": {"value": 30.0, "target": 35.0, "met": False},
                         "batch_invariance_greedy": {"value": False, "target": True, "met": False}}}
    d = {"meta": {"command": "hyspec bench --config b2 --batch 1,16,64 --out /x/b.json",
                  "git": {"commit": "fedcba9876543210", "dirty": False}},
         "batch": batch, "targets": {"draft_vocab_k3_speedup": {"value": 2.31, "target": 2.2, "met": True},
                                     "sampled_vs_greedy_frac": {"value": 0.85, "target": 0.9, "met": False}}}
    (res_dir / "b2_h200_batch.json").write_text(json.dumps(d))
    out = tables.render("b2_h200_batch", tables.Results(res_dir))
    assert "`hyspec bench --config b2 --batch 1,16,64`, backend `cuda-graphs`" in out
    assert "| 16 | 7,250 | 13,750 | ×1.90 | ×12.50 | 2.10 | yes | `fedcba9` |" in out
    assert "| alone vs batched (64 prompts × 500 tokens, batch 16), K=3 | 63/64 bitwise equal |" in out
    assert "| plain aggregate tok/s, batch 64 ÷ batch 1 | ×30.00 | ≥ ×35 | **missed** | `fedcba9` |" in out
    assert "| `draft_vocab_k3_speedup` | 2.31 | ≥ ×2.2 | met | `fedcba9` |" in out
    assert "| `sampled_vs_greedy_frac` | 85.0 % | ≥ 90 % | **missed** | `fedcba9` |" in out
    assert "bitwise | **missed**" in out  # batch invariance failed


def test_where_results_keep_their_commit(tables, tmp_path):
    layouts = {
        "a.json": {"meta": {"git": {"commit": "a" * 40, "dirty": False}}},  # hyspec bench
        "b.json": {"git": {"commit": "b" * 40, "dirty": True}},  # most bench scripts
        "c.json": {"meta": {"commit": "c" * 40, "dirty": False}},  # bench/constraints_cpu.py
        "d.json": {"git_commit": "d" * 40, "dirty": None},  # bench/sessions.py
        "e.json": {"meta": {"device": "x"}},
        "f.json": {"git": {"commit": None, "dirty": None}},  # outside a git checkout
    }
    for n, d in layouts.items():
        (tmp_path / n).write_text(json.dumps(d))
    (tmp_path / tables.NOTES).write_text(json.dumps({"files": {"e.json": {"commit": None, "added_in": "1234567"}}}))
    res = tables.Results(tmp_path)
    assert [res.commit(n) for n in layouts] == [
        "`aaaaaaa`", "`bbbbbbb` dirty", "`ccccccc`", "`ddddddd` (dirty: unknown)",
        "not recorded (added in `1234567`)", "not recorded"]
    assert tables.missing_provenance(res) == ["f.json"]


def test_a_file_of_runs_at_two_commits_and_a_log_without_a_dirty_flag_name_their_commits(tables, tmp_path):
    """A file whose runs ran at two commits names both (b2_h200_batch_ablation.json showed
    only the first), and a GPU test log headed `commit SHA; COMMAND` names its commit with
    its dirty state unknown (gpu_tests_logprobs_h200.txt and gpu_tests_pmin_h200.txt showed
    "not recorded")."""
    (tmp_path / "a.json").write_text(json.dumps({"git": {"commit": "d24997f / 3c2f9fd", "dirty": False}}))
    assert tables.Results(tmp_path).commit("a.json") == "`d24997f / 3c2f9fd`"
    log = tmp_path / "gpu_tests_x_h200.txt"
    log.write_text("commit 19d34be9f0c691f3712cbda6170ce9e5c0ca62a3; HYSPEC_TEST_DEVICE=cuda python3 -m pytest -q\n"
                   "5 passed in 9.1s\n")
    assert tables.gpu_log_commit(log) == "`19d34be` (dirty: unknown)"
    assert "| `gpu_tests_x_h200.txt` | GPU tests: 5 passed | `19d34be` (dirty: unknown) |" in \
        tables.gpu_tests(tables.Results(tmp_path))


def test_a_batch_target_shows_the_ratio_of_the_runs_the_batch_table_shows(tables, tmp_path):
    """A batch target's value is rounded to 3 places (12.0347 -> 12.035): its row shows the
    runs' own ratio, as the batch table beside it does (x12.03, not x12.04)."""
    runs = {"1": {"plain_tok_s": 648.30016041234, "spec_tok_s": 1301.1, "spec_vs_plain": 2.007, "plain_vs_B1": 1.0},
            "16": {"plain_tok_s": 7802.125267940832, "spec_tok_s": 13585.6, "spec_vs_plain": 1.741265387089489,
                   "plain_vs_B1": 12.03474215242894}}
    targets = {"plain_B16_vs_B1": {"value": 12.035, "target": 12.0, "met": True},
               "spec_K3_vs_plain_B16": {"value": 1.741, "target": 1.5, "met": True}}
    d = {"git": {"commit": "a" * 40, "dirty": False}, "batch": {"backend": "cuda-graphs", "runs": runs, "targets": targets}}
    (tmp_path / "b.json").write_text(json.dumps(d))
    out = tables.render("b", tables.Results(tmp_path))
    assert "| 16 | 7,802 | 13,586 | ×1.74 | ×12.03 | `aaaaaaa` |" in out
    assert "| plain aggregate tok/s, batch 16 ÷ batch 1 | ×12.03 | ≥ ×12 | met | `aaaaaaa` |" in out
    assert "| forced K=3 ÷ plain, batch 16 | ×1.74 | ≥ ×1.5 | met | `aaaaaaa` |" in out
    runs["16"]["plain_tok_s"] = 648.30016041234 * 11.998  # a ratio that 2 places would round onto its target
    targets["plain_B16_vs_B1"] = {"value": 11.998, "target": 12.0, "met": False}
    (tmp_path / "b.json").write_text(json.dumps(d))
    assert "| plain aggregate tok/s, batch 16 ÷ batch 1 | ×11.998 | ≥ ×12 | **missed** |" in \
        tables.render("b", tables.Results(tmp_path))


def test_git_state_names_only_this_checkout_and_never_fails(tmp_path, monkeypatch):
    """Results record the commit of hyspec's own checkout. Without git on the machine
    `hyspec bench` / `hyspec train` failed ("No such file or directory: git"); an installed
    copy inside another repository (a venv in the user's project) would have recorded that
    project's commit as hyspec's."""
    import subprocess

    from hyspec.provenance import git_state

    monkeypatch.delenv("HYSPEC_GIT_COMMIT", raising=False)
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if here.returncode == 0:  # (a checkout: the commit is its HEAD)
        assert git_state()["commit"] == here.stdout.strip()
    other = tmp_path / "project"
    (other / ".venv" / "site-packages").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    subprocess.run(["git", "-C", str(other), "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    assert git_state(other)["commit"] is not None  # the top of a repository: its commit
    pair = lambda g: (g["commit"], g["dirty"])  # noqa: E731 (HYSPEC_* switches may add "env")
    assert pair(git_state(other / ".venv" / "site-packages")) == (None, None)
    monkeypatch.setenv("PATH", str(tmp_path / "no-such-dir"))
    assert pair(git_state()) == (None, None)


def test_git_state_counts_untracked_files_and_an_unnamed_dirty_state_is_unknown(tmp_path, monkeypatch):
    """A new, uncommitted script (untracked) left the tree "clean": results named a commit
    that lacks the code that wrote them. HYSPEC_GIT_COMMIT alone (the GPU machine's copy)
    was recorded clean whatever the copy held: now unknown (None) unless HYSPEC_GIT_DIRTY
    is 0 or 1."""
    import subprocess

    from hyspec.provenance import git_state

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    monkeypatch.delenv("HYSPEC_GIT_COMMIT", raising=False)
    repo = tmp_path / "r"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run(["git", "-C", str(repo), "add", "a.py"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-q", "-m", "x"],
                   check=True)
    assert git_state(repo)["dirty"] is False
    (repo / "tiny_default").mkdir()  # a documented command's output (make-tiny --out, bench --out): not code
    (repo / "tiny_default" / "config.json").write_text("{}")
    (repo / "bench.json").write_text("{}")
    assert git_state(repo)["dirty"] is False
    (repo / "tools").mkdir()
    (repo / "tools" / "new_bench.py").write_text("print(1)\n")
    assert git_state(repo)["dirty"] is True
    monkeypatch.setenv("HYSPEC_GIT_COMMIT", "abc1234")
    monkeypatch.delenv("HYSPEC_GIT_DIRTY", raising=False)
    assert (git_state()["commit"], git_state()["dirty"]) == ("abc1234", None)
    for value, dirty in (("0", False), ("1", True), ("yes", None)):
        monkeypatch.setenv("HYSPEC_GIT_DIRTY", value)
        assert git_state()["dirty"] is dirty
