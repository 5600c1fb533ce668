#!/bin/bash
# The GPU test suite on the device, in one log headed by the commit it ran at:
#   bash bench/gpu_tests.sh          (HYSPEC_B2_EXACT="tokens,prompts": the b2 exactness test's size; repo root, on the GPU machine; writes $OUT/gpu_tests_h200.txt)
#   PYTEST_ARGS="-n 4" bash bench/gpu_tests.sh    (four test processes on the one GPU: pytest-xdist,
#                                     carried as a wheel in .whl/ like the others)
# Commit the log as bench/results/gpu_tests_h200.txt, beside the bench JSON of the same commit.
# On a copy of the tree without its .git, name the commit: HYSPEC_GIT_COMMIT=<sha>
# and HYSPEC_GIT_DIRTY=0 or 1 (clean or not; unset: recorded unknown), as for hyspec bench.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=$OUT/${LOG_NAME:-gpu_tests_h200.txt}
source bench/device_env.sh "$HYSPEC_GIT_COMMIT"  # the carried wheels, in one fresh install (see there)
{
  python3 - <<'PY'
import importlib.metadata as md
import time

import torch

from hyspec.provenance import git_state

g = git_state()
state = {True: "dirty", False: "clean"}.get(g["dirty"], "dirty: unknown")
print(f"commit {g['commit']} ({state}), {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
versions = [f"torch {torch.__version__}"]
for pkg in ("triton", "fla-core"):
    try:
        versions.append(f"{pkg} {md.version(pkg)}")
    except md.PackageNotFoundError:
        versions.append(f"{pkg} absent")
print(", ".join(versions))
PY
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
  rc=0
  echo "== GPU tests (python3 -m pytest -q -s -rs -m gpu tests $PYTEST_ARGS; HYSPEC_B2_EXACT=${HYSPEC_B2_EXACT:-2000,4})"
  python3 -m pytest -q -s -rs -m gpu $PYTEST_ARGS --durations=15 tests || rc=1
  echo "== session (engine core and graph lanes), graph-store and lane-logprobs tests on CUDA (HYSPEC_TEST_DEVICE=cuda)"
  HYSPEC_TEST_DEVICE=cuda python3 -m pytest -q $PYTEST_ARGS tests/test_sessions.py tests/test_session_state.py \
    tests/test_prefix_store.py tests/test_graph_store.py tests/test_sessions_graphs.py \
    tests/test_batch_logprobs.py tests/test_batch_adaptive.py tests/test_batch_pmin.py || rc=1
  echo "== kernel tests that run compiled where CUDA is (the interpreter on the CPU): argmax, load order, top-p cut, probability rows"
  python3 -m pytest -q -rs $PYTEST_ARGS tests/test_kernels_argmax.py \
    tests/test_kernels_load_order.py tests/test_kernels_topp.py tests/test_kernels_probs.py || rc=1
  echo "== sampling kernels compiled where CUDA is (the interpreter on the CPU): Philox rows and draws, Gumbel-max, penalty window"
  python3 -m pytest -q -rs tests/test_gpu_sampling.py -k "philox or u01_at or gumbel_argmax or penalty_window" || rc=1
  exit $rc
} 2>&1 | tee "$LOG"
