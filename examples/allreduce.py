"""Compressed all-reduce in a few lines.

    python examples/allreduce.py --nranks 4                    # local ranks over gloo
    torchrun --nproc-per-node 2 examples/allreduce.py
    mpirun -np 4 python examples/allreduce.py
"""

import argparse
import hashlib

import torch
import torch.distributed as dist

import zipccl
from zipccl import launch


def main(rank: int, world: int) -> float:
    g = torch.Generator().manual_seed(rank)
    grad = (torch.randn(1 << 20, generator=g) * 0.01).to(torch.bfloat16)  # a 2 MB bf16 "gradient"
    plain = grad.clone()
    dist.all_reduce(plain)                                # what torch.distributed sends
    zipccl.all_reduce(grad, codec="lossless")             # the drop-in replacement
    s = zipccl.stats()["total"]
    diff = (grad.float() - plain.float()).abs().max().item()
    if rank == 0:
        print(f"{world} ranks: sent {s['wire_bytes'] / 1e6:.2f} MB instead of {s['raw_bytes'] / 1e6:.2f} MB "
              f"(ratio {s['ratio']:.3f}); max |zipccl - torch.distributed| = {diff:.3g}", flush=True)
    # the result's fingerprint, the same on every rank (zipccl's sum is in rank order, fp32, rounded once)
    print(f"rank {rank}: result sha256 {hashlib.sha256(grad.view(torch.int16).numpy().tobytes()).hexdigest()[:16]}",
          flush=True)
    return diff


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nranks", type=int, default=4, help="local ranks when started without a launcher")
    args = ap.parse_args()
    if launch.detect():
        world = launch.init()
        main(world.rank, world.size)
        launch.shutdown()
    else:
        launch.spawn(main, args.nranks)
