"""Groups destroyed and worlds made again in one process (zipccl.lifetime): a second world works as
the first did, and what zipccl made for a destroyed group goes with it. Fresh ranks per test:
each makes and destroys worlds of its own."""

import datetime
import gc
import os

import pytest
import torch

from workers import spawn
from zipccl.launch import free_port

N = 3


def _init(rank: int, port: int):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=N, timeout=datetime.timedelta(seconds=60))


def _message(tag: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(tag)
    return (torch.randn(1 << 20, generator=g) * 0.01).to(torch.bfloat16)  # 2 MiB: framed, not sent natively


def _rank(rank: int, body, args: tuple, results):
    """Run ``body(rank, *args)`` on this spawned rank (zipccl's waits bounded at 10 s) and answer
    its value or its error; then leave the world it made."""
    import torch.distributed as dist

    from zipccl import config
    config.TIMEOUT = 10.0
    try:
        results.put((rank, body(rank, *args)))
    except BaseException as e:  # noqa: BLE001 - the test asserts on it
        results.put((rank, repr(e)))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _worlds(rank: int, ports):
    """World 1: rank 0 sends to rank 1 (auto, then lossless). World 2: rank 0 sends to rank 2 (a
    pair the first world never formed, whose first message reads rank 0's node from the new
    world's store), and every rank all-reduces losslessly."""
    import torch.distributed as dist

    import zipccl

    def messages(dst: int, tag: int):
        x = _message(tag)
        for codec in ("auto", "lossless"):
            if rank == 0:
                zipccl.send(x, dst, codec=codec)
            elif rank == dst:
                got = torch.empty_like(x)
                zipccl.recv(got, 0, codec=codec)
                assert torch.equal(got.view(torch.int16), x.view(torch.int16)), codec

    _init(rank, ports[0])
    messages(1, 1)
    dist.barrier()
    dist.destroy_process_group()
    _init(rank, ports[1])
    messages(2, 2)
    t = _message(10 + rank)
    want = sum(_message(10 + r).float() for r in range(N)).to(torch.bfloat16)  # rank order, fp32, rounded once
    zipccl.all_reduce(t, codec="lossless")
    assert torch.equal(t.view(torch.int16), want.view(torch.int16))
    return "ok"


@pytest.mark.timeout(120)
def test_a_second_world_in_the_same_processes_works_as_the_first():
    got, _ = spawn(_rank, N, (_worlds, ((free_port(), free_port()),)), seconds=90)
    assert got == {r: "ok" for r in range(N)}, got


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _subgroups(rank: int, port: int, cycles: int):
    """Make a group of every rank, all-reduce on it losslessly (zipccl makes its second gloo group
    and its transport), destroy it: ``cycles`` times. Then torch holds as many groups as before
    and this rank as many open files, give or take a few."""
    import torch.distributed as dist

    import zipccl
    _init(rank, port)
    c10d = dist.distributed_c10d

    def cycle():
        g = dist.new_group(list(range(N)))
        t = _message(20 + rank)
        want = sum(_message(20 + r).float() for r in range(N)).to(torch.bfloat16)
        zipccl.all_reduce(t, group=g, codec="lossless")
        assert torch.equal(t.view(torch.int16), want.view(torch.int16))
        dist.barrier()
        dist.destroy_process_group(g)
        gc.collect()

    cycle()  # the world's own first-call state made once
    groups, files = len(c10d._world.pg_map), _open_files()
    for _ in range(cycles):
        cycle()
    from zipccl.transport import torch_dist
    held = [k for k in torch_dist._transports if (k[0] if isinstance(k, tuple) else k) not in c10d._world.pg_map]
    return len(c10d._world.pg_map) - groups, _open_files() - files, len(held)


@pytest.mark.timeout(120)
def test_a_destroyed_group_takes_what_zipccl_made_for_it():
    """Each cycle used to leave two groups with torch (the destroyed group's second gloo group) and
    about ten open files per rank; the last destroyed group's transport (its second gloo group,
    its sockets) was held until the next call that zipccl had not seen before."""
    got, _ = spawn(_rank, N, (_subgroups, (free_port(), 6)), seconds=90)
    assert sorted(got) == list(range(N)), got
    for rank, value in got.items():
        assert isinstance(value, tuple), (rank, value)
        groups, files, held = value
        assert groups == 0 and files < 5 and held == 0, (rank, groups, files, held)


def _threads(rank: int, port: int, warm: bool):
    """Two groups of every rank, each all-reduced by a thread of its own, both threads at once;
    ``warm``: their groups made first, in one order (zipccl.make_groups)."""
    import threading

    import torch.distributed as dist

    import zipccl
    _init(rank, port)
    groups = [dist.new_group(list(range(N))) for _ in range(2)]
    if warm:
        for g in groups:
            zipccl.make_groups(g, "lossless")
    sizes = [300_000 + 1000 * i for i in range(2)]  # a crossed pair of groups would mismatch the sizes
    out, start = [None, None], threading.Barrier(2)

    def run(i):
        try:
            t = torch.full((sizes[i],), float(rank + 1))
            start.wait()
            zipccl.all_reduce(t, group=groups[i], codec="lossless")
            out[i] = bool(torch.equal(t, torch.full_like(t, float(sum(range(1, N + 1))))))
        except BaseException as e:  # noqa: BLE001
            out[i] = repr(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.timeout(120)
def test_groups_made_first_let_two_threads_make_their_first_calls_at_once():
    got, _ = spawn(_rank, N, (_threads, (free_port(), True)), seconds=60)
    assert got == {r: [True, True] for r in range(N)}, got


def _destroy_midflight(rank: int, ports):
    """Three async lossless all-reduces, then the world destroyed without waiting for them (rank 1
    half a second later) and made again: the old calls end with their sums, on the world they
    were issued on, and the new world's first call works."""
    import time

    import torch.distributed as dist

    import zipccl
    _init(rank, ports[0])
    zipccl.all_reduce(torch.ones(1000), codec="lossless")
    xs = [torch.full((1 << 21,), float(rank + 1 + i)) for i in range(3)]
    handles = [zipccl.all_reduce(x, async_op=True, codec="lossless") for x in xs]
    time.sleep(0.5 * rank)
    dist.destroy_process_group()
    done = [h.is_completed() for h in handles]
    _init(rank, ports[1])
    y = torch.full((1000,), float(rank + 1))
    zipccl.all_reduce(y, codec="lossless")
    for h in handles:
        h.wait()
    sums = [float(sum(r + 1 + i for r in range(N))) for i in range(3)]
    return done, bool(torch.equal(y, torch.full_like(y, float(sum(range(1, N + 1)))))), \
        [bool(torch.equal(x, torch.full_like(x, s))) for x, s in zip(xs, sums)]


@pytest.mark.timeout(120)
def test_destroy_waits_for_the_async_calls_issued_before_it():
    """Before, a call still queued at the destroy ran on no world, or on the next one, and the
    new world's first call failed on every rank after zipccl's timeout."""
    got, _ = spawn(_rank, N, (_destroy_midflight, ((free_port(), free_port()),)), seconds=90)
    assert got == {r: ([True] * 3, True, [True] * 3) for r in range(N)}, got


_EXIT_MIDFLIGHT = """
import atexit, datetime, os, time
import torch, torch.distributed as dist
import zipccl
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
zipccl.all_reduce(torch.ones(1000), codec="lossless")
xs = [torch.full((1 << 21,), float(rank + 1 + i)) for i in range(4)]

def check():  # registered before zipccl's own exit handler, so it runs after it
    sums = [float(3 + 2 * i) for i in range(4)]
    ok = all(h.is_completed() for h in handles) and all(torch.equal(x, torch.full_like(x, s)) for x, s in zip(xs, sums))
    late = torch.full((1 << 20,), 1.0)  # an async call after zipccl's exit handler, with a slow callback
    handle = zipccl.all_reduce(late, async_op=True, codec="lossless")
    handle.get_future().add_done_callback(lambda f: time.sleep(0.5))
    handle.wait()
    ok = ok and torch.equal(late, torch.full_like(late, 2.0))
    print("ended with its sums" if ok else "lost", flush=True)

atexit.register(check)
handles = [zipccl.all_reduce(x, async_op=True, codec="lossless") for x in xs]
handles[-1].get_future().add_done_callback(lambda f: time.sleep(0.5))  # a slow callback, on zipccl's thread
time.sleep(0.3 * rank)
"""


@pytest.mark.timeout(120)
def test_a_process_that_exits_with_async_calls_running_ends_them_and_exits_cleanly(tmp_path):
    """A script that returns with async calls still running (no wait, no destroy): the interpreter's
    exit waits for them and ends zipccl's threads first. Before, the thread still inside gloo's
    C++ code when the interpreter finalized aborted the process ("terminate called without an
    active exception"): also one that ran a callback of the last handle's future, done already,
    and one that an exit handler's later async call started."""
    import subprocess
    import sys
    script = tmp_path / "exit_midflight.py"
    script.write_text(_EXIT_MIDFLIGHT)
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "ended with its sums" in out, (p.returncode, out[-2000:])
