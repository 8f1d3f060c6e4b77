"""The drop-in backend: plain torch.distributed code, one word changed.

    ZIPCCL_CODEC=lossless python examples/dropin.py --nranks 4      # local ranks
    ZIPCCL_CODEC=lossless torchrun --nproc-per-node 2 examples/dropin.py
    mpirun -np 4 -x ZIPCCL_CODEC=lossless python examples/dropin.py

ZIPCCL_CODEC=lossless compresses every float all-reduce; unset ("auto"), zipccl keeps the
backend's own collective wherever compression would not pay (loopback, small tensors).
"""

import argparse
import hashlib

import torch
import torch.distributed as dist

import zipccl  # registers backend="zipccl"
from zipccl import launch


def main(rank: int, world: int) -> bool:
    plain = dist.new_group(backend="gloo")          # torch's own gloo over the same ranks, for the check
    g = torch.Generator().manual_seed(rank)
    grad = (torch.randn(1 << 20, generator=g) * 0.01).to(torch.bfloat16)  # a 2 MB bf16 "gradient"
    parts = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(parts, grad)                    # the inputs, to check the result
    by_gloo = grad.clone()
    dist.all_reduce(by_gloo, group=plain)
    dist.all_reduce(grad)                           # unchanged torch.distributed code
    s = zipccl.stats().get("all_reduce", {"wire_bytes": 0, "raw_bytes": 0, "ratio": float("nan")})
    if s["raw_bytes"]:  # zipccl carried it: its raw and lossless codecs promise the rank-order sum
        want, what = torch.stack([p.float() for p in parts]).sum(0).to(torch.bfloat16), "the rank-order fp32 sum"
    else:  # auto kept the backend's own all-reduce
        want, what = by_gloo, "gloo's own all-reduce"
    exact = torch.equal(grad.view(torch.int16), want.view(torch.int16))
    if rank == 0:
        print(f"{world} ranks: sent {s['wire_bytes'] / 1e6:.2f} MB instead of {s['raw_bytes'] / 1e6:.2f} MB "
              f"(ratio {s['ratio']:.3f}) on backend {dist.get_backend()}; result equals {what}: {exact}", flush=True)
    # the result's fingerprint, the same on every rank
    print(f"rank {rank}: result sha256 {hashlib.sha256(grad.view(torch.int16).numpy().tobytes()).hexdigest()[:16]}",
          flush=True)
    return exact


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nranks", type=int, default=4, help="local ranks when started without a launcher")
    args = ap.parse_args()
    if launch.detect():
        world = launch.init(backend="zipccl")
        main(world.rank, world.size)
        launch.shutdown()
    else:
        launch.spawn(main, args.nranks, backend="zipccl")
