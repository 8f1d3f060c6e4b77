"""Ahead-of-time compilation of the Triton kernels for real GPUs, without a GPU.

``python -m zipccl.kernels.aot`` compiles every kernel of kernels/gpu.py for
each dtype and for sm_80 and sm_90, and reports what the compiler says about
it: registers, spills and static shared memory (from Triton's metadata and,
where the bundled ``cuobjdump`` runs, from the cubin itself), and the SASS
instructions and barriers of each program. It cannot run
under TRITON_INTERPRET=1, which replaces kernels by interpreted functions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

from ..bank import BANK_SIZE
from ..errors import UnsupportedError
from ..format import GPU_BLOCK_SIZE, LAYOUTS, NSYM, RAW_BLOCK, SYM_ZERO

ARCHS = (80, 90)
BLOCK_SIZE = GPU_BLOCK_SIZE
_DTYPES = {"bfloat16": "*i16", "float16": "*i16", "float32": "*i32"}  # the elements' pointer type


def _specs(dtype: str):
    """(kernel name, signature, constexprs, num_warps) of every kernel for one dtype."""
    ptr, layout = _DTYPES[dtype], LAYOUTS[getattr(torch, dtype)]
    ebits, mbits, rest_bytes, side_bits, bias, itemsize = (layout.ebits, layout.mbits, layout.rest_bytes,
                                                           layout.side_bits, layout.offset_bias, layout.itemsize)
    vmask = -1 if itemsize == 4 else 0xFFFF
    bs = BLOCK_SIZE
    from . import gpu
    # encode_many's builds (PARTS): encode_into's are the same code without the parts' offsets
    yield ("_analyse", {"x_ptr": ptr, "xoff_ptr": "*i64", "n": "i64", "ref_ptr": "*i32", "hist_ptr": "*i16"},
           dict(BS=bs, VMASK=vmask, MBITS=mbits, EMAX=(1 << ebits) - 1, BIAS=bias, PARTS=True), gpu.block_warps(bs))
    yield ("_encode", {"x_ptr": ptr, "xoff_ptr": "*i64", "n": "i64", "block_ptr": "*i64", "codes_ptr": "*i32",
                       "lens_ptr": "*i32", "sub_ptr": "*u8", "words_ptr": "*i32", "rest_ptr": "*u8", "slot": "i64",
                       "totals_ptr": "*i64"},
           dict(BS=bs, VMASK=vmask, MBITS=mbits, EBITS=ebits, REST_BYTES=rest_bytes, SIDE_BITS=side_bits, BIAS=bias,
                ITEMSIZE=itemsize, PARTS=True), gpu.block_warps(bs))
    # decode_many's builds (PARTS): decode_into's are the same code without the packets' places
    many = {"parts_ptr": "*i64", "part_words": "i64"}
    # the decoder's lanes at a block of one sub-stream, of 16 (the default) and of 128 (4 warps)
    for sub_bs in (256, bs, 32768):
        width = gpu.lanes(sub_bs)[0]
        yield ("_decode_symbols", {"words_ptr": "*i32", "nwords": "i64", "pkt_ptr": "*u8", "code_ptr": "*i16",
                                   "count_ptr": "*i32",
                                   "coded_ptr": "*i64", "meta_ptr": "*i64", "first": "i64", "span": "i64", "n": "i64",
                                   "rows_ptr": "*i64", "stride": "i64", "lut_ptr": "*i32", "err_ptr": "*i64", **many,
                                   "err_stride": "i64"},
               dict(BS=sub_bs, LANES=width, CHUNK=gpu.JOIN_CHUNK, EBITS=ebits, BIAS=bias, PARTS=True),
               width // 32)
        yield ("_decode_join", {"code_ptr": "*i16", "count_ptr": "*i32", "rest_ptr": "*u8", "out_ptr": ptr, "n": "i64",
                                "coded_ptr": "*i64", "meta_ptr": "*i64", "first": "i64", "span": "i64",
                                "rows_ptr": "*i64", "stride": "i64", "err_ptr": "*i64", **many, "err_stride": "i64"},
               dict(BS=sub_bs, LANES=width, CHUNK=gpu.JOIN_CHUNK, MBITS=mbits, EBITS=ebits, REST_BYTES=rest_bytes,
                    SIDE_BITS=side_bits, PARTS=True), gpu.join_warps(width))
    yield ("_decode_raw", {"rest_ptr": "*u8", "out_ptr": ptr, "n": "i64", "order_ptr": "*i64", "meta_ptr": "*i64",
                           "rows_ptr": "*i64", "stride": "i64", "err_ptr": "*i64", **many, "err_stride": "i64"},
           dict(BS=bs, ITEMSIZE=itemsize, PARTS=True), gpu.block_warps(bs))
    from . import device_plan
    yield ("_choose", {"sampled_ptr": "*i16", "exact_ptr": "*i16", "stride": "i64", "ref_ptr": "*i32",
                       "bits_ptr": "*i32", "index_ptr": "*i16", "index_stride": "i64", "block_ptr": "*i64",
                       "lens_ptr": "*i64", "nb": "i64", "numel": "i64"},
           dict(BS=bs, NSYM=NSYM, NBANK=BANK_SIZE, ZERO=SYM_ZERO, RAW=RAW_BLOCK, REST_BYTES=rest_bytes,
                SIDE_BITS=side_bits, ITEMSIZE=itemsize, TILE=device_plan.TILE), 4)
    yield ("_place", {"lens_ptr": "*i64", "block_ptr": "*i64", "totals_ptr": "*i64", "nb": "i64", "tmpl_ptr": "*u8",
                      "hdr_ptr": "*u8", "hdr_stride": "i64", "size_ptr": "*i64", "prefix": "i64"},
           dict(SCAN=device_plan.SCAN, SEAL=True), 4)
    yield ("_index", {"pkt_ptr": "*u8", "start": "i64", "nb": "i64", "n": "i64", "bs": "i64", "ntables": "i64",
                      "rows_ptr": "*i64", "order_ptr": "*i64", "meta_ptr": "*i64", "verdict_ptr": "*i64",
                      "tmpl_ptr": "*u8", "room": "i64", "s2": "i64", "s3": "i64", "parts_ptr": "*i64",
                      "part_words": "i64"},
           dict(EMAX=(1 << ebits) - 1, ITEMSIZE=itemsize, REST_BYTES=rest_bytes, SIDE_BITS=side_bits, RAW=RAW_BLOCK,
                SCAN=device_plan.SCAN, HEADER=True, ERRORS=device_plan.VERDICT_ERRORS, PARTS=True),
           device_plan.INDEX_WARPS)


def _cubin_usage(cubin: bytes) -> dict:
    """cubin_reg, _stack, _shared, _local of the cubin's function, from the cuobjdump that Triton
    bundles; and its SASS: instructions and barriers (``bar``), counted statically. In a kernel
    without a loop of its own (``_analyse``, ``_encode``, ``_decode_join``, ``_decode_raw``,
    ``_choose``: their loops unroll) that is close to what each thread executes, a measure of a
    compute-bound kernel's work that needs no GPU."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        tool = shutil.which("cuobjdump")
    if not tool:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    usage = {f"cubin_{k.lower()}": int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return {**usage, "sass": len(ops), "sass_bar": ops.count("BAR")}


def compile_kernels(archs=ARCHS, dtypes=tuple(_DTYPES)) -> list[dict]:
    """Compile every kernel; one row per (kernel, dtype, arch) with the compiler's resource report."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise UnsupportedError("AOT compilation needs TRITON_INTERPRET unset (interpreted kernels do not compile)")
    import triton
    from triton.backends.compiler import GPUTarget
    from . import device_plan, gpu
    rows = []
    for dtype in dtypes:
        for name, signature, constexprs, warps in _specs(dtype):
            for arch in archs:
                fn = getattr(gpu, name, None) or getattr(device_plan, name)
                src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
                k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
                usage = _cubin_usage(k.asm["cubin"])
                rows.append(dict(kernel=name, dtype=dtype, arch=f"sm_{arch}", block=constexprs.get("BS"), num_warps=warps,
                                 triton=triton.__version__, shared=k.metadata.shared, ptx_bytes=len(k.asm["ptx"]),
                                 cubin_bytes=len(k.asm["cubin"]), **usage))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zipccl.kernels.aot", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    ap.add_argument("--arch", type=int, action="append", choices=ARCHS,
                    help="compile for this sm_ only (repeatable; default: all of %(choices)s)")
    args = ap.parse_args(argv)
    rows = compile_kernels(tuple(args.arch or ARCHS))
    if args.json:
        print(json.dumps(rows))
        return 0
    # Spilled registers go to the stack frame (cuobjdump's STACK), not LOCAL: both are shown.
    print(f"{'kernel':<15} {'dtype':<9} {'arch':<6} {'block':>6} {'warps':>5} {'regs':>5} {'stack':>6} {'local':>6} "
          f"{'shared':>7} {'cubin':>7} {'sass':>6} {'bar':>4}")
    for r in rows:
        print(f"{r['kernel']:<15} {r['dtype']:<9} {r['arch']:<6} {r['block'] or '-':>6} {r['num_warps']:>5} "
              f"{r.get('cubin_reg', '-'):>5} "
              f"{r.get('cubin_stack', '-'):>6} {r.get('cubin_local', '-'):>6} {r['shared']:>7} {r['cubin_bytes']:>7} "
              f"{r.get('sass', '-'):>6} {r.get('sass_bar', '-'):>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
