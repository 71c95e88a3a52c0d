# Two commands on a fresh machine: `make demo` and `make test`. Everything else is a helper.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3
# Which lock `make setup` installs: cpu (PyTorch's CPU wheel) or cuda (PyPI's CUDA build, with
# its nvidia-* wheels). pip does not look for GPUs: the choice is this variable, which defaults to
# cuda where nvidia-smi is on PATH and to cpu elsewhere. `make setup TORCH_BACKEND=cpu` on a GPU
# machine installs the CPU build on purpose.
TORCH_BACKEND ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
LOCK   := requirements/$(TORCH_BACKEND).txt
# PyTorch publishes its CPU wheels on its own index, not on PyPI (the cpu lock pins their hashes).
# Setup adds that index only when pip's own sources (a find-links folder) lack the pinned wheel:
# pip asks every index for every package, and an index it cannot reach costs seconds each.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# The venv holds exactly one lock: made anew when the lock (or the backend) changes.
LOCKED := $(VENV)/.locked-$(TORCH_BACKEND)
STAMP  := $(VENV)/.installed
# `make lock LOCK_ARGS=--upgrade` takes the newest releases the ranges allow; plain `make lock`
# keeps every pin that still satisfies pyproject.toml.
LOCK_ARGS ?=
PIP_COMPILE = CUSTOM_COMPILE_COMMAND="make lock" $(PY) -m piptools compile --quiet \
	--generate-hashes --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links \
	$(LOCK_ARGS)

include ops/image.env

.PHONY: setup lock soak test lint typecheck pytest demo bench bench-gpu tune-gpu gpu-check image \
	proto \
	proto-check clean

setup: $(STAMP)

$(LOCKED): $(LOCK)
	@case "$(TORCH_BACKEND)" in cpu|cuda) ;; *) echo "TORCH_BACKEND must be cpu or cuda, not '$(TORCH_BACKEND)'" >&2; exit 1;; esac
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { \
	  echo "the locks in requirements/ are compiled for CPython 3.11: make setup PYTHON=python3.11" >&2; exit 1; }
	@echo "setup: installing $(LOCK) (TORCH_BACKEND=$(TORCH_BACKEND)) into a new $(VENV)"
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	torch=$$(grep -o '^torch==[^ ]*' $(LOCK)); source=""; \
	if [ $(TORCH_BACKEND) = cpu ] && ! $(PY) -m pip install -q --dry-run --no-deps --no-index \
	  "$$torch" >/dev/null 2>&1; then source="--extra-index-url $(TORCH_CPU_INDEX)"; fi; \
	$(PY) -m pip install -q --require-hashes --no-deps $$source -r $(LOCK)
	touch $@

# The editable install also compiles the C extensions (setup.py) in place: a changed C source
# makes setup run again.
NATIVE := $(wildcard daemon/core/*.[ch] model_runner/kernels/*.[ch])
$(STAMP): $(LOCKED) pyproject.toml setup.py $(NATIVE)
	@command -v $${CC:-cc} >/dev/null || { echo "setup compiles pagedkv's C extensions (setup.py):" \
	  "install a C compiler and the Python headers (Debian/Ubuntu: apt-get install gcc python3-dev)" >&2; exit 1; }
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	@if [ "$(TORCH_BACKEND)" = cpu ] && $(PY) -m pip list 2>/dev/null | grep -qi '^nvidia-'; then \
	  echo "nvidia-* packages in a cpu venv" >&2; exit 1; fi
	touch $@

# Refresh the locks from pyproject.toml and requirements/*.in (tests/project/test_lock.py fails
# while they disagree): cpu and cuda hold every extra, image only the runtime the container runs.
# The CUDA builds are resolved against PyPI alone: a local wheel folder or a pip constraint of this
# machine must not leak into what other machines install.
PYPI_ONLY := env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null
lock: setup
	$(PIP_COMPILE) --all-extras pyproject.toml requirements/cpu.in -o requirements/cpu.txt
	$(PYPI_ONLY) $(PIP_COMPILE) --all-extras pyproject.toml requirements/cuda.in \
	  -o requirements/cuda.txt
	$(PYPI_ONLY) $(PIP_COMPILE) --extra runtime pyproject.toml requirements/image.in \
	  -o requirements/image.txt

# The stateful fuzzer (30,000 calls), the load run (8 clients, 60 s, a SIGKILLed client) and
# the runner fuzzer (120 s: honest clients checked token by token, hostile and killed ones) at
# full size; `make test` runs them briefly (tests/benchmarks/test_fuzzers.py). About 10 minutes.
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

# Two workers, one per core of the CI machine; each test file stays on one worker, so a module's
# daemons start once. PYTEST_WORKERS=0 runs the suite in one process. The 25 slowest tests are
# printed at the end (benchmarks/RESULTS.md keeps a run's list).
PYTEST_WORKERS ?= 2
pytest: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile --durations=25

demo: setup
	$(PY) -m pagedkv.demo

bench: setup
	$(PY) benchmarks/bench_block_pool.py
	$(PY) benchmarks/bench_daemon_step.py
	$(PY) benchmarks/bench_stream.py
	$(PY) benchmarks/bench_batch_cost.py
	$(PY) benchmarks/bench_release_batch.py
	$(PY) benchmarks/bench_keepalive_stall.py
	$(PY) benchmarks/bench_peer_gate.py
	$(PY) benchmarks/bench_core_trace.py
	$(PY) benchmarks/bench_runner_cpu.py
	$(PY) benchmarks/bench_decode_forward.py
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
	$(PY) benchmarks/bench_daemon_restart.py
	$(PY) benchmarks/bench_fair_keys.py
	$(PY) benchmarks/bench_serve.py
	$(PY) benchmarks/bench_slowloris.py
	$(PY) benchmarks/bench_replay_flood.py
	$(PY) benchmarks/bench_fence.py --rounds 5
	$(PY) benchmarks/bench_structured.py
	$(PY) benchmarks/bench_fp8_kv.py
	$(PY) benchmarks/bench_restart_snapshot.py
	$(PY) benchmarks/bench_crash_log.py
	$(PY) benchmarks/bench_daemon_crash_restore.py
	$(PY) benchmarks/bench_daemon_upgrade.py
	$(PY) benchmarks/bench_step_files.py
	$(PY) benchmarks/bench_suite.py

bench-gpu: setup
	$(PY) benchmarks/bench_kernels_gpu.py

# Time num_warps x num_stages per (kernel, HEAD_DIM, GROUP, dtype, cache dtype) on this GPU and
# rewrite model_runner/kernels/tuned_configs.json, to commit (about 40 minutes). Fails without CUDA.
tune-gpu: setup
	$(PY) benchmarks/tune_kernels_gpu.py

# The first thing a session with a lent GPU runs (at most 8 minutes): CUDA seen, `pytest -m gpu`
# (CUDA-graph decode included), bench-gpu --quick, the tuner --quick against the committed table,
# `pagedkv serve` on CUDA against transformers, one summary. Fails without CUDA.
gpu-check: setup
	$(PY) benchmarks/gpu_check.py

# The image ops/kubernetes runs (name and tag: ops/image.env), where a container engine runs.
image:
	@engine=$$(command -v docker || command -v podman) || { echo "make image: no docker or podman on PATH" >&2; exit 1; }; \
	$$engine info >/dev/null 2>&1 || { echo "make image: $$engine finds no running container engine" >&2; exit 1; }; \
	$$engine build --build-arg VERSION=$(lastword $(subst :, ,$(IMAGE))) \
	  --build-arg REVISION=$$(git rev-parse HEAD 2>/dev/null || echo unknown) -t $(IMAGE) .

proto: setup
	$(PY) proto/generate.py

proto-check: setup
	$(PY) proto/generate.py --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .mypy-src
