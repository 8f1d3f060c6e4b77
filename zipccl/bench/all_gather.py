"""zipccl-perf spec of all-gather: size = output bytes, count = elements per rank,
busbw = algbw * (n-1)/n; in place, the input is this rank's slice of the output (nccl-tests)."""

import torch

import zipccl

from ..torch_compat import all_gather_single
from .common import Spec


def _run(out, inp, op, group, codec, algorithm="auto"):
    if codec is None:
        all_gather_single(out, inp, group=group)
    else:
        zipccl.all_gather(out, inp, group=group, codec=codec, algorithm=algorithm)


def expect(inputs, op, rank, nranks):
    return torch.cat([x.double() for x in inputs])


def _in_place(numel_in, numel_out, rank, nranks, dtype):
    out = torch.empty(numel_out, dtype=dtype)
    return out, out[rank * numel_in:(rank + 1) * numel_in]


SPEC = Spec("all_gather", False, lambda n: (n - 1) / n, lambda count, n: (count // n, count // n * n), _run, expect,
            _in_place, line_bytes=16)
