"""The convergence benchmark in one go: every communication variant, same seed and data.

    python bench/convergence.py [--steps 400] [--out docs/bench/convergence] [--only NAME ...]
    python bench/convergence.py --seed 1 --out docs/bench/convergence_seed1 --plot none --only torch ...

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
VARIANTS = {  # the runs of docs/PERFORMANCE.md; lossy ones keep the default layer rules unless --no-rules
    "torch": ["--comm", "torch"],
    "lossless": ["--comm", "lossless"],
    "powersgd1": ["--comm", "powersgd1"],
    "powersgd4": ["--comm", "powersgd4"],
    "topk1pct": ["--comm", "topk", "--density", "0.01"],
    "topk5pct": ["--comm", "topk", "--density", "0.05"],
    "topk10pct": ["--comm", "topk", "--density", "0.1"],
    "entropy_s08_w10_norules": ["--comm", "entropy", "--start-density", "0.08", "--warmup", "10", "--no-rules"],
    "entropy_s10_w20_bf16": ["--comm", "entropy", "--start-density", "0.1", "--warmup", "20", "--bf16-values"],
    "entropy_s10_w20_norules_bf16": ["--comm", "entropy", "--start-density", "0.1", "--warmup", "20", "--no-rules",
                                     "--bf16-values"],
    "entropy_s095_w20_norules_bf16": ["--comm", "entropy", "--start-density", "0.095", "--warmup", "20",
                                      "--no-rules", "--bf16-values"],
}
PLOTTED = ("torch", "powersgd4", "topk1pct", "topk10pct", "entropy_s08_w10_norules", "entropy_s10_w20_norules_bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "convergence")
    ap.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="run these variants only")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and batches (eval windows stay fixed)")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "convergence.png"), help="loss-curve PNG, or 'none'")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(VARIANTS)
    for i, name in enumerate(names, 1):
        t0 = time.perf_counter()
        print(f"[{i}/{len(names)}] {name} ...", flush=True)
        cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--nranks", str(args.nranks),
               "--steps", str(args.steps), "--seed", str(args.seed), "--json", str(args.out / f"{name}.json"),
               *VARIANTS[name]]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        print(f"[{i}/{len(names)}] {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.plot == "none":
        return
    plotted = [str(args.out / f"{n}.json") for n in PLOTTED if (args.out / f"{n}.json").exists()]
    subprocess.run([sys.executable, str(ROOT / "bench" / "convergence_plot.py"), *plotted, "--out", args.plot],
                   check=True)


if __name__ == "__main__":
    main()
