"""CPU time per rank of one all-reduce: plain gloo, zipccl raw and zipccl lossless.

    python bench/collective_cpu.py [--nranks 4] [--numel 33554432] [--iters 4]

On a machine with fewer cores than ranks, a collective cannot be faster than the
sum of its ranks' CPU time divided by the cores, whatever the link; this says how
large that sum is for each path (``time.process_time``: every thread of the rank,
gloo's included, user and system). Ranks run over loopback gloo on real bf16
gradients, tiled to size and scaled per rank.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zipccl

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "grads_step050_bucket0_fp32.npy"
PATHS = ("gloo", "raw", "lossless")


def _rank(rank: int, n: int, numel: int, iters: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    base = np.load(DATA).ravel() if DATA.exists() else np.random.default_rng(0).normal(0, 1e-3, 1 << 20)
    x = torch.from_numpy(np.resize(base, numel).astype(np.float32)).mul_(1 + 0.01 * rank).to(torch.bfloat16)
    y = torch.empty_like(x)
    for path in PATHS:
        run = (lambda: dist.all_reduce(y)) if path == "gloo" else (lambda: zipccl.all_reduce(y, codec=path))
        y.copy_(x)
        run()  # warm-up: JIT, connections, allocator
        dist.barrier()
        cpu = wall = 0.0
        for _ in range(iters):
            y.copy_(x)
            c0, w0 = time.process_time(), time.perf_counter()
            run()
            cpu += time.process_time() - c0
            wall += time.perf_counter() - w0
        results.put((path, rank, cpu / iters, wall / iters))
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nranks", type=int, default=4)
    ap.add_argument("--numel", type=int, default=32 << 20, help="bf16 elements (default 64 MiB)")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--port", type=int, default=29571)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_rank, args=(a.nranks, a.numel, a.iters, a.port, results), nprocs=a.nranks,
                       start_method="spawn")
    rows = [results.get() for _ in range(a.nranks * len(PATHS))]
    print(f"# all-reduce of {a.numel * 2 / 2**20:.1f} MiB bf16, {a.nranks} ranks on {os.cpu_count()} cores, "
          f"mean of {a.iters} calls")
    print(f"{'path':<9} {'CPU ms/rank':>12} {'wall ms':>9} {'CPU of all ranks / cores, ms':>29}")
    for path in PATHS:
        mine = [r for r in rows if r[0] == path]
        cpu = sum(r[2] for r in mine) / len(mine)
        wall = max(r[3] for r in mine)
        print(f"{path:<9} {cpu * 1e3:12.1f} {wall * 1e3:9.1f} {cpu * a.nranks / os.cpu_count() * 1e3:29.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
