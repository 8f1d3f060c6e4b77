"""Bit primitives for the numba kernels that numba does not offer: unaligned loads and stores,
and BMI2's ``pext`` (the bits under a mask, packed together), which gathers a float16 pair's two
coded fields in one instruction where shifts and masks took five. Kernels choose their ``pext``
functions at import by FAST_PEXT, with shifts elsewhere."""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import config
from numba.extending import intrinsic


def _unaligned(nbits: int, load: bool):
    """An intrinsic for an unaligned little-endian load (``f(buf, pos) -> int64``) or
    store (``f(buf, pos, value)``, truncating) of ``nbits`` at byte ``pos`` of a uint8 array.

    LSB-first bits in little-endian 32-bit words (the format) are the same bytes
    as an LSB-first byte stream, so the coder may read and write whole bytes."""
    ty = ir.IntType(nbits)

    def address(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.bitcast(builder.gep(arr.data, [args[1]]), ty.as_pointer())

    if load:
        @intrinsic
        def load_(typingctx, buf, pos):
            def codegen(context, builder, sig, args):
                v = builder.load(address(context, builder, sig, args))
                v.align = 1
                return builder.zext(v, ir.IntType(64)) if nbits < 64 else v
            return types.int64(buf, pos), codegen
        return load_

    @intrinsic
    def store_(typingctx, buf, pos, value):
        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[2], sig.args[2], types.int64)
            builder.store(builder.trunc(v, ty) if nbits < 64 else v, address(context, builder, sig, args)).align = 1
            return context.get_dummy_value()
        return types.void(buf, pos, value), codegen
    return store_


load_u16 = _unaligned(16, load=True)
load_u32 = _unaligned(32, load=True)
load_u64 = _unaligned(64, load=True)
store_u32 = _unaligned(32, load=False)
store_u64 = _unaligned(64, load=False)


def fast_pext() -> bool:
    """Whether numba compiles for a host with a fast BMI2 ``pext``: x86 with BMI2, but not AMD
    before Zen 3, where it is microcoded (18 cycles and more), and not when numba is told to
    compile for another CPU (NUMBA_CPU_NAME), whose features the host's do not tell."""
    if config.CPU_NAME not in (None, "host"):
        return False
    name = llvm.get_host_cpu_name()
    return bool(llvm.get_host_cpu_features().get("bmi2")) and not name.startswith(("znver1", "znver2", "bdver"))


FAST_PEXT = fast_pext()


@intrinsic
def pext(typingctx, value, mask):
    """BMI2 ``pext``: the bits of ``value`` under ``mask``, packed to the low end (uint64). Only
    where FAST_PEXT: elsewhere LLVM may have no instruction for it."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fn = builder.module.globals.get("llvm.x86.bmi.pext.64") or ir.Function(
            builder.module, ir.FunctionType(i64, [i64, i64]), "llvm.x86.bmi.pext.64")
        return builder.call(fn, [context.cast(builder, a, t, types.uint64) for a, t in zip(args, sig.args)])
    return types.uint64(value, mask), codegen


def _prefetch(write: int):
    """An intrinsic ``f(buf, pos)``: a hint to bring the cache line of element ``pos`` of array
    ``buf`` in, to read it or (``write``) to write it (``llvm.prefetch``; no effect on what a
    kernel computes, and never a fault, wherever ``pos`` points)."""
    @intrinsic
    def prefetch_(typingctx, buf, pos):
        def codegen(context, builder, sig, args):
            arr = context.make_array(sig.args[0])(context, builder, args[0])
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = builder.module.globals.get("llvm.prefetch.p0i8") or ir.Function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8")
            builder.call(fn, [builder.bitcast(builder.gep(arr.data, [args[1]]), i8p), i32(write), i32(3), i32(1)])
            return context.get_dummy_value()
        return types.void(buf, pos), codegen
    return prefetch_


prefetch = _prefetch(0)
prefetch_write = _prefetch(1)
