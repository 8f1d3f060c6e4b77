"""The reduce-scatter's fused sum against the torch path it replaces: the same bits."""

import numpy as np
import pytest
import torch

from zipccl.collectives import reduce_in_rank_order
from zipccl.kernels.reduce import DTYPES, sum_in_rank_order

SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 3e38, -3e38, 1.0, -1.0]


def _parts(n: int, m: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, generator=g) * torch.exp(torch.randn(n, m, generator=g) * 8)
    x.view(-1)[torch.randint(0, max(1, n * m), (n * m // 7,), generator=g)] = torch.tensor(
        SPECIAL)[torch.randint(0, len(SPECIAL), (n * m // 7,), generator=g)]
    return x.to(dtype)


def _int_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(1, 5), (2, 0), (2, 4097), (3, 10000), (4, 4096), (5, 9001)])
@pytest.mark.parametrize("average", [False, True])
def test_fused_sum_matches_torch_bits(dtype, n, m, average):
    parts = _parts(n, m, dtype, seed=n * 100003 + m)
    for r in range(n):
        own = _parts(1, m, dtype, seed=r + 7)[0]
        rows = [own if j == r else parts[j] for j in range(n)]
        want = torch.empty(m, dtype=dtype)
        want.copy_(reduce_in_rank_order(rows, 2 if average else 1, n, dtype))
        got = torch.full((m,), 7.0, dtype=dtype)
        sum_in_rank_order(parts, own, r, average, got)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(_int_bits(got)[~nan], _int_bits(want)[~nan])


def test_nan_sum_is_one_pattern():
    parts = torch.tensor([[float("nan"), float("inf"), 1.0], [1.0, -float("inf"), float("nan")]],
                         dtype=torch.bfloat16)
    got = torch.empty(3, dtype=torch.bfloat16)
    sum_in_rank_order(parts, parts[1], 1, False, got)
    bits = got.view(torch.int16).numpy().view(np.uint16)
    assert list(bits) == [0x7FC0, 0x7FC0, 0x7FC0]
