"""The codec calls of one rank of a lossless all-reduce, replayed in call order in one process.

    python bench/codec_replay.py [--nranks 4] [--numel 33554432] [--runs 7]

A 4-rank all-reduce over loopback gloo records what rank 0 encodes (its chunks, then
its reduced chunk) and the packets it decodes (peers' chunks, then peers' reduced
chunks); this process then encodes and decodes them again in the same order, each
once per run, and reports the median of each kernel stage. Unlike bench/codec_stages.py
(one tensor, warm caches) this sees what the collectives see: many 1M-element pieces,
summed gradients, tables that change from packet to packet. Real bf16 gradients from
../shared/data, tiled to size and scaled per rank, as in bench/collective_cpu.py.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "grads_step050_bucket0_fp32.npy"
STAGES = ("_analyse", "_pack", "_rest", "_symbols", "_compose")


def _record(rank: int, n: int, numel: int, port: int, path: str) -> None:
    import zipccl
    from zipccl.codecs import Lossless
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    base = np.load(DATA).ravel() if DATA.exists() else np.random.default_rng(0).normal(0, 1e-3, 1 << 20)
    x = torch.from_numpy(np.resize(base, numel).astype(np.float32)).mul_(1 + 0.01 * rank).to(torch.bfloat16)
    calls = {"encode": [], "decode": []}
    if rank == 0:
        encode, decode = Lossless.encode, Lossless.decode
        Lossless.encode = lambda self, t: (calls["encode"].append(t.clone()), encode(self, t))[1]
        Lossless.decode = lambda self, p, out=None: (calls["decode"].append(p.clone()), decode(self, p, out))[1]
    zipccl.all_reduce(x, codec="lossless")
    if rank == 0:
        torch.save(calls, path)
    dist.barrier()
    dist.destroy_process_group()


def replay(calls: dict, runs: int) -> dict:
    """{stage or total: median seconds per run} of encoding and decoding ``calls`` in order."""
    from zipccl.codecs import Lossless
    from zipccl.kernels import cpu
    codec = Lossless(impl="numba")
    outs = [torch.empty(codec.decode(p).numel(), dtype=codec.decode(p).dtype) for p in calls["decode"]]
    spent = {s: 0.0 for s in STAGES}
    originals = {s: getattr(cpu, s) for s in STAGES}

    def timed(stage):
        def run(*args):
            t0 = time.perf_counter()
            result = originals[stage](*args)
            spent[stage] += time.perf_counter() - t0
            return result
        return run

    rows = {"encode (all)": [], "decode (all)": [], **{s: [] for s in STAGES}}
    try:
        for s in STAGES:
            setattr(cpu, s, timed(s))
        for r in range(runs + 1):  # the first run compiles and warms up
            for s in STAGES:
                spent[s] = 0.0
            t0 = time.perf_counter()
            for t in calls["encode"]:
                codec.encode(t)
            t1 = time.perf_counter()
            for p, out in zip(calls["decode"], outs):
                codec.decode(p, out=out)
            t2 = time.perf_counter()
            if r:
                rows["encode (all)"].append(t1 - t0)
                rows["decode (all)"].append(t2 - t1)
                for s in STAGES:
                    rows[s].append(spent[s])
    finally:
        for s in STAGES:
            setattr(cpu, s, originals[s])
    return {k: float(np.median(v)) for k, v in rows.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nranks", type=int, default=4)
    ap.add_argument("--numel", type=int, default=32 << 20, help="bf16 elements (default 64 MiB)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--port", type=int, default=29573)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "calls.pt")
        mp.start_processes(_record, args=(a.nranks, a.numel, a.port, path), nprocs=a.nranks, start_method="spawn")
        calls = torch.load(path)
    ne = sum(t.numel() for t in calls["encode"])
    nd = sum(int(p[8:16].view(torch.int64)) for p in calls["decode"])
    print(f"# rank 0 of a {a.numel * 2 / 2**20:.1f} MiB bf16 all-reduce over {a.nranks} ranks: "
          f"{len(calls['encode'])} encodes ({ne / 1e6:.1f}M elements), {len(calls['decode'])} decodes "
          f"({nd / 1e6:.1f}M elements); median of {a.runs} replays")
    for name, seconds in replay(calls, a.runs).items():
        per = ne if name in ("encode (all)", "_analyse", "_pack", "_rest") else nd
        print(f"{name:14s} {seconds * 1e3:8.2f} ms {seconds / max(per, 1) * 1e9:6.2f} ns/element")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
