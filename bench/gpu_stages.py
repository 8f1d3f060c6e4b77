"""Where the GPU codec's time goes: torch.profiler over encode and decode of one large bf16
gradient tensor, kernels against host work (planning, the histogram read, launches).

    python bench/gpu_stages.py [--numel N] [--dtype bf16] [--data FILE]

Prints the card; the device operations per ``encode_into`` and ``decode_into``; the host's
time per call of each, unsynchronised and without a profiler (what a pipeline pays to issue a
call while the device works on the one before), with zipccl's direct launches and with
Triton's own (zipccl.kernels.launch), and the host functions that take it
(cProfile's own time per call); the wall time per synchronised call; the wall time of the
bookkeeping steps (the packet plan and the packet's validation, timed by wrapping them) per call
that makes them; and the profiler's table (device time per kernel and copy, host time per
operator), sorted by device time. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import zipccl.codecs as codecs
from zipccl import config
import zipccl.kernels.device_plan as device_plan
from zipccl.bench.common import DEFAULT_DATA
from zipccl.codecs import Lossless

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _host_time(fn, calls: int = 200) -> float:
    """Seconds of host time per call of ``fn``, issued back to back without a synchronisation
    (the device queue drained first and after; the caching allocator's blocks reused)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - t
    torch.cuda.synchronize()
    return spent / calls


def _host_profile(fn, calls: int = 200, rows: int = 14) -> str:
    """cProfile's table of the host functions under ``fn``, by their own time (tottime)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(rows)
    return f"# cProfile over {calls} calls (seconds in all):\n" + text.getvalue().split("\n", 4)[-1]


def _timed_host_steps() -> dict:
    """Wrap the GPU codec's host steps so that each call's time and calls add up per step."""
    spent = {}

    def wrap(module, name):
        fn = getattr(module, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = f"{module.__name__}.{name}"
                total, calls = spent.get(key, (0.0, 0))
                spent[key] = (total + time.perf_counter() - t, calls + 1)
        setattr(module, name, timed)

    for module, name in ((device_plan, "plan"), (codecs, "parse_lossless")):
        wrap(module, name)
    return spent


def _device_operations(fn) -> int:
    """The kernels, copies and fills the device ran for one call of ``fn`` (the profiler's events
    on the device: tests/test_device_ops.py's target is 6 per encode_into and decode_into)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=32 * 1024 * 1024)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    base = torch.from_numpy(np.load(args.data)) if args.data.exists() else torch.randn(1 << 22) * 0.02
    x = base.repeat(-(-args.numel // base.numel()))[:args.numel].to(DTYPES[args.dtype]).cuda()
    z, out = Lossless("triton"), torch.empty_like(x)
    buf = torch.empty(z.max_encoded_size(x.numel(), x.dtype), dtype=torch.uint8, device="cuda")
    z.decode(z.encode(x), out)  # compile
    z.encode_into(x, buf)
    size = z.encode_into(x, buf)
    z.decode_into(buf[:int(size)], out).check()
    packet = buf[:int(size)]
    print(f"# device operations per call: encode_into {_device_operations(lambda: z.encode_into(x, buf))}, "
          f"decode_into {_device_operations(lambda: z.decode_into(packet, out))}")
    for name, fn in (("encode_into", lambda: z.encode_into(x, buf)), ("decode_into", lambda: z.decode_into(packet, out))):
        host = {"direct": [], "triton": []}  # zipccl.kernels.launch's launches, and Triton's own
        for _ in range(3):  # alternating, so that the host's drift falls on both alike
            for mode, times in host.items():
                config.TRITON_LAUNCH = mode
                times.append(_host_time(fn) * 1e6)
        config.TRITON_LAUNCH = "direct"
        print(f"# host time per {name}, unsynchronised, no profiler: {np.median(host['direct']):.0f} us with direct "
              f"launches, {np.median(host['triton']):.0f} us with Triton's own (ZIPCCL_TRITON_LAUNCH=triton); "
              f"medians of 3 alternating runs of 200 calls")
        print(_host_profile(fn))
    spent = _timed_host_steps()
    walls = {"encode": [], "decode": [], "encode_into": [], "decode_into": []}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.repeat):
            torch.cuda.synchronize()
            t = time.perf_counter()
            coded = z.encode(x)
            torch.cuda.synchronize()
            walls["encode"].append(time.perf_counter() - t)
            t = time.perf_counter()
            z.decode(coded, out)
            torch.cuda.synchronize()
            walls["decode"].append(time.perf_counter() - t)
            t = time.perf_counter()
            z.encode_into(x, buf)  # no host read: the size stays on the device
            torch.cuda.synchronize()
            walls["encode_into"].append(time.perf_counter() - t)
            t = time.perf_counter()
            z.decode_into(packet, out)  # its size read before the loop: no host read inside
            torch.cuda.synchronize()
            walls["decode_into"].append(time.perf_counter() - t)
    nbytes = x.numel() * x.element_size()
    print(f"# {torch.cuda.get_device_name()}, {args.numel} {args.dtype} elements ({nbytes / 2**20:.0f} MiB), "
          f"ratio {coded.numel() / nbytes:.4f}")
    for k, v in walls.items():
        m = float(np.median(v))
        print(f"# {k}: median {m * 1e3:.3f} ms per call, {nbytes / m / 1e9:.1f} GB/s of input")
    for k, (total, calls) in spent.items():
        print(f"# step {k}: {total / calls * 1e3:.3f} ms per call (wall, under the profiler; {calls} calls)")
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=48))
            break
        except (AttributeError, KeyError, ValueError):
            continue


if __name__ == "__main__":
    main()
