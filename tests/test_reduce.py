"""The reduce-scatter's fused sum (zipccl/kernels/reduce.py) and the torch path it replaces
(zipccl.collectives.reduce_in_rank_order) against plain torch doing what the design says: add
the ranks' parts in rank order in float32, starting from rank 0's value, divide by the rank
count for an average, and round once. Bit for bit, NaNs included as far as they are promised:

- bfloat16: every NaN sum comes out as 0x7FC0 (kernels/reduce.py; torch itself rounds a NaN to
  0x7FC0 or 0xFFFF depending on whether its conversion ran vectorised, so it cannot say).
- float32: where exactly one rank's value is a NaN and the sum makes no NaN of its own, the sum
  is that NaN, quieted, with its sign and payload (IEEE 754 recommends it; x86 and Arm do it,
  in torch and in the kernel alike). Where two NaNs meet (two ranks' NaNs, or one and a NaN the
  sum made from inf - inf), IEEE leaves open which one survives, and the compiler may swap the
  operands of an addition: only NaN-ness is promised there. A NaN made from inf - inf has no
  promised bits either (x86 makes 0xFFC00000, Arm 0x7FC00000).
"""

import numpy as np
import pytest
import torch

from zipccl.collectives import reduce_in_rank_order
from zipccl.kernels.reduce import DTYPES, sum_in_rank_order

SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 3e38, -3e38, 1.0, -1.0]
# Quiet and signalling, both signs, payloads low and high.
NANS = {torch.float32: np.array([0x7FC12345, 0x7F812345, 0xFFC54321, 0xFF800001, 0x7FFFFFFF, 0x7FC00000],
                                np.uint32).view(np.int32),
        torch.bfloat16: np.array([0x7FC1, 0x7F81, 0xFFC0, 0xFF85, 0x7FFF, 0x7FC0], np.uint16).view(np.int16)}
BF16_NAN = 0x7FC0


def _int_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def _parts(n: int, m: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, generator=g) * torch.exp(torch.randn(n, m, generator=g) * 8)
    x.view(-1)[torch.randint(0, max(1, n * m), (n * m // 7,), generator=g)] = torch.tensor(
        SPECIAL)[torch.randint(0, len(SPECIAL), (n * m // 7,), generator=g)]
    x = x.to(dtype)
    nans = torch.from_numpy(NANS[dtype])  # set as bits: a conversion could change them
    _int_bits(x).view(-1)[torch.randint(0, max(1, n * m), (n * m // 20,), generator=g)] = nans[
        torch.randint(0, len(nans), (n * m // 20,), generator=g)]
    return x


def _plain_sum(rows, average: bool):
    """(float32 sum in rank order, averaged; mask of the elements whose NaN bits are promised)."""
    acc = rows[0].float().clone()  # widening bfloat16 shifts its bits: NaNs keep theirs
    made = torch.zeros(acc.shape, dtype=torch.bool)  # a NaN from two numbers (inf - inf)
    for row in rows[1:]:
        nxt = acc + row.float()
        made |= nxt.isnan() & ~acc.isnan() & ~row.isnan()
        acc = nxt
    if average:
        acc = acc / len(rows)
    one_nan = sum(row.isnan().int() for row in rows) == 1
    return acc, one_nan & ~made


def _assert_float32_sum(got, want, promised):
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(_int_bits(got)[~nan], _int_bits(want)[~nan])
    assert torch.equal(_int_bits(got)[promised], _int_bits(want)[promised])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,m", [(1, 5), (2, 0), (2, 4097), (3, 10000), (4, 4096), (5, 9001)])
@pytest.mark.parametrize("average", [False, True])
def test_sum_matches_plain_torch_bits(dtype, n, m, average):
    parts = _parts(n, m, dtype, seed=n * 100003 + m)
    for r in range(n):
        own = _parts(1, m, dtype, seed=r + 7)[0]
        rows = [own if j == r else parts[j] for j in range(n)]
        acc, promised = _plain_sum(rows, average)
        # The torch path: float32 (or the dtype's) sums, rounded by its caller.
        _assert_float32_sum(reduce_in_rank_order(rows, 2 if average else 1, n, dtype).float(), acc, promised)
        got = torch.full((m,), 7.0, dtype=dtype)
        sum_in_rank_order(parts, own, r, average, got)
        if dtype == torch.bfloat16:
            want = acc.to(dtype)  # numbers: to nearest even, as torch rounds them
            _int_bits(want)[acc.isnan()] = BF16_NAN
            assert torch.equal(_int_bits(got), _int_bits(want))
        else:
            _assert_float32_sum(got, acc, promised)


def test_the_data_covers_every_nan_case():
    """Single NaNs of every pattern (quiet, signalling, both signs), NaNs meeting, inf - inf."""
    for dtype in DTYPES:
        parts = _parts(5, 9001, dtype, seed=5 * 100003 + 9001)
        _, promised = _plain_sum(list(parts), False)
        nan_count = sum(row.isnan().int() for row in parts)
        singles = torch.cat([row[promised] for row in parts])
        assert set(NANS[dtype].tolist()) <= set(_int_bits(singles).tolist())
        assert bool((nan_count >= 2).any())
        made = parts.float().sum(0).isnan() & (nan_count == 0)
        assert bool(made.any())


def test_nan_sum_is_one_pattern():
    parts = torch.tensor([[float("nan"), float("inf"), 1.0], [1.0, -float("inf"), float("nan")]],
                         dtype=torch.bfloat16)
    got = torch.empty(3, dtype=torch.bfloat16)
    sum_in_rank_order(parts, parts[1], 1, False, got)
    bits = got.view(torch.int16).numpy().view(np.uint16)
    assert list(bits) == [BF16_NAN, BF16_NAN, BF16_NAN]


def test_a_single_nan_keeps_its_bits_in_float32():
    """The promise spelled out on one column per pattern: rank 1's NaN, quieted, is the sum."""
    nans = torch.from_numpy(NANS[torch.float32]).view(torch.float32)
    parts = torch.stack([torch.full((len(nans),), 2.5), nans, torch.full((len(nans),), -1.0)])
    got = torch.empty(len(nans))
    sum_in_rank_order(parts, parts[2], 2, True, got)
    quieted = NANS[torch.float32] | np.int32(0x00400000)
    assert _int_bits(got).tolist() == quieted.tolist()
