"""Compile zipccl's numba kernels into numba's on-disk cache: ``python tests/compile_kernels.py
lossless [bf16|fp16|fp32] | sparse``. tests/conftest.py runs the lossless kernels of each dtype
and the sparse ones at once before any test process starts; otherwise, in a fresh clone, every
test process and every rank of a pool compiles them itself until one of them has written the
cache (lossless 130 s for the three dtypes, 40-46 s each, top-k and sums 20 s, on one core of a
2-core AMD EPYC host).
"""

from __future__ import annotations

import sys

import torch


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def lossless(*dtypes: str) -> None:
    from zipccl.codecs import Lossless
    g = torch.Generator().manual_seed(0)
    for dtype in (DTYPES[d] for d in dtypes or DTYPES):
        x = torch.randn(20000, generator=g) * 10.0 ** torch.randint(-8, 3, (20000,), generator=g).float()
        x[::7] = 0.0
        x = x.to(dtype)
        for impl in ("numba", "reference"):
            codec = Lossless(impl)
            packet = codec.encode(x)
            codec.decode(packet, out=torch.empty_like(x))


def sparse() -> None:
    from zipccl.kernels import reduce, sparse as topk
    g = torch.Generator().manual_seed(0)
    for grad_dtype in (torch.float32, torch.bfloat16):
        for value_dtype in (torch.bfloat16, torch.float32):
            grad = torch.randn(5000, generator=g).to(grad_dtype)
            if topk.supports(grad, value_dtype, torch.float32):
                _, _, residual = topk.compensated_topk(grad, None, 50, value_dtype, torch.float32)
                topk.compensated_topk(grad, residual, 50, value_dtype, torch.float32,
                                      sample=torch.arange(0, 5000, 10), sample_k=5)
    for dtype in (torch.bfloat16, torch.float32):
        parts = torch.randn(2, 1000, generator=g).to(dtype)
        reduce.sum_in_rank_order(parts, parts[0], 0, False, torch.empty(1000, dtype=dtype))


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"lossless": lossless, "sparse": sparse}[sys.argv[1]](*sys.argv[2:])
