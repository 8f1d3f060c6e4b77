"""Start ranks: under torchrun, under mpirun (Open MPI), or as N local processes over gloo.

- torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: ``init()`` uses them.
- mpirun (Open MPI) sets OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK but no rendezvous address:
  ``init()`` takes MASTER_ADDR/MASTER_PORT from the environment, defaulting to
  127.0.0.1:29500 (single node; pass ``-x MASTER_ADDR=host`` to mpirun for several).
- ``spawn(fn, nranks)`` starts N local ranks over gloo: the embedded default of the
  examples and benchmarks.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_ADDR, DEFAULT_PORT = "127.0.0.1", 29500


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    launcher: str  # "torchrun", "mpirun", "spawn" or "single"


def detect() -> World | None:
    """The world a launcher describes in the environment, or None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return World(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    if "OMPI_COMM_WORLD_RANK" in env:
        return World(int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                     int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)), "mpirun")
    return None


def init(backend: str = "gloo", timeout: float = 600.0) -> World:
    """Initialise torch.distributed from the launcher's environment (idempotent).

    Without a launcher this is a single-process world of size 1."""
    world = detect() or World(0, 1, 0, "single")
    if dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), world.local_rank, world.launcher)
    os.environ.setdefault("MASTER_ADDR", DEFAULT_ADDR)
    os.environ.setdefault("MASTER_PORT", str(DEFAULT_PORT))
    if world.launcher == "mpirun" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as torchrun does: ranks with full thread pools oversubscribe the cores
    dist.init_process_group(backend, rank=world.rank, world_size=world.size,
                            timeout=datetime.timedelta(seconds=timeout))
    return world


def shutdown() -> None:
    """Wait until every rank is here, then destroy the process groups (zipccl's own included).

    A rank's sends complete once its bytes are in the socket, and its receives once it has
    them: without the barrier, a fast rank could close its connections while a slower peer
    is still reading the end of the last collective (seen once as an abort at exit)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, fn, nranks, port, backend, timeout, results, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nranks), LOCAL_RANK=str(rank),
                      MASTER_ADDR=DEFAULT_ADDR, MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N ranks share the machine's cores
    init(backend, timeout)
    try:
        out = fn(rank, nranks, *args)
        results.put((rank, out))
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other ranks may never get there
        raise
    shutdown()


def spawn(fn, nranks: int, *args, backend: str = "gloo", timeout: float = 600.0) -> list:
    """Run ``fn(rank, nranks, *args)`` on ``nranks`` local processes with torch.distributed
    initialised over ``backend``; returns each rank's return value (which must pickle).
    ``fn`` must be importable (defined at module level)."""
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_child, args=(fn, nranks, free_port(), backend, timeout, results, args),
                       nprocs=nranks, join=True, start_method="spawn")
    out = [None] * nranks
    while not results.empty():
        rank, value = results.get()
        out[rank] = value
    return out
