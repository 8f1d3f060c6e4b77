"""CPU time of the lossy path on one bucket: the torch path against zipccl's numba kernels.

    python bench/lossy_cpu.py [--numel 7300000] [--density 0.05] [--ranks 4] [--runs 5]

Error feedback and top-k selection (exact and sampled threshold), then the rank-order sum
of ``--ranks`` ranks' packets into the dense result, for float32 and bfloat16 gradients;
the median of ``--runs``, one thread. Both paths give the same bits (tests/test_sparse.py).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

from zipccl.collectives import _sum_pairs
from zipccl.feedback import Residuals
from zipccl.kernels import sparse
from zipccl.topk import TopK


def _torch_select(grad, residuals, codec):
    compensated = residuals.compensate("bucket", grad)
    wire = torch.empty_like(grad)
    wire.copy_(compensated)
    idx, values = codec.select(wire)
    sent = torch.zeros_like(compensated)
    sent[idx.long()] = values.float()
    residuals.update("bucket", compensated, sent)
    return idx, values


def _numba_select(grad, residuals, codec):
    idx, values, residual = sparse.compensated_topk(grad, residuals.get("bucket", grad.numel()),
                                                    codec.k(grad.numel()), grad.dtype, residuals.dtype,
                                                    codec.sample_positions(grad.numel()), codec.sample_k())
    residuals.store["bucket"] = residual
    return idx, values


def _median_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=7_300_000, help="bucket elements (the d384 model of the DDP runs)")
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"# {a.numel} elements, density {a.density}, {a.ranks} ranks' packets summed; median of {a.runs}, ms")
    print(f"{'dtype':<9} {'step':<28} {'torch':>8} {'numba':>8} {'speed-up':>9}")
    for dtype in sparse.DTYPES:
        grad = (torch.randn(a.numel, generator=gen) * 1e-3).to(dtype)
        for sampled in (False, True):
            codec = TopK(a.density, sampled=sampled)
            ms = []
            for select in (_torch_select, _numba_select):
                store = Residuals(torch.float32)
                store.store["bucket"] = torch.randn(a.numel, generator=gen) * 1e-4
                ms.append(_median_ms(lambda: select(grad, store, codec), a.runs))
            name = f"feedback + top-k, {'sampled' if sampled else 'exact'}"
            print(f"{str(dtype)[6:]:<9} {name:<28} {ms[0]:8.1f} {ms[1]:8.1f} {ms[0] / ms[1]:8.1f}x")
        codec = TopK(a.density)
        parts = [codec.encode((torch.randn(a.numel, generator=gen) * 1e-3).to(dtype)) for _ in range(a.ranks)]
        out = torch.empty(a.numel, dtype=dtype)

        def torch_sum():
            total, _ = _sum_pairs(parts, codec, out, dist.ReduceOp.AVG, a.ranks)
            out.copy_(total)

        ms = [_median_ms(torch_sum, a.runs),
              _median_ms(lambda: sparse.sum_pairs_into(parts, dtype, True, a.ranks, out), a.runs)]
        print(f"{str(dtype)[6:]:<9} {'rank-order sum of pairs':<28} {ms[0]:8.1f} {ms[1]:8.1f} {ms[0] / ms[1]:8.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
