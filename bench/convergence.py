"""The convergence benchmark in one go: every communication variant, same seed and data.

    python bench/convergence.py [--steps 400] [--out docs/bench/convergence] [--only NAME ...]

Runs examples/train_gpt.py (2 local ranks, fp32 gradients, the reference model of
../shared/data/README.md) once per variant, writes one JSON summary per run, then
the loss-curve plot and the table of docs/PERFORMANCE.md (bench/convergence_plot.py).
About 3-5 minutes per variant on 2 cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "torch": ["--comm", "torch"],
    "lossless": ["--comm", "lossless"],
    "powersgd1": ["--comm", "powersgd1"],
    "powersgd4": ["--comm", "powersgd4"],
    "topk1pct": ["--comm", "topk", "--density", "0.01"],
    "topk10pct": ["--comm", "topk", "--density", "0.1"],
    "entropy": ["--comm", "entropy", "--start-density", "0.08", "--warmup", "10"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "convergence")
    ap.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="run these variants only")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(VARIANTS)
    for i, name in enumerate(names, 1):
        t0 = time.perf_counter()
        print(f"[{i}/{len(names)}] {name} ...", flush=True)
        cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--nranks", str(args.nranks),
               "--steps", str(args.steps), "--json", str(args.out / f"{name}.json"), *VARIANTS[name]]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        print(f"[{i}/{len(names)}] {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
    subprocess.run([sys.executable, str(ROOT / "bench" / "convergence_plot.py"),
                    *map(str, sorted(args.out.glob("*.json"))), "--out", str(ROOT / "docs" / "convergence.png")],
                   check=True)


if __name__ == "__main__":
    main()
