"""bench/sass_stats.py: the GDN step kernel compiled for sm_90 without a GPU (Triton's own
ptxas and nvdisasm), its registers and SASS counted.  Run in a subprocess without
TRITON_INTERPRET (this process interprets Triton on a CPU machine); skipped where the
installed Triton has no NVIDIA backend."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args):
    out = tmp_path / "s.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sass_stats.py"), "--json", str(out), *args],
                       capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text()), r.stdout


def test_step_kernel_compiles_offline_and_counts_its_sass(tmp_path):
    d, text = _run(tmp_path, "--compare", "PF=0")
    a, b = d["builds"]
    assert a["settings"]["PF"] is True and b["settings"]["PF"] == 0 and a["settings"]["EVEN"]
    assert a["registers"] and a["instructions"] > 100 and a["ops"]["LDG"] > 0 and a["ops"]["STG"] > 0
    # without the next-row prefetch (loads only): fewer instructions
    assert b["instructions"] < a["instructions"]
    assert "float instructions:" in text
    # without fp fusion (no FMA contraction): fewer FFMA, more FADD
    c = _run(tmp_path, "--no-fp-fusion")[0]["builds"][0]
    assert c["ops"]["FFMA"] < a["ops"]["FFMA"] and c["ops"]["FADD"] > a["ops"]["FADD"]


def test_an_unknown_setting_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sass_stats.py"), "--set", "NOT_A_PARAM=1"],
                       capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode != 0 and "no parameter 'NOT_A_PARAM'" in r.stderr


def test_compiled_in_dv_takes_immediate_offsets(tmp_path):
    """The runner's build compiles Dv in (DVC): a thread's state values are loaded from one
    base with immediate offsets, so it issues fewer instructions on fewer registers than
    the build with Dv a runtime value (int32 offsets, one 64-bit address per value)."""
    d, _ = _run(tmp_path, "--compare", "DVC=0")
    a, b = d["builds"]
    assert a["settings"]["DVC"] == 128 and b["settings"]["DVC"] == 0
    assert a["instructions"] < 0.85 * b["instructions"] and a["registers"] < b["registers"]
    assert a["ops"]["LDG"] == b["ops"]["LDG"]  # the same loads, addressed differently
