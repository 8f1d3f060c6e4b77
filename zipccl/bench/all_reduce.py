"""zipccl-perf spec of all-reduce: busbw = algbw * 2(n-1)/n."""

import torch
import torch.distributed as dist

import zipccl

from .common import Spec


def _run(out, inp, op, group, codec, algorithm="auto"):
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


SPEC = Spec("all_reduce", True, lambda n: 2 * (n - 1) / n, lambda count, n: (count, count), _run, expect)
