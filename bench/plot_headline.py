"""The README's headline plot, drawn from recorded results only (nothing is measured here).

Three panels, each from JSON in docs/bench:
- the lossless ratio on the real gradient bucket, zipccl against ZipNN (2026-11-27-encode-zeros/codec_new-1.json);
- 64 MiB collectives on two nodes of two ranks at 1 Gbit/s per node, torch.distributed
  against zipccl's auto (2026-11-25-hierarchical/*_2x2.json);
- the Triton codec's kernel throughput on an NVIDIA H100, bf16 (2026-11-26-gpu-decoder/run3).

    python bench/plot_headline.py [--records docs/bench] [--out docs/headline.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def codec_ratios(records: Path) -> dict[str, dict[str, float]]:
    """{dtype: {"zipccl": ratio, "ZipNN": ratio}} on the real bucket."""
    names = {"zipccl-lossless": "zipccl", "zipnn-1thread": "ZipNN"}
    out: dict[str, dict[str, float]] = {}
    for row in json.loads((records / "2026-11-27-encode-zeros" / "codec_new-1.json").read_text()):
        if row["data"] == "grads_step050" and row["codec"] in names:
            out.setdefault(row["dtype"], {})[names[row["codec"]]] = row["ratio"]
    return out


def lab_times(records: Path, size: int = 64 * MiB) -> dict[str, dict[str, float]]:
    """{collective: {"torch": ms, "zipccl auto": ms}} at `size`, medians of the recorded rounds."""
    out = {}
    for name, label in (("ar", "all-reduce"), ("reduce_scatter", "reduce-scatter"), ("all_gather", "all-gather")):
        doc = json.loads((records / "2026-11-25-hierarchical" / f"{name}_2x2.json").read_text())
        row = next(r for r in doc["rows"] if r["size"] == size)
        out[label] = {"torch": row["medians_s"]["torch"] * 1e3, "zipccl auto": row["medians_s"]["auto"] * 1e3}
    return out


def gpu_rates(records: Path) -> dict[str, dict[str, float]]:
    """{"bf16 64 MiB": {"encode": GB/s, "decode": GB/s}, ...}: kernels only, the run of bf1d847."""
    out = {}
    for line in (records / "2026-11-26-gpu-decoder" / "run3" / "ab.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["label"] != "new" or row["dtype"] != "bf16" or not (row["same_bytes"] and row["same_bits"]):
            continue
        label = f"bf16 {row['numel'] * 2 // MiB} MiB"
        out[label] = {"encode": row["encode"]["kernels_GBps"], "decode": row["decode"]["kernels_GBps"]}
    return out


def bars(ax, groups: dict[str, dict[str, float]], fmt: str) -> None:
    """Grouped bars: one group per key, one bar per inner key, each labelled with its value."""
    series = list(next(iter(groups.values())))
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        values = [groups[k][name] for k in groups]
        drawn = ax.bar(xs, values, width, label=name)
        ax.bar_label(drawn, [fmt.format(v) for v in values], fontsize=8)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylim(0, 1.3 * max(max(g.values()) for g in groups.values()))  # room for the legend
    ax.legend(fontsize=8, loc="upper left", ncol=len(series))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=Path, default=ROOT / "docs" / "bench")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "headline.png")
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2))
    bars(a, codec_ratios(args.records), "{:.3f}")
    a.set_title("Lossless size / original, real gradients\n(CPU, lower is better)", fontsize=10)
    bars(b, lab_times(args.records), "{:.0f}")
    b.set_ylabel("ms per call (median)")
    b.set_title("64 MiB bf16, 2 nodes x 2 ranks, 1 Gbit/s per node\n(lower is better)", fontsize=10)
    bars(c, gpu_rates(args.records), "{:.0f}")
    c.set_ylabel("GB/s of uncompressed bytes")
    c.set_title("Triton codec kernels, NVIDIA H100\n(higher is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
