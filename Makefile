# Two commands do all set-up: `make run` and `make test`.
# TORCH_SPEC picks the torch build. On a machine without an NVIDIA GPU we pin the CPU-capable
# release; set TORCH_SPEC/TORCH_PIP_ARGS to take a CUDA build (see README, "Installing torch").
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

.PHONY: run test lint bench paper profile env clean

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $@

run: env
	$(VENV)/bin/pagelab simulate --plot --out runs/azure-conv --overwrite

test: env
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# The vLLM paper's Fig. 2 / Fig. 13 tables (docs/paper-reproduction.md) and the README's lead figure.
paper: env
	$(PY) -m bench.paper --free-causes --out runs
	$(VENV)/bin/pagelab plot runs/paper-sharegpt-burst --only breakdown --out runs/paper-sharegpt-burst/figures

bench: env
	$(PY) -m pytest -q benchmarks --benchmark-enable --benchmark-only

# A latency profile for this machine in one command (docs/calibration.md), e.g. on a GPU:
#   make profile DEVICE=cuda MODEL=llama-1b-shape GPU=h100-80gb BACKEND=triton PROFILE=h100-1b.json
# Three replays of synthetic calibration traces, then a fit. The traces span what a workload's steps can be:
# prompts up to max_model_len (a fit extrapolates badly past its longest prefill), and short prompts in
# batches of 2-8, so that per-sequence and per-context-token decode costs can be told apart.
# Then, on a CPU, the held-out validation: python -m bench.calibration --profile $(PROFILE) --repeat B,A,C
DEVICE ?= cpu
MODEL ?= tiny
BACKEND ?= torch
GPU ?= cpu
CLOCK ?= $(if $(filter cpu,$(DEVICE)),cpu,wall)
PROFILE ?= runs/profile/$(GPU)-$(MODEL).json
CAL_TRACE = $(VENV)/bin/pagelab trace gen --num 48 --arrival poisson --lengths uniform --output-range 8:300 \
	  --max-model-len 4096
profile: env
	mkdir -p runs/profile
	$(CAL_TRACE) --rate 1.5 --prompt-range 16:3796 --seed 11 --out runs/profile/cal1.csv
	$(CAL_TRACE) --rate 4 --prompt-range 16:3796 --seed 12 --out runs/profile/cal2.csv
	$(CAL_TRACE) --rate 3 --prompt-range 16:600 --seed 13 --out runs/profile/cal3.csv
	for i in 1 2 3; do rm -rf runs/profile/replay$$i; $(VENV)/bin/pagelab replay runs/profile/cal$$i.csv --limit 48 \
	  --model $(MODEL) --device $(DEVICE) --backend $(BACKEND) --clock $(CLOCK) --out runs/profile/replay$$i || exit 1; done
	$(VENV)/bin/pagelab calibrate runs/profile/replay1 runs/profile/replay2 runs/profile/replay3 --gpu $(GPU) \
	  --objective relative --out $(PROFILE)

clean:
	rm -rf $(VENV) runs build *.egg-info
