"""zipccl-perf spec of reduce-scatter: size = input bytes, count = output elements,
busbw = algbw * (n-1)/n; in place, the output is this rank's slice of the input (nccl-tests)."""

import torch

import zipccl

from ..torch_compat import reduce_scatter_single
from .all_reduce import reduce_all
from .common import Spec


def _run(out, inp, op, group, codec, algorithm="auto"):
    if codec is None:
        reduce_scatter_single(out, inp, op=op, group=group)
    else:
        zipccl.reduce_scatter(out, inp, op=op, group=group, codec=codec, algorithm=algorithm)


def expect(inputs, op, rank, nranks):
    full = reduce_all(inputs, op)
    m = full.numel() // nranks
    return full[rank * m:(rank + 1) * m]


def _in_place(numel_in, numel_out, rank, nranks, dtype):
    inp = torch.empty(numel_in, dtype=dtype)
    return inp[rank * numel_out:(rank + 1) * numel_out], inp


SPEC = Spec("reduce_scatter", True, lambda n: (n - 1) / n,
            lambda count, n: (count // n * n, count // n), _run, expect, _in_place, line_bytes=16)
