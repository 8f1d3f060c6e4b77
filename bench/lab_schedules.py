"""How the order of point-to-point messages decides the rate on the 1 Gbit/s lab.

    python bench/lab_schedules.py            # builds a 4-rank lab, runs, tears it down (root)

Plain torch.distributed isend/irecv over gloo, no codec: each rank sends 48 MiB
in 2 MiB messages (8 pieces x 3 peers) by four schedules, and 16 MiB each way
between ranks r and r+2 by three. Why zipccl's collectives post the next piece
before waiting for the current one (docs/PERFORMANCE.md, issue 5).
"""

from __future__ import annotations

import os
import sys
import time

PIECES, MESSAGE = 8, 1 << 20  # bf16 elements per message: 2 MiB


def _schedules(dist, torch, r, n):
    xs = [torch.ones(MESSAGE, dtype=torch.bfloat16) for _ in range(n)]
    ys = [torch.empty(MESSAGE, dtype=torch.bfloat16) for _ in range(n)]

    def wait(works):
        for w in works:
            w.wait()

    def rounds():  # round s: to r+s, from r-s, one round at a time
        for _ in range(PIECES):
            for s in range(1, n):
                wait([dist.isend(xs[(r + s) % n], (r + s) % n), dist.irecv(ys[(r - s) % n], (r - s) % n)])

    def post(k):
        return [w for s in range(1, n) for w in (dist.isend(xs[(r + s) % n], (r + s) % n, tag=k % 2),
                                                  dist.irecv(ys[(r - s) % n], (r - s) % n, tag=k % 2))]

    def all_peers():  # every peer at once, one piece at a time
        for k in range(PIECES):
            wait(post(k))

    def two_deep():  # every peer at once, piece k+1 posted before piece k is awaited
        previous = []
        for k in range(PIECES):
            current = post(k)
            wait(previous)
            previous = current
        wait(previous)

    def ring():
        for _ in range(PIECES * (n - 1)):
            wait([dist.isend(xs[0], (r + 1) % n), dist.irecv(ys[0], (r - 1) % n)])

    big = torch.ones(8 * MESSAGE, dtype=torch.bfloat16)
    big_in = torch.empty_like(big)
    peer = (r + 2) % n

    def pair_at_once():
        wait([dist.isend(big, peer), dist.irecv(big_in, peer)])

    def pair_send_first():  # blocking: the lower rank sends, then receives
        if r < peer:
            dist.send(big, peer)
            dist.recv(big_in, peer)
        else:
            dist.recv(big_in, peer)
            dist.send(big, peer)

    def ring_step():
        wait([dist.isend(big, (r + 1) % n), dist.irecv(big_in, (r - 1) % n)])

    line = 3 * PIECES * MESSAGE * 2 * 8 / 1e9 * 1e3  # ms at 1 Gbit/s
    return [("pairwise rounds, one at a time", rounds, line), ("all peers, one piece at a time", all_peers, line),
            ("all peers, two pieces in flight", two_deep, line), ("ring", ring, line),
            ("16 MiB each way, r <-> r+2 at once", pair_at_once, big.numel() * 2 * 8 / 1e6),
            ("16 MiB each way, send before receive", pair_send_first, big.numel() * 2 * 8 / 1e6),
            ("16 MiB ring step", ring_step, big.numel() * 2 * 8 / 1e6)]


def rank_main() -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    for name, run, line in _schedules(dist, torch, r, n):
        run()  # warm-up
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        if r == 0:
            print(f"{name:<40} {best * 1e3:8.1f} ms   (line rate {line:.0f} ms)", flush=True)
    dist.destroy_process_group()


def main() -> int:
    from zipccl.bench.netlab import NetLab
    with NetLab(4, "1gbit") as lab:
        codes = lab.run_ranks([sys.executable, os.path.abspath(__file__), "--rank"], timeout=600)
    return max(codes, key=abs)


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main()
    else:
        raise SystemExit(main())
