"""Time each stage of the numba lossless codec on one tensor (min of N runs, one thread).

    python bench/codec_stages.py [--data FILE.npy] [--dtype bf16|fp16|fp32] [--runs 15]

Where the codec benchmark (python -m zipccl.bench.codec) says how fast, this says
where the time goes: analyse, tables, pack, plan and rest on the encode side; on the decode
side, the kernel alone (symbols and join, a few blocks at a time) against the whole call.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from zipccl.bench.common import DEFAULT_DATA
from zipccl.codecs import Lossless
from zipccl.format import DEFAULT_BLOCK_SIZE, HEADER_SIZE, LAYOUTS, MAXLEN, NSYM, num_blocks, substreams
from zipccl.kernels import cpu as C
from zipccl.reference.packet import parse_lossless
from zipccl.reference.plan import choose, plan

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def best(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def stages(x: torch.Tensor) -> dict:
    """{stage: callable} for one tensor, each ready to run on its own."""
    layout, bs, n = LAYOUTS[x.dtype], DEFAULT_BLOCK_SIZE, x.numel()
    bits, nb = C._int_view(x), num_blocks(n, bs)
    ref, hist, nzero = np.zeros(nb, np.int64), np.zeros((nb, NSYM), np.int64), np.zeros(nb, np.int64)
    analyse = lambda: C._analyse(bits, bs, layout.mbits, ref, hist, nzero)  # noqa: E731
    analyse()
    tables = choose(hist, x.dtype)
    cost = np.zeros(nb, np.int64)
    streams = np.empty(4 * nb * bs + 8, np.uint8)
    subs = np.zeros((nb, substreams(bs) or 1), np.uint16)  # the encoder's own type: no second compile
    pack = lambda: C._pack(bits, bs, layout.mbits, ref, tables.assign, nzero, hist, tables.codes,  # noqa: E731
                           tables.lengths, streams, cost, subs, C._pair_tables())
    pack()
    pl = plan(tables, ref, cost, nzero, n, bs, layout)
    start = HEADER_SIZE + pl.sizes[0] + len(pl.front())
    buf = np.empty(pl.total_size + 8, np.uint8)
    codec = Lossless()
    packet, out = codec.encode(x), torch.empty_like(x)
    out_stages = {
        "analyse": analyse,
        "tables": lambda: choose(hist, x.dtype),
        "pack": pack,
        "plan": lambda: plan(tables, ref, cost, nzero, n, bs, layout),
        "rest": lambda: C._rest(bits, bs, layout.mbits, pl.table, pl.nzero, pl.rest_start,
                                buf[start + pl.sizes[2]:]),
        "encode (all)": lambda: codec.encode(x),
    }
    p = parse_lossless(packet)
    raw = packet.numpy()
    nw = int(p.word_start[-1])
    stream = np.zeros(4 * nw + 8 + (MAXLEN + layout.ebits) * bs // 8, np.uint8)
    stream[:4 * nw] = raw[p.stream_offset:p.rest_offset]
    luts, mluts = C._decoder_tables(p.lengths.tobytes())
    rest = raw[p.rest_offset:p.rest_offset + int(p.rest_start[-1])]
    s0 = raw[HEADER_SIZE:HEADER_SIZE + p.header.sections[0]]
    out_stages["decode kernel"] = lambda: C._decode(stream, rest, bs, n, layout.mbits, p.ref, p.table, p.nzero,  # noqa: E731
                                                    p.word_start, p.rest_start, s0, luts, mluts,
                                                    C._int_view(out))
    out_stages["decode (all)"] = lambda: codec.decode(packet, out=out)
    return out_stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.from_numpy(np.load(args.data)).reshape(-1).to(DTYPES[args.dtype])
    print(f"# {args.data.name} as {args.dtype}: {x.numel()} elements, min of {args.runs} runs")
    for name, fn in stages(x).items():
        fn()  # compile / warm up
        s = best(fn, args.runs)
        print(f"{name:14s} {s * 1e3:8.2f} ms {s / x.numel() * 1e9:6.2f} ns/element "
              f"{x.numel() * x.element_size() / s / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
