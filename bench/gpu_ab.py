"""The GPU codec's kernels timed, and its bytes checked, for whichever checkout is on the path.

    PYTHONPATH=CHECKOUT python bench/gpu_ab.py [--data FILE] --label v1 [--cases 33554432:bf16[:BLOCK],...]

Written for format A/Bs (v1 against an unmerged v2 prototype): it uses only
`zipccl.codecs.Lossless`, which both formats share, so one script times both in one run on one
card. Per case (the real bucket tiled to N elements): the Triton packet must equal the numba
encoder's bytes (the CPU path, itself tested byte for byte against the reference) and decode to
the same bits; then the profiler's device time per kernel, summed per call, and the wall time per
call; then encode_into and decode_into, as whole calls and replayed from CUDA graphs. One JSON
line per case on stdout; `--json` appends them to a file. `--ncu-window`: after
the checks, one encode and one decode inside the CUDA profiler's window (``cudaProfilerStart``
and ``Stop``), for ``ncu --profile-from-start off`` (bench/gpu_check.sh's ``ncu`` step), untimed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import zipccl
from zipccl import format as F
from zipccl.bench.common import DEFAULT_DATA
from zipccl.codecs import Lossless

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT = {2: torch.int16, 4: torch.int32}


def _kernel_times(prof, calls: int) -> dict[str, float]:
    """Device microseconds per call for each Triton kernel of the codec (names start with '_')."""
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if e.key.startswith("_") and us:
            out[e.key] = out.get(e.key, 0.0) + us / calls
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _profiled(fn, repeat: int, device: str) -> tuple[float, dict[str, float]]:
    """Median wall seconds per call of fn(), timed without the profiler (whose per-launch cost
    would lower small calls' GB/s), and the kernels' device microseconds per call, profiled apart."""
    wall = _walls(fn, repeat, device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])) as prof:
        for _ in range(repeat):
            fn()
        _sync(device)
    return wall, _kernel_times(prof, repeat)


def join_sweep(settings: str, gpu: Lossless, packet: torch.Tensor, x: torch.Tensor, repeat: int, device: str) -> dict:
    """Decode again under each _decode_join setting ("CHUNKxWARPS"), where the checkout has that kernel."""
    from zipccl.kernels import gpu as kernels
    if not settings or not hasattr(kernels, "JOIN_CHUNK"):
        return {}
    # The warps: join_warps() here, a constant JOIN_WARPS in checkouts before it.
    knob = "join_warps" if hasattr(kernels, "join_warps") else "JOIN_WARPS"
    saved, rows = (kernels.JOIN_CHUNK, kernels.COUNT_ROWS, getattr(kernels, knob)), {}
    ints = INT[x.element_size()]
    try:
        for s in settings.split(","):
            chunk, warps = (int(v) for v in s.split("x"))
            # the counts' rows follow the chunk (the scratch between the two kernels is sized by them)
            kernels.JOIN_CHUNK, kernels.COUNT_ROWS = chunk, kernels.SUBSTREAM // chunk + 1
            setattr(kernels, knob, (lambda width, warps=warps: warps) if knob == "join_warps" else warps)
            out = torch.empty(x.shape, dtype=x.dtype, device=packet.device)
            gpu.decode(packet, out)
            wall, kern = _profiled(lambda: gpu.decode(packet, out), repeat, device)
            rows[s] = {"same_bits": torch.equal(out.cpu().view(ints), x.view(ints)), "wall_ms": round(wall * 1e3, 4),
                       "kernels_us": {k: round(v, 1) for k, v in kern.items()}}
    finally:
        kernels.JOIN_CHUNK, kernels.COUNT_ROWS = saved[:2]
        setattr(kernels, knob, saved[2])
    return rows


def _walls(fn, repeat: int, device: str) -> float:
    """Median wall seconds per synchronised call of fn()."""
    walls = []
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        walls.append(time.perf_counter() - t)
    return float(np.median(walls))


def _graph(fn) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, after a run on a side stream (as torch's docs warm up)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def into_and_graphs(gpu: Lossless, xc: torch.Tensor, packet: torch.Tensor, x: torch.Tensor, repeat: int,
                    device: str) -> dict:
    """encode_into and decode_into (no host read, as the collectives call them) timed as whole
    calls, then each replayed from a CUDA graph (on CUDA): the same kernels without the host's
    launch work, which sets a call's time below 64 MiB. Each replay's packet and output are
    checked against the first encode's bytes and the input's bits."""
    nbytes, ints = x.numel() * x.element_size(), INT[x.element_size()]
    buf = torch.zeros(gpu.max_encoded_size(x.numel(), x.dtype) + 16, dtype=torch.uint8, device=xc.device)
    out = torch.empty_like(xc)
    pkt = packet.clone()
    calls = {"encode_into": lambda: gpu.encode_into(xc, buf), "decode_into": lambda: gpu.decode_into(pkt, out)}
    row = {}
    for name, fn in calls.items():
        wall = _walls(fn, repeat, device)
        row[name] = {"wall_ms": round(wall * 1e3, 4), "wall_GBps": round(nbytes / wall / 1e9, 1)}
    if device != "cuda":
        return row
    try:
        graphs = {name: _graph(fn) for name, fn in calls.items()}
    except Exception as e:  # noqa: BLE001 (a finding to record, not a reason to lose the case's other rows)
        return {**row, "graph_error": f"{type(e).__name__}: {e}"}
    buf.zero_()
    out.zero_()
    for name, graph in graphs.items():
        wall = _walls(graph.replay, repeat, device)
        row[name + "_graph"] = {"wall_ms": round(wall * 1e3, 4), "wall_GBps": round(nbytes / wall / 1e9, 1)}
    row["graph_same_bytes"] = torch.equal(buf[:packet.numel()], packet)
    row["graph_same_bits"] = torch.equal(out.cpu().view(ints), x.view(ints))
    return row


def _profiler_window(fn, device: str) -> None:
    """``fn()`` alone inside the CUDA profiler's window (what ``ncu --profile-from-start off`` sees)."""
    _sync(device)
    if device == "cuda":
        torch.cuda.profiler.start()
    fn()
    _sync(device)
    if device == "cuda":
        torch.cuda.profiler.stop()


def case(base: torch.Tensor, numel: int, dtype: str, block: int, repeat: int, device: str = "cuda",
         join: str = "", ncu_window: bool = False) -> dict:
    x = base.repeat(-(-numel // base.numel()))[:numel].to(DTYPES[dtype]).contiguous()
    xc = x.to(device)
    gpu = Lossless("triton", block_size=block)
    packet = gpu.encode(xc)
    same_bytes = torch.equal(packet.cpu(), Lossless("numba", block_size=block).encode(x))
    out = torch.empty_like(xc)
    gpu.decode(packet, out)
    ints = INT[x.element_size()]
    same_bits = torch.equal(out.cpu().view(ints), x.view(ints))
    nbytes = x.numel() * x.element_size()
    if ncu_window:
        _profiler_window(lambda: gpu.decode(gpu.encode(xc), out), device)
        return {"numel": numel, "dtype": dtype, "block": block, "ratio": round(packet.numel() / nbytes, 5),
                "same_bytes": same_bytes, "same_bits": same_bits, "profiled": "one encode, one decode"}
    timed = {"encode": _profiled(lambda: gpu.encode(xc), repeat, device),
             "decode": _profiled(lambda: gpu.decode(packet, out), repeat, device)}
    row = {"card": torch.cuda.get_device_name() if device == "cuda" else device, "zipccl": os.path.relpath(zipccl.__file__),
           "numel": numel, "dtype": dtype, "block": block, "ratio": round(packet.numel() / nbytes, 5),
           "same_bytes": same_bytes, "same_bits": same_bits}
    for side, (wall, kernels) in timed.items():
        kern = sum(kernels.values())
        row[side] = {"wall_ms": round(wall * 1e3, 4), "wall_GBps": round(nbytes / wall / 1e9, 1),
                     "kernels_us": {k: round(v, 1) for k, v in kernels.items()},
                     "kernels_GBps": round(nbytes / (kern * 1e-6) / 1e9, 1) if kern else None}
    row.update(into_and_graphs(gpu, xc, packet, x, repeat, device))
    sweep = join_sweep(join, gpu, packet, x, repeat, device)
    if sweep:
        row["join_sweep"] = sweep
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA,
                    help="the real fp32 gradient bucket (default: ZIPCCL_DATA, the checkout's data/, ../shared/data); "
                         "where it is missing, gradient-like synthetic values (said on stderr)")
    ap.add_argument("--label", default="")
    ap.add_argument("--cases", default="4194304:bf16,33554432:bf16,134217728:bf16,33554432:fp16,16777216:fp32",
                    help="NUMEL:DTYPE[:BLOCK],...: the real bucket tiled to NUMEL elements, in blocks of BLOCK "
                         "(default --block)")
    ap.add_argument("--block", type=int, default=getattr(F, "GPU_BLOCK_SIZE", 1024),
                    help="elements per block where a case names none (default: the Triton encoder's own)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--join", default="", help="CHUNKxWARPS,...: also decode under these _decode_join settings")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script under TRITON_INTERPRET=1")
    ap.add_argument("--ncu-window", action="store_true",
                    help="after each case's checks, one encode and one decode inside the CUDA profiler's window "
                         "(for ncu --profile-from-start off), untimed")
    args = ap.parse_args()
    if args.data.exists():
        base = torch.from_numpy(np.load(args.data))
    else:
        print(f"# {args.data} not found: synthetic values (normal, sd 0.02, seed 0) instead of the real gradients",
              file=sys.stderr)
        base = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 0.02
    for spec in args.cases.split(","):
        n, dt, *block = spec.split(":")
        row = {"label": args.label, **case(base, int(n), dt, int(block[0]) if block else args.block, args.repeat,
                                             args.device, args.join, args.ncu_window)}
        line = json.dumps(row)
        print(line, flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
