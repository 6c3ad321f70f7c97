#!/usr/bin/env bash
# One-step GPU check for a borrowed GPU machine (no network needed), in well under 4 minutes:
# runs tests/gpu (kernels against their torch references, the GPU tier) and bench/kernels.py,
# and writes the logs, a JUnit XML and kernels.json into OUT_DIR.
#
#   bench/gpu_check.sh OUT_DIR          (PYTHON=/path/to/python to pick the interpreter)
#
# The interpreter is $PYTHON, else the project's .venv if its torch sees CUDA, else python3.
# CuPy missing: tries `pip install cupy-cuda<major>x` (wheels in ./.whl first, then the index).
set -uo pipefail
out=${1:?usage: bench/gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
py=${PYTHON:-}
if [ -z "$py" ]; then
  for cand in .venv/bin/python python3; do
    if command -v "$cand" >/dev/null 2>&1 && has_cuda "$cand"; then py=$cand; break; fi
  done
fi
if [ -z "$py" ]; then echo "gpu_check: no python whose torch sees a CUDA device" >&2; exit 2; fi
echo "gpu_check: $("$py" -c 'import sys, torch; print(sys.executable, "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())')"

if ! "$py" -c 'import cupy' 2>/dev/null; then
  major=$("$py" -c 'import torch; print((torch.version.cuda or "12").split(".")[0])')
  echo "gpu_check: installing cupy-cuda${major}x"
  { [ -d .whl ] && "$py" -m pip install -q --no-index --find-links .whl "cupy-cuda${major}x"; } \
    || "$py" -m pip install -q --retries 0 --timeout 10 "cupy-cuda${major}x" \
    || echo "gpu_check: could not install CuPy; the gpu tests will be skipped and the bench will not run" >&2
fi

# --confcutdir keeps tests/conftest.py (which builds whole stores, needing lmdb & co.) out of this run.
timeout 100 "$py" -m pytest tests/gpu -q -rs -p no:cacheprovider --confcutdir=tests/gpu \
  --junitxml "$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

timeout 120 "$py" bench/kernels.py --json "$out/kernels.json" 2>&1 | tee "$out/kernels.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests exit $tests_rc, bench exit $bench_rc; results in $out"
grep -E "passed|failed|error" "$out/gpu_tests.log" | tail -1
grep -E "^targets:" "$out/kernels.log" || true
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
