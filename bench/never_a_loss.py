"""Is codec="auto" ever slower than the plain collective, or than the best fixed plan?

    python bench/never_a_loss.py --lab loopback|4|2x2 [--collective all_reduce|...|alltoall|sendrecv|pair]
                                 [--sizes 64K,1M,16M,256M] [--data FILE] [--rounds 5] [--min-seconds 4]
                                 [--only flat/raw] [--json FILE] [--plot FILE.png]
                                 # labs other than loopback: root

Four ranks: on unshaped loopback (one node), in the 1 Gbit/s lab with one rank per node
(``4``), or two nodes of two ranks (``2x2``). For each size (real bf16 gradients, tiled, or
``--data``: e.g. bench/activations.py's activations), the
ranks first make codec="auto" finish its learning calls, then time in rounds, one call of
each in turn (the order rotated every round so that the host's drift falls on all alike):
the plain ``torch.distributed`` collective, zipccl with ``codec="auto"``, and every plan auto
chooses from, fixed (flat raw and lossless; where there are two levels, hierarchical with
the node's shared memory inside and native, raw or lossless between nodes). A sample's time
is the slowest rank's, averaged over enough calls to last about 50 ms; small sizes get more
rounds (about ``--min-seconds`` of them, 4 s by default, at most 30). The table gives medians
and auto's ratio to the plain collective and to the best fixed plan.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zipccl
from zipccl import launch, topology
from zipccl.bench import alltoall, sendrecv
from zipccl.bench.common import DEFAULT_DATA, load_data, parse_size, real
from zipccl.bench.netlab import LabError, NetLab, worst
from zipccl.torch_compat import all_gather_single, reduce_scatter_single

NATIVE = {"all_reduce": lambda o, i: dist.all_reduce(o),
          "reduce_scatter": lambda o, i: reduce_scatter_single(o, i),
          "all_gather": lambda o, i: all_gather_single(o, i)}
def pair(out, inp, op, group, codec):
    """One message between two nodes, the others idle: from the first node's last rank to the
    second node's first (ranks 1 and 2 in the 2x2 lab; on loopback, one node, from 0 to 1), as a
    pipeline stage sends its activations to the next. torch's send and recv where ``codec`` is
    None."""
    nodes = topology.topology().nodes
    src, dst = (nodes[0][-1], nodes[1][0]) if len(nodes) > 1 else (0, 1)
    me = dist.get_rank()
    if me == src:
        dist.send(inp, dst) if codec is None else zipccl.send(inp, dst, codec=codec)
    elif me == dst:
        dist.recv(out, src) if codec is None else zipccl.recv(out, src, codec=codec)


#: nccl-tests' alltoall_perf and sendrecv_perf calls (zipccl-perf's specs: the same calls as its
#: tables), and one message between two nodes.
EXCHANGES = {"alltoall": alltoall.SPEC.run, "sendrecv": sendrecv.SPEC.run, "pair": pair}


def zipccl_call(collective: str, **kw):
    fn = getattr(zipccl, collective)
    if collective == "all_reduce":
        return lambda o, i: fn(o, **kw)
    return lambda o, i: fn(o, i, **kw)


def exchange_variants(collective: str) -> dict:
    """All-to-all (each rank's buffer split evenly among the ranks), a ring shift of send/recv or
    one message between two nodes (``pair``): torch's, auto, and the plans auto may choose, fixed
    (per link where there are several nodes: the plain bytes inside a node, lossless between)."""
    run = EXCHANGES[collective]
    out = {"torch": lambda o, i: run(o, i, None, None, None)}
    for name, codec in (("auto", "auto"), ("flat/raw", "raw"), ("flat/lossless", "lossless")):
        out[name] = lambda o, i, codec=codec: run(o, i, None, None, codec)
    if len(topology.topology().nodes) > 1:
        links = {"intra": "native", "inter": "lossless"}
        out["links/plain+lossless"] = lambda o, i: run(o, i, None, None, links)
    return out


def variants(collective: str) -> dict:
    if collective in EXCHANGES:
        return exchange_variants(collective)
    out = {"torch": NATIVE[collective], "auto": zipccl_call(collective),
           "flat/raw": zipccl_call(collective, codec="raw"), "flat/lossless": zipccl_call(collective, codec="lossless")}
    if topology.levels() is not None:
        for inter in ("native", "raw", "lossless"):
            out[f"hier/shm+{inter}"] = zipccl_call(collective, codec={"intra": "shm", "inter": inter},
                                                  algorithm="hierarchical")
    return out


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def sweep(args, data: torch.Tensor) -> list[dict]:
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for nbytes in args.sizes:
        numel = nbytes // 2
        inp = real(data, numel, torch.bfloat16, rank)
        if args.collective == "all_gather":
            src, out = inp[:numel // n].clone(), torch.empty(numel // n * n, dtype=torch.bfloat16)
        elif args.collective == "reduce_scatter":
            src, out = inp[:numel // n * n].clone(), torch.empty(numel // n, dtype=torch.bfloat16)
        elif args.collective in EXCHANGES:
            src = inp[:numel // n * n].clone()
            out = torch.empty_like(src)
        else:
            src, out = inp, inp.clone()
        runs = {name: run for name, run in variants(args.collective).items()
                if args.only is None or name in ("torch", "auto") or name in args.only}
        one = slowest(_time(runs["torch"], out, src, 1))
        reps = max(1, min(50, int(0.05 / max(one, 1e-6))))
        for _ in range(14):  # auto's learning calls (two of each of up to six plans), then one more
            runs["auto"](out, src)
        for name, run in runs.items():  # warm every fixed plan (its buffers, its shared memory)
            run(out, src)
        times = {name: [] for name in runs}
        names = list(runs)
        # small calls are cheap and noisy (4 ranks share 2 cores): more rounds, about min_seconds of them
        rounds = max(args.rounds, min(30, int(args.min_seconds / (len(names) * reps * max(one, 1e-4)))))
        for k in range(rounds):
            for name in names[k % len(names):] + names[:k % len(names)]:
                times[name].append(slowest(_time(runs[name], out, src, reps)))
        zipccl.reset_stats()
        runs["auto"](out, src)
        plans = [None] * n  # what auto runs now, on the ranks that took part (a native message records nothing)
        dist.all_gather_object(plans, zipccl.stats()["last"].get("codec"))
        plan = next((p for p in plans if p is not None), "native")
        med = {name: statistics.median(ts) for name, ts in times.items()}
        fixed = {name: t for name, t in med.items() if name != "auto"}
        best = min(fixed, key=fixed.get)
        row = dict(size=nbytes, reps=reps, rounds=rounds, medians_s=med, times_s=times, best_fixed=best,
                   auto_vs_torch=med["auto"] / med["torch"], auto_vs_best=med["auto"] / med[best],
                   auto_plan=plan)
        rows.append(row)
        if rank == 0:
            print(f"{nbytes:>11} {med['torch'] * 1e3:9.2f} {med['auto'] * 1e3:9.2f} {best:>16} "
                  f"{med[best] * 1e3:9.2f} {row['auto_vs_torch']:8.3f} {row['auto_vs_best']:8.3f}  "
                  f"{row['auto_plan']}", flush=True)
    return rows


def _time(run, out, src, reps: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        run(out, src)
    return (time.perf_counter() - t0) / reps


def rank_main(args) -> None:
    torch.set_num_threads(1)
    if not dist.is_initialized():  # a lab's rank, from its launcher's variables
        dist.init_process_group("gloo")
    data = load_data(Path(args.data))
    if dist.get_rank() == 0:
        print(f"# {args.collective}, lab {args.lab}, 4 ranks, topology {topology.topology()}, {args.rounds} rounds; "
              "ms per call (slowest rank), medians")
        print(f"{'size (B)':>11} {'torch':>9} {'auto':>9} {'best fixed':>16} {'its ms':>9} {'auto/tor':>8} "
              f"{'auto/best':>8}  auto's last plan")
    rows = sweep(args, data)
    if dist.get_rank() == 0:
        worst = max(rows, key=lambda r: r["auto_vs_torch"])
        print(f"# worst auto/torch: {worst['auto_vs_torch']:.3f} at {worst['size']} B; worst auto/best fixed: "
              f"{max(r['auto_vs_best'] for r in rows):.3f}")
        print("# " + "\n# ".join(zipccl.collectives.auto_policy().explain()))
        if args.json:
            Path(args.json).write_text(json.dumps(dict(lab=args.lab, collective=args.collective,
                                                       topology=str(topology.topology()), rows=rows), indent=1))
        if args.plot:
            plot(rows, args)
    dist.destroy_process_group()


def plot(rows: list[dict], args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [r["size"] for r in rows]
    for name in rows[0]["medians_s"]:
        ax.plot(sizes, [r["medians_s"]["torch"] / r["medians_s"][name] for r in rows], marker="o" if name == "auto"
                else ".", linewidth=2.5 if name == "auto" else 1, label=name)
    ax.axhline(0.9, color="grey", linestyle=":", label="10% loss")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("speed vs torch.distributed (x)")
    ax.set_title(f"{args.collective}, 4 ranks, lab {args.lab}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lab", default="loopback", choices=["loopback", "4", "2x2"])
    ap.add_argument("--collective", default="all_reduce", choices=[*NATIVE, *EXCHANGES])
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M,256M",
                    type=lambda s: [parse_size(x) for x in s.split(",")], help="bytes per rank's input")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-seconds", dest="min_seconds", type=float, default=4.0,
                    help="small sizes: more rounds, about this long (0: --rounds only)")
    ap.add_argument("--only", type=lambda s: s.split(","), help="time only these fixed plans besides torch and auto "
                    "(comma-separated, e.g. flat/raw)")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        rank_main(args)
        return 0
    if not os.path.exists(args.data):
        ap.error(f"no data file {args.data}")
    if args.lab == "loopback":
        return _loopback(args)
    argv = [sys.executable, os.path.abspath(__file__), "--rank", "--lab", args.lab, "--collective", args.collective,
            "--sizes", ",".join(str(s) for s in args.sizes), "--rounds", str(args.rounds),
            "--min-seconds", str(args.min_seconds), "--data", os.path.abspath(args.data)]
    argv += ["--only", ",".join(args.only)] if args.only else []
    argv += ["--json", os.path.abspath(args.json)] if args.json else []
    argv += ["--plot", os.path.abspath(args.plot)] if args.plot else []
    timeout = 600 + 60 * len(args.sizes) * args.rounds
    nodes = 4 if args.lab == "4" else 2
    try:
        with NetLab(4, "1gbit", nodes=nodes) as lab:
            codes = lab.run_ranks(argv, timeout=timeout)
    except LabError as e:
        print(f"never_a_loss.py: {e}", file=sys.stderr)
        return 2
    return worst(codes)


def _loopback(args) -> int:
    """Four local ranks over 127.0.0.1, one node, forked from a fork server that imported torch
    once (zipccl.launch.spawn)."""
    os.environ.update(GROUP_RANK="0", LOCAL_WORLD_SIZE="4")
    launch.spawn(_spawned, 4, args)
    return 0


def _spawned(rank: int, nranks: int, args) -> None:
    rank_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
