"""FSDP2 end to end in the 1 Gbit/s lab: FSDP2's default against zipccl's comms, A/B alternating.

    python bench/fsdp_ab.py [--rounds 2] [--steps 400] [--comms torch lossless tagc] [--out docs/bench/fsdp]
                            [-- extra examples/fsdp_gpt.py flags]

Each round runs examples/fsdp_gpt.py once per comm (4 ranks, one per emulated node, 1 Gbit/s
each; --mp bf16 parameters), in the order given, so that a drift in the host's load (it is
shared) hits every comm alike; each run builds the lab and tears it down (root). Writes one
JSON summary per run and prints the table of docs/PERFORMANCE.md: median step time of the
second half, speed-up against torch in the same round, bytes sent per step and rank (all
collectives, and the reduce-scatters alone), eval loss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--mesh", "4", "--netlab", "1gbit", "--mp", "bf16", "--batch", "1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--comms", nargs="+", default=["torch", "lossless", "tagc"])
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "fsdp"))
    ap.add_argument("extra", nargs="*", help="more examples/fsdp_gpt.py flags (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rnd in range(args.rounds):
        for comm in args.comms:
            path = out / f"r{rnd}_{comm}.json"
            cmd = [sys.executable, str(ROOT / "examples" / "fsdp_gpt.py"), *COMMON, "--comm", comm,
                   "--steps", str(args.steps), "--json", str(path), *args.extra]
            print("#", " ".join(cmd[1:]), flush=True)
            t0 = time.time()
            subprocess.run(cmd, check=True, cwd=ROOT, timeout=3600)
            res = json.loads(path.read_text())
            res["wall_seconds"] = time.time() - t0
            path.write_text(json.dumps(res, indent=1))
            rows.append((rnd, comm, res))
    print("\n| round | comm | step ms (2nd half) | vs torch | MB/step/rank | RS MB/step/rank | eval loss |")
    print("|---|---|---|---|---|---|---|")
    for rnd, comm, res in rows:
        base = next(r for k, c, r in rows if k == rnd and c == "torch") if "torch" in args.comms else None
        speed = f"{base['later_median_step_seconds'] / res['later_median_step_seconds']:.2f}x" if base else "-"
        mb = res["wire_bytes_per_step"]
        rs = res["reduce_scatter_wire_bytes_per_step"]
        print(f"| {rnd} | {comm} | {res['later_median_step_seconds'] * 1e3:.0f} | {speed} | "
              f"{mb / 1e6:.2f} | {rs / 1e6:.2f} | {res['eval_loss']:.4f} |" if mb is not None else
              f"| {rnd} | {comm} | {res['later_median_step_seconds'] * 1e3:.0f} | {speed} | - | - | "
              f"{res['eval_loss']:.4f} |")


if __name__ == "__main__":
    main()
