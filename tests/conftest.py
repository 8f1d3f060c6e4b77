"""Shared fixtures: real gradients from ../shared/data (or ZIPCCL_DATA) when present."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# NCCL's rules on gloo (zipccl.transport.strict): every collective of the suite proves that it posts
# exact-size receives, matches messages in issue order without tags and groups its sends and receives.
os.environ.setdefault("ZIPCCL_STRICT_TRANSPORT", "1")

GRADS_FILE = "grads_step050_bucket0_fp32.npy"


def _grads_dir() -> Path:
    """ZIPCCL_DATA, else data/ in this checkout (`make gpu-data`), else shared/data beside it, else
    beside the repository it was cloned from where that is a local path (a clone made elsewhere:
    git clone . "$(mktemp -d)")."""
    if os.environ.get("ZIPCCL_DATA"):
        return Path(os.environ["ZIPCCL_DATA"])
    root = Path(__file__).resolve().parents[1]
    places = [root / "data", root.parent / "shared" / "data"]
    try:  # a copy of the checkout on a machine without git has no origin to look beside
        origin = subprocess.run(["git", "-C", str(root), "config", "--get", "remote.origin.url"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        origin = ""
    if origin and Path(origin).is_dir():
        places.append(Path(origin).resolve().parent / "shared" / "data")
    return next((d for d in places if (d / GRADS_FILE).exists()), places[0])


GRADS = _grads_dir() / GRADS_FILE
if GRADS.exists():
    os.environ.setdefault("ZIPCCL_DATA", str(GRADS.parent))  # the scripts that tests run read it too


def pytest_configure(config):
    """Under xdist (`make test`), numba's kernels compiled into its cache once, before the test
    processes start (the workers skip this): tests/compile_kernels.py, the lossless kernels of
    each dtype and the sparse ones side by side (150 s on one core in a fresh clone, so about
    half that on two), 4 s once cached. Where a family fails, the tests that need it report why."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        return
    script = Path(__file__).with_name("compile_kernels.py")
    runs = [subprocess.Popen([sys.executable, str(script), *family], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            for family in (("lossless", "fp32"), ("lossless", "bf16"), ("lossless", "fp16"), ("sparse",))]
    for run in runs:
        run.wait(timeout=600)


#: The test files that run longest on 2 cores, longest first (`pytest --durations=0` at a023d4e,
#: summed per file; the others, 10 s or less each, follow). `make test` hands whole files to its
#: two processes in collection order (--dist loadfile --no-loadscope-reorder): longest first, they
#: finish together.
LONGEST_FIRST = ("test_codec.py", "test_dead_rank.py", "test_triton.py", "test_fsdp.py", "test_gpu_check.py",
                 "test_perf_cli.py", "test_backend.py", "test_perf_format.py", "test_ddp.py", "test_launch.py",
                 "test_cpu_kernels.py", "test_ci_rules.py", "test_faults.py", "test_soak.py", "test_netlab.py",
                 "test_collectives.py", "test_fuzz.py", "test_hierarchical.py", "test_alltoall.py", "test_p2p.py",
                 "test_bench_codec.py", "test_nccl.py", "test_device_plan.py", "test_sparse.py", "test_device_ops.py",
                 "test_strict_transport.py", "test_backend_ddp.py", "test_host_reads.py", "test_perf_cuda.py")


def pytest_collection_modifyitems(items):
    if stale := [name for name in LONGEST_FIRST if not Path(__file__).with_name(name).exists()]:
        raise pytest.UsageError(f"tests/conftest.py's LONGEST_FIRST names files that do not exist: {stale}")
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each file's order kept


@pytest.fixture(scope="session")
def real_grads() -> torch.Tensor:
    """The fp32 gradient bucket of a small GPT (3.3M elements), or skip with the reason."""
    if not GRADS.exists():
        pytest.skip(f"real gradients not found at {GRADS} (set ZIPCCL_DATA)")
    return torch.from_numpy(np.load(GRADS))


@pytest.fixture(scope="session")
def pool_factory():
    """One worker pool of 4 gloo ranks for the whole test run, restarted if a test ended it."""
    from workers import Pool, Restarting
    pools = Restarting(lambda: Pool(4))
    yield pools
    pools.close()


@pytest.fixture
def pool(pool_factory):
    return pool_factory()


# Under CI nothing passes silently (an unexpected skip, xfail or deselection fails the run) and
# hypothesis is derandomized: tests/ci_rules.py. Triton's interpreter for CPU tensors, compiled
# kernels for the `compiled` tests on a GPU machine: tests/triton_mode.py.
pytest_plugins = ("ci_rules", "triton_mode")


@pytest.fixture
def lab_lock():
    """One network lab on this host at a time: the lab's namespaces have fixed names, so the test
    processes (test_netlab.py, the gpu_check dry run's shaped lab) take turns, a file lock held
    for the test (a lab that met another's ranks refused to start, once in a suite run)."""
    import fcntl
    with open("/tmp/zipccl-tests-netlab.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # the test's timeout bounds the wait
        yield
