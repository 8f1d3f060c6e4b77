"""A long-lived pool of gloo ranks for multi-process tests (importing torch costs seconds per process).

``Pool(4)`` starts four spawned processes once; each joins a gloo world of 4 and
a sub-group of ranks {0, 1}. ``pool.run(fn, *args)`` runs ``fn(rank, groups, *args)``
on every rank, where ``groups`` maps a world size (2 or 4) to the process group to
use, and returns each rank's return value, or the exception it raised. A task that
does not finish within its timeout kills the pool (the next run starts a new one)
and fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import sys
import time

import torch.multiprocessing as mp

from zipccl.launch import fork_server, free_port


class UserCodec:
    """A user's exact codec as the Codec protocol asks for it (encode, decode,
    max_encoded_size; plain bytes through zipccl's Raw), with no repr of its own: Python's
    default names an address, another in every process. ``name``: its name, or (None) none."""
    exact = True

    def __init__(self, name: str | None = "user-plain"):
        from zipccl.codecs import Raw
        self.raw = Raw()
        if name is not None:
            self.name = name

    def encode(self, x):
        return self.raw.encode(x)

    def decode(self, packet, out=None):
        return self.raw.decode(packet, out)

    def max_encoded_size(self, numel, dtype):
        return self.raw.max_encoded_size(numel, dtype)


@contextlib.contextmanager
def environ(**values: str):
    """The environment variables ``values`` set (None: unset) for the block, then as they were;
    zipccl's settings read again after, as a drop-in group's making would read them."""
    from zipccl import config

    def put(settings: dict) -> None:
        for k, v in settings.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    old = {k: os.environ.get(k) for k in values}
    try:
        put(values)
        yield
    finally:
        put(old)
        config.refresh()


def _serve(rank: int, nranks: int, port: int, tasks, results, backend: str, more_groups) -> None:
    import torch
    import torch.distributed as dist
    import zipccl  # noqa: F401 - registers the "zipccl" backend
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=nranks, timeout=datetime.timedelta(seconds=60))
    groups = {nranks: dist.group.WORLD, 2: dist.new_group([0, 1])}
    if more_groups is not None:
        groups.update(more_groups(nranks))
    results.put((rank, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            value = fn(rank, groups, *args)
        except BaseException as e:  # returned to the test, which asserts on it
            value = e
        results.put((rank, value))
    dist.destroy_process_group()


class Pool:
    """``backend``: the world's; ``more_groups(nranks)``: an importable function that every rank
    calls after the default groups are made, returning more named groups."""

    def __init__(self, nranks: int = 4, start_timeout: float = 120.0, backend: str = "gloo", more_groups=None):
        ctx = mp.get_context("spawn")
        self.nranks = nranks
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(nranks)]
        port = free_port()
        self.procs = [ctx.Process(target=_serve, daemon=True,
                                  args=(r, nranks, port, self.tasks[r], self.results, backend, more_groups))
                      for r in range(nranks)]
        for p in self.procs:
            p.start()
        self._collect(start_timeout)

    def _collect(self, timeout: float) -> list:
        """Every rank's answer; a rank that died (a segfault) or the deadline kills the pool and
        fails the test, a dead rank within a second (the queue is polled, not waited on)."""
        out, deadline = {}, time.monotonic() + timeout
        while len(out) < self.nranks:
            try:
                rank, value = self.results.get(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
                if time.monotonic() >= deadline or dead:
                    self.close(kill=True)
                    raise TimeoutError(f"ranks {sorted(set(range(self.nranks)) - set(out))} did not answer "
                                       f"(limit {timeout:.0f} s; dead, with exit codes: {dead})") from None
                continue
            out[rank] = value
        return [out[r] for r in range(self.nranks)]

    def run(self, fn, *args, timeout: float = 60.0) -> list:
        """Every rank's ``fn(rank, groups, *args)``, or what it raised. A run that broke the groups
        (a RankFailure with ``broken``) ends the pool, so the tests after it start on a new one
        instead of failing on its lost connections."""
        for q in self.tasks:
            q.put((fn, args))
        values = self._collect(timeout)
        if any(getattr(v, "broken", False) for v in values):
            self.close(kill=True)
        return values

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks):
            if kill:
                p.kill()
            elif p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


class Restarting:
    """A pool made on first use, and made again once a test ended it (a rank died, or a run broke
    its groups): ``pools()`` is the live one. ``make()``: a new Pool."""

    def __init__(self, make):
        self.make, self.pool = make, None

    def __call__(self) -> Pool:
        if self.pool is None or not self.pool.alive:
            self.pool = self.make()
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def spawn(target, n: int, args: tuple, answers: int | None = None, seconds: float = 180,
          stop_on_crash: bool = False) -> tuple[dict, list]:
    """Fresh processes for tests a pool cannot host (a rank that dies, one world per test): start
    ``target(rank, *args, results)`` on n spawned processes and collect their ``(rank, value)``
    until ``answers`` ranks (default: all) have answered or ``seconds`` have passed
    (``stop_on_crash``: or a process has exited with an error); then join each for up to 30 s and
    kill what still lives (the ranks that never answered, stopped ones, get 1 s together). Returns
    ({rank: value}, the processes): a rank that hung is missing. The processes fork from a
    fork server that has torch imported (zipccl.launch.fork_server). Inside a step of
    bench/gpu_check.sh (ZIPCCL_STEP_END: when the step is killed, in seconds since the epoch) the
    collecting ends 7 s before that and the joins 3 s before, so that the test still says which
    ranks answered (pytest's report takes about a second)."""
    end = float(os.environ.get("ZIPCCL_STEP_END") or "inf") - time.time() + time.monotonic() - 3
    with fork_server(target) as method:
        return _run(mp.get_context(method), target, n, args, answers, seconds, stop_on_crash, end)


def _run(ctx, target, n, args, answers, seconds, stop_on_crash, end=float("inf")) -> tuple[dict, list]:
    """``end``: the monotonic time by which the joins end too."""
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, results)) for r in range(n)]
    for p in procs:
        p.start()
    got, deadline, wanted = {}, min(time.monotonic() + seconds, end - 4), n if answers is None else answers
    try:
        while len(got) < wanted and time.monotonic() < deadline:
            try:
                rank, value = results.get(timeout=1)
                got[rank] = value
            except queue.Empty:
                if stop_on_crash and any(p.exitcode not in (None, 0) for p in procs):
                    break
        while time.monotonic() >= deadline and len(got) < n:  # what came at the deadline
            try:
                rank, value = results.get(timeout=0.1)
                got[rank] = value
            except queue.Empty:
                break
        if len(got) < wanted and deadline == end - 4 and time.monotonic() >= deadline:
            print(f"# tests/workers.py: the gpu_check.sh step's time ran out (ZIPCCL_STEP_END) before ranks "
                  f"{sorted(set(range(n)) - set(got))} answered", file=sys.stderr, flush=True)
        grace = time.monotonic() + 1  # for the ranks that never answered, together
        for r, p in enumerate(procs):
            p.join(timeout=max(0.1, min(30 if r in got else grace - time.monotonic(), end - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return got, procs


def join_gpu_world(rank: int, n: int, port: int, timeout: float = 120.0) -> int:
    """For a process of ``spawn``: this rank's GPU (cuda:rank where the machine has n GPUs, else
    the one-GPU lab's cuda:0, each rank its own NCCL host: zipccl.launch.use_gpu), then a gloo
    world of n on ``port``. Returns the device index. The ranks share the machine's cores (each
    computes plain torch's reference on the CPU too). Inside a step of bench/gpu_check.sh, a rank
    still running 9 s before the step ends prints every thread's stack (a hang says where)."""
    import datetime
    import faulthandler

    import torch
    import torch.distributed as dist

    from zipccl import launch
    if step_end := os.environ.get("ZIPCCL_STEP_END"):
        faulthandler.dump_traceback_later(max(1.0, float(step_end) - time.time() - 9), exit=False)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    os.environ["TRITON_INTERPRET"] = "0"  # the compiled kernels: the interpreter is the test process's, for CPU tensors
    device = launch.use_gpu(rank, rank, share_gpu=torch.cuda.device_count() < n)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=timeout))
    return device
