"""The GPU codec's host path against a stand-in CUDA driver for Triton, without a GPU: every
kernel is compiled for sm_90 as on a GPU machine, and its launcher records each launch's
arguments instead of running it. Run as a script (without TRITON_INTERPRET, which replaces the
kernels by interpreted ones): the launches of the same calls made through Triton's own launch
(ZIPCCL_TRITON_LAUNCH=triton) and through zipccl.kernels.launch's direct one, as JSON on stdout,
for tests/test_triton_launch.py to compare.

The calls run on CPU tensors and their kernels do not run, so packets and outputs hold nothing
meaningful; no call reads them on the host (encode_into, decode_into and their batched forms
leave every result on the device).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

LAUNCHES: list = []
TRITON_RUNS: list = []


class _Launcher:
    """One per compiled kernel (as Triton makes them): records its calls."""

    def __init__(self, src, metadata):
        self.name = getattr(metadata, "name", "?")

    def __call__(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        hooks = [enter, exit_]
        LAUNCHES.append(dict(kernel=self.name, compiled=id(self), grid=[gx, gy, gz], stream=stream,
                             function=function, packed=repr(packed_metadata), args=[_shown(a) for a in args],
                             hooks_run=sum(len(getattr(h, "calls", [h])) for h in hooks if h is not None)))


def _shown(a):
    """An argument as a launch passes it: a tensor by its dtype, shape and address (numbered in
    ``main`` by first appearance in the call: each call allocates its scratch afresh), others as
    they are."""
    if isinstance(a, torch.Tensor):
        return ["tensor", str(a.dtype), list(a.shape), a.data_ptr() % 16, a.data_ptr()]
    return a if isinstance(a, (int, float, bool, type(None), str)) else repr(a)


def _numbered(launches: list) -> list:
    """The launches with each tensor address replaced by its number of first appearance."""
    seen: dict = {}
    for launch in launches:
        for a in launch["args"]:
            if isinstance(a, list) and a[0] == "tensor":
                a[-1] = seen.setdefault(a[-1], len(seen))
    return launches


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return object(), f"function:{name}", 64, 0, 1024

    def get_device_properties(self, device):
        return dict(max_shared_mem=232448, multiprocessor_count=132, max_num_regs=65536, warpSize=32,
                    sm_clock_rate=1980000, mem_clock_rate=2619000, mem_bus_width=6144)


class FakeCuda:
    """What Triton's JIT asks of its driver, for one sm_90 device on stream 7."""
    launcher_cls = _Launcher

    def __init__(self):
        self.utils = _Utils()

    def is_active(self):
        return True

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 7

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def _calls(n: int):
    """The codec calls to record, each on the same tensors every round: aligned and not."""
    from zipccl.codecs import Lossless
    from zipccl.kernels import gpu
    codec = Lossless("triton")
    base = torch.zeros(n + 8, dtype=torch.bfloat16)
    x, shifted = base[:n], base[1:n + 1]  # shifted: 2 bytes past a 16-byte boundary
    out = torch.zeros(codec.max_encoded_size(n, x.dtype) + 64, dtype=torch.uint8)
    y = torch.zeros(n, dtype=x.dtype)
    k = n // 4
    slot = codec.slot(k, x.dtype)
    many = torch.zeros(3 * slot, dtype=torch.uint8)
    outs = torch.zeros(3 * k, dtype=x.dtype)
    return [
        ("encode_into", lambda: gpu.encode_into(x, out, 4096)),
        ("encode_into, x at 2 bytes past 16", lambda: gpu.encode_into(shifted, out, 4096)),
        ("decode_into", lambda: gpu.decode_into(out, y, 4096)),
        ("encode_many", lambda: gpu.encode_many([x[j * k:(j + 1) * k] for j in range(3)], many, slot, 4096)),
        ("decode_many", lambda: gpu.decode_many([many[j * slot:(j + 1) * slot] for j in range(3)],
                                                [outs[j * k:(j + 1) * k] for j in range(3)], 4096)),
    ]


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: the kernels must compile")
    driver.set_active(FakeCuda())
    real_run = JITFunction.run

    def counted(self, *args, **kwargs):
        TRITON_RUNS.append(self.fn.__name__)
        return real_run(self, *args, **kwargs)
    JITFunction.run = counted
    from zipccl import config
    rounds = {}
    calls = _calls(int(sys.argv[1]) if len(sys.argv) > 1 else 3 * 4096 + 100)
    for mode, label in (("triton", "triton"), ("direct", "direct, first"), ("direct", "direct, again")):
        config.TRITON_LAUNCH = mode
        for name, call in calls:
            LAUNCHES.clear()
            TRITON_RUNS.clear()
            call()
            rounds.setdefault(label, {})[name] = dict(launches=_numbered(list(LAUNCHES)),
                                                      triton_runs=list(TRITON_RUNS))
    # A setting of Triton's that its key reads (Triton 3.9's float-sanitizer casts; 3.6 has none):
    # changed, the next launches are Triton's own again, which compile kernels of their own.
    from triton import knobs
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        knobs.compilation.fpsan_homomorphic_casts = not knobs.compilation.fpsan_homomorphic_casts
        for mode, label in (("direct", "direct, a setting changed"), ("triton", "triton, a setting changed")):
            config.TRITON_LAUNCH = mode
            LAUNCHES.clear()
            TRITON_RUNS.clear()
            calls[0][1]()
            rounds[label] = dict(launches=_numbered(list(LAUNCHES)), triton_runs=list(TRITON_RUNS))
    print(json.dumps(rounds))


if __name__ == "__main__":
    main()
