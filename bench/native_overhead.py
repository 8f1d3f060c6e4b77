"""What zipccl adds to a call that runs the group's own collective: host time per call, alternating.

    python bench/native_overhead.py [--ranks 4] [--device cpu|cuda] [--calls 3000] [--collectives C,...] [--json FILE]
    torchrun --nproc-per-node 4 bench/native_overhead.py ...    # or under mpirun

For each collective (all-reduce, reduce-scatter, all-gather, all-to-all, and a ring of
send/recv in one batch_isend_irecv) of 1 element per rank and peer, every rank
alternates one call of the plain torch.distributed collective (A) and one call of a zipccl
variant (B), ``--calls`` pairs each, timing every call on the host (``time.perf_counter_ns``
around it, or with ``--clock cpu`` the calling thread's CPU time in it, which other processes on
the cores do not inflate): so the host's drift and the other ranks' scheduling fall on both alike. The
variants: ``zipccl.<collective>`` with codec "auto" (the default) and with codec "native", on
the group; and the drop-in backend, ``dist.<collective>`` on a group of backend "zipccl" against
the same call on a group of the plain backend over the same ranks. A row gives both medians
(microseconds) and the extra host time: the median of the paired differences B - A, the
slowest rank's. On CPU the ranks run gloo over loopback, where a call's host time is the whole
call; on CUDA (``--device cuda``, NCCL; several ranks share one GPU where there are fewer GPUs
than ranks, as in the one-GPU lab) a call returns once its work is queued, and that queueing is
what is timed (the device is synchronised every 100 calls, outside the times).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zipccl
from zipccl import launch
from zipccl.torch_compat import all_gather_single, reduce_scatter_single

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "sendrecv")
#: wall: the time from call to return; cpu: the calling thread's CPU time in it, which the other
#: processes sharing the cores do not inflate (a call that waits for its peers sleeps).
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
#: The extra host time a native call should stay within (docs/PERFORMANCE.md shows where it does not), us.
BOUND_US = 15.0


def _pairs(name: str, group, plain_group, zipccl_group, device: torch.device) -> dict:
    """{variant: (A, B)} for ``name`` on 1 element per rank: A the plain collective, B zipccl's."""
    n = dist.get_world_size(group)
    x = torch.ones(1, dtype=torch.bfloat16, device=device)
    many = torch.ones(n, dtype=torch.bfloat16, device=device)
    if name == "all_reduce":
        plain = lambda g: dist.all_reduce(x, group=g)  # noqa: E731
        ours = lambda **kw: zipccl.all_reduce(x, group=group, **kw)  # noqa: E731
    elif name == "reduce_scatter":
        plain = lambda g: reduce_scatter_single(x, many, group=g)  # noqa: E731
        ours = lambda **kw: zipccl.reduce_scatter(x, many, group=group, **kw)  # noqa: E731
    elif name == "all_gather":
        plain = lambda g: all_gather_single(many, x, group=g)  # noqa: E731
        ours = lambda **kw: zipccl.all_gather(many, x, group=group, **kw)  # noqa: E731
    elif name == "all_to_all":
        out = torch.empty_like(many)
        plain = lambda g: dist.all_to_all_single(out, many, group=g)  # noqa: E731
        ours = lambda **kw: zipccl.all_to_all_single(out, many, group=group, **kw)  # noqa: E731
    else:  # a ring shift: each rank sends to the next and receives from the previous, in one batch
        me, out = dist.get_rank(group), torch.empty_like(x)

        def plain(g):
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, group=g, group_peer=(me + 1) % n),
                                             dist.P2POp(dist.irecv, out, group=g, group_peer=(me - 1) % n)]):
                w.wait()

        def ours(**kw):
            ops = [zipccl.P2POp(zipccl.isend, x, group=group, group_peer=(me + 1) % n, **kw),
                   zipccl.P2POp(zipccl.irecv, out, group=group, group_peer=(me - 1) % n, **kw)]
            for w in zipccl.batch_isend_irecv(ops):
                w.wait()
    return {"zipccl auto": (lambda: plain(group), lambda: ours()),
            "zipccl native": (lambda: plain(group), lambda: ours(codec="native")),
            "drop-in": (lambda: plain(plain_group), lambda: plain(zipccl_group))}


def _time(a, b, calls: int, cuda: bool, clock) -> tuple[list[int], list[int]]:
    """``clock`` nanoseconds of ``calls`` calls of each, alternating a, b (b first every other pair)."""
    ta, tb = [], []
    for k in range(calls):
        if cuda and k % 100 == 0:
            torch.cuda.synchronize()
        first, second, out1, out2 = (a, b, ta, tb) if k % 2 == 0 else (b, a, tb, ta)
        t0 = clock()
        first()
        t1 = clock()
        second()
        t2 = clock()
        out1.append(t1 - t0)
        out2.append(t2 - t1)
    if cuda:
        torch.cuda.synchronize()
    return ta, tb


def _rank(rank: int, nranks: int, args) -> list[dict]:
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    backend = "nccl" if args.device == "cuda" else "gloo"
    ranks = list(range(nranks))
    plain_group = dist.new_group(ranks, backend=backend)
    zipccl_group = dist.new_group(ranks, backend="zipccl")
    rows = []
    for name in args.collectives:
        for variant, (a, b) in _pairs(name, None, plain_group, zipccl_group, device).items():
            _time(a, b, args.warmup, device.type == "cuda", CLOCKS[args.clock])  # connections, caches
            dist.barrier()
            ta, tb = _time(a, b, args.calls, device.type == "cuda", CLOCKS[args.clock])
            extra = statistics.median(y - x for x, y in zip(ta, tb)) / 1e3
            mine = torch.tensor([statistics.median(ta) / 1e3, statistics.median(tb) / 1e3, extra],
                                dtype=torch.float64, device=device)
            every = [torch.zeros_like(mine) for _ in range(nranks)]
            dist.all_gather(every, mine)
            every = [t.cpu() for t in every]
            slowest = max(every, key=lambda t: float(t[2]))
            rows.append(dict(collective=name, variant=variant, plain_us=float(slowest[0]), zipccl_us=float(slowest[1]),
                             extra_us=float(slowest[2]), extra_us_by_rank=[float(t[2]) for t in every]))
            if rank == 0:
                r = rows[-1]
                print(f"{name:15s} {variant:14s} {r['plain_us']:10.1f} {r['zipccl_us']:10.1f} {r['extra_us']:9.1f}"
                      f"  {'ok' if r['extra_us'] <= BOUND_US else 'ABOVE ' + str(BOUND_US)}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="local ranks to spawn (not under a launcher; default 4)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--calls", type=int, default=3000, help="timed pairs per row (default 3000)")
    ap.add_argument("--warmup", type=int, default=200, help="untimed pairs per row first (default 200)")
    ap.add_argument("--clock", default="wall", choices=list(CLOCKS),
                    help="wall: call to return (default); cpu: the calling thread's CPU time in the call")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES), type=lambda v: v.split(","),
                    help=f"comma-separated, of {','.join(COLLECTIVES)} (default all)")
    ap.add_argument("--json", type=Path, help="write the rows and the run's facts here")
    args = ap.parse_args()
    if set(args.collectives) - set(COLLECTIVES):
        ap.error(f"--collectives: unknown {sorted(set(args.collectives) - set(COLLECTIVES))}; use {COLLECTIVES}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch finds no CUDA device here")
    world = launch.detect()
    if (world.size if world else args.ranks) < 2 and {"all_to_all", "sendrecv"} & set(args.collectives):
        ap.error("all_to_all and sendrecv need 2 ranks or more: pick --collectives all_reduce,reduce_scatter,all_gather")
    print(f"# native_overhead: {args.device}, {world.size if world else args.ranks} ranks, {args.calls} pairs a row; "
          f"host microseconds per call ({args.clock} clock), medians; extra = median of (zipccl - plain), the "
          f"slowest rank's", flush=True)
    print(f"{'collective':15s} {'variant':14s} {'plain us':>10s} {'zipccl us':>10s} {'extra us':>9s}", flush=True)
    if world is not None:  # under torchrun or mpirun: this process is one rank
        launch.init("nccl" if args.device == "cuda" else "gloo")
        rows = _rank(world.rank, world.size, args)
        launch.shutdown()
        if world.rank:
            return 0
        nranks = world.size
    else:
        share = args.device == "cuda" and torch.cuda.device_count() < args.ranks
        out = launch.spawn(_rank, args.ranks, args, backend="nccl" if args.device == "cuda" else "gloo",
                           share_gpu=share)
        rows, nranks = out[0], args.ranks
    worst = max(r["extra_us"] for r in rows)
    print(f"# worst extra: {worst:.1f} us (bound {BOUND_US:g} us)", flush=True)
    if args.json:
        facts = dict(device=args.device, ranks=nranks, calls=args.calls, clock=args.clock, torch=torch.__version__,
                     zipccl=zipccl.__version__, host=os.uname().nodename, cpus=os.cpu_count(), python=sys.version.split()[0],
                     date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        if args.device == "cuda":
            facts["gpu"] = torch.cuda.get_device_name()
        args.json.write_text(json.dumps(dict(facts, bound_us=BOUND_US, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
