# Two commands do all set-up on a fresh machine: `make bench` (the main job) and `make test`.
PYTHON ?= python3
PYTEST_ARGS ?=
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

bench: setup
	$(PYTHON) -m zipccl.bench --baseline

codec-bench: setup
	$(PYTHON) -m zipccl.bench.codec

test: setup
	$(PYTHON) -m pytest -q -rs $(PYTEST_ARGS)

clean:
	rm -f $(STAMP)
