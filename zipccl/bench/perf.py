"""zipccl-perf: nccl-tests' bandwidth benchmark, for zipccl's compressed collectives.

    zipccl-perf                                   # 4 local ranks over gloo, all codecs
    zipccl-perf -b 64M -e 64M -d bfloat16 --baseline --data grads.npy --netlab 1gbit
    torchrun --nproc-per-node 4 -m zipccl.bench.perf ...   # or mpirun -np 4 zipccl-perf ...
    zipccl-perf --backend zipccl -b 64K -e 64M          # dist.* on the drop-in backend vs on gloo

Standard output is nccl-tests' (2.19.6) exactly, one complete table per codec (report.py):
out-of-place and in-place columns (size count type redop root time algbw busbw #wrong
time algbw busbw #wrong), busbw on the uncompressed size (effective bandwidth). zipccl's
own figures (codec, wire bytes, ratio, what auto ran) follow each table's footer in `#`
lines and sit under "zipccl" keys in the -J JSON. Progress goes to standard error. The tables
are printed when the sweep ends: at each size the tables' calls take turns, call by call, so
that their ratios compare calls made in the same seconds on a host whose speed drifts.
"""

from __future__ import annotations

import atexit
import os
import platform
import socket
import sys

import torch
import torch.distributed as dist

from .. import __version__, config, launch, topology
from ..collectives import auto_policy
from ..errors import UnsupportedError
from . import all_gather, all_reduce, alltoall, reduce_scatter, report, sendrecv
from . import cuda
from .common import (BASELINE, DTYPES, OPS, Variant, codecs_of, gaussian, load_data, measure_side_by_side, parser,
                     plot, progress, rank_order_reduce, real, sizes, validate, verifiable)

SPECS = {s.name: s for s in (all_reduce.SPEC, reduce_scatter.SPEC, all_gather.SPEC, alltoall.SPEC, sendrecv.SPEC)}


#: --backend zipccl's two tables: plain dist.* calls on a gloo group, then on the zipccl world.
GLOO, DROPIN = "torch-gloo", "drop-in"


def _plan(args):
    """dtypes, ops and the variants to time, one table each: (label, zipccl codec or None for
    the plain torch.distributed call, on the world or on a gloo group)."""
    dtypes = list(DTYPES.values()) if args.datatype == "all" else [DTYPES[args.datatype]]
    ops = list(OPS.values()) if args.op == "all" else [OPS[args.op]]
    if args.backend == "zipccl":
        return dtypes, ops, [(GLOO, None, "gloo"), (DROPIN, None, "world")]
    # on CUDA zipccl runs on the NCCL group, as a user's would: "native" is that group's own NCCL
    where = cuda.NCCL_GROUP if args.device == "cuda" else "world"
    variants = [(c, c, where) for c in codecs_of(args.codec)]
    if args.baseline:
        variants = [(BASELINE, None, "world")] + variants
    if args.device == "cuda":
        variants = cuda.with_baseline(variants, BASELINE)
    return dtypes, ops, variants


def run_config(args) -> dict:
    """nccl-tests' "config" (the run line's figures); booleans as nccl-tests writes them."""
    step = {"step_factor": args.stepfactor} if args.stepfactor > 1 else {"step_bytes": args.stepbytes}
    return dict(nthreads=args.nthreads, ngpus=args.ngpus, minimum_bytes=args.minbytes, maximum_bytes=args.maxbytes,
                **step, warmup_iters=args.warmup_iters, iterations=args.iters, aggregated_iterations=1,
                validation=args.check, graph=0, blocking_collectives="false",
                per_iter_timing="true" if args.per_iter_timing else "false", per_iter_skip=0, parallel_init="false")


def devices(device: str = "cpu") -> list[dict]:
    """One entry per rank (nccl-tests' "Using devices"): CPU ranks have no device (-1) and say so."""
    mine = dict(rank=dist.get_rank(), group=0, pid=os.getpid(), hostname=socket.gethostname().split(".")[0],
                device=-1, device_hex="0000:00:00",
                device_info=f"CPU {platform.machine()} ({dist.get_backend()}, torch {torch.__version__})")
    if device == "cuda":
        mine.update(cuda.device_entry())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _inputs(spec, args, data, dtype, op, numel_in, rank, nranks):
    """(this rank's timed input, the checks' input and expected output, every rank's input).
    Without --data: gaussian data timed, and checked on verifiable data against plain torch on
    every rank's; with it: the real tensors timed and checked, every rank's input given for
    the reference, which depends on the codec (real_reference)."""
    if data is None:
        check = verifiable(numel_in, dtype, rank, nranks) if args.check else None
        ref = spec.expect([verifiable(numel_in, dtype, r, nranks) for r in range(nranks)], op, rank, nranks) \
            .to(dtype) if args.check else None
        return gaussian(numel_in, dtype, rank), check, ref, None
    inputs = [real(data, numel_in, dtype, r) for r in range(nranks)] if args.check else None
    return real(data, numel_in, dtype, rank), None, None, inputs


def run_rank(rank: int, nranks: int, args, how: str = "local spawn", argv: list[str] | None = None) -> list[dict]:
    """Every rank runs the sweep, size by size, each size's variants side by side (their calls
    taking turns: common.measure_side_by_side); rank 0 prints one table per variant at the end,
    and writes the JSON after each size (a run cut short keeps the sizes it measured) and the plot."""
    spec = SPECS[args.collective]
    if not spec.has_op:
        args.op = "sum"
    dtypes, ops, variants = _plan(args)
    data = load_data(args.data) if args.data else None
    points = [(d, o, s) for d in dtypes for o in ops for s in sizes(args.minbytes, args.maxbytes, args.stepfactor,
                                                                      args.stepbytes)]
    say = print if rank == 0 else (lambda *a, **k: None)
    start, cfg, devs = report.now(), run_config(args), devices(args.device)
    if args.output_file:
        say(f"# Writing JSON output to {args.output_file}")
    groups = _groups(variants)
    topo = str(topology.topology(groups.get(variants[-1][2])))  # on every rank: the first call is collective
    tables = [dict(name=f"{spec.name}_perf:{label}", codec=label, rows=[], notes=[], versus=None)
              for label, _, _ in variants]
    for k, (dtype, op, size) in enumerate(points, 1):
        itemsize = torch.empty(0, dtype=dtype).element_size()
        count = size // itemsize
        if spec.line_bytes:  # as nccl-tests: each rank's part in whole 16-byte lines
            line = spec.line_bytes // itemsize
            count = count // nranks // line * line * nranks
        numel_in, numel_out = spec.buffers(count, nranks)
        if rank == 0:
            progress(k, len(points), f"{spec.name} {size} B {dtype}: {', '.join(t['codec'] for t in tables)}")
        inp, check, ref, inputs = _inputs(spec, args, data, dtype, op, numel_in, rank, nranks)
        timed = []
        for table, (label, variant, where) in zip(tables, variants):
            group = groups.get(where)
            if variant is None and spec.reduces and op == dist.ReduceOp.AVG and dist.get_backend(group) == "gloo":
                table["notes"].append(f"{size} B {dtype}: avg skipped (gloo has no AVG)")
                continue
            reference = real_reference(spec, args, inputs, op, variant, rank, nranks) \
                if data is not None and args.check else ref
            timed.append((table, Variant(label, variant, group, reference)))
        rows = measure_side_by_side(spec, args, numel_in, numel_out, dtype, op, [v for _, v in timed], inp, rank,
                                    nranks, check)
        for (table, v), row in zip(timed, rows):
            table["rows"].append(row)
            if v.codec == "auto" and rank == 0:  # which plans the row's calls ran, at once (a run cut short
                # keeps it), on stderr as the progress lines: stdout keeps nccl-tests' format
                for line in learning_lines([row])[1:]:
                    print("# auto at " + line[1:].strip(), file=sys.stderr, flush=True)
        _versus(tables)
        if rank == 0 and args.output_file:
            _write_json(args, spec, nranks, how, start, argv, cfg, devs, tables, variants, groups, topo)
    version = (f"zipccl-perf version {__version__} (nccl-tests {report.FORMAT_VERSION} output format) "
               f"torch {torch.__version__} backend {dist.get_backend()}")
    clock = "CUDA-event" if args.device == "cuda" else "wall-clock"  # as bench.cuda.Clock times the calls
    for table, (label, variant, where) in zip(tables, variants):
        what = {BASELINE: "plain torch.distributed (--baseline)", GLOO: "plain torch.distributed on gloo",
                DROPIN: f"plain torch.distributed on the zipccl backend (ZIPCCL_CODEC={config.CODEC})"}.get(
                    label, f"zipccl codec {label}")
        extra = [f"# zipccl-perf table: {what}; {spec.name}, {nranks} ranks ({how}), algorithm {args.algorithm}, "
                 f"data {args.data or 'gaussian, checked on a grid whose sums are exact'}; busbw on uncompressed bytes"]
        if len(variants) > 1:
            extra.append(f"# its calls took turns, call by call, with those of "
                         f"{', '.join(t['codec'] for t in tables if t is not table)}: the tables' ratios are of calls "
                         f"made in the same seconds")
        extra += cuda.table_lines(args, nranks)
        lines = report.preamble_lines(table["name"], version, cfg, devs, extra, clock) + \
            report.header_lines(args.per_iter_timing) + \
            [report.row_line(row, args.per_iter_timing) for row in table["rows"]] + \
            report.footer_lines(table["rows"], table["name"]) + \
            zipccl_lines(table["rows"], table["notes"], variant == "auto", groups.get(where)) + \
            (["# " + table["versus"]["line"]] if table["versus"] else []) + [""]
        for line in lines:
            say(line, flush=True)
    rows = [r for t in tables for r in t["rows"]]
    if rank == 0 and args.plot:
        plot([(f"zipccl-perf {spec.name}, {nranks} ranks ({how})", rows)], args.plot)
    _quiet_exit()
    return rows


def _versus(tables: list[dict]) -> None:
    """Each later table against the first, where that is the plain call (report.versus)."""
    if not tables or tables[0]["codec"] not in (BASELINE, GLOO):
        return
    for table in tables[1:]:
        line, ratios = report.versus(table["codec"], table["rows"], tables[0]["codec"], tables[0]["rows"])
        table["versus"] = dict(line=line[2:], ratios=ratios)


def _write_json(args, spec, nranks: int, how: str, start, argv, cfg, devs, tables, variants, groups,
                topo: str) -> None:
    """The run's nccl-tests JSON as it stands (rank 0, after each size)."""
    extra = dict(version=__version__, format=f"nccl-tests {report.FORMAT_VERSION}", collective=spec.name,
                 nranks=nranks, launcher=how, backend=dist.get_backend(), torch=torch.__version__,
                 algorithm=args.algorithm, data=str(args.data) if args.data else None,
                 topology=topo,
                 auto_plans=next((auto_policy(groups.get(w)).explain() for _, v, w in variants if v == "auto"), []))
    report.write_json(report.document(start, argv if argv is not None else sys.argv, cfg, devs, tables, extra,
                                      cuda.nccl_version()), args.output_file)


def _groups(variants) -> dict:
    """The groups of their own that the variants run on, by name: a gloo group (--backend
    zipccl's torch-gloo table), torch's NCCL (the baseline on CUDA). The world is None."""
    wanted = {where for _, _, where in variants} & {"gloo", cuda.NCCL_GROUP}
    return {where: dist.new_group(backend=where) for where in sorted(wanted)}


def zipccl_lines(rows: list[dict], notes: list[str], auto: bool, group=None) -> list[str]:
    """zipccl's figures for one table, after its footer: per row, rank 0's wire bytes per call,
    the ratio to the raw bytes and the plan that ran last; then the topology and auto's plans."""
    lines = []
    if rows and rows[0]["zipccl"]["wire_bytes"] is not None:
        lines.append(f"# zipccl {'size':>12s}  {'type':>8s}  {'redop':>6s}  {'wire_B/call':>12s}  {'ratio':>6s}  ran")
        for r in rows:
            z = r["zipccl"]
            ratio = "N/A" if z["ratio"] is None else f"{z['ratio']:.4f}"
            lines.append(f"# zipccl {r['size']:12d}  {r['type']:>8s}  {r['redop']:>6s}  {z['wire_bytes']:12d}  "
                         f"{ratio:>6s}  {z['plan']}")
    lines += [f"# zipccl note: {n}" for n in notes]
    return lines + learning_lines(rows) + plan_lines(auto, group)


def learning_lines(rows: list[dict]) -> list[str]:
    """What codec "auto" learned before each row's timed calls (common.learn), and which plans
    the timed calls ran."""
    learned = [r for r in rows if r["zipccl"].get("auto")]
    if not learned:
        return []
    lines = ["# auto learning, untimed, before each size's timed calls (calls out of place + in place; "
             "one size class for both):"]
    for r in learned:
        a = r["zipccl"]["auto"]
        calls, ran = a["learning_calls"], a["timed_plans"]
        if ran["out_of_place"] and ran["in_place"]:
            done = f"timed calls ran {'+'.join(ran['out_of_place'])} / {'+'.join(ran['in_place'])}"
        elif r["zipccl"]["collective"] == "sendrecv":  # zipccl.p2p: no learning, a rule per link and size
            done = f"auto does not learn messages: it sends by link and size (rank 0's last: {r['zipccl']['plan']})"
        else:
            done = "a size auto does not learn: the backend's own call"
        lines.append(f"#   {r['size']} B {r['type']} {r['redop']}: {calls['out_of_place']} + {calls['in_place']} "
                     f"calls; {done}")
    return lines


def plan_lines(auto: bool, group=None) -> list[str]:
    """The group's topology, and what codec="auto" measured on it per size class (the better of
    each plan's last two times, slowest rank) and what it runs now."""
    lines = [f"# topology: {topology.topology(group)}"]
    explained = auto_policy(group).explain() if auto else []
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
    if not spec.reduces:  # data moved: the same bits for every plan and backend
        return spec.expect(inputs, op, rank, nranks).to(inputs[0].dtype)
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


def _quiet_exit() -> None:
    """numba colours its messages with colorama, whose exit hook writes a terminal reset to
    standard output when that is a terminal, as mpirun makes it for its ranks: a stray line
    after the tables. Drop the hook (registered, once, by numba's first compile)."""
    hooks = sys.modules.get("colorama.initialise")
    if hooks is not None:
        atexit.unregister(hooks.reset_all)


def _wrong(rows: list[dict]) -> int:
    return sum(int(r[k]["wrong"] or 0) for r in rows for k in report.PLACEMENTS)


def _spawned(rank, nranks, args):
    cuda.bind(args)
    return _wrong(run_rank(rank, nranks, args, argv=args.argv))


def main(argv: list[str] | None = None) -> int:
    ap = parser("zipccl-perf")
    cuda.add_options(ap)
    args = ap.parse_args(argv)
    validate(ap, args)
    refused = cuda.refusal(args, launch.detect() is not None)
    if refused:
        print(f"zipccl-perf: {refused}", file=sys.stderr)
        return 2
    cuda.apply(args)
    given = list(argv if argv is not None else sys.argv[1:])
    args.argv = ["zipccl-perf", *given]  # the JSON's "args", as nccl-tests records its command line
    if args.netlab:
        from .netlab import run_perf
        return run_perf(args.netlab, args.nranks, given, nodes=args.nodes)
    world = launch.detect()
    if args.nodes is not None and args.nodes > 1:  # emulated nodes for the ranks spawned here (a launcher's variables take second place)
        os.environ["ZIPCCL_TOPOLOGY"] = f"{args.nodes}x{(world.size if world else args.nranks) // args.nodes}"
        config.TOPOLOGY = os.environ["ZIPCCL_TOPOLOGY"]
    if world is not None:
        try:
            launch.init(args.backend, share_gpu=args.share_gpu)
            cuda.bind(args)
        except UnsupportedError as e:  # this rank's GPU (one per local rank)
            print(f"zipccl-perf: rank {world.rank}: {e}", file=sys.stderr)
            return 2
        rows = run_rank(world.rank, world.size, args, args.how or world.launcher, args.argv)
        launch.shutdown()
        return 1 if _wrong(rows) else 0
    wrong = launch.spawn(_spawned, args.nranks, args, backend=args.backend, share_gpu=args.share_gpu)
    return 1 if any(w for w in wrong) else 0


if __name__ == "__main__":
    sys.exit(main())
