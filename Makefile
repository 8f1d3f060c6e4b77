# Two commands do all set-up on a fresh machine: `make bench` (the main job) and `make test`.
PYTHON ?= python3
# More pytest options for `make test`, e.g. PYTEST_ARGS="--durations=25" (.ci/run).
PYTEST_ARGS ?=
# Test processes (pytest-xdist), each taking whole files, so that a file's worker pool and fixtures
# are made once: on 2 cores, 2 run the suite in two thirds of one's time (docs/PERFORMANCE.md).
TEST_WORKERS ?= 2
STAMP := .setup.stamp

.PHONY: setup bench codec-bench test clean

$(STAMP): pyproject.toml Makefile
	@# Open MPI for the mpirun tests and launcher, iproute2 for the network lab (Debian/Ubuntu, as
	@# root; skipped elsewhere).
	if { ! command -v mpirun || ! command -v tc; } >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev iproute2; fi
	$(PYTHON) -m pip install torch==2.13.0
	@# cuda12: CuPy + libnccl + NVML for the NCCL transport's CPU-runnable tests (about 470 MB; no GPU needed).
	$(PYTHON) -m pip install -e '.[test,bench,gpu,cuda12]'
	touch $(STAMP)

setup: $(STAMP)

# Loopback tables, then (as root) the same collectives in the network lab: 111 s on a quiet 2-core
# host (docs/bench/2026-11-27-make-bench-cc42b72), minutes more on a busy one.
bench: setup
	$(PYTHON) -m zipccl.bench.tour

codec-bench: setup
	$(PYTHON) -m zipccl.bench.codec

test: setup
	$(PYTHON) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

clean:
	rm -f $(STAMP)
