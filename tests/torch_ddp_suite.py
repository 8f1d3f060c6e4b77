"""torch's own DistributedTest (torch/testing/_internal/distributed/distributed_test.py) on the
drop-in backend: a runner, as torch's test/distributed/test_distributed_spawn.py is for gloo.

    pip install expecttest  # torch's test utilities import it
    BACKEND=zipccl WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) ZIPCCL_CODEC=lossless \
        PYTHONPATH=. python tests/torch_ddp_suite.py -k test_ddp_create_graph

Not collected by pytest: each test spawns its ranks afresh (test_ddp_create_graph: about 100 s
on 2 cores). Each rank is a spawned process that imports this module, hence zipccl, which
registers "zipccl".

Run on 2026-11-26 (torch 2.13.0+cpu, 2 cores, ZIPCCL_CODEC=lossless, commit 511d8ee on):
test_DistributedDataParallelCPU, test_DistributedDataParallelCPU_grad_is_view and
test_ddp_create_graph pass (test_ddp_create_graph died with SIGSEGV before); torch gates its
other DDP tests on 2 GPUs or on the backend's name (nccl, gloo, ucc).
"""

import zipccl  # noqa: F401 - registers the "zipccl" backend in every rank's process
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
