# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install
# everything first; later runs reinstall only when the build inputs changed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEPS_STAMP := $(VENV)/.deps-installed
PKG_STAMP := $(VENV)/.moecomm-installed
BUILD_INPUTS := $(shell find csrc bindings cmake -type f 2>/dev/null) CMakeLists.txt pyproject.toml
PY_SOURCES := python serving tests bench tools
CXX_SOURCES = $(shell find csrc bindings -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh')

.PHONY: demo test lint format pytest build venv bench bench-full clean etcd engines gpu-check gpu-check-plan gpu-wheels

venv: $(PKG_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned to the CPU wheel on local disk; any other request pulls a multi-GB CUDA build.
$(DEPS_STAMP): pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0 "numpy<2.3"
	$(PIP) install -q "scikit-build-core>=0.10" "pybind11>=2.12" ninja \
		"pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "pyzmq>=25" \
		"ruff>=0.6" "clang-format>=18" triton "fastapi>=0.110" "uvicorn>=0.29" "httpx>=0.27" \
		"safetensors>=0.4" matplotlib "tokenizers>=0.22,<0.24" "jinja2>=3.1" "openai>=1.40" \
		transformers==5.18.0
	# GPU data path: NVSHMEM headers + device library for the build (the CUDA 13 wheel matches the
	# machine's nvcc 13; use nvidia-nvshmem-cu12 with a CUDA 12 toolkit) and cuda-python for
	# device discovery and IPC handles. Both install and import without a GPU.
	$(PIP) install -q nvidia-nvshmem-cu13 "cuda-bindings>=13,<14"
	# The cross-host transport: NIXL over UCX (moecomm[nixl]); its UCX backend moves host memory
	# without a GPU, which is what the network-namespace tests run on.
	$(PIP) install -q "nixl-cu12>=1.5,<1.6"
	touch $@

$(PKG_STAMP): $(DEPS_STAMP) $(BUILD_INPUTS)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(PKG_STAMP)

demo: $(PKG_STAMP)
	$(PY) -m moecomm_serving.cli demo

lint: $(DEPS_STAMP)
	$(VENV)/bin/ruff check $(PY_SOURCES)
	$(VENV)/bin/ruff format --check $(PY_SOURCES)
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)
	$(PY) tools/check_imports.py

format: $(DEPS_STAMP)
	$(VENV)/bin/ruff check --fix $(PY_SOURCES)
	$(VENV)/bin/ruff format $(PY_SOURCES)
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

# The etcd membership backend is tested against a real etcd: Debian's etcd-server, when missing.
etcd:
	@command -v etcd >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server; }

# vLLM 0.33.0 and SGLang 0.5.23, their Python only (--no-deps, pinned in
# tests/engines/requirements.txt), and the opt-in alias (engines/alias) in a folder beside the
# venv (.venv/engines/site, ~1 GB, ~20 s): tests/engines/ drives the engines' own MoE code on
# moecomm. Up to date in a fraction of a second when nothing changed.
engines: $(DEPS_STAMP)
	tools/engines_env.sh

# MOECOMM_REQUIRE_ENGINES=1: a missing engine environment fails tests/engines/ instead of
# skipping it, so CI cannot pass without running the engines' code.
pytest: $(PKG_STAMP) etcd engines
	MOECOMM_REQUIRE_ENGINES=1 $(PY) -m pytest -q

test: lint pytest

# A short pass of every benchmark (bench/run.py: seconds each on a quiet machine; JSON under
# build/bench-quick, the committed figures untouched); bench-full: the runs behind the committed
# figures in bench/results (hours: the soaks).
bench: $(PKG_STAMP)
	$(PY) bench/run.py

bench-full: $(PKG_STAMP)
	$(PY) bench/run.py --full

# The GPU check (docs/gpu-check.md), in stages that fit a lent GPU machine's device time:
# CALL=1 runs preflight, build, joinleave, core, smoke, regress (<= 7 min); CALL=2 preflight,
# build (reused on the warm machine), deepep, bench, sanitizer (<= 4 min). Stages share the
# call's deadline (unused time flows on); every test file has its own cap. STAGE=a,b runs those
# stages (and the preflight and build they need); neither runs every stage. Without a device it
# runs preflight, build (make build) and host, and lists each device stage as skipped with the
# reason. Results in OUT: summary.md/.json (rewritten after every test file), logs/<stage>.log,
# junit/<stage>.<file>.xml; PACK=1 folds logs and junit into two archives (the device tool
# returns at most 8 files). gpu-check-plan lists every GPU test file with its stage and cap, and
# each call's budgets against its limit.
OUT ?= gpu-check-results
gpu-check:
	$(PYTHON) tools/gpu_check.py --out $(OUT) $(if $(CALL),--call $(CALL)) \
		$(if $(STAGE),--only $(STAGE)) $(if $(PACK),--pack) $(GPU_CHECK_ARGS)

gpu-check-plan:
	$(PYTHON) tools/gpu_check.py --plan

# Wheels the GPU image lacks (tests' imports), for cp312, into .gpu-wheels/ (carried by the
# device tool: carry=[".gpu-wheels"]).
gpu-wheels:
	tools/fetch_gpu_wheels.sh

clean:
	rm -rf build $(VENV) .pytest_cache .ruff_cache .hypothesis
