"""zipccl-perf on CUDA: its options, their refusal where CUDA is missing, the clock, the baseline.

    zipccl-perf --device cuda --share-gpu --nranks 4 -b 64K -e 256M -d bfloat16   # the one-GPU lab
    zipccl-perf --device cuda --transport nccl ...                                # one GPU per rank

The ranks' world stays gloo (barriers, times, #wrong counts: CPU tensors). The baseline table
is NCCL's own collective on torch's "nccl" group of the same ranks, and zipccl's tables run on
that group too, as a user's calls would: auto's native plan is the group's own NCCL collective,
and zipccl's packets go through its NCCL transport (``--transport``, ZIPCCL_TRANSPORT: nccl by
default on CUDA).
Times come from CUDA events around each call on the caller's stream, so a call that returns
before its work is done (NCCL's, queued) is timed to the device's end of it. Without CUDA the
options stop the run before any rank starts: one line naming CUDA, exit code 2.
"""

from __future__ import annotations

import os
import time

import torch

from .. import config, launch
from ..collectives import pipeline

#: zipccl's transport for CUDA tensors in the timed calls (ZIPCCL_TRANSPORT's values that move them).
TRANSPORTS = ("nccl", "auto")
NCCL_GROUP = "nccl"  # where the baseline runs: a torch.distributed group of backend nccl


def add_options(ap) -> None:
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the tensors live (default cpu); cuda: one GPU per rank, zipccl's NCCL transport, "
                         "NCCL's own collective as the baseline table, times from CUDA events")
    ap.add_argument("--share-gpu", action="store_true",
                    help="all ranks on the visible GPU (cuda:0), each its own NCCL host (NCCL_HOSTID), NCCL's "
                         "socket transport between them on loopback (or the --netlab links): the one-GPU lab; "
                         "implies --device cuda")
    ap.add_argument("--transport", choices=TRANSPORTS,
                    help="zipccl's transport for CUDA tensors, in place of ZIPCCL_TRANSPORT in the ranks (default "
                         "nccl); implies --device cuda")


def wanted(args) -> bool:
    return args.device == "cuda" or args.share_gpu or args.transport is not None


def refusal(args, launched: bool) -> str | None:
    """Why this run cannot go on CUDA, in one line, or None (then ``args.device`` is "cuda" where
    any CUDA option was given). ``launched``: the ranks come from a launcher, not from here."""
    if not wanted(args):
        return None
    args.device = "cuda"
    if not torch.cuda.is_available():
        return (f"--device cuda, --share-gpu and --transport need a CUDA device, and torch {torch.__version__} "
                "finds none here (torch.cuda.is_available() is False)")
    if args.backend == "zipccl":
        return ("--backend zipccl times dist.* calls on CPU tensors; on CUDA, zipccl's codecs (--codec) are timed "
                "against NCCL's own collective")
    if args.netlab and not args.share_gpu:
        return "--netlab on CUDA runs every rank on this machine's GPU: add --share-gpu"
    count = torch.cuda.device_count()
    if not launched and not args.share_gpu and args.nranks > count:
        return (f"{args.nranks} ranks need {args.nranks} CUDA devices and torch sees {count}: add --share-gpu "
                "(every rank on cuda:0, NCCL's socket transport between them)")
    return None


def apply(args) -> None:
    """zipccl's transport for CUDA tensors, in this process and in the ranks it spawns."""
    if args.device == "cuda":
        os.environ["ZIPCCL_TRANSPORT"] = config.TRANSPORT = args.transport or "nccl"


def with_baseline(variants: list, label: str) -> list:
    """The variants with NCCL's own collective first, as ``label`` (on CUDA the baseline is always timed)."""
    return [(label, None, NCCL_GROUP)] + [v for v in variants if v[0] != label]


def device_entry() -> dict:
    """This rank's GPU as nccl-tests' "Using devices" line names it."""
    d = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(d)
    domain, bus, dev = (getattr(p, f"pci_{k}_id", 0) for k in ("domain", "bus", "device"))
    bus = f"{domain:04x}:{bus:02x}:{dev:02x}"
    return dict(device=d, device_hex=bus, device_info=f"{p.name} (torch {torch.__version__}, CUDA {torch.version.cuda})")


def nccl_version() -> int:
    """The NCCL that torch loaded, as nccl-tests' JSON writes it (NCCL_VERSION_CODE: 2.28.9 is
    22809); 0 where this torch has none (a CPU build)."""
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except (AttributeError, RuntimeError):
        return 0
    return major * 10000 + minor * 100 + patch


def table_lines(args, nranks: int) -> list[str]:
    """The table's `#` line saying how the CUDA run is made."""
    if args.device != "cuda":
        return []
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    where = (f"cuda:0 shared by {nranks} ranks, each its own NCCL host, NCCL's socket transport on "
             f"{os.environ.get('NCCL_SOCKET_IFNAME', 'lo')}" if args.share_gpu else "one GPU per rank")
    pieces = pipeline.piece_bytes(cuda=True)
    return [f"# zipccl-perf on CUDA: {where}; NCCL {nccl}; every table on torch's nccl group; zipccl transport "
            f"{config.TRANSPORT}; coded pipeline pieces of {pieces / (1 << 20):g} MiB; times from CUDA events on the "
            "caller's stream"]


class Clock:
    """The time of each call made inside ``with clock:``. On CUDA, from events recorded on the
    current stream before and after the call: the device's end of a queued call, not the host's
    return from it. On CPU, the host clock. A clock starts with the device idle."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []
        if self.cuda:
            torch.cuda.synchronize()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def __enter__(self) -> "Clock":
        self._start = self._mark()
        return self

    def __exit__(self, *exc) -> None:
        self.marks.append((self._start, self._mark()))

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in self.marks]
        return [b - a for a, b in self.marks]


def bind(args) -> None:
    """This rank's GPU, from its launcher's variables (launch.use_gpu): cuda:0 in the one-GPU lab,
    else its local rank's; before any NCCL communicator exists."""
    if args.device == "cuda":
        world = launch.detect() or launch.World(0, 1, 0, "single")
        launch.use_gpu(world.rank, world.local_rank, args.share_gpu)
