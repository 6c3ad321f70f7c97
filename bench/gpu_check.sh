#!/usr/bin/env bash
# The GPU check: one prepared run on a borrowed machine with an NVIDIA GPU and no network, in at
# most 8 minutes, that writes at most 8 files into OUT_DIR.
#
#   bench/gpu_wheels.sh            (once, where the package index is reachable: fills .whl/)
#   bench/gpu_check.sh OUT_DIR     (on the GPU machine, from a copy of the tree with .whl/;
#                                   PYTHON=/path/to/python picks the interpreter, default python3)
#
# The machine needs python3 with torch (CUDA), CuPy for its CUDA, numpy, msgpack, aiohttp and
# pytest; what `import kvstore` needs beyond that (lmdb, zstandard, xxhash, redis) and
# compute-sanitizer come from .whl/. Nothing is installed into the interpreter: the tree and the
# wheels are staged in a temporary folder put first on PYTHONPATH (bench/offline_stage.py).
#
# Steps, each with its share of the time (a step that runs out is reported and the next runs):
#   stage      the tree as the `kvstore` package, the carried wheels, imports checked
#   device     stops here, exit 3, where torch sees no CUDA device (saying so); exit 4 without CuPy
#   tests      tests/gpu (kernels against their torch references, the GPU tier, the connector's
#              CUDA paged layouts, NVRTC) and every other test marked `gpu` (a whole store: GPU
#              over CPU over disk, codecs, close and reopen, bit-exact against a CPU-only store)
#   memcheck   compute-sanitizer memcheck over the kernel tests
#   bench      bench/kernels.py: the store's real paths, each a ratio to a copy of the same bytes
# OUT_DIR: gpu_check.log (everything printed), tests.xml, marked.xml (JUnit), memcheck.log,
# kernels.json, summary.txt. Exit status 0 only when every step passed.
set -uo pipefail
out=${1:?usage: bench/gpu_check.sh OUT_DIR}
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
root=$PWD
py=${PYTHON:-python3}
wheels=${WHEELS:-$root/.whl}
budget_s=${GPU_CHECK_BUDGET_S:-470}  # the whole run stays within 8 minutes
start_s=$SECONDS
exec 3>&1 4>&2 > >(tee "$out/gpu_check.log") 2>&1
tee_pid=$!
summary=$out/summary.txt
: > "$summary"
note() { echo "gpu_check: $*"; echo "$*" >> "$summary"; }
left() { echo $(( budget_s - (SECONDS - start_s) )); }
# A step's time: its share, or what is left of the budget after reserving `reserve` seconds for the steps after it.
share() { local want=$1 reserve=$2 rest; rest=$(( $(left) - reserve )); [ "$rest" -lt "$want" ] && want=$rest; echo $(( want > 5 ? want : 5 )); }

stage=$(mktemp -d "${TMPDIR:-/tmp}/kvstore-gpu-check.XXXXXX") || exit 2
# On exit: the staging folder goes, and the log is complete before the script returns.
trap 'rm -rf "$stage"; exec 1>&3 2>&4; wait "$tee_pid"' EXIT
unset PYTHONPATH
if ! "$py" "$root/bench/offline_stage.py" "$stage" --wheels "$wheels"; then
  note "stage: FAILED (the tree or a carried wheel does not import; see above)"
  exit 2
fi
# PYTHONSAFEPATH: `python -m pytest` and `python -` would otherwise put the current folder, the
# repository root, first on sys.path, where its kvstore/ folder (without its subpackages) would
# shadow the stage.
export PYTHONPATH=$stage PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 KVSTORE_STAGE=$stage
note "stage: ok ($py, $("$py" -c 'import platform; print("Python", platform.python_version())'))"

# No CUDA device is where a CPU machine stops: a clear line and exit 3, never a traceback.
"$py" - <<'EOF'
import os
import sys

import torch

import kvstore
from kvstore.gpu.runtime import kernels_unavailable_reason

if list(kvstore.__path__) != [os.path.join(os.environ["KVSTORE_STAGE"], "kvstore")]:
    print(f"gpu_check: kvstore was imported from {list(kvstore.__path__)}, not from the stage")
    sys.exit(2)

if not torch.cuda.is_available():
    print(f"gpu_check: no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none; "
          f"run this on a machine with an NVIDIA GPU")
    sys.exit(3)
reason = kernels_unavailable_reason()
if reason is not None:
    print(f"gpu_check: the CUDA kernels cannot run: {reason}")
    sys.exit(4)
import cupy

props = torch.cuda.get_device_properties(0)
print(f"gpu_check: device {props.name} ({props.total_memory >> 30} GiB, sm_{props.major}{props.minor}), "
      f"torch {torch.__version__} CUDA {torch.version.cuda}, CuPy {cupy.__version__} "
      f"(CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()})")
EOF
device_rc=$?
case $device_rc in
  0) note "device: ok" ;;
  3) note "device: none (no CUDA device); stopped"; exit 3 ;;
  4) note "device: no usable CuPy; stopped"; exit 4 ;;
  *) note "device: FAILED (exit $device_rc); stopped"; exit 2 ;;
esac

# -o pythonpath=tests: the ini's "." would put the repository's kvstore/ folder (without its
# subpackages) ahead of the stage.
pytest_args=(-q -rs -p no:cacheprovider -o pythonpath=tests)
marked=$(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu|marks=pytest\.mark\.gpu' tests | grep -v '^tests/gpu/' | sort)
failed=0
run_step() {  # name, seconds, command...
  local name=$1 seconds=$2 rc
  shift 2
  echo "gpu_check: --- $name (up to ${seconds}s)"
  timeout --kill-after=10 "$seconds" "$@"
  rc=$?
  if [ "$rc" -eq 0 ]; then note "$name: passed"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note "$name: TIMED OUT after ${seconds}s"; failed=1
  else note "$name: FAILED (exit $rc)"; failed=1; fi
  return 0
}

run_step tests "$(share 120 330)" "$py" -m pytest "${pytest_args[@]}" tests/gpu --junitxml "$out/tests.xml"
if [ -n "$marked" ]; then
  # shellcheck disable=SC2086  # one path per word
  run_step marked "$(share 90 240)" "$py" -m pytest "${pytest_args[@]}" -m gpu $marked --junitxml "$out/marked.xml"
fi

sanitizer=$(command -v compute-sanitizer || true)
for candidate in /usr/local/cuda/bin/compute-sanitizer $(find "$stage/nvidia" -type f -name compute-sanitizer 2>/dev/null); do
  [ -z "$sanitizer" ] && [ -x "$candidate" ] && sanitizer=$candidate
done
if [ -z "$sanitizer" ]; then
  note "memcheck: FAILED (no compute-sanitizer: not on PATH, not in /usr/local/cuda, not in .whl/)"
  failed=1
else
  echo "gpu_check: compute-sanitizer: $sanitizer ($("$sanitizer" --version 2>&1 | tail -1))"
  # The kernels' own tests; API errors are left out (torch and CuPy probe devices with calls that
  # fail by design), memory errors are what this counts.
  run_step memcheck "$(share 170 110)" "$sanitizer" --tool memcheck --report-api-errors no --error-exitcode 9 \
    --log-file "$out/memcheck.log" "$py" -m pytest "${pytest_args[@]}" tests/gpu/test_gpu_kernels.py \
    -k "gather or scatter or quantize or rope or codec"
  grep -h "ERROR SUMMARY" "$out/memcheck.log" | tail -1 | sed 's/^=* */memcheck: /' | tee -a "$summary"
fi

run_step bench "$(share 110 0)" "$py" bench/kernels.py --json "$out/kernels.json"
"$py" - "$out/kernels.json" <<'EOF' | tee -a "$summary"
import json
import sys

try:
    with open(sys.argv[1]) as f:
        checks = json.load(f)["targets"]
except (OSError, ValueError, KeyError) as exc:
    sys.exit(f"bench: no targets ({exc})")
for check in checks:
    print(f"target {check['path']}: worst {check['worst']:.2f}x {check['baseline']} (at least {check['at_least']}x): "
          f"{'met' if check['met'] else 'MISSED'}")
EOF

note "total: $(( SECONDS - start_s ))s; $([ $failed -eq 0 ] && echo 'every step passed' || echo 'a step failed')"
exit $failed
