"""Nsight Compute's CSV (``ncu --csv --page details``) as one table row per kernel launch: the
few metrics that say whether a kernel is bound by DRAM, by latency or by occupancy.

    python bench/ncu_table.py ncu.csv

ncu's own lines (``==PROF==``, ``==WARNING==``) and the profiled program's output in the file
are skipped: the CSV starts at its header line. A metric that a section did not report is "-".
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

#: (column, ncu's metric name), in the order printed.
METRICS = (
    ("time", "Duration"),
    ("DRAM", "DRAM Throughput"),
    ("memory", "Memory Throughput"),
    ("SM", "Compute (SM) Throughput"),
    ("L1 hit", "L1/TEX Hit Rate"),
    ("L2 hit", "L2 Hit Rate"),
    ("occupancy", "Achieved Occupancy"),
    ("registers", "Registers Per Thread"),
    ("grid", "Grid Size"),
    ("block", "Block Size"),
)
UNITS = {"%": "%", "byte": " B", "usecond": " us", "msecond": " ms", "nsecond": " ns"}


def launches(text: str) -> list[tuple[str, dict[str, str]]]:
    """[(kernel name, {metric name: "value unit"})] per launch, in the CSV's order of IDs."""
    start = next((i for i, line in enumerate(text.splitlines()) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting with \"ID\") in the input")
    rows = csv.DictReader(io.StringIO("\n".join(text.splitlines()[start:])))
    found: dict[str, tuple[str, dict]] = {}
    for row in rows:
        if not row.get("ID", "").isdigit():
            continue
        name, metrics = found.setdefault(row["ID"], (row["Kernel Name"], {}))
        unit = row.get("Metric Unit") or ""
        metrics[row["Metric Name"]] = row["Metric Value"] + UNITS.get(unit, f" {unit}" if unit else "")
    return [found[k] for k in sorted(found, key=int)]


def table(text: str) -> str:
    """The markdown table of ``launches(text)``."""
    lines = ["| kernel | " + " | ".join(c for c, _ in METRICS) + " |", "|---" + "|---:" * len(METRICS) + "|"]
    for name, metrics in launches(text):
        short = name.split("(")[0]
        lines.append(f"| {short} | " + " | ".join(metrics.get(m, "-") for _, m in METRICS) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path, help="ncu --csv --page details output (ncu's --log-file)")
    args = ap.parse_args()
    try:
        print(table(args.csv.read_text(errors="replace")))
    except ValueError as e:
        sys.exit(f"ncu_table: {e}")


if __name__ == "__main__":
    main()
