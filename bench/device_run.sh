#!/bin/bash
# One device call: native kernel tests, the full b2 bench (b2_h200.json + b2_h200_log.txt, the
# names they keep in bench/results/), then the decoder tests.
# Usage (repo root, on the H200): bash bench/device_run.sh   (writes under $OUT, else /tmp/out)
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
source bench/device_env.sh "$HYSPEC_GIT_COMMIT"  # the carried wheels, in one fresh install (see there)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
echo "== kernel tests"; timeout ${T_KERN:-90} python3 -m pytest -q -s tests/test_gpu_fast.py -k "not decoder and not b2" 2>&1 | tail -15 | tee $OUT/tests_kernels.txt
echo "== bench"; timeout ${T_BENCH:-360} python3 -m hyspec.bench --config b2 --prompt-len 512 --new-tokens 256 ${BENCH_ARGS} --out $OUT/b2_h200.json 2>&1 | tee $OUT/b2_h200_log.txt | grep -v "^  tune" | tail -70
echo "== decoder tests"; timeout ${T_DEC:-100} python3 -m pytest -q -s tests/test_gpu_fast.py -k "one_lane" 2>&1 | tail -25 | tee $OUT/tests_decoder.txt
