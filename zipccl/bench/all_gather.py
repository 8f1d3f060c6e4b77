"""zipccl-perf spec of all-gather: size = output bytes, busbw = algbw * (n-1)/n."""

import torch
import torch.distributed as dist

import zipccl

from .common import Spec


def _run(out, inp, op, group, codec, algorithm="auto"):
    if codec is None:
        dist.all_gather_single(out, inp, group=group)
    else:
        zipccl.all_gather(out, inp, group=group, codec=codec, algorithm=algorithm)


def expect(inputs, op, rank, nranks):
    return torch.cat([x.double() for x in inputs])


SPEC = Spec("all_gather", False, lambda n: (n - 1) / n, lambda count, n: (count // n, count // n * n), _run, expect)
