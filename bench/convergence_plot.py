"""Loss curves and a summary table from examples/train_gpt.py JSON summaries.

    python bench/convergence_plot.py docs/bench/convergence/*.json --out docs/convergence.png
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def smooth(values, width=20):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - width] if i >= width else 0.0)
        out.append(acc / min(i + 1, width))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/convergence.png"))
    args = ap.parse_args()
    runs = [(p.stem, json.loads(p.read_text())) for p in args.runs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in runs:
        ax.plot(smooth(r["losses"]), label=f"{name} (eval {r['eval_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (20-step mean)")
    ax.set_title(f"small GPT, {runs[0][1]['nranks']} ranks, same seed and data")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    base = next((r for n, r in runs if n == "torch"), runs[0][1])
    print("| run | eval loss | vs torch | bytes sent per step (per rank) | median step |")
    print("|---|---:|---:|---:|---:|")
    for name, r in runs:
        sent = f"{r['wire_bytes'] / r['steps'] / 1e6:.2f} MB" if r.get("wire_bytes") else "not counted"
        print(f"| {name} | {r['eval_loss']:.4f} | {100 * (r['eval_loss'] / base['eval_loss'] - 1):+.1f}% | {sent} "
              f"| {r['median_step_seconds'] * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
