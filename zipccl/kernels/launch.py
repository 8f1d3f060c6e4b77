"""Triton launches without Triton's per-call bookkeeping.

Triton's own launch (``kernel[grid](...)``) binds and specializes every argument, builds its
cache key with the text of the compile options and checks the kernel's globals, on every call:
on the H200 host of docs/bench/2026-11-30-gpu-h200-run2 an ``encode_into`` of 8 MiB spent
302 us of host time, about half of it inside Triton's launch function (cProfile's table in that
record: 62 of 132 ms over 200 calls, under the profiler). ``launch`` keeps, per kernel, the compiled kernel
that Triton's own launch chose for a set of argument properties that decide Triton's
specialization, and calls that kernel's launcher directly when they recur:

- each tensor's dtype and whether its address is a multiple of 16;
- each int's range (32 or 64 bits), whether it is 1, and whether it is a multiple of 16;
- each bool, float and None by its type; every constexpr and launch option by its type and value;
- the device, and the settings of Triton's that its key reads (debug, instrumentation, and
  Triton 3.9's float-sanitizer casts and stage-inspection hook).

That is at least as fine as Triton's own key, so a recurring set always meets the kernel Triton
compiled for it. The first call of a set goes through Triton (which compiles, or finds, the
kernel); so does every call under TRITON_INTERPRET (the interpreter's kernels have no launcher),
while a launch or pre-run hook is set (profilers add them), or with ZIPCCL_TRITON_LAUNCH=triton.
Not done here: Triton's check that a kernel's globals kept their values (the codec's are
constants).
"""

from __future__ import annotations

import torch
from triton import knobs
from triton.runtime import driver

from .. import config

_KERNELS: dict = {}  # id(kernel) -> _Kernel


class _Kernel:
    """A JIT function's parameters (names, constexpr flags) and its compiled kernels by argument
    properties."""
    __slots__ = ("fn", "names", "params", "constexpr", "compiled")

    def __init__(self, fn):
        self.fn = fn
        self.names = [p.name for p in fn.params]
        self.params = frozenset(self.names)  # for the per-call test of which keywords are options
        self.constexpr = [p.is_constexpr for p in fn.params]
        self.compiled: dict = {}


class _Unknown(Exception):
    """An argument whose specialization this module does not know: Triton's own launch takes it."""


_PLAIN = (bool, float, type(None))


def _property(value, constexpr: bool):
    """What Triton's specialization may read of one argument."""
    if constexpr:  # by type too: Triton keys a constexpr by its text, where True, 1 and 1.0 differ
        return type(value), value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    kind = type(value)
    if kind is int:
        return value == 1, value % 16 == 0, -2**31 <= value < 2**31, -2**63 <= value < 2**63
    if kind in _PLAIN:
        return kind
    raise _Unknown(kind)


def _hooked(hook) -> bool:
    """Whether a launch hook would run: Triton 3.6 and 3.9 keep chains of them (``calls``), empty
    unless a profiler added one; the launcher calls none where it is given None."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(fn, grid: tuple, *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)``, through the kernel Triton chose for these arguments' properties
    once it has chosen one (the module's docstring says when Triton's own launch runs instead)."""
    run = getattr(fn, "run", None)
    if config.TRITON_LAUNCH != "direct" or type(fn).__name__ != "JITFunction" or run is None:
        fn[grid](*args, **kwargs)
        return
    runtime = knobs.runtime
    kernel = _KERNELS.get(id(fn))
    if kernel is None or kernel.fn is not fn:
        kernel = _KERNELS[id(fn)] = _Kernel(fn)
    try:
        if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook) or fn.pre_run_hooks \
                or len(args) > len(kernel.names):
            raise _Unknown("a launch hook, a pre-run hook, or too many arguments")
        values = list(args)
        for name in kernel.names[len(args):]:
            if name not in kwargs:  # a default: Triton's own launch fills it in
                raise _Unknown(f"no value for {name}")
            values.append(kwargs[name])
        compilation = knobs.compilation
        key = (driver.active.get_current_device(), runtime.debug,  # and what else Triton 3.9 keys by
               getattr(compilation, "instrumentation_mode", None),
               getattr(compilation, "fpsan_homomorphic_casts", None),
               getattr(runtime, "add_stages_inspection_hook", None),
               tuple((k, type(v), v) for k, v in kwargs.items() if k not in kernel.params),
               tuple(_property(v, c) for v, c in zip(values, kernel.constexpr)))
        compiled = kernel.compiled.get(key)
    except (_Unknown, TypeError):  # TypeError: an option that cannot be a key (unhashable)
        fn[grid](*args, **kwargs)
        return
    if compiled is None:  # Triton's own launch: it compiles or finds the kernel, and launches it
        kernel.compiled[key] = run(*args, grid=grid, warmup=False, **kwargs)
        return
    g = (*grid, 1, 1)
    compiled.run(g[0], g[1], g[2], driver.active.get_current_stream(key[0]), compiled.function,
                 compiled.packed_metadata, None, None, None, *values)
