"""The drop-in backend end to end: examples/train_gpt.py unchanged on backend="zipccl" against
gloo and against zipccl's explicit DDP hook with the same codec, alternating, several rounds.

    python bench/backend_e2e.py --netlab 1gbit --rounds 2 --out docs/bench/<date>/backend_e2e
    python bench/backend_e2e.py --rounds 3 --out /tmp/loopback          # unshaped loopback

Each variant is one train_gpt.py run (``--nranks 4 --batch 1 --ctx 64 --dtype bf16``: the
communication-bound configuration); the table gives each variant's median step time per round
and its ratio to gloo's in the same round. Run it from outside the checkout with PYTHONPATH
pointing at the code to measure (``python -m`` would put the checkout first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name -> (train_gpt.py arguments, environment): DDP's own all-reduce on gloo and on the
#: drop-in backend, and zipccl's explicit hook with the same codec policy.
VARIANTS = {
    "gloo": (["--backend", "gloo", "--comm", "torch"], {}),
    "drop-in auto": (["--backend", "zipccl", "--comm", "torch"], {"ZIPCCL_CODEC": "auto"}),
    "hook auto": (["--backend", "gloo", "--comm", "auto"], {}),
    "drop-in lossless": (["--backend", "zipccl", "--comm", "torch"], {"ZIPCCL_CODEC": "lossless"}),
    "hook lossless": (["--backend", "gloo", "--comm", "lossless"], {}),
}


def run(name: str, extra: list[str], out: Path, rnd: int, args) -> dict:
    flags, env = VARIANTS[name]
    path = out / f"{name.replace(' ', '_')}_{rnd}.json"
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--nranks", "4", "--batch", "1", "--ctx", "64",
           "--dtype", "bf16", "--d-model", str(args.d_model), "--steps", str(args.steps), *flags, *extra,
           "--json", str(path)]
    print(f"# round {rnd}: {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    res = subprocess.run(cmd, env=dict(os.environ, **env), capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed:\n{res.stderr[-3000:]}")
    return json.loads(path.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--netlab", metavar="RATE", help="in the network lab (root), e.g. 1gbit; default: loopback")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--d-model", dest="d_model", type=int, default=384)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, required=True, help="folder for each run's JSON and the summary")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    extra = ["--netlab", args.netlab] if args.netlab else []
    rows: dict = {v: [] for v in args.variants}
    for rnd in range(1, args.rounds + 1):
        for name in args.variants:
            rows[name].append(run(name, extra, args.out, rnd, args))
    summary = {name: [dict(median_ms=r["later_median_step_seconds"] * 1e3, all_ms=r["median_step_seconds"] * 1e3,
                           sha=r["param_sha256"][:8], eval_loss=r["eval_loss"], wire_bytes=r.get("wire_bytes"),
                           raw_bytes=r.get("raw_bytes")) for r in runs] for name, runs in rows.items()}
    (args.out / "summary.json").write_text(json.dumps(dict(netlab=args.netlab, steps=args.steps, rounds=summary),
                                                      indent=1))
    base = summary.get("gloo")
    print("| variant | median step (second half), per round | vs gloo, per round | parameters |")
    print("|---|---:|---:|---|")
    for name, runs in summary.items():
        times = " / ".join(f"{r['median_ms']:.1f} ms" for r in runs)
        ratios = " / ".join(f"{b['median_ms'] / r['median_ms']:.2f}x" for r, b in zip(runs, base)) if base else "-"
        shas = " / ".join(r["sha"] for r in runs)
        print(f"| {name} | {times} | {ratios} | {shas} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
