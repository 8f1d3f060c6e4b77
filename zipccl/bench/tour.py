"""make bench: zipccl-perf on loopback, then the same collectives on a shaped network, and there
all-to-all and send/recv of real activations too, each table summed up against torch.distributed,
and one plot of them all.

    python -m zipccl.bench.tour [--out DIR] [--no-lab] [zipccl-perf flags, given to both runs]

On loopback (4 ranks on this host, gloo over TCP) compression cannot pay: there codec "auto"
must match torch (it learns untimed, then runs the backend's own collective). In the network
lab (zipccl-netlab: 2 nodes of 2 ranks, 1 Gbit/s per node) the link is the limit, where auto's
hierarchical and lossless plans can pay, if the cores are free to run them (on a busy 2-core
host they are not: docs/PERFORMANCE.md "make bench"). The lab needs root and network
namespaces; elsewhere one line says how to see it. The JSON of each run and the plot go to DIR
(default bench-results). Flags after the tour's own go to zipccl-perf in both runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import netlab, perf
from .common import parser, plot

#: 1, 4 and 16 MiB of bf16 on 4 local ranks: torch, raw, lossless, auto. Auto's learning calls
#: come before its warm-up; a longer warm-up than zipccl-perf's 2 gives the other tables' first
#: calls at a size (allocations, TCP buffers growing) time to settle too. 40 timed calls a size:
#: with 10, one gloo call read 0.80-1.18x of itself across the tables on a quiet 2-core host.
LOOPBACK = ["--baseline", "-w", "5", "-n", "40"]
LAB_RATE = "1gbit"
#: 4, 16 and 64 MiB on 2 nodes of 2 ranks: torch and auto, 5 timed calls each (a 64 MiB call
#: takes about a second on these links).
LAB = ["-b", "4M", "-e", "64M", "-n", "5", "-w", "2", "--baseline", "--codec", "auto", "--nranks", "4",
       "--nodes", "2"]
LAB_TIMEOUT = 600.0  # seconds; the lab is torn down after, whatever happened
#: Then all-to-all and send/recv (nccl-tests' alltoall_perf and sendrecv_perf) in the same lab: 16 MiB
#: of bf16 activations per rank, torch against auto (a send/recv is a ring shift: two of its four
#: messages cross between the nodes).
EXCHANGES = ("alltoall", "sendrecv")
EXCHANGE = ["-b", "16M", "-e", "16M", "-n", "5", "-w", "2", "--baseline", "--codec", "auto", "--nranks", "4",
            "--nodes", "2"]
#: The real activations those runs send (bench/activations.py, in a checkout; elsewhere the
#: harness's verifiable data).
ACTIVATIONS = Path(__file__).resolve().parents[2] / "bench" / "activations.py"


def lab_command(extra: list[str] = ()) -> str:
    return " ".join(["zipccl-perf", *LAB, *extra, "--netlab", LAB_RATE])


def activations(out: Path) -> list[str]:
    """--data for the exchange runs: 16 MiB of bf16 activations written into ``out``, where this is
    a checkout (bench/activations.py); else nothing (verifiable data)."""
    if not ACTIVATIONS.exists():
        return []
    path = out / "activations.npy"
    if not path.exists():
        import importlib.util
        spec = importlib.util.spec_from_file_location("activations", ACTIVATIONS)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.main(["--out", str(path), "--numel", str(8 << 20)])
    return ["--data", str(path)]


def _rows(path: Path) -> list[dict]:
    """The rows of a zipccl-perf JSON document, as the plot takes them."""
    return [dict(r, out_of_place={"busbw": r["out_of_place"]["bus_bw"]}, in_place={"busbw": r["in_place"]["bus_bw"]})
            for r in json.loads(path.read_text())["results"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zipccl.bench.tour", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-results"), help="where the JSON and the plot go")
    ap.add_argument("--no-lab", action="store_true", help="loopback only")
    args, extra = ap.parse_known_args(argv)
    local, shape = (parser("zipccl-perf").parse_args([*flags, *extra]) for flags in (LOOPBACK, LAB))  # flags checked first
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    loopback, lab = args.out / "loopback.json", args.out / "lab.json"  # the lab's ranks share this directory
    for old in (loopback, lab):
        old.unlink(missing_ok=True)
    status = perf.main([*LOOPBACK, *extra, "-J", str(loopback)])
    panels = [(f"loopback: {local.nranks} ranks on one host (gloo over TCP)", _rows(loopback))] \
        if loopback.exists() else []
    exchanges = {c: args.out / f"lab_{c}.json" for c in EXCHANGES}
    for old in exchanges.values():
        old.unlink(missing_ok=True)
    if not args.no_lab:
        why = netlab.unavailable()
        if why is None:
            try:
                status = max(status, netlab.run_in_lab(LAB_RATE, shape.nranks, [*LAB, *extra, "-J", str(lab)],
                                                       LAB_TIMEOUT, shape.nodes))
                data = activations(args.out)
                for c, path in exchanges.items():
                    status = max(status, netlab.run_in_lab(
                        LAB_RATE, shape.nranks, ["--collective", c, *EXCHANGE, *data, *extra, "-J", str(path)],
                        LAB_TIMEOUT, shape.nodes))
            except netlab.LabError as e:  # built, then failed (a timeout, a tc refusal): the run fails
                print(f"# network lab failed ({e})", flush=True)
                status = max(status, 1)
        if why is not None:
            print(f"# network lab not run ({why}); to see zipccl win on a 1 Gbit/s network, as root: "
                  f"{lab_command(extra)}", flush=True)
    where = f"network lab: {shape.nodes} nodes of {shape.nranks // shape.nodes} ranks, {LAB_RATE} per node"
    if lab.exists():
        panels.append((where, _rows(lab)))
    for c, path in exchanges.items():
        if path.exists():
            panels.append((f"{c}, {where}", _rows(path)))
    png = args.out / "bench.png"
    if panels:
        plot(panels, png)
        print(f"# plot: {png}  JSON: {args.out}/*.json  ({time.monotonic() - start:.0f} s)", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
