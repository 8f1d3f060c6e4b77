"""Where one collective call's host time goes: each rank's wall time per warm call, and rank 0's
cProfile table over the same calls.

    python bench/call_profile.py [--device cpu|cuda] [--nranks 2] [--size 64K] [--codec lossless]
                                 [--collective all_reduce] [--calls 20] [--rows 30]

On CUDA, the one-GPU lab (every rank on cuda:0, each its own NCCL host: ``launch.spawn(...,
share_gpu=True)``), the calls on a torch.distributed group of backend nccl, as zipccl-perf's;
on CPU, gloo. A fixed cost per call (a small lossless all-reduce took 11 ms in the lab, raw 3.9,
NCCL 0.4) shows here as the functions that take it: host waits, launches, bookkeeping.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

import zipccl
from zipccl import launch
from zipccl.bench.common import parse_size

CALLS = {"all_reduce": lambda x, g, codec: zipccl.all_reduce(x, group=g, codec=codec),
         "reduce_scatter": lambda x, g, codec: zipccl.reduce_scatter(
             torch.empty(x.numel() // g.size(), dtype=x.dtype, device=x.device), list(x.chunk(g.size())), group=g,
             codec=codec),
         "all_gather": lambda x, g, codec: zipccl.all_gather(
             [torch.empty_like(x) for _ in range(g.size())], x, group=g, codec=codec)}


def _rank(rank: int, nranks: int, device: str, numel: int, codec: str, collective: str, calls: int,
          rows: int) -> dict:
    cuda = device == "cuda"
    group = dist.new_group(backend="nccl") if cuda else dist.group.WORLD
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 0.02).to(torch.bfloat16)
    x = x.to(f"cuda:{torch.cuda.current_device()}") if cuda else x
    call = CALLS[collective]

    def one():
        call(x.clone(), group, codec)
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):  # warm: kernels compiled, communicators made, auto's learning
        one()
    dist.barrier()
    walls = []
    for _ in range(calls):
        t = time.perf_counter()
        one()
        walls.append(time.perf_counter() - t)
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        one()
    prof.disable()
    text = ""
    if rank == 0:
        for key in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(rows)
            text += f"# rank 0, {calls} calls under cProfile, by {key} (seconds in all):\n"
            text += out.getvalue().split("\n", 4)[-1].strip("\n") + "\n"
    return {"median_ms": statistics.median(walls) * 1e3, "profile": text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--size", default="64K", help="bytes per rank's input (bf16), e.g. 64K, 1M")
    ap.add_argument("--codec", default="lossless")
    ap.add_argument("--collective", choices=sorted(CALLS), default="all_reduce")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    numel = parse_size(args.size) // 2
    if numel % args.nranks:
        ap.error(f"--size must hold a multiple of --nranks bf16 elements, not {numel}")
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    results = launch.spawn(_rank, args.nranks, args.device, numel, args.codec, args.collective, args.calls,
                           args.rows, share_gpu=cuda)
    where = torch.cuda.get_device_name() if cuda else "CPU, gloo"
    print(f"# {args.collective} of {args.size} bf16, codec {args.codec}, {args.nranks} ranks ({where}); "
          f"{time.perf_counter() - t0:.1f} s in all")
    for rank, r in enumerate(results):
        print(f"# rank {rank}: median {r['median_ms']:.3f} ms per call (synchronised, no profiler)")
    print(results[0]["profile"], end="")


if __name__ == "__main__":
    main()
