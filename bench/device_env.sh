#!/bin/bash
# Source this first in a device call (repo root):  source bench/device_env.sh [commit-sha]
# * installs the wheels carried in .whl/ (the `run` tool's carry: [".whl"]; .whl/ is
#   git-ignored) in ONE pip command into a fresh /tmp/site: fla-core and
#   flash-linear-attention both ship a top-level fla/ folder, and installing them one by one
#   with --upgrade leaves the second's folder alone (no fla.ops); a warm machine may still
#   hold an earlier call's /tmp/site, hence the rm;
# * exports PYTHONPATH, PYTHONUNBUFFERED and, with an argument, HYSPEC_GIT_COMMIT /
#   HYSPEC_GIT_DIRTY from a second argument, clean or dirty (the device copy has no .git:
#   hyspec.provenance reads these; without it the results say "dirty: unknown"):
#     source bench/device_env.sh $(git rev-parse --short HEAD) $(test -z "$(git status --porcelain)" && echo clean || echo dirty)
#   (run that $(...) here, on this machine, and paste the two words into the device command);
# * prints which optional modules import, so a missing wheel shows before the run
#   (fla.ops needs einops; tests/test_server_constraints.py needs jsonschema).
# The wheel list (python3.12, manylinux x86_64; docs/gpu.md "Tests"): fla-core,
# flash-linear-attention, einops, llguidance, fastapi, starlette, uvicorn, prometheus_client,
# openai and their dependencies, pytest-xdist, execnet. Take the versions this checkout's own
# environment runs (`pip show NAME`), and their dependencies with them: openai 3.63 needs
# httpx2, httpcore2 and truststore, fastapi 0.165 opentelemetry-api (without them the
# server test files skip at import; the machine already has anyio, h11, einops, xdist).
if ls .whl/*.whl >/dev/null 2>&1; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    2>&1 | grep -v "^WARNING" || true
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  echo "device_env: no .whl/*.whl here (carry: [\".whl\"]?): optional modules come from the machine alone"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
if [ -n "$1" ]; then
  export HYSPEC_GIT_COMMIT=$1
  case "$2" in
    clean) export HYSPEC_GIT_DIRTY=0 ;;
    dirty) export HYSPEC_GIT_DIRTY=1 ;;
    "") ;;  # (HYSPEC_GIT_DIRTY as the caller set it, or unknown)
    *) echo "device_env: the second argument is clean or dirty, got '$2'"; return 1 ;;
  esac
fi
python3 - <<'PY'
import importlib
found, missing = [], []
for name in ("fla.ops.gated_delta_rule", "llguidance", "fastapi", "uvicorn", "openai", "jsonschema", "xdist"):
    try:
        importlib.import_module(name)
        found.append(name)
    except Exception as e:  # noqa: BLE001 - report, do not stop the call
        missing.append(f"{name} ({type(e).__name__}: {e})")
print("device_env: imports " + ", ".join(found) + ("; MISSING " + "; ".join(missing) if missing else ""))
PY
