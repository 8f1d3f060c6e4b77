"""Start ranks: under torchrun, under mpirun (Open MPI), or as N local processes over gloo.

- torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: ``init()`` uses them.
- mpirun (Open MPI) sets OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK but no rendezvous address:
  ``init()`` takes MASTER_ADDR/MASTER_PORT from the environment, defaulting to
  127.0.0.1:29500 (single node; pass ``-x MASTER_ADDR=host`` to mpirun for several).
- ``spawn(fn, nranks)`` starts N local ranks over gloo: the embedded default of the
  examples and benchmarks.

GPUs: a rank that uses NCCL (``backend`` "nccl", or ``share_gpu``) is bound to one GPU before
its group exists: its local rank's under a launcher with one GPU per local rank, or GPU 0 for
every rank of the one-GPU lab (``share_gpu=True``), where each rank is an NCCL host of its own
(``lab_env``) and NCCL connects the ranks with its socket transport.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import signal
import socket
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import lifetime, topology
from .errors import UnsupportedError

DEFAULT_ADDR, DEFAULT_PORT = "127.0.0.1", 29500


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    launcher: str  # "torchrun", "mpirun", "spawn" or "single"


#: Each launcher's variables, in the order they are read: (launcher, rank, size, local ranks).
#: PMI's are MPICH's and Intel MPI's mpiexec (Hydra), and srun --mpi=pmi2's, which gives no
#: MPI_LOCALRANKID.
_LAUNCHERS = (("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",)),
              ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),
              ("mpirun", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "SLURM_LOCALID")))


def detect() -> World | None:
    """The world a launcher describes in the environment, or None. torchrun's variables come
    first (torchrun started by mpirun, one per node, sets them for its ranks over mpirun's). A
    rank without its size, a value that is not a whole number or a rank outside its world raises
    ValueError naming the variables, as does a RANK that torchrun did not set (no
    TORCHELASTIC_RUN_ID: one left in the shell, which mpirun passes on) against an MPI rank it
    disagrees with: each rank would otherwise make a world of its own."""
    env, found = os.environ, []
    for launcher, rank_var, size_var, local_vars in _LAUNCHERS:
        if rank_var not in env and size_var not in env:
            continue
        if rank_var not in env or size_var not in env:
            given, missing = (rank_var, size_var) if rank_var in env else (size_var, rank_var)
            raise ValueError(f"{given} is set but {missing} is not: a launcher sets both (unset {given}?)")
        rank, size = _whole(rank_var), _whole(size_var)
        local = next((_whole(v) for v in local_vars if v in env), 0)
        if not 0 <= rank < size or local < 0:
            raise ValueError(f"{rank_var}={rank} is not a rank of {size_var}={size} (local rank {local})")
        found.append(World(rank, size, local, launcher))
    if not found:
        return None
    first = found[0]
    if first.launcher == "torchrun" and "TORCHELASTIC_RUN_ID" not in env:
        for other in found[1:]:
            if (other.rank, other.size) != (first.rank, first.size):
                raise ValueError(f"RANK={first.rank} and WORLD_SIZE={first.size}, which torchrun did not set, "
                                 f"against {other.launcher}'s rank {other.rank} of {other.size}: unset RANK and "
                                 "WORLD_SIZE (left in the shell?), or start the ranks with torchrun")
    return first


def _whole(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: a launcher's ranks and sizes are whole numbers") from None


def lab_env(rank: int, ifname: str = "lo") -> dict[str, str]:
    """NCCL's variables for rank ``rank`` of the one-GPU lab, where several ranks share one GPU.

    NCCL refuses two ranks of a communicator on one GPU when they look like one host: the
    check is "same host hash and same bus id" (NCCL 2.28.9, src/init.cc, "Duplicate GPU
    detected"; from 2.30 the GPU's UUID, "Multiple Ranks are using the same GPU"). The host hash
    is a hash of NCCL_HOSTID where that is set, in place of the host name and boot id
    (src/misc/utils.cc, getHostHashOnce), so a different NCCL_HOSTID per rank makes each rank a
    host of its own. Between hosts NCCL uses neither P2P nor shared memory (both require equal
    host hashes: src/transport/p2p.cc and shm.cc, canConnect) but its network transport:
    NCCL_NET=Socket picks the built-in socket one by name (src/plugin/net.cc, ncclNetInit; no
    IB, no plugin), NCCL_IB_DISABLE=1 keeps IB out, NCCL_SOCKET_IFNAME names its interface (lo,
    or a network lab's veth: src/misc/socket.cc), and NCCL_MNNVL_ENABLE=0 keeps the "hosts"
    from being joined over a multi-node NVLink fabric (src/mnnvl.cc). NCCL_P2P_DISABLE and
    NCCL_SHM_DISABLE do not help: the refusal comes first."""
    return {"NCCL_HOSTID": f"zipccl-lab-rank{rank}", "NCCL_SOCKET_IFNAME": ifname, "NCCL_IB_DISABLE": "1",
            "NCCL_NET": "Socket", "NCCL_MNNVL_ENABLE": "0"}


def gpu_for(local_rank: int, ngpus: int, share_gpu: bool = False) -> int:
    """The CUDA device of a rank: 0 for every rank of the one-GPU lab, and where the process sees
    one GPU alone (a launcher that gives each rank its own through CUDA_VISIBLE_DEVICES, as
    ``srun --gpus-per-task=1`` does; ranks that in fact share it meet NCCL's own refusal of one
    GPU twice), else one GPU per local rank."""
    if ngpus < 1:
        raise UnsupportedError("these ranks run on CUDA, and torch finds no CUDA device here "
                               "(torch.cuda.is_available() is False)")
    if share_gpu or ngpus == 1:
        return 0
    if local_rank >= ngpus:
        raise UnsupportedError(f"local rank {local_rank} has no CUDA device of its own ({ngpus} here): run at most "
                               f"{ngpus} ranks per node, or share one GPU (share_gpu=True, zipccl-perf --share-gpu)")
    return local_rank


def use_gpu(rank: int, local_rank: int, share_gpu: bool = False) -> int:
    """Bind this process to its GPU before any NCCL communicator exists (NCCL reads its host id
    once per process); in the lab, with ``lab_env``'s variables (an NCCL_SOCKET_IFNAME already
    set, such as a network lab's veth, is kept). Returns the device index."""
    device = gpu_for(local_rank, torch.cuda.device_count() if torch.cuda.is_available() else 0, share_gpu)
    if share_gpu:
        os.environ.update(lab_env(rank, os.environ.get("NCCL_SOCKET_IFNAME", "lo")))
    torch.cuda.set_device(device)
    return device


def init(backend: str = "gloo", timeout: float = 600.0, share_gpu: bool = False) -> World:
    """Initialise torch.distributed from the launcher's environment (idempotent); with NCCL
    (``backend`` naming it, or ``share_gpu``), bind the rank to its GPU first (``use_gpu``).

    Without a launcher this is a single-process world of size 1."""
    world = detect() or World(0, 1, 0, "single")
    if dist.is_initialized():
        topology.publish_node()
        return World(dist.get_rank(), dist.get_world_size(), world.local_rank, world.launcher)
    if share_gpu or "nccl" in backend:
        use_gpu(world.rank, world.local_rank, share_gpu)
    os.environ.setdefault("MASTER_ADDR", DEFAULT_ADDR)
    os.environ.setdefault("MASTER_PORT", str(DEFAULT_PORT))
    if world.launcher == "mpirun" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as torchrun does: ranks with full thread pools oversubscribe the cores
    dist.init_process_group(backend, rank=world.rank, world_size=world.size,
                            timeout=datetime.timedelta(seconds=timeout))
    topology.publish_node()  # so that a peer's first message under codec "auto" need not wait for it
    return world


def shutdown() -> None:
    """Wait until every rank is here, then destroy the process groups (zipccl's own included).

    A rank's sends complete once its bytes are in the socket, and its receives once it has
    them: without the barrier, a fast rank could close its connections while a slower peer
    is still reading the end of the last collective (seen once as an abort at exit)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:  # a peer gone before it: the groups are destroyed all the same (a later init makes new ones)
            dist.destroy_process_group()


#: Where ``free_port`` looks first: below Linux's ephemeral range (ip_local_port_range, 32768
#: and up by default), which the kernel hands out to every socket bound to port 0 and to every
#: outgoing connection (gloo's among them), so that a port found free there is not taken by
#: another test's ranks before this job's store listens on it (EADDRINUSE, seen once in a
#: suite of 1,500 tests).
PORTS = range(20000, 32000)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now: one of PORTS at random, else one the
    kernel picks."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for port in rng.sample(PORTS, min(32, len(PORTS))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nranks: int, port: int, share_gpu: bool = False) -> dict[str, str]:
    """A spawned rank's launcher variables (torchrun's names). In the one-GPU lab each rank is a
    node of its own, as NCCL sees it there: GROUP_RANK = rank, local rank 0 of 1 (zipccl.topology
    reads these; ZIPCCL_TOPOLOGY overrides them)."""
    env = dict(RANK=str(rank), WORLD_SIZE=str(nranks), LOCAL_RANK=str(rank), MASTER_ADDR=DEFAULT_ADDR,
               MASTER_PORT=str(port))
    if share_gpu:
        env.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    return env


def _die_with_launcher() -> None:
    """Linux: this rank is killed when the process that spawned it dies, however it dies (a
    launcher killed by a timeout must not leave its ranks running, holding ports and cores).
    torch's spawn asks for SIGINT there, which a rank blocked in a C++ call (a store's wait) or
    one that ignores SIGINT (a shell's background job) never acts on."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: ranks end with their work or their timeout
        pass


def _child(rank, fn, nranks, port, backend, timeout, results, args, share_gpu=False):
    _die_with_launcher()
    os.environ.update(rank_env(rank, nranks, port, share_gpu))
    torch.set_num_threads(1)  # N ranks share the machine's cores
    init(backend, timeout, share_gpu)
    try:
        out = fn(rank, nranks, *args)
        results.put((rank, out))
    except BaseException:
        results.put((rank, _Raised(traceback.format_exc())))  # before its peers fail of its going
        lifetime.torch_destroy()  # no barrier, no wait for zipccl's calls: the other ranks may never get there
        raise
    shutdown()


class _Raised:
    """A rank's exception as it raised it (its traceback's text), for ``spawn`` to report."""

    def __init__(self, text: str):
        self.text = text


@contextlib.contextmanager
def fork_server(fn):
    """The start method for ranks that run ``fn``: "forkserver", with multiprocessing's fork
    server started for them with torch, zipccl and ``fn``'s module imported, so that each rank
    forks from it instead of importing them again (about 2 s of CPU per rank, the most of a small
    run's start). Started afresh, so that its ranks see this process's environment as it is now,
    as spawned ranks would; it starts no CUDA context and no thread, and it is killed on the way
    out (any rank still alive dies with it). "spawn" where this Python has no fork server to
    restart, where this process already runs one (its own processes may still need it), and
    where a CUDA device is visible: an import in the server that initialised CUDA
    (torch.cuda.is_available() does) would leave its forked ranks unable to use it."""
    import multiprocessing.forkserver as forkserver
    server = getattr(forkserver, "_forkserver", None)
    if (os.name != "posix" or not hasattr(server, "_stop") or getattr(server, "_forkserver_pid", 0) is not None
            or torch.cuda.is_available()):
        yield "spawn"
        return
    forkserver.set_forkserver_preload(["torch", "torch.distributed", __name__, "zipccl._dies_with_launcher",
                                       getattr(fn, "__module__", __name__)])
    try:
        yield "forkserver"
    finally:
        if server._forkserver_pid is not None:
            os.kill(server._forkserver_pid, signal.SIGKILL)  # a stop waits for every rank to end
        server._stop()


def spawn(fn, nranks: int, *args, backend: str = "gloo", timeout: float = 600.0, share_gpu: bool = False) -> list:
    """Run ``fn(rank, nranks, *args)`` on ``nranks`` local processes with torch.distributed
    initialised over ``backend``; returns each rank's return value (which must pickle).
    ``fn`` must be importable (defined at module level).

    ``share_gpu``: every rank on the visible GPU (cuda:0), each its own NCCL host and its own
    node (GROUP_RANK = rank), so that NCCL, zipccl's NCCL transport included, connects them
    with its socket transport over loopback: the one-GPU lab (docs/GPU.md)."""
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    if share_gpu and not torch.cuda.is_available():
        raise UnsupportedError("spawn(share_gpu=True) runs every rank on the visible CUDA device, and torch finds "
                               "no CUDA device here (torch.cuda.is_available() is False)")
    out, raised = [None] * nranks, []

    def collect():  # while the ranks run: a result larger than the pipe's buffer blocks its rank until read
        while not results.empty():
            rank, value = results.get()
            if isinstance(value, _Raised):
                raised.append((rank, value.text))
            else:
                out[rank] = value

    with fork_server(fn) as method:
        results = mp.get_context(method).SimpleQueue()
        ranks = mp.start_processes(_child, args=(fn, nranks, free_port(), backend, timeout, results, args, share_gpu),
                                   nprocs=nranks, join=False, start_method=method)
        try:
            while not ranks.join(timeout=0.05):
                collect()
        except mp.ProcessRaisedException as e:  # torch names the lowest rank that ended, often a peer
            collect()                           # that failed of the first one's going: name the first
            if not raised:
                raise
            raise _first_raised(raised, ranks) from e
    collect()
    if raised:  # a KeyboardInterrupt, which torch's spawn takes for its own stop: the rank ended with 0
        raise _first_raised(raised, ranks)
    return out


def _first_raised(raised: list, ranks) -> mp.ProcessRaisedException:
    """The error of the rank that raised first, as torch's spawn names a rank's, with its traceback."""
    rank, text = raised[0]
    return mp.ProcessRaisedException(f"rank {rank} raised first:\n\n{text}", rank, ranks.processes[rank].pid)
