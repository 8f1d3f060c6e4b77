"""numba CPU kernel of the direct reduce-scatter's sum: every rank's part of a piece, added in
rank order in fp32 and rounded once, for bf16 and fp32 sums and averages.

torch made three passes over memory per part (widen, add, and at the end round), each of them
through its dtype-promoting machinery: four bf16 parts of 2M elements took 18.7 ms, about a
sixth of a rank's CPU in a lossless all-reduce. Here every part is read once, a few thousand
elements at a time, and the bits are the torch path's (tests/test_reduce.py): the sum starts
from rank 0's value (starting from 0.0 would turn -0.0 into +0.0), an average divides the fp32
sum by the rank count, and fp32 rounds to bf16 to nearest even. A NaN sum becomes 0x7FC0, as
torch's scalar conversion makes it (its vectorized one makes 0xFFFF: torch's own bits for a NaN
depend on where the element falls)."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

_NOGIL = dict(cache=True, nogil=True, boundscheck=False)
_SPAN = 4096  # elements summed at a time: the fp32 sums stay in L1
DTYPES = (torch.bfloat16, torch.float32)


@njit(**_NOGIL)
def _sum_bf16(parts, own, r, avg, out):
    """out[i] = bf16(sum over ranks j of parts[j, i], rank r's from ``own``) (divided by the
    rank count if ``avg``), all as uint16 bits."""
    n, m = parts.shape
    wide = np.empty(_SPAN, np.uint32)
    widef = wide.view(np.float32)
    acc = np.empty(_SPAN, np.float32)
    accu = acc.view(np.uint32)
    for lo in range(0, m, _SPAN):
        k = min(m, lo + _SPAN) - lo
        for j in range(n):
            row = own[lo:lo + k] if j == r else parts[j, lo:lo + k]
            for i in range(k):
                wide[i] = np.uint32(row[i]) << 16
            if j == 0:
                acc[:k] = widef[:k]
            else:
                for i in range(k):
                    acc[i] += widef[i]
        if avg:
            for i in range(k):
                acc[i] /= np.float32(n)
        dest = out[lo:lo + k]
        for i in range(k):
            x = accu[i]
            rounded = (x + np.uint32(0x7FFF) + ((x >> 16) & np.uint32(1))) >> 16
            dest[i] = np.uint32(0x7FC0) if (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded


@njit(**_NOGIL)
def _sum_fp32(parts, own, r, avg, out):
    """_sum_bf16 for float32 values: no widening, no rounding."""
    n, m = parts.shape
    for lo in range(0, m, _SPAN):
        k = min(m, lo + _SPAN) - lo
        acc = out[lo:lo + k]
        for j in range(n):
            row = own[lo:lo + k] if j == r else parts[j, lo:lo + k]
            if j == 0:
                acc[:] = row
            else:
                for i in range(k):
                    acc[i] += row[i]
        if avg:
            for i in range(k):
                acc[i] /= np.float32(n)


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()


def sum_in_rank_order(parts: torch.Tensor, own: torch.Tensor, rank: int, average: bool, out: torch.Tensor) -> None:
    """out = the sum (or average) over j of parts[j], with ``own`` standing in for parts[rank]:
    contiguous CPU tensors of one dtype in DTYPES, parts of shape (ranks, len(out))."""
    kernel = _sum_bf16 if parts.dtype == torch.bfloat16 else _sum_fp32
    kernel(_bits(parts), _bits(own), rank, average, _bits(out))
