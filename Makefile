# Two commands on a fresh machine: `make demo` and `make test`. Everything else is a helper.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Torch first, pinned: on a machine without CUDA, 2.13.0 is the CPU wheel, so the `runtime`
# extra's range is already satisfied and pip never pulls a CUDA build or nvidia-* packages.
TORCH  ?= torch==2.13.0

.PHONY: setup soak test lint typecheck pytest demo bench bench-gpu proto proto-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[runtime,test,bench]'
	@if $(PY) -m pip list 2>/dev/null | grep -qi '^nvidia-'; then \
	  if ! command -v nvidia-smi >/dev/null; then echo "nvidia-* packages on a machine without CUDA" >&2; exit 1; fi; fi
	touch $@

# The stateful fuzzer (30,000 calls), the load run (8 clients, 60 s, a SIGKILLed client) and
# the runner fuzzer (120 s: honest clients checked token by token, hostile and killed ones) at
# full size; `make test` runs them briefly (tests/test_fuzz_brief.py). About 10 minutes.
soak: setup
	$(PY) benchmarks/soak.py

test: setup lint typecheck proto-check pytest

lint: setup
	$(VENV)/bin/ruff check .

# mypy cannot follow setuptools' package-dir mapping: link the folders under their import names.
typecheck: setup
	mkdir -p .mypy-src/pagedkv
	for pkg in vocab demo daemon client proto memory model_runner process llm server cli; do ln -sfn ../../$$pkg .mypy-src/pagedkv/$$pkg; done
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy benchmarks

pytest: setup
	$(PY) -m pytest -q -p no:cacheprovider

demo: setup
	$(PY) -m pagedkv.demo

bench: setup
	$(PY) benchmarks/bench_block_pool.py
	$(PY) benchmarks/bench_daemon_step.py
	$(PY) benchmarks/bench_stream.py
	$(PY) benchmarks/bench_batch_cost.py
	$(PY) benchmarks/bench_keepalive_stall.py
	$(PY) benchmarks/bench_peer_gate.py
	$(PY) benchmarks/bench_core_trace.py
	$(PY) benchmarks/bench_runner_cpu.py
	$(PY) benchmarks/bench_runner.py
	$(PY) benchmarks/bench_runner_stream.py
	$(PY) benchmarks/bench_e2e_concurrency.py
	$(PY) benchmarks/bench_sharing.py
	$(PY) benchmarks/bench_prefix.py
	$(PY) benchmarks/bench_preempt.py
	$(PY) benchmarks/bench_host_tier.py
	$(PY) benchmarks/bench_kv_events_load.py
	$(PY) benchmarks/bench_scheduler.py
	$(PY) benchmarks/bench_call_work.py
	$(PY) benchmarks/bench_queued_requests.py
	$(PY) benchmarks/bench_figures.py
	$(PY) benchmarks/bench_prefill_fairness.py
	$(PY) benchmarks/bench_multi_model.py
	$(PY) benchmarks/bench_runner_restart.py

bench-gpu: setup
	$(PY) benchmarks/bench_kernels_gpu.py

proto: setup
	$(PY) proto/generate.py

proto-check: setup
	$(PY) proto/generate.py --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .mypy-src
