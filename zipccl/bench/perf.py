"""zipccl-perf: nccl-tests-style bandwidth of zipccl's compressed collectives.

    zipccl-perf                                   # 4 local ranks over gloo, all codecs
    zipccl-perf -b 64M -e 64M -d bfloat16 --baseline --data grads.npy --netlab 1gbit
    torchrun --nproc-per-node 4 -m zipccl.bench.perf ...   # or mpirun -np 4 zipccl-perf ...

Columns follow nccl-tests (size count type redop root time algbw busbw #wrong),
with busbw computed on the uncompressed size (effective bandwidth), plus
codec, wire_B (bytes this rank sent per call) and ratio (wire / raw bytes).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from .. import config, launch, topology
from ..collectives import auto_policy
from . import all_gather, all_reduce, reduce_scatter
from .common import (CODECS, DTYPES, OPS, footer_lines, header_lines, load_data, measure, parser, plot, progress,
                     rank_order_reduce, real, row_line, sizes, validate, verifiable, write_json, zipccl_codec)

SPECS = {s.name: s for s in (all_reduce.SPEC, reduce_scatter.SPEC, all_gather.SPEC)}


def _plan(args):
    dtypes = list(DTYPES.values()) if args.datatype == "all" else [DTYPES[args.datatype]]
    ops = list(OPS.values()) if args.op == "all" else [OPS[args.op]]
    codecs = list(CODECS) if args.codec == "all" else [args.codec]
    if args.baseline:
        codecs = [None] + codecs
    return dtypes, ops, codecs


def run_rank(rank: int, nranks: int, args, how: str = "local spawn") -> list[dict]:
    """Every rank runs the sweep; rank 0 prints the table and writes JSON and the plot."""
    spec = SPECS[args.collective]
    if not spec.has_op:
        args.op = "sum"
    dtypes, ops, codecs = _plan(args)
    data = load_data(args.data) if args.data else None
    points = [(d, o, s) for d in dtypes for o in ops for s in sizes(args.minbytes, args.maxbytes, args.stepfactor,
                                                                      args.stepbytes)]
    say = print if rank == 0 else (lambda *a, **k: None)
    for line in header_lines(args, nranks, how):
        say(line, flush=True)
    rows, k, total = [], 0, len(points) * len(codecs)
    for dtype, op, size in points:
        count = size // torch.empty(0, dtype=dtype).element_size()
        numel_in, numel_out = spec.buffers(count, nranks)
        if numel_in == 0:
            continue
        if data is None:
            inp = verifiable(numel_in, dtype, rank, nranks)
            ref = spec.expect([verifiable(numel_in, dtype, r, nranks) for r in range(nranks)], op, rank, nranks) \
                .to(dtype) if args.check else None
        else:  # real data: sums depend on the order, checked where zipccl promises it (real_reference)
            inp = real(data, numel_in, dtype, rank)
            inputs = [real(data, numel_in, dtype, r) for r in range(nranks)] if args.check else None
        for codec in codecs:
            k += 1
            if rank == 0:
                progress(k, total, f"{spec.name} {size} B {dtype} {codec or 'torch'}")
            if codec is None and op == dist.ReduceOp.AVG:
                say("#  (torch baseline skipped for avg: gloo has no AVG)")
                continue
            reference = ref if data is None else \
                real_reference(spec, args, inputs, op, codec, rank, nranks) if args.check else None
            row = measure(spec, args, numel_in, numel_out, dtype, op, codec, inp, reference, nranks)
            rows.append(row)
            say(row_line(row), flush=True)
    for line in footer_lines(rows):
        say(line, flush=True)
    for line in plan_lines("auto" in codecs):
        say(line, flush=True)
    if rank == 0 and args.output_file:
        write_json(rows, args.output_file, dict(args={k: str(v) for k, v in vars(args).items()}, how=how))
    if rank == 0 and args.plot:
        plot(rows, args.plot, f"zipccl-perf {spec.name}, {nranks} ranks ({how})")
    return rows


def plan_lines(auto: bool) -> list[str]:
    """The group's topology, and what codec="auto" measured on it per size class (the better of
    each plan's last two times, slowest rank) and what it runs now."""
    lines = [f"# topology: {topology.topology()}"]
    explained = auto_policy().explain() if auto else []
    if explained:
        lines.append("# auto plans (per size class: each plan's time, the better of its last two, slowest rank):")
        lines += [f"#   {line}" for line in explained]
    return lines


def real_reference(spec, args, inputs, op, codec, rank: int, nranks: int):
    """This rank's expected output for real data (every rank's input, ``inputs``, is known
    here: real() is deterministic), from plain torch, or None where no exact bits are
    promised. Gathers, MAX and MIN do not depend on the order: checked for every codec and the
    backend. SUM and AVG: zipccl's exact codecs add in rank order, or node by node with
    --algorithm hierarchical and zipccl's own sums inside the nodes (rank_order_reduce); the
    backend (the torch baseline, auto's native plans, a native intra-node level) adds in an
    order of its own, and so does the opt-in ring reduce-scatter (ZIPCCL_REDUCE_SCATTER=ring,
    rounding at every hop): those rows are not checked."""
    if spec.name == "all_gather":
        return torch.cat(inputs)
    ordered = op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
    if ordered and (codec in (None, "auto") or config.REDUCE_SCATTER == "ring"
                    or (args.algorithm == "hierarchical" and args.intra == "native")):
        return None
    nodes = topology.topology().nodes if ordered and args.algorithm == "hierarchical" else None
    full = rank_order_reduce(inputs, op, nodes)
    if spec.name == "reduce_scatter":
        m = full.numel() // nranks
        return full[rank * m:(rank + 1) * m]
    return full


def _spawned(rank, nranks, args):
    rows = run_rank(rank, nranks, args)
    return sum(r["wrong"] or 0 for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = parser("zipccl-perf")
    args = ap.parse_args(argv)
    validate(ap, args)
    if args.netlab:
        from .netlab import run_perf
        return run_perf(args.netlab, args.nranks, [a for a in (argv if argv is not None else sys.argv[1:])],
                        nodes=args.nodes)
    if args.nodes is not None and args.nodes > 1:  # emulated nodes for the ranks spawned here (a launcher's variables take second place)
        os.environ["ZIPCCL_TOPOLOGY"] = f"{args.nodes}x{args.nranks // args.nodes}"
        config.TOPOLOGY = os.environ["ZIPCCL_TOPOLOGY"]
    world = launch.detect()
    if world is not None:
        launch.init()
        rows = run_rank(world.rank, world.size, args, args.how or world.launcher)
        launch.shutdown()
        return 1 if any((r["wrong"] or 0) > 0 for r in rows) else 0
    wrong = launch.spawn(_spawned, args.nranks, args)
    return 1 if any(w for w in wrong) else 0


if __name__ == "__main__":
    sys.exit(main())
