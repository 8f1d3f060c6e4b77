"""Peak host memory of one call, zipccl's codecs against torch's own (gloo), on local ranks.

Each rank's growth of its peak resident size over the call (VmHWM, reset before it through
/proc/self/clear_refs; Linux), the larger of two calls, the largest over the ranks; every call
first made once small, so that kernels compiled and scratch made once are not counted. With
glibc's mmap threshold low (MALLOC_MMAP_THRESHOLD_, set here for the ranks) a freed buffer goes
back at once and the next call's growth is its own.

    python bench/peak_memory.py --size-mib 256 --ranks 4 --json peak.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all_single", "send_recv")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _call(collective: str, codec: str, out: torch.Tensor, inp: torch.Tensor, rank: int) -> None:
    import torch.distributed as dist

    import zipccl
    from zipccl.torch_compat import all_gather_single, reduce_scatter_single
    if codec == "torch":
        calls = {"all_reduce": lambda: dist.all_reduce(inp), "reduce_scatter": lambda: reduce_scatter_single(out, inp),
                 "all_gather": lambda: all_gather_single(out, inp),
                 "all_to_all_single": lambda: dist.all_to_all_single(out, inp),
                 "send_recv": lambda: dist.send(inp, rank + 1) if rank % 2 == 0 else dist.recv(inp, rank - 1)}
    else:
        calls = {"all_reduce": lambda: zipccl.all_reduce(inp, codec=codec),
                 "reduce_scatter": lambda: zipccl.reduce_scatter(out, inp, codec=codec),
                 "all_gather": lambda: zipccl.all_gather(out, inp, codec=codec),
                 "all_to_all_single": lambda: zipccl.all_to_all_single(out, inp, codec=codec),
                 "send_recv": lambda: zipccl.send(inp, rank + 1, codec=codec) if rank % 2 == 0
                 else zipccl.recv(inp, rank - 1, codec=codec)}
    calls[collective]()


def _tensors(collective: str, numel: int, dtype, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    inp = (torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 1e-3).to(dtype)
    out = torch.zeros(numel * n if collective == "all_gather" else numel // n if collective == "reduce_scatter"
                      else numel, dtype=dtype)
    return out, inp


def _rank(rank: int, n: int, args) -> list[dict]:
    import torch.distributed as dist
    rows = []
    for collective in args.collectives:
        for dname in args.dtypes:
            for codec in args.codecs:  # once small: compiled kernels and scratch are not the call's
                _call(collective, codec, *_tensors(collective, 1 << 16, DTYPES[dname], rank, n), rank)
            numel = args.size_mib * 2**20 // DTYPES[dname].itemsize + args.plus
            out, inp = _tensors(collective, numel, DTYPES[dname], rank, n)
            for codec in args.codecs:
                grew = []
                for _ in range(2):
                    gc.collect()
                    dist.barrier()
                    with open("/proc/self/clear_refs", "w") as f:
                        f.write("5")  # VmHWM from here
                    base = _mib("VmRSS")
                    _call(collective, codec, out, inp, rank)
                    grew.append(_mib("VmHWM") - base)
                rows.append(dict(collective=collective, dtype=dname, codec=codec, peak_mib=max(grew)))
            del out, inp
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256, help="each rank's tensor (all-gather: its input)")
    p.add_argument("--ranks", type=int, default=4, help="local ranks (even: send_recv pairs rank 2k with 2k+1)")
    p.add_argument("--plus", type=int, default=0, help="elements more per rank (1: a length not a multiple of the ranks)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--codecs", default="torch,raw,lossless", help="torch: the plain torch.distributed call")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    args.collectives, args.dtypes, args.codecs = (args.collectives.split(","), args.dtypes.split(","),
                                                  args.codecs.split(","))
    if args.ranks < 2 or args.ranks % 2 or set(args.collectives) - set(COLLECTIVES) or set(args.dtypes) - set(DTYPES):
        p.error(f"--ranks: an even number >= 2; --collectives from {COLLECTIVES}; --dtypes from {tuple(DTYPES)}")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # the ranks inherit it: freed buffers go back at once
    from zipccl.launch import spawn
    per_rank = spawn(_rank, args.ranks, args, timeout=3600)
    rows = [dict(row, peak_mib=round(max(r[i]["peak_mib"] for r in per_rank), 1)) for i, row in enumerate(per_rank[0])]
    print(f"# peak memory of one call, MiB over the rank's resident size before it ({args.size_mib} MiB"
          f"{f' + {args.plus} elements' if args.plus else ''} per rank, "
          f"{args.ranks} ranks, the largest rank)")
    print(f"{'collective':18s} {'dtype':9s} " + " ".join(f"{c:>9s}" for c in args.codecs))
    for i in range(0, len(rows), len(args.codecs)):
        group = rows[i:i + len(args.codecs)]
        print(f"{group[0]['collective']:18s} {group[0]['dtype']:9s} " + " ".join(f"{r['peak_mib']:9.1f}" for r in group))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(size_mib=args.size_mib, plus=args.plus, ranks=args.ranks, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
