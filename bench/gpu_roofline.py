"""An estimate, not a measurement: predicted Triton codec throughput on H100 / H200.

This script compiles the kernels for sm_90 (zipccl.kernels.aot), counts the
SASS instructions they execute per element, and combines three bounds per bf16
element: HBM bytes moved, instruction issue, and (decode) the latency of its
serial per-block loop. The assumptions are printed with the numbers;
docs/GPU.md discusses them, and the measurements on an NVIDIA H100 (2026-11-26), which found
the bound this model lacks (scattered per-lane accesses, one L1 wavefront per
lane and instruction).

    python bench/gpu_roofline.py [--ratio 0.67] [--mib 64]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from zipccl.kernels import aot, gpu

GPUS = {"H100 SXM": 3.35e12, "H200": 4.8e12}  # HBM bytes/s
SMS, CLOCK, ISSUE = 132, 1.98e9, 4           # both: 132 SMs, 1.98 GHz boost, 4 warp-instructions/clock/SM
DECODE_LATENCY = 100                          # assumed cycles per iteration of one lane's dependent chain
STATS_BYTES = 4 + 2 * 2 * 32                  # ref + two 16-bit histograms per block


def sass(name: str, dtype: str) -> tuple[int, int, int]:
    """(static instructions, innermost loop body instructions, warps) of one kernel on sm_90."""
    for kname, sig, cx, warps in aot._specs(dtype):
        if kname == name:
            break
    k = triton.compile(triton.compiler.ASTSource(fn=getattr(gpu, name), signature=sig, constexprs=cx),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)
    spans = []
    for addr, ins in lines:
        m = re.search(r"BRA (0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < int(addr, 16):
            spans.append((int(addr, 16) - int(m.group(1), 16)) // 16 + 1)
    return len(lines), min(spans, default=0), warps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratio", type=float, default=0.67, help="compressed/original size (bf16 gradients: 0.67)")
    ap.add_argument("--mib", type=float, default=64, help="message size for the decode latency bound")
    args = ap.parse_args()
    bs, item, r = aot.BLOCK_SIZE, 2, args.ratio
    a_ins, _, a_w = sass("_analyse", "bfloat16")
    e_ins, _, e_w = sass("_encode", "bfloat16")
    _, d_body, _ = sass("_decode_symbols", "bfloat16")
    j_ins, _, j_w = sass("_decode_join", "bfloat16")
    enc_instr = (a_ins * a_w + e_ins * e_w) / bs       # warp-instructions per element (loop-free kernels)
    # one loop iteration decodes LANES elements; a join program makes LANES x CHUNK of them
    dec_instr = d_body / gpu.LANES + j_ins * j_w / (gpu.LANES * gpu.JOIN_CHUNK)
    enc_bytes = item + STATS_BYTES / bs + item + item * r  # analyse reads, encode reads and writes
    need = item + item * r                               # what any encoder must read and write
    dec_bytes = item * r + item + 2 * 2                  # + the 16-bit codes written and read between kernels
    issue = SMS * ISSUE * CLOCK
    warps = max(1.0, args.mib * 2**20 / item / bs / gpu.LANES)
    latency = min(warps / SMS, 64) * SMS * 32 * CLOCK / DECODE_LATENCY  # elements/s with that many warps
    print(f"# ESTIMATE, not a measurement. bf16, ratio {r}, block {bs}, sm_90 SASS from triton {triton.__version__}")
    print(f"# encode: {a_ins} + {e_ins} static instructions x {a_w}/{e_w} warps per block = "
          f"{enc_instr:.1f} warp-instr/element; {enc_bytes:.2f} B/element moved ({need:.2f} B needed)")
    print(f"# decode: loop body {d_body} instructions for {gpu.LANES} lanes, join {j_ins} x {j_w} warps for "
          f"{gpu.LANES * gpu.JOIN_CHUNK} elements = {dec_instr:.2f} warp-instr/element;"
          f" {dec_bytes:.2f} B/element; {warps:.0f} warps for {args.mib:g} MiB, {DECODE_LATENCY} cycles/iteration")
    print(f"# issue: {SMS} SMs x {ISSUE} warp-instr/clock x {CLOCK / 1e9:.2f} GHz")
    print(f"{'GPU':<9} {'op':<7} {'HBM roof':>9} {'bytes bound':>11} {'issue bound':>11} {'latency':>9} "
          f"{'predicted':>9} {'of roof':>7}   (GB/s of uncompressed bf16)")
    for gpu_name, bw in GPUS.items():
        roof = bw / need * item / 1e9
        rows = [("encode", bw / enc_bytes, issue / enc_instr, float("inf")),
                ("decode", bw / dec_bytes, issue / dec_instr, latency)]
        for op, mem, ins, lat in rows:
            pred = min(mem, ins, lat) * item / 1e9
            lat_s = "-" if lat == float("inf") else f"{lat * item / 1e9:.0f}"
            print(f"{gpu_name:<9} {op:<7} {roof:>9.0f} {mem * item / 1e9:>11.0f} {ins * item / 1e9:>11.0f} "
                  f"{lat_s:>9} {pred:>9.0f} {pred / roof:>7.0%}")


if __name__ == "__main__":
    main()
