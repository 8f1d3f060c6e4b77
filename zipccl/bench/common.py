"""The nccl-tests-style harness behind zipccl-perf: flags, sizes, data, timing, checking, plot.

Each collective is a small ``Spec`` (all_reduce.py, reduce_scatter.py, all_gather.py, alltoall.py, sendrecv.py):
its buffers, where its in-place buffers sit, how to run it, its bus-bandwidth factor and
its expected output. The output formats live in report.py.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from .. import config, launch
from ..auto import Policy
from ..collectives import auto_policy
from .cuda import Clock
from .report import size_text

DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
CODECS = ("raw", "lossless", "auto")
PLACES = (("out_of_place", False), ("in_place", True))  # nccl-tests' two columns, in its order
BASELINE = "torch"  # the label of the plain torch.distributed collective (--baseline)


@dataclass(frozen=True)
class Spec:
    """One collective, nccl-tests style."""
    name: str
    has_op: bool
    bus_factor: Callable[[int], float]             # busbw = algbw * bus_factor(nranks)
    buffers: Callable[[int, int], tuple[int, int]]  # (count, nranks) -> (input numel, output numel)
    run: Callable                                  # run(out, inp, op, group, codec, algorithm), codec None = torch
    expect: Callable                               # expect(inputs of every rank, op, rank, nranks) -> output
    in_place: Callable                             # in_place(numel_in, numel_out, rank, nranks, dtype) -> (out, inp)
    count: Callable | None = None  # count(numel_in, numel_out, nranks): the count column (None: the smaller)
    line_bytes: int = 0            # each rank's part in whole lines of this many bytes (nccl-tests' alltoall,
                                   # reduce_scatter and all_gather: 16)
    checks_in_place: bool = True   # False: in place is timed, not checked (nccl-tests' alltoall and sendrecv)
    reduces: bool = True           # False: the output is data moved, the same bits for any plan or backend
    policy_name: str = ""          # the collective's name in zipccl.auto's classes (default: name)


def parse_size(text: str) -> int:
    """'64M' -> 67108864 (K, M, G are powers of 1024, as in nccl-tests, which reads '64KB' as
    '64K'; so does this, and '64KiB')."""
    given = text
    text = text.strip().upper()
    text = text[:-2] if text.endswith("IB") else text[:-1] if text.endswith("B") else text
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    try:
        value = int(float(number) * mult)
    except (ValueError, OverflowError):  # 'inf' overflows
        raise argparse.ArgumentTypeError(f"not a size: {given!r} (use e.g. 1M, 64K, 1G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must be >= 0, got {given!r}")
    return value


def _whole(text: str) -> int:
    """-f's value: a whole number, as nccl-tests reads it (its tables print the factor as one)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r} (nccl-tests' -f takes 2, 4, ...)") from None


def codecs_of(text: str) -> tuple[str, ...]:
    """--codec's codecs in the order their tables run: "all" (CODECS, in its order), or names of
    CODECS, comma-separated (the one that matters most first, where a time limit may cut the
    run short)."""
    return CODECS if text == "all" else tuple(text.split(","))


def _codecs(text: str) -> str:
    """--codec, checked (``codecs_of`` reads it)."""
    names = codecs_of(text)
    if any(n not in CODECS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give 'all', or codecs of {', '.join(CODECS)} once each, "
                                         "comma-separated")
    return text


def sizes(min_bytes: int, max_bytes: int, factor: float, step: int) -> list[int]:
    """min_bytes, then each times ``factor`` (where > 1, at least one byte more: a fraction or a
    start at 0 must not end the sweep), else plus ``step``, up to max_bytes."""
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s = max(s + 1, int(s * factor)) if factor > 1 else s + step
        if s == out[-1]:
            break
    return out


#: nccl-tests' flags that zipccl-perf takes for compatibility (a script that passes them runs):
#: flag -> (long name, default, the values it takes (None: any, without effect), what it is).
#: The defaults are nccl-tests' (src/common.cu, 2.19); each mode that zipccl-perf lacks takes its
#: off value alone.
NCCL_TESTS_ONLY = {
    "-g": ("ngpus", 1, (1,), "GPUs per thread"),
    "-t": ("nthreads", 1, (1,), "threads per process"),
    "-m": ("agg_iters", 1, (1,), "operations aggregated per timed iteration"),
    "-N": ("run_cycles", 1, (1,), "runs of the whole sweep"),
    "-p": ("parallel_init", 0, None, "threads' parallel set-up"),
    "-r": ("root", 0, None, "root rank of rooted collectives (none here)"),
    "-z": ("blocking", 0, (0,), "blocking collectives"),
    "-y": ("stream_null", 0, (0,), "collectives on the default CUDA stream"),
    "-T": ("timeout", 0, (0,), "a timeout in seconds (zipccl's own: ZIPCCL_TIMEOUT)"),
    "-G": ("cudagraph", 0, (0,), "CUDA graph launches"),
    "-C": ("report_cputime", 0, (0,), "CPU time instead of wall time"),
    "-S": ("report_timestamps", 0, (0,), "timestamps per row"),
    "-R": ("local_register", 0, (0,), "buffer registration"),
    "-x": ("cta_policy", -1, (-1,), "NCCL's CTA policy"),
    "-D": ("device_implementation", 0, (0,), "device-initiated collectives"),
    "-V": ("device_cta_count", 16, None, "CTAs of -D's device collectives"),
    "-M": ("memory", 0, (0,), "a memory report"),
    "-u": ("unalign", 0, (0,), "buffer offsets"),
    "-K": ("per_iter_skip", 0, (0,), "iterations left out of -I 1's figures"),
}


def parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="nccl-tests-style bandwidth benchmark of zipccl's "
                                 "compressed collectives (effective bandwidth on uncompressed bytes).")
    ap.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1M"), help="minimum size (default 1M)")
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"), help="maximum size (default 16M)")
    ap.add_argument("-i", "--stepbytes", type=parse_size, default=parse_size("1M"),
                    help="fixed increment between sizes (used when -f is 1; default 1M)")
    ap.add_argument("-f", "--stepfactor", type=_whole, default=4, help="multiplication factor between sizes, a whole "
                    "number as in nccl-tests (default 4)")
    ap.add_argument("-d", "--datatype", default="bfloat16", choices=[*DTYPES, "all"], help="default bfloat16")
    ap.add_argument("-o", "--op", default="sum", choices=[*OPS, "all"], help="reduction op (default sum)")
    ap.add_argument("-n", "--iters", type=int, default=10, help="timed iterations (default 10)")
    ap.add_argument("-w", "--warmup_iters", type=int, default=2, help="warm-up iterations (default 2)")
    ap.add_argument("-c", "--check", type=int, default=1, help="check correctness of this many iterations (default 1)")
    ap.add_argument("-a", "--average", type=int, default=1, choices=[0, 1, 2, 3],
                    help="how times combine across ranks: 0 rank 0, 1 average, 2 minimum, 3 maximum (default 1)")
    ap.add_argument("-J", "--output_file", type=Path, help="write the results as nccl-tests' JSON to this file")
    ap.add_argument("-I", "--per_iter_timing", type=int, default=0, choices=[0, 1],
                    help="1: per-iteration times per process (i_* columns, and *_per_iter in the JSON), as "
                    "nccl-tests -I 1 (default 0)")
    for flag, (name, default, allowed, what) in NCCL_TESTS_ONLY.items():
        takes = "any value (no effect here)" if allowed is None else " or ".join(map(str, allowed)) + " only"
        ap.add_argument(flag, f"--{name}", type=int, default=default,
                        help=f"as nccl-tests' {flag}, {what}: accepted for compatibility, {takes}")
    ap.add_argument("--collective", default="all_reduce",
                    choices=["all_reduce", "reduce_scatter", "all_gather", "alltoall", "sendrecv"],
                    help="the collective (alltoall, sendrecv: nccl-tests' alltoall_perf and sendrecv_perf)")
    ap.add_argument("--codec", default="all", type=_codecs,
                    help=f"zipccl codec, or several in the order to time them, comma-separated (one table each; "
                         f"default all: {','.join(CODECS)})")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "zipccl"],
                    help="the ranks' torch.distributed backend; zipccl: time plain dist.* calls on the drop-in "
                         "backend (policy ZIPCCL_CODEC, default auto) against the same calls on a gloo group "
                         "(two tables: torch-gloo, then drop-in); --codec and --baseline do not apply")
    ap.add_argument("--baseline", action="store_true", help="also run the plain torch.distributed collective "
                    "(its own table, first)")
    ap.add_argument("--data", type=Path, help="real tensors (.npy or .pt), tiled to each size (sums depend on the "
                    "order: checked against plain torch where zipccl promises one, #wrong N/A for the backend's sums)")
    ap.add_argument("--nranks", type=int, default=4, help="local ranks to spawn when not under a launcher (default 4)")
    ap.add_argument("--plot", type=Path, help="draw busbw against size per codec into this PNG")
    ap.add_argument("--algorithm", default="auto", choices=["auto", "flat", "hierarchical"],
                    help="zipccl's algorithm (default auto: with --codec auto, learned; else flat)")
    ap.add_argument("--intra", default="shm", choices=["shm", "native", "raw", "lossless"],
                    help="with --algorithm hierarchical: the codec inside a node (--codec is the one between nodes)")
    ap.add_argument("--nodes", type=int, help="the ranks form this many nodes of nranks/nodes ranks: the lab's "
                    "shape with --netlab (a node's ranks share one shaped link; default one rank per node), "
                    "else ZIPCCL_TOPOLOGY for the spawned ranks (default: what the launcher or host says)")
    ap.add_argument("--netlab", metavar="RATE", help="run the ranks in the network lab at RATE per node (e.g. 1gbit)")
    ap.add_argument("--how", help=argparse.SUPPRESS)  # set by --netlab for the ranks it starts
    return ap


#: Buffers of the largest size that a rank holds at once: input, output, the timed data and
#: the checks' reference (zipccl's packets and the checks' data come on top).
BUFFERS_PER_RANK = 4


def host_memory() -> int | None:
    """This host's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def validate(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.minbytes > args.maxbytes:
        ap.error(f"-b ({args.minbytes}) must not be larger than -e ({args.maxbytes})")
    if args.stepfactor < 1 or (args.stepfactor == 1 and args.stepbytes <= 0):
        ap.error("-f must be >= 1, and -i > 0 when -f is 1")
    if args.iters < 1 or args.warmup_iters < 0 or args.check < 0:
        ap.error("-n must be >= 1, -w and -c >= 0")
    for flag, (name, _, allowed, what) in NCCL_TESTS_ONLY.items():
        value = getattr(args, name)
        if allowed is not None and value not in allowed:
            more = ("zipccl-perf runs one process per rank with one device each; for more ranks use --nranks N "
                    "or a launcher (mpirun -np N, torchrun)") if flag in ("-g", "-t") else "zipccl-perf has no such mode"
            ap.error(f"{flag} {value} ({what}): {flag} takes {' or '.join(map(str, allowed))} only: {more}")
    if args.nranks < 1:
        ap.error("--nranks must be >= 1")
    if args.netlab is not None:
        from .netlab import rate_bits  # here: `python -m zipccl.bench.netlab` must find it unimported
        try:
            rate_bits(args.netlab)
        except ValueError as e:
            ap.error(f"--netlab: {e}")
    try:
        world = launch.detect()
    except ValueError as e:
        ap.error(f"the launcher's environment: {e}")
    if args.collective == "sendrecv" and (world.size if world else args.nranks) < 2:
        ap.error("--collective sendrecv needs two ranks or more (--nranks, or the launcher's): "
                 "torch.distributed sends to no rank itself")
    ranks = world.size if world else args.nranks
    if args.nodes is not None and (args.nodes < 1 or ranks % args.nodes):
        ap.error(f"--nodes ({args.nodes}) must divide the ranks ({ranks}: "
                 f"{'the launcher' + chr(39) + 's' if world else '--nranks'})")
    if args.backend == "zipccl" and (args.baseline or args.codec not in ("all", "auto")):
        ap.error("--backend zipccl times plain dist.* calls (the drop-in's policy is ZIPCCL_CODEC): "
                 "leave out --baseline and --codec")
    if args.data is not None:
        if not args.data.exists():
            ap.error(f"--data {args.data} does not exist")
        try:
            found = load_data(args.data).numel()
        except Exception as e:  # noqa: BLE001 - any file that is no tensor
            ap.error(f"--data {args.data}: not a tensor file (.npy, or .pt of a tensor or a dict of them): {e}")
        if found == 0:
            ap.error(f"--data {args.data} holds no elements")
    if world is None and args.device == "cpu":  # every rank on this host: their buffers must fit in it
        need, have = args.nranks * BUFFERS_PER_RANK * args.maxbytes, host_memory()
        if have and need > have:
            ap.error(f"-e {args.maxbytes}: {args.nranks} ranks need at least {BUFFERS_PER_RANK} buffers of "
                     f"{size_text(args.maxbytes)} each ({need / 2**30:.1f} GiB), more than this host's memory "
                     f"({have / 2**30:.1f} GiB); lower -e or --nranks")
    if args.output_file is not None:  # before any table is run, not when the first is written
        folder = args.output_file.resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK) or args.output_file.is_dir():
            ap.error(f"-J {args.output_file}: cannot write there (its folder must exist and be writable)")


# ---- data --------------------------------------------------------------------------------------------------

def verifiable(numel: int, dtype: torch.dtype, rank: int, nranks: int, seed: int = 0) -> torch.Tensor:
    """The checks' data: gaussian-like values on a grid coarse enough that any sum over the ranks
    is exact in ``dtype`` (nccl-tests' idea): multiples of 2**-q within +-2, q chosen from the
    precision and the ranks that add into an element. Each element takes values from at most
    2**(precision - 3) ranks (bf16: 32; the others give it 0), so that q stays >= 1 on any
    number of ranks: on more, a finer grid cannot sum exactly, and a coarser one is all zeros."""
    precision = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[dtype]
    adders = min(nranks, 1 << (precision - 3))
    q = precision - 2 - math.ceil(math.log2(max(adders, 2)))
    g = torch.Generator().manual_seed(seed * 100003 + rank)
    x = torch.randn(numel, generator=g).clamp_(-2, 2)
    x = torch.round(x * 2.0 ** q) / 2.0 ** q + 0.0  # + 0.0: no -0.0, whose sums depend on order
    if adders < nranks:  # element i from ranks i, i+1, ..., i+adders-1 (mod nranks)
        x[(rank - torch.arange(numel)) % nranks >= adders] = 0.0
    return x.to(dtype)


def gaussian(numel: int, dtype: torch.dtype, rank: int, seed: int = 0) -> torch.Tensor:
    """The timed calls' default data: N(0, 1) in ``dtype``, every bit of the draw kept, so that
    what a codec makes of it does not depend on the number of ranks (``verifiable``'s grid
    coarsens with them, and its zeros and short mantissas code better than real tensors)."""
    g = torch.Generator().manual_seed(seed * 100003 + rank + 7919)
    return (torch.randn(numel, generator=g) + 0.0).to(dtype)


def rank_order_reduce(inputs: list[torch.Tensor], op, nodes=None) -> torch.Tensor:
    """What zipccl's exact codecs promise for ``inputs`` (one per rank), in plain torch: SUM and
    AVG add in rank order (fp32 for 16-bit types), divide by the rank count for AVG and round
    once; with ``nodes`` (rank lists, zipccl.hierarchical's order) each node's sum is rounded
    to the dtype, the nodes' sums are added in node order and rounded, and AVG divides that.
    MAX and MIN take the elementwise extreme (any order; -0.0 against +0.0 is left to torch)."""
    dtype = inputs[0].dtype
    if op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        stacked = torch.stack(inputs)
        return (stacked.amax(0) if op == dist.ReduceOp.MAX else stacked.amin(0)).to(dtype)
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def in_order(parts):
        total = parts[0].to(wide, copy=True)
        for part in parts[1:]:
            total = total + part.to(wide)
        return total

    if nodes is None:
        total = in_order(inputs)
        return (total / len(inputs) if op == dist.ReduceOp.AVG else total).to(dtype)
    total = in_order([in_order([inputs[r] for r in ranks]).to(dtype) for ranks in nodes]).to(dtype)
    return total / len(inputs) if op == dist.ReduceOp.AVG else total


def _default_data(name: str = "grads_step050_bucket0_fp32.npy") -> Path:
    """The real gradient bucket: in ZIPCCL_DATA (a folder) where set, else in the checkout's data/
    (`make gpu-data` copies it there, so that it travels with the checkout to a GPU machine), else
    in shared/data beside the checkout."""
    if config.DATA:
        return Path(config.DATA) / name
    root = Path(__file__).resolve().parents[2]
    places = [root / "data" / name, root.parent / "shared" / "data" / name]
    return next((p for p in places if p.exists()), places[-1])


DEFAULT_DATA = _default_data()


def load_data(path: Path) -> torch.Tensor:
    t = torch.load(path) if path.suffix == ".pt" else torch.from_numpy(np.load(path))
    if isinstance(t, dict):
        t = torch.cat([v.reshape(-1).float() for v in t.values() if torch.is_tensor(v)])
    return t.reshape(-1).float()


def real(data: torch.Tensor, numel: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """The real tensor tiled to ``numel``, shifted by rank so that ranks differ."""
    tiled = data.roll(rank * 7919).repeat(-(-numel // max(1, data.numel())))[:numel]
    return tiled.to(dtype)


# ---- running ------------------------------------------------------------------------------------------------

def combine_time(seconds: float, mode: int, group=None) -> float:
    """nccl-tests -a: rank 0's time (0), the average (1), minimum (2) or maximum (3) over ranks."""
    t = torch.tensor([seconds], dtype=torch.float64)
    if mode == 0:
        dist.broadcast(t, 0, group=group)
        return float(t)
    op = {1: dist.ReduceOp.SUM, 2: dist.ReduceOp.MIN, 3: dist.ReduceOp.MAX}[mode]
    dist.all_reduce(t, op=op, group=group)
    return float(t) / (dist.get_world_size(group) if mode == 1 else 1)


def sums_over_ranks(values: list[int], group=None) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return t.tolist()


def gather_times(times: list[float], group=None) -> list[list[float]]:
    """Every process's per-iteration times (seconds), in rank order."""
    mine = torch.tensor(times, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [t.tolist() for t in every]


def _int_view(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.int32 if x.element_size() == 4 else torch.int16)


def _unwritten(out: torch.Tensor) -> None:
    """``out`` filled with what no check expects: NaN, or an integer type's minimum."""
    out.fill_(float("nan") if out.dtype.is_floating_point else torch.iinfo(out.dtype).min)


def count_wrong(got: torch.Tensor, want: torch.Tensor, op) -> int:
    """Elements whose bits differ; for MAX and MIN +0.0 and -0.0 count as equal, because which
    of the two a maximum of both returns is the implementation's (gloo's and torch's differ)."""
    diff = _int_view(got) != _int_view(want)
    if op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        diff &= ~((got.reshape(-1) == 0) & (want.reshape(-1) == 0))
    return int(diff.sum())


def zipccl_codec(args, codec):
    """The codec argument of a zipccl call: per level for a hierarchical run. An all-to-all or a
    message inside a node goes as plain bytes for --intra shm, the reductions' shared memory."""
    if codec is not None and args.algorithm == "hierarchical" and codec != "auto":
        exchange = getattr(args, "collective", None) in ("alltoall", "sendrecv")
        return {"intra": "native" if exchange and args.intra == "shm" else args.intra, "inter": codec}
    return codec


def placed(spec: Spec, in_place: bool, numel_in: int, numel_out: int, rank: int, nranks: int, dtype, device="cpu"):
    """(out, inp) for one placement on ``device``, as nccl-tests places them: separate buffers
    out of place; in place, the collective's own aliasing (spec.in_place)."""
    with torch.device(device):
        if in_place:
            return spec.in_place(numel_in, numel_out, rank, nranks, dtype)
        return torch.empty(numel_out, dtype=dtype), torch.empty(numel_in, dtype=dtype)


@dataclass
class Variant:
    """One table's calls at one size: ``codec`` None is the plain torch.distributed call on
    ``group``; ``reference`` the output its checks expect (None: not checked)."""
    label: str
    codec: object
    group: object = None
    reference: torch.Tensor | None = None


#: zipccl's counters that a row sums over its timed calls.
TALLIED = ("calls", "raw_bytes", "wire_bytes")


def _tally(spec: Spec, tally: dict) -> None:
    """Add the call just made to ``tally``: zipccl's counters since the last reset_stats, its
    async work ended first (a send's record comes from its lane); a send/recv call is two
    records, a send's bytes and a receive's none, and counts as its sends."""
    import zipccl
    from .. import executor
    executor.wait_all()
    st = zipccl.stats()
    total = st["total"]
    for k in TALLIED:
        tally[k] = tally.get(k, 0) + (st.get("send", total)["calls"] if k == "calls" and spec.name == "sendrecv"
                                      else total[k])
    tally["plan"] = st["last"].get("codec", tally.get("plan"))
    zipccl.reset_stats()


def measure_placement(spec: Spec, args, in_place: bool, numel_in: int, numel_out: int, dtype, op,
                      variants: list[Variant], data: torch.Tensor, rank: int, nranks: int,
                      check_data: torch.Tensor | None = None) -> list[tuple]:
    """One untimed call of each variant (nccl-tests' first call of each placement: its one-off
    costs, such as a buffer's first use, are never timed, whatever -w), then ``args.iters``
    timed calls of each, the variants taking turns call by call (forward, then backward), the
    input restored before each and the ranks starting each together (a barrier), untimed: every
    call sees the same data, and none is timed waiting for the laggards of a slower call before
    it (of another table: a lossless call leaves the ranks milliseconds apart); then each
    variant's ``args.check`` calls on ``check_data`` (default ``data``) against its reference
    (bitwise; wrong elements summed over the ranks). Returns each variant's figures and
    zipccl's counters over its timed calls; for codec "auto", the figures also name the plans
    that the timed calls ran ("auto_plans")."""
    import zipccl
    restore = in_place and spec.name != "all_gather"  # a gather writes back this rank's own data
    buffers = [placed(spec, in_place, numel_in, numel_out, rank, nranks, dtype, args.device) for _ in variants]
    for v, (out, inp) in zip(variants, buffers):
        inp.copy_(data)
        spec.run(out, inp, op, v.group, v.codec, args.algorithm)
    autos = [auto_class(spec, v.group, dtype, numel_in, args.device) if v.codec == "auto" else None for v in variants]
    firsts = [a[0].calls.get(a[1], 0) if a else 0 for a in autos]
    clocks, tallies = [Clock(args.device) for _ in variants], [{} for _ in variants]
    dist.barrier()
    zipccl.reset_stats()
    turn = list(range(len(variants)))
    for i in range(args.iters):
        for j in (turn if i % 2 == 0 else turn[::-1]):
            (out, inp), v = buffers[j], variants[j]
            if restore:
                inp.copy_(data)
            dist.barrier()  # the ranks start together: no call's time holds the laggards of the call before
            with clocks[j]:
                spec.run(out, inp, op, v.group, v.codec, args.algorithm)
            _tally(spec, tallies[j])
    return [_figures(spec, args, in_place, numel_in, numel_out, op, v, out, inp, data, clock, tally, auto, first,
                     nranks, check_data)
            for v, (out, inp), clock, tally, auto, first in zip(variants, buffers, clocks, tallies, autos, firsts)]


def _figures(spec: Spec, args, in_place: bool, numel_in: int, numel_out: int, op, v: Variant, out, inp, data, clock,
             tally: dict, auto, first: int, nranks: int, check_data) -> tuple:
    """One variant's figures of a placement (measure_placement): its times, what auto ran, its checks."""
    times = clock.seconds()
    ran = plans_since(*auto, first) if auto else None
    reference = v.reference if spec.checks_in_place or not in_place else None
    wrong = failed = None  # as nccl-tests: the first check that finds a wrong element is the one reported
    for _ in range(args.check if reference is not None else 0):
        _unwritten(out)  # what the call leaves unwritten counts as wrong, not as the last call's result
        inp.copy_(data if check_data is None else check_data)  # in place, after: the input is (part of) the output
        spec.run(out, inp, op, v.group, v.codec, args.algorithm)
        mine = count_wrong(out.cpu(), reference, op)
        wrong, failed = sums_over_ranks([mine, int(mine > 0)])  # its elements, and the ranks that found them
        if wrong:
            break
    seconds = combine_time(sum(times) / len(times), args.average)
    size = max(numel_in, numel_out) * inp.element_size()
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    result = dict(time_us=seconds * 1e6, algbw=algbw, busbw=algbw * spec.bus_factor(nranks), wrong=wrong,
                  failed=failed)
    if ran is not None:
        result["auto_plans"] = ran
    if args.per_iter_timing:
        per_process = [[t * 1e6 for t in proc] for proc in gather_times(times)]
        result.update(per_process=per_process, times_us=[max(col) for col in zip(*per_process)])
    return result, tally


def measure(spec: Spec, args, numel_in: int, numel_out: int, dtype, op, codec, data: torch.Tensor,
            reference: torch.Tensor | None, rank: int, nranks: int, group=None, label: str | None = None,
            check_data: torch.Tensor | None = None) -> dict:
    """One row of one table: measure_side_by_side of one variant."""
    return measure_side_by_side(spec, args, numel_in, numel_out, dtype, op,
                                [Variant(label or codec or BASELINE, codec, group, reference)], data, rank, nranks,
                                check_data)[0]


def measure_side_by_side(spec: Spec, args, numel_in: int, numel_out: int, dtype, op, variants: list[Variant],
                         data: torch.Tensor, rank: int, nranks: int,
                         check_data: torch.Tensor | None = None) -> list[dict]:
    """One row of each variant's table at one size: codec "auto"'s learning (learn) and a warm-up
    (out of place) for each variant in turn, then both placements, nccl-tests' order, timed on
    ``data`` with the variants' calls taking turns (measure_placement), checked on
    ``check_data`` (default ``data``). Taking turns call by call puts the host's drift, 20-40%
    within minutes on a shared 2-core host, on every table alike: two tables run one after the
    other read the same call 0.7-1.2x of itself. The drop-in backend's calls (codec None on a
    zipccl group) are plain dist.* calls whose zipccl figures are reported too."""
    data = data.to(args.device)
    check_data = check_data.to(args.device) if check_data is not None else None
    variants = [Variant(v.label, zipccl_codec(args, v.codec), v.group, v.reference) for v in variants]
    learning = [{key: learn(spec, args, in_place, numel_in, numel_out, dtype, op, data, rank, nranks, v.group)
                 for key, in_place in PLACES} if v.codec == "auto" else None for v in variants]
    for v in variants:
        out, inp = placed(spec, False, numel_in, numel_out, rank, nranks, dtype, args.device)
        inp.copy_(data)
        for _ in range(args.warmup_iters):
            spec.run(out, inp, op, v.group, v.codec, args.algorithm)
    count = spec.count(numel_in, numel_out, nranks) if spec.count else min(numel_in, numel_out)
    rows = [dict(size=max(numel_in, numel_out) * data.element_size(), count=count, type=args_type(dtype),
                 redop=op_name(op) if spec.has_op else "none", root=-1, iterations=args.iters) for _ in variants]
    tallies = [{} for _ in variants]
    for key, in_place in PLACES:
        placements = measure_placement(spec, args, in_place, numel_in, numel_out, dtype, op, variants, data, rank,
                                       nranks, check_data)
        for row, tally, (figures, st) in zip(rows, tallies, placements):
            row[key] = figures
            for k in TALLIED:
                tally[k] = tally.get(k, 0) + st.get(k, 0)
            tally["plan"] = st.get("plan")
    for v, row, tally, learned in zip(variants, rows, tallies, learning):
        ran = v.codec is not None or dist.get_backend(v.group) == "zipccl"
        wire, raw, calls = (tally.get(k, 0) for k in ("wire_bytes", "raw_bytes", "calls"))
        row["zipccl"] = dict(codec=v.label, collective=spec.name, nranks=nranks,
                             wire_bytes=int(wire / calls) if ran and calls else None,
                             raw_bytes=int(raw / calls) if ran and calls else None,
                             ratio=wire / raw if ran and raw else None, plan=tally.get("plan") if ran else None)
        if learned is not None:
            row["zipccl"]["auto"] = dict(learning_calls=learned,
                                         timed_plans={key: row[key].pop("auto_plans") for key, _ in PLACES})
    return rows


# ---- codec "auto": its learning, before the timed calls -------------------------------------------------------

def auto_class(spec: Spec, group, dtype, numel_in: int, device="cpu") -> tuple:
    """(policy, class): codec "auto"'s policy on ``group`` and the class of this collective's
    calls (zipccl.auto.Policy.key of the input's bytes and device, as zipccl's calls key it)."""
    return auto_policy(group), Policy.key(spec.policy_name or spec.name, dtype,
                                          numel_in * torch.empty(0, dtype=dtype).element_size(), device)


#: The calls that must run one plan, in a row, before auto's choice counts as settled.
STREAK = 4


def settled(policy: Policy, key: tuple) -> bool:
    """Whether auto's choice for class ``key`` has settled: every plan has run ``explore``
    times, then the last STREAK calls ran one plan. A call's time reaches the policy with the
    next call's metadata exchange, in time for the call after that, and the lower of a plan's
    last two times decides: the fourth call of a streak is the first chosen from the streak's own
    times alone, so one lucky time from before it can no longer hold a plan in place."""
    calls = policy.calls.get(key, 0)
    last = sorted(i for (k, _), i in policy.last.items() if k == key)  # the index of each plan's last call
    return len(last) > 1 and calls >= policy.explore * len(last) and last[-2] < calls - STREAK


def plans_since(policy: Policy, key: tuple, first: int) -> list[str]:
    """The plans that the class's calls from index ``first`` on ran (each plan's last call is
    kept, and those only grow)."""
    return sorted(p for (k, p), i in policy.last.items() if k == key and i >= first)


#: At most this many untimed learning calls per class: a choice that keeps moving on a loaded host
#: must not stall the benchmark (the # lines then show which plans the timed calls ran).
LEARN_LIMIT = 40


def learn(spec: Spec, args, in_place: bool, numel_in: int, numel_out: int, dtype, op, data: torch.Tensor,
          rank: int, nranks: int, group=None) -> int:
    """codec "auto" learns each class's plan from the calls' own times, trying every plan in
    turn (zipccl.auto): left to nccl-tests' warm-up of two calls, that probing would fall in the
    timed calls. So call it, untimed, until its choice has settled (or the class is one that
    auto does not learn: below Policy.probe_min_bytes); returns the calls that learned.
    Out-of-place and in-place calls of one size are one class: the second finds it learned."""
    policy, key = auto_class(spec, group, dtype, numel_in, args.device)
    out, inp = placed(spec, in_place, numel_in, numel_out, rank, nranks, dtype, args.device)
    calls = 0
    while calls < LEARN_LIMIT and not settled(policy, key):
        inp.copy_(data)
        before = policy.calls.get(key, 0)
        spec.run(out, inp, op, group, "auto", args.algorithm)
        if policy.calls.get(key, 0) == before:
            break
        calls += 1
    return calls


def args_type(dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def op_name(op) -> str:
    return {v: k for k, v in OPS.items()}[op]


# ---- plot and progress --------------------------------------------------------------------------------------

def plot(panels: list[tuple[str, list[dict]]], path: Path) -> None:
    """busbw against size, one panel per (title, rows), one colour per table (codec) and dtype,
    the same in every panel: out of place solid, in place dashed. Rows of size 0 (a count
    rounded to 0) have no place on the log axis; a panel without others says so."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(title, [r for r in rows if r["size"] > 0]) for title, rows in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    lines = list(dict.fromkeys((r["zipccl"]["codec"], r["type"]) for _, rows in panels for r in rows))
    colours = plt.get_cmap("tab10")
    for ax, (title, rows) in zip(axes[0], panels):
        if not rows:
            ax.set_title(title, fontsize=10)
            ax.text(0.5, 0.5, "no size above 0 bytes", ha="center", va="center", transform=ax.transAxes)
            continue
        for n, (codec, dtype) in enumerate(lines):
            mine = sorted((r for r in rows if (r["zipccl"]["codec"], r["type"]) == (codec, dtype)),
                          key=lambda r: r["size"])
            for place, style in (("out_of_place", "-"), ("in_place", "--")):
                if mine:
                    ax.plot([r["size"] for r in mine], [r[place]["busbw"] for r in mine], style, marker="o",
                            color=colours(n % 10), label=f"{codec} ({dtype})" if place == "out_of_place" else None)
        ax.set_xscale("log", base=2)
        sizes = sorted({r["size"] for r in rows})
        ax.set_xticks(sizes, [size_text(n) for n in sizes])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("message size")
        ax.set_ylabel("bus bandwidth, uncompressed bytes (GB/s)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(title="solid: out of place, dashed: in place", title_fontsize=8, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def progress(i: int, total: int, text: str) -> None:
    print(f"# [{i}/{total}] {text}", file=sys.stderr, flush=True)
