# Two commands do all set-up on a fresh machine: `make bench` (the main job) and `make test`.
PYTHON ?= python3
# More pytest options for `make test`, e.g. PYTEST_ARGS="--durations=25" (.ci/run).
PYTEST_ARGS ?=
# Test processes (pytest-xdist), each taking whole files, so that a file's worker pool and fixtures
# are made once: on 2 cores, 2 run the suite in two thirds of one's time (docs/PERFORMANCE.md).
TEST_WORKERS ?= 2
STAMP := .setup.stamp
IMAGE_TRITON := 3.6.0
IMAGE_TRITON_DIR := build/triton-$(IMAGE_TRITON)

.PHONY: setup bench codec-bench test test-long coverage gpu-data gpu-tools clean

$(STAMP): pyproject.toml Makefile
	@# Open MPI for the mpirun tests and launcher, iproute2 for the network lab (Debian/Ubuntu, as
	@# root; skipped elsewhere).
	if { ! command -v mpirun || ! command -v tc; } >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev iproute2; fi
	$(PYTHON) -m pip install torch==2.13.0
	@# cuda12: CuPy + libnccl + NVML for the NCCL transport's CPU-runnable tests (about 470 MB; no GPU needed).
	$(PYTHON) -m pip install -e '.[test,bench,gpu,cuda12]' -c .ci/versions.txt
	@# The Triton of the CUDA image that GPU checks run on (docs/GPU.md), beside the package's own:
	@# tests/test_triton.py compiles the kernels with it too (a 190 MB wheel, 640 MB installed).
	$(PYTHON) -m pip install -q --no-deps --upgrade --target $(IMAGE_TRITON_DIR) triton==$(IMAGE_TRITON)
	touch $(STAMP)

setup: $(STAMP)

# Loopback tables, then (as root) the same collectives in the network lab: 167 s on a quiet 2-core
# host (docs/bench/2026-12-03-make-bench-10d24fa), minutes more on a busy one.
bench: setup
	$(PYTHON) -m zipccl.bench.tour

codec-bench: setup
	$(PYTHON) -m zipccl.bench.codec

PYTEST := -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Bytecode cached even where PYTHONDONTWRITEBYTECODE is set: the suite starts hundreds of Python
# processes, dozens of them pytest, which without a cache rewrites its plugins' asserts each time
# (about 1 s a launch; test_ci_rules and test_gpu_check took 10% longer).
test: setup
	env -u PYTHONDONTWRITEBYTECODE $(PYTHON) $(PYTEST) $(PYTEST_ARGS)

# Before each release: the long fuzz and soak runs that the suite runs small (tests/test_fuzz.py,
# tests/test_soak.py), into LONG_OUT; record them in docs/bench/<date>-test-long/ with a README
# (docs/RELIABILITY.md). About an hour on a 2-core host.
LONG_OUT ?= long-results
test-long: setup
	mkdir -p $(LONG_OUT)
	$(PYTHON) bench/fuzz.py --cases 200000 --family raw,topk,numba,reference=20000,triton=2000 --json $(LONG_OUT)/fuzz.json
	$(PYTHON) bench/soak.py --json $(LONG_OUT)/soak.json --plot $(LONG_OUT)/soak.png

# Line coverage of zipccl/ over the whole suite, subprocesses included (pyproject.toml
# [tool.coverage.run]); prints the total and the modules below 80%. Slower than `make test`.
coverage: setup
	rm -f .coverage .coverage.* coverage.json
	COVERAGE_FILE=$(CURDIR)/.coverage $(PYTHON) -m coverage run -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder $(PYTEST_ARGS)
	$(PYTHON) -m coverage combine -q
	$(PYTHON) -m coverage json -q -o coverage.json
	$(PYTHON) .ci/coverage_below.py coverage.json 80

# The real gradients into data/ (ignored by git), copied with the checkout to a GPU machine
# (bench/gpu_check.sh, the tests and the benchmarks look there): from ZIPCCL_DATA or ../shared/data.
GPU_DATA ?= $(or $(ZIPCCL_DATA),../shared/data)
gpu-data:
	mkdir -p data
	cp -u $(GPU_DATA)/*.npy data/
	ls -l data

# iproute2 for the shaped lab, into gpu_tools/ (ignored by git), for a GPU machine without it
# (bench/gpu_check.sh uses it where `ip` is missing): Debian's packages, unpacked, not installed.
gpu-tools:
	bash bench/gpu_tools.sh gpu_tools

clean:
	rm -f $(STAMP)
	rm -rf build/triton-*
