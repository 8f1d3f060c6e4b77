"""Print zipccl's line coverage, total and per module, and the modules below a threshold (percent,
default 80), from the JSON report that `coverage json` wrote (`make coverage`)."""

import json
import sys

report = json.load(open(sys.argv[1] if len(sys.argv) > 1 else "coverage.json"))
threshold = float(sys.argv[2]) if len(sys.argv) > 2 else 80.0
total = report["totals"]
print(f"zipccl/: {total['percent_covered']:.1f}% of {total['num_statements']} lines "
      f"(modules run mostly on a GPU and numba-compiled functions left out: pyproject.toml [tool.coverage])")
low = sorted((f["summary"]["percent_covered"], name) for name, f in report["files"].items()
             if f["summary"]["percent_covered"] < threshold)
print(f"{len(low)} module(s) below {threshold:.0f}%:")
for percent, name in low:
    print(f"  {percent:5.1f}%  {name}")
