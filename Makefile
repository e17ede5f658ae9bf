# Every target sets itself up from a clean clone: a virtual environment in .venv (reused when present).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install test lint bench bench-compare reproduce-llama7b reproduce-glue project clean

install: $(STAMP)

# torch first, alone and pinned, so nothing can resolve a (multi-GB CUDA) torch; deepspeed's sdist build then
# needs no build isolation (it imports torch at build time and must see the same one).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation deepspeed==0.19.8
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -c "import torch, deepspeed, zenflow; print('torch', torch.__version__, '| deepspeed', deepspeed.__version__)"
	touch $(STAMP)

test: install
	$(PY) -m ruff check zenflow tests bench reproduce
	$(PY) -m pytest tests -q
	ZENFLOW_BENCH_SMALL=1 $(PY) -m pytest bench/ -q --benchmark-disable  # smoke: the benchmarks cannot rot

lint: install
	$(PY) -m ruff check zenflow tests bench reproduce

# Each run is saved with its raw timings in .benchmarks/<hardware-id>/ (bench/conftest.py); ARGS for more flags,
# e.g. ARGS=--benchmark-json=out.json. docs/benchmarks.md
bench: install
	$(PY) -m pytest bench/ --benchmark-only $(ARGS)

# Verdict per benchmark (Regression / Suspicious / No change / Improvement / Insufficient data); exit 1 on Regression.
# BASELINE, CANDIDATE: pytest-benchmark JSON files or folders (newest JSON); MARKDOWN=summary.md; ARGS for more flags.
bench-compare: install
	@test -n "$(BASELINE)" -a -n "$(CANDIDATE)" || { echo "usage: make bench-compare BASELINE=... CANDIDATE=..."; exit 2; }
	$(PY) -m zenflow.bench_compare "$(BASELINE)" "$(CANDIDATE)" $(if $(MARKDOWN),--markdown "$(MARKDOWN)") $(ARGS)

# Llama-2-7B scenario on a GPU host (MODEL=hub id or path); the cpu-scale scenario here. ARGS for more flags.
reproduce-llama7b: install
	$(PY) reproduce/llama7b.py $(if $(MODEL),--model $(MODEL)) $(ARGS)

# Cost model: calibrate on this machine (≈1 min), validate against the committed cpu-scale records, project to
# A100 / H100 (results/costmodel/<hardware-id>/). ARGS=--no-calibrate reuses the calibration record;
# ARGS=--run-validation reruns the cpu-scale validation runs first (≈30 min).
project: install
	$(PY) reproduce/project.py $(ARGS)

# GLUE parity: MiniLM on SST-2 and MRPC, five engines, three seeds (≈40 min on a quiet 2-core Intel Xeon; docs/glue.md).
reproduce-glue: install
	$(PY) reproduce/glue.py $(if $(MODEL),--model $(MODEL)) $(ARGS)

clean:
	rm -rf $(VENV)
