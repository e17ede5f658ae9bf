# Every target sets itself up from a clean clone: a virtual environment in .venv (reused when present).
# VENV= (empty): use the interpreter at hand ($(PYTHON), e.g. PYTHON=/opt/conda/bin/python) as it is: no virtual
# environment, no pip, no network; `install` only checks the imports and prints what is missing (docs/install.md).
PYTHON ?= python3
COMMA := ,
VENV ?= .venv

.PHONY: install test test-fast lint bench bench-bounds bench-compare reproduce-llama7b reproduce-glue project clean

ifeq ($(strip $(VENV)),)
PY := $(PYTHON)
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

install:
	$(PY) zenflow/harness/preflight.py
else
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

install: $(STAMP)

# torch first, alone and pinned, so nothing can resolve a (multi-GB CUDA) torch; deepspeed's sdist build then
# needs no build isolation (it imports torch at build time and must see the same one). The library itself needs only
# torch; every target here also runs the harness, reproductions or bench, hence the [harness] extra.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation deepspeed==0.19.8
	$(PY) -m pip install -q -e ".[harness,test$(if $(shell command -v nvidia-smi 2>/dev/null),$(COMMA)peers)]"
	$(PY) -c "import torch, deepspeed, zenflow; print('torch', torch.__version__, '| deepspeed', deepspeed.__version__)"
	touch $(STAMP)
endif

# Everything (what CI runs; 40-50 min on 2 cores), printing the slowest tests. tests/README.md: the tiers.
test: install
	$(PY) -m ruff check zenflow tests bench reproduce examples
	$(PY) -m pytest tests -q
	ZENFLOW_BENCH_SMALL=1 $(PY) -m pytest bench/ -q --benchmark-disable  # smoke: the benchmarks cannot rot

# The in-process tier, the loop while editing (a few minutes): every test that starts no process. Last failures
# first. Then the tier of what you touched: .venv/bin/python -m pytest tests -m ranks (or deepspeed, script, slow).
test-fast: install
	$(PY) -m ruff check zenflow tests bench reproduce examples
	$(PY) -m pytest tests -q -m "not slow" --ff $(ARGS)

lint: install
	$(PY) -m ruff check zenflow tests bench reproduce examples

# Each run is saved with its raw timings in .benchmarks/<hardware-id>/ (bench/conftest.py); ARGS for more flags,
# e.g. ARGS=--benchmark-json=out.json. docs/benchmarks.md
bench: install
	$(PY) -m pytest bench/ --benchmark-only $(ARGS)

# Every part of a ZenFlow step against its byte bound, and ZenFlow's cycle against ZeRO-Offload's step
# (bench/test_bounds.py, bench/test_step_ratio.py; docs/benchmarks.md): the run and its
# table land in results/bounds/<hardware-id>/ even when a part is over its limit (then the exit code is 1).
bench-bounds: install
	$(PY) -m pytest bench/test_bounds.py bench/test_step_ratio.py --benchmark-only --benchmark-json=.benchmarks/bounds.json $(ARGS) || failed=1; \
	$(PY) -m zenflow.reports.bounds .benchmarks/bounds.json --publish results/bounds && exit $${failed:-0}

# Verdict per benchmark (Regression / Suspicious / No change / Improvement / Insufficient data); exit 1 on Regression.
# BASELINE, CANDIDATE: pytest-benchmark JSON files or folders (newest JSON); MARKDOWN=summary.md; ARGS for more flags.
bench-compare: install
	@test -n "$(BASELINE)" -a -n "$(CANDIDATE)" || { echo "usage: make bench-compare BASELINE=... CANDIDATE=..."; exit 2; }
	$(PY) -m zenflow.bench_compare "$(BASELINE)" "$(CANDIDATE)" $(if $(MARKDOWN),--markdown "$(MARKDOWN)") $(ARGS)

# Llama-2-7B scenario on a GPU host (MODEL=hub id or path); the cpu-scale scenario here. NPROC=N: N ranks per run,
# every engine (results/llama7b/<hardware-id>/nproc-N/; docs/distributed.md). ARGS for more flags.
reproduce-llama7b: install
	$(PY) reproduce/llama7b.py $(if $(MODEL),--model $(MODEL)) $(if $(NPROC),--nproc $(NPROC)) $(ARGS)

# GPU evidence in one command (docs/gpu-window.md): the phases of reproduce/gpu_window.py's PHASES (facts, checks,
# the host ceiling, the Llama-2-7B-layer scenario, ...) under one deadline (BUDGET seconds, default 540 for a 590 s
# command), packed after every phase into $(OUT)/gpu-evidence.tar.gz. On a GPU host: make gpu-window VENV= OUT=DIR (or the bare python3 line of
# the docs, where there is no make). Here: make gpu-window ARGS=--publish=gpu-evidence.tar.gz files it in results/.
.PHONY: gpu-window
gpu-window: install
	$(PY) reproduce/gpu_window.py $(if $(OUT),--out $(OUT)) $(if $(BUDGET),--budget-s $(BUDGET)) $(ARGS)

# The GPU checks alone (≈3-6.5 min on one H100; with the host's own torch: make gpu-check VENV=): the rows of
# zenflow/harness/checks/gpu.py's CHECKS (docs/gpu-check.md) -> results/gpu-check/<hardware-id>/. Here: the CPU part, and what it could not check. ARGS=--smoke, --checks a,b.
.PHONY: gpu-check
gpu-check: install
	$(PY) reproduce/gpu_check.py $(ARGS)

# Wheels for a GPU host with its own torch and transformers but no package index: .whl/ (ignored; carry it with the
# tree) holds DeepSpeed built here, pydantic with pydantic-core for PYVER (default 3.12) and this Python, and the
# small rest; it prints the host's install line (docs/install.md). Needs PyPI or pip's cache.
.PHONY: gpu-wheels
gpu-wheels: install
	$(PY) reproduce/gpu_wheels.py $(if $(PYVER),--python-version $(PYVER)) $(ARGS)

# Cost model: calibrate on this machine (≈5 min) and measure its host AdamW kernels, run a same-day validation
# sample (25 runs, ≈5-7 min) and validate against it, project to A100 / H100 as a band, solve the inputs the published
# step times imply, draw the sensitivity figure (results/costmodel/<hardware-id>/). ARGS=--no-sample validates against
# the committed full validation, ARGS=--run-validation reruns it (≈30 min); runs more than 12 h from the calibration
# are refused unless ARGS=--allow-old-runs. ARGS=--no-calibrate reuses the calibration record.
project: install
	$(PY) reproduce/project.py $(ARGS)

# The claims table of results/README.md, rewritten from the committed tables (zenflow/reports/claims.py); run it
# after a reproduction changed one of them (tests/reports/test_claims.py fails until then).
.PHONY: claims
claims: install
	$(PY) -m zenflow.reports.claims

# Is ZenFlow's GLUE deficit ZenFlow's or the budget's? 3 epochs, and the staleness knobs (update interval, topk) at
# the default budget, 3 seeds each, beside `make reproduce-glue`'s runs (≈75 min; results/glue/<hw>/study/; docs/glue.md)
.PHONY: reproduce-glue-study
reproduce-glue-study: install
	$(PY) reproduce/glue_study.py $(ARGS)

# Does "auto" find what the best fixed ZenFlow setting finds? ref-zenflow at update interval 1 2 4 8 auto, topk 0.05
# 0.1 0.2, select interval fixed or auto, beside ref-offload and DeepSpeed's "auto", on the Llama convergence workload
# and GLUE SST-2, 3 seeds interleaved, each workload trimmed to BUDGET minutes (default 60) estimated from the
# committed records; resumable (results/knobs/<hw>/: knobs.md/.csv, verdict.json, figures). ARGS=--smoke: < 60 s.
.PHONY: reproduce-knobs
reproduce-knobs: install
	$(PY) reproduce/knobs.py $(if $(BUDGET),--budget-min $(BUDGET)) $(ARGS)

# The claims in their regime (issue 42): every engine at the split placement (the GPU analog: device work on the device
# cores, host work on the host cores), swept over tokens per step, 3 interleaved rounds, after the cost model's
# calibration of the day (≈12 + 30 min on the 2-core VM; results/regime/<hw>/: regime.md/.csv, regime.png, each point's
# tables, costmodel/ the model along the sweep). ARGS=--smoke: the tiny model, two points; ARGS=--no-calibrate.
.PHONY: reproduce-regime reproduce-regime-convergence
reproduce-regime: install
	$(PY) reproduce/regime.py $(ARGS)

# C6 in the GPU analog: Llama convergence at the sweep's analog point (regime.csv), 5 rounds (≈30 min on the 2-core VM;
# results/regime/<hw>/convergence/). ARGS=--resume continues it.
reproduce-regime-convergence: install
	$(PY) reproduce/regime.py --convergence $(ARGS)

# GLUE parity: MiniLM on SST-2 and MRPC, five engines, three seeds (≈40 min on a quiet 2-core Intel Xeon; docs/glue.md).
reproduce-glue: install
	$(PY) reproduce/glue.py $(if $(MODEL),--model $(MODEL)) $(ARGS)

clean:
	$(if $(strip $(VENV)),rm -rf $(VENV),@echo "VENV= (the interpreter at hand): nothing to clean")
