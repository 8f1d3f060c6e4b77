"""How much of the lossless all-reduce's time on the 1 Gbit/s lab is the codec's CPU.

    python bench/transport_bound.py [--reps 12] [--data FILE] [--json FILE]   # root: builds the lab

Four ranks in the lab, 64 MiB of bf16 gradients each; calls alternate, one of each
per round, so that the machine's load falls on all three alike:
- gloo: ``torch.distributed.all_reduce``;
- lossless: ``zipccl.all_reduce(codec="lossless")``;
- free codec: the same pipeline, messages and bytes on the wire, with a stand-in codec
  whose packets are a prefix of the input as long as the lossless packet (a memcpy
  to encode and to decode, results not meaningful). It is what lossless would take
  if coding cost nothing: a GPU codec at hundreds of GB/s, or a core of its own.

Each call's time is the slowest rank's; the table gives the median over rounds.
On these machines four ranks share two cores, so the codec's work competes with
the other ranks' and with the kernel's networking.
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
from zipccl.bench.common import DEFAULT_DATA, load_data, real
from zipccl.bench.netlab import NetLab, worst
from zipccl.codecs import Lossless

NUMEL = 32 << 20  # bf16 elements per rank: 64 MiB


class FreeCodec:
    """Packets of ``ratio`` times the input's bytes, copied from its prefix; decoding copies
    them back. Same sizes and the same pipeline as a real codec, no coding work."""
    name = "free"
    exact = True

    def __init__(self, ratio: float):
        self.ratio = ratio

    def encode(self, x):
        data = x.reshape(-1).view(torch.uint8)
        return data[:max(1, int(data.numel() * self.ratio))].clone()

    def decode(self, packet, out=None):
        out.view(-1).view(torch.uint8)[:packet.numel()].copy_(packet)
        return out

    def max_encoded_size(self, numel: int, dtype) -> int:
        return numel * dtype.itemsize + 64


def measure(x: torch.Tensor, reps: int) -> tuple[float, dict]:
    """(lossless wire ratio, {path: [slowest rank's seconds per round]}) of the all-reduce of
    ``x`` on the default group, the three paths alternating; every rank calls it."""
    ratio = torch.tensor([Lossless().encode(x).numel() / (x.numel() * x.element_size())])
    dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
    free = FreeCodec(float(ratio))
    runs = {"gloo": lambda y: dist.all_reduce(y),
            "lossless": lambda y: zipccl.all_reduce(y, codec="lossless"),
            "free codec": lambda y: zipccl.all_reduce(y, codec=free)}
    times = {name: [] for name in runs}
    y = torch.empty_like(x)
    first = None
    for k in range(reps + 1):  # round 0 warms up
        for name, run in runs.items():
            y.copy_(x)
            dist.barrier()
            t0 = time.perf_counter()
            run(y)
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if k:
                times[name].append(float(t))
            if name == "lossless":  # the same bits every round
                if first is None:
                    first = y.clone()
                elif not torch.equal(first.view(torch.int16), y.view(torch.int16)):
                    raise RuntimeError(f"rank {dist.get_rank()}: the lossless all-reduce changed its result")
        if dist.get_rank() == 0:
            print(f"# round {k}/{reps}", file=sys.stderr, flush=True)
    return float(ratio), times


def rank_main(args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    x = real(load_data(Path(args.data)), NUMEL, torch.bfloat16, dist.get_rank())
    ratio, times = measure(x, args.reps)
    if dist.get_rank() == 0:
        base = statistics.median(times["gloo"])
        print(f"# 4 ranks, 64 MiB bf16 all-reduce, {args.reps} rounds; lossless wire ratio {ratio:.4f}")
        print(f"{'':<12} {'median':>9} {'quartiles':>17} {'vs gloo':>8}")
        rows = []
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=4)
            med = statistics.median(ts)
            print(f"{name:<12} {med * 1e3:7.1f} ms {q[0] * 1e3:7.1f}-{q[2] * 1e3:<7.1f}  {base / med:7.2f}x")
            rows.append(dict(name=name, median_s=med, quartiles_s=[q[0], q[2]], times_s=ts, speedup=base / med))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(ratio=ratio, reps=args.reps, rows=rows), f, indent=1)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=12, help="rounds after the warm-up (default 12)")
    ap.add_argument("--data", default=DEFAULT_DATA, help="real tensor (.npy/.pt) tiled to 64 MiB per rank")
    ap.add_argument("--json", help="write the times here")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reps < 2:
        ap.error("--reps must be at least 2")
    if args.rank:
        rank_main(args)
        return 0
    if not os.path.exists(args.data):
        ap.error(f"no data file {args.data}")
    argv = [sys.executable, os.path.abspath(__file__), "--rank", "--reps", str(args.reps),
            "--data", os.path.abspath(args.data)] + (["--json", os.path.abspath(args.json)] if args.json else [])
    with NetLab(4, "1gbit") as lab:
        codes = lab.run_ranks(argv, timeout=600 + 10 * args.reps)
    return worst(codes)


if __name__ == "__main__":
    raise SystemExit(main())
