"""zipccl-perf spec of all-reduce: busbw = algbw * 2(n-1)/n.

Out of place, the input is copied into the output and reduced there (torch.distributed and
zipccl reduce in place: the copy is what an out-of-place all-reduce costs with them); in
place, the input is the output, as in nccl-tests."""

import torch
import torch.distributed as dist

import zipccl

from .common import Spec


def _run(out, inp, op, group, codec, algorithm="auto"):
    if out is not inp:
        out.copy_(inp)
    if codec is None:
        dist.all_reduce(out, op=op, group=group)
    else:
        zipccl.all_reduce(out, op=op, group=group, codec=codec, algorithm=algorithm)


def expect(inputs, op, rank, nranks):
    return reduce_all(inputs, op)


def reduce_all(inputs, op):
    stacked = torch.stack([x.double() for x in inputs])
    if op == dist.ReduceOp.MAX:
        return stacked.max(0).values
    if op == dist.ReduceOp.MIN:
        return stacked.min(0).values
    total = stacked.sum(0)
    return total / len(inputs) if op == dist.ReduceOp.AVG else total


def _in_place(numel_in, numel_out, rank, nranks, dtype):
    buf = torch.empty(numel_in, dtype=dtype)
    return buf, buf


SPEC = Spec("all_reduce", True, lambda n: 2 * (n - 1) / n, lambda count, n: (count, count), _run, expect, _in_place)
