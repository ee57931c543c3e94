# Two commands do all set-up: `make run` and `make test`.
# TORCH_SPEC picks the torch build. On a machine without an NVIDIA GPU we pin the CPU-capable
# release; set TORCH_SPEC/TORCH_PIP_ARGS to take a CUDA build (see docs/getting-started.md, "Installing torch").
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_NVIDIA),1)
TORCH_SPEC ?= torch>=2.5
else
TORCH_SPEC ?= torch==2.13.0
endif
TORCH_PIP_ARGS ?=

.PHONY: run test lint bench paper profile docs env clean gpu-check chromium

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,docs]"
	$(MAKE) --no-print-directory chromium
	touch $@

# Headless Chromium for the run explorer's browser tests (tests/viz/test_viz_explorer_browser.py): Debian's
# package, installed when missing and this user can; without it those tests are skipped (fail under CI=true).
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	    else echo "chromium is not installed (apt-get install chromium): the browser tests will be skipped"; fi; }

run: env
	$(VENV)/bin/pagelab simulate --plot --out runs/azure-conv --overwrite

test: env
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n auto --maxprocesses 4
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir "$$site"; \
	  status=$$?; rm -rf "$$site"; exit $$status

# The documentation site in site/ (docs/cli.md is generated: python docs/gen_cli.py).
docs: env
	$(VENV)/bin/mkdocs build --strict

# The vLLM paper's Fig. 2 / Fig. 13 tables (docs/paper-reproduction.md) and the README's lead figure.
paper: env
	$(PY) -m bench.paper --free-causes --out runs
	$(VENV)/bin/pagelab plot runs/paper-sharegpt-burst --only breakdown --out runs/paper-sharegpt-burst/figures

bench: env
	$(PY) -m pytest -q tests/benchmarks --benchmark-enable --benchmark-only

# A latency profile for this machine in one command (docs/calibration.md), e.g. on a GPU:
#   make profile DEVICE=cuda GPU=h100-80gb PROFILE=h100-1b.json     (llama-1b-shape, Triton, wall clock)
# bench/profile.py replays four synthetic calibration traces and fits them. Then the held-out validation:
#   python -m bench.calibration --profile $(PROFILE) --device $(DEVICE) --repeat B,A,C
DEVICE ?= cpu
profile: env
	$(PY) -m bench.profile --device $(DEVICE) $(if $(GPU),--gpu $(GPU)) $(if $(MODEL),--model $(MODEL)) \
	  $(if $(BACKEND),--backend $(BACKEND)) $(if $(PROFILE),--out $(PROFILE))

# The GPU check in one go, on a GPU machine whose image already has torch, Triton and transformers (no venv:
# nothing is installed beyond the project): bench/gpu.py; about 5 minutes (GPU_BUDGET seconds).
#   make gpu-check GPU_OUT=$$OUT       -> gpu-check.json, gpu-check.md, gpu-check-runs.tar.gz
GPU_OUT ?= runs/gpu-check
GPU_BUDGET ?= 300
gpu-check:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -m bench.gpu --out $(GPU_OUT) --budget-s $(GPU_BUDGET)

clean:
	rm -rf $(VENV) runs build site *.egg-info
