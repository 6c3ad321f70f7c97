#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with the wheels bench/gpu_check.sh carries to a borrowed GPU machine
# that has no network: what `import kvstore` needs beyond that machine's own packages (python3
# 3.12 with torch for CUDA 13, cupy-cuda13x, aiohttp, msgpack, uvloop, pytest, transformers), and
# compute-sanitizer. Run it where the package index is reachable; copy .whl/ along with the tree.
#
#   bench/gpu_wheels.sh          (PIP=/path/to/pip picks pip; default .venv/bin/pip, else pip3)
#
# lmdb, zstandard, xxhash: the disk tier and its records (the whole-store check runs GPU over CPU
# over disk); redis: the Redis tier, which the tier stack imports. The sanitizer is the CUDA 13.0
# release: a newer CUDA 13 driver runs it too. Pure or manylinux wheels for CPython 3.12, x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=${PIP:-$( [ -x .venv/bin/pip ] && echo .venv/bin/pip || echo pip3 )}
rm -rf .whl
mkdir .whl
"$pip" download --dest .whl --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_25_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  "lmdb>=3.0" "zstandard>=0.22" "xxhash>=3.0" "redis>=5.0" "nvidia-cuda-sanitizer-api==13.0.85"
ls -l .whl
echo "gpu_wheels: $(du -sm .whl | cut -f1) MiB in .whl; with the tracked tree: $(( $(du -sm .whl | cut -f1) + $(git ls-files -z | du -cm --files0-from=- | tail -1 | cut -f1) )) MiB"
