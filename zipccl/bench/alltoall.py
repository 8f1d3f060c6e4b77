"""zipccl-perf spec of all-to-all (nccl-tests' alltoall_perf): each rank sends count elements
to every rank (count rounded down to a multiple of 16 bytes, as nccl-tests does); size = the
n x count elements of a rank's buffer, count = elements per peer, busbw = algbw * (n-1)/n; in
place, output and input are one buffer, timed and not checked (as nccl-tests)."""

import torch
import torch.distributed as dist

import zipccl

from .common import Spec


def _run(out, inp, op, group, codec, algorithm="auto"):
    if codec is None:
        dist.all_to_all_single(out, inp, group=group)
    else:
        zipccl.all_to_all_single(out, inp, group=group, codec=codec, algorithm=algorithm)


def expect(inputs, op, rank, nranks):
    m = inputs[0].numel() // nranks
    return torch.cat([x[rank * m:(rank + 1) * m].double() for x in inputs])


def _in_place(numel_in, numel_out, rank, nranks, dtype):
    buf = torch.empty(numel_in, dtype=dtype)
    return buf, buf


SPEC = Spec("alltoall", False, lambda n: (n - 1) / n, lambda count, n: (count // n * n, count // n * n), _run, expect,
            _in_place, count=lambda numel_in, numel_out, n: numel_in // n, line_bytes=16, checks_in_place=False,
            reduces=False, policy_name="all_to_all")
