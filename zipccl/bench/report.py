"""zipccl-perf's output in nccl-tests' formats: the text table and the -J JSON document.

Written from nccl-tests 2.19.6 (src/util.cu and src/common.cu of NVIDIA's nccl-tests), so that
the tools which parse nccl-tests read zipccl-perf unchanged: the same `#` preamble, the
out-of-place / in-place group header, 13 fields per data row (21 with -I 1, as nccl-tests),
the same footers with the same padding, and the same JSON keys and nesting (booleans as the
strings "true"/"false", as nccl-tests writes them). zipccl's own figures (codec, wire bytes,
ratio, auto's plan) never sit in those places: they go in `#` lines after the footer and under
"zipccl" keys in the JSON, which nccl-tests does not use.

A row is a dict: size, count, type, redop, root, and per placement ("out_of_place",
"in_place") a dict with time_us, algbw, busbw, wrong (None: not checked), failed (the ranks
whose check found a wrong element: nccl-tests' "Out of bounds values" counts them) and, with -I 1,
times_us (max over processes per iteration) and per_process (one list per process);
plus "zipccl", zipccl's figures for the row.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PLACEMENTS = ("out_of_place", "in_place")
FORMAT_VERSION = "2.19.6"  # the nccl-tests release whose output this follows
JSON_FILE_VERSION = 3    # nccl-tests' JSON_FILE_VERSION (3 since 2.19.6: per_iter_skip, skipped_iterations)
# CUDA_MPS_: a table run under NVIDIA's MPS daemon says so (bench/gpu_check.sh sets them only once it started)
_ENV_PREFIXES = ("ZIPCCL_", "NCCL_", "OMPI_COMM_WORLD_", "MASTER_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GLOO_",
                 "CUDA_MPS_")


def float_str(value: float, width: int) -> str:
    """A number in ``width`` characters as nccl-tests prints time and bandwidth: two decimals
    where they fit, then one, then none, then an exponent."""
    for fmt in (".2f", ".1f", ".0f"):
        text = f"{value:{width}{fmt}}"
        if len(text) <= width:
            return text
    return f"{value:{width}{'.1e' if width >= 7 else '.0e'}}"


def iter_stats(times_us: list[float]) -> dict:
    """nccl-tests' per-iteration summary of one series (microseconds): min, max, avg, p50, p95,
    p99 (nearest rank), population stdev and its ratio to the average in percent."""
    s, n = sorted(times_us), len(times_us)

    def pct(p: int) -> float:
        return s[min(n - 1, (n * p + 99) // 100 - 1)]

    avg = sum(s) / n
    stdev = (sum((t - avg) ** 2 for t in s) / n) ** 0.5
    return dict(skipped_iterations=0, min_us=s[0], max_us=s[-1], avg_us=avg, p50_us=s[n // 2], p95_us=pct(95),
                p99_us=pct(99), stdev_us=stdev, cv_pct=stdev / avg * 100 if avg > 0 else 0.0)


# ---- text ---------------------------------------------------------------------------------------------------

def run_line(cfg: dict) -> str:
    step = f"{cfg['step_factor']}(factor)" if "step_factor" in cfg else f"{cfg['step_bytes']}(bytes)"
    return (f"# nThread {cfg['nthreads']} nGpus {cfg['ngpus']} minBytes {cfg['minimum_bytes']} maxBytes "
            f"{cfg['maximum_bytes']} step: {step} warmup iters: {cfg['warmup_iters']} iters: {cfg['iterations']} "
            f"agg iters: {cfg['aggregated_iterations']} validation: {cfg['validation']} graph: {cfg['graph']} "
            "unalign: 0")  # nccl-tests 2.19 prints its -u offset here; zipccl's buffers are never offset


def device_line(dev: dict) -> str:
    return (f"#  Rank {dev['rank']:2d} Group {dev['group']:2d} Pid {dev['pid']:6d} on {dev['hostname']:>10s} "
            f"device {dev['device']:2d} [{dev['device_hex']}] {dev['device_info']}")


def preamble_lines(name: str, version: str, cfg: dict, devices: list[dict], extra: list[str] = (),
                   clock: str = "wall-clock") -> list[str]:
    """Version line, test start, run line (then ``extra`` `#` lines, as nccl-tests' optional
    mode lines), the devices, up to the group header. ``clock``: what times a call ("wall-clock"
    on CPU; on CUDA, events on the stream)."""
    lines = [f"# {version}", f"# Collective test starting: {name}", run_line(cfg)]
    if cfg.get("per_iter_timing") == "true":
        lines.append(f"# Per-Iteration Report: {clock} timing per call; i_* uses max over process rows ")
    lines += [*extra, "#", "# Using devices", *map(device_line, devices)]
    return lines


def header_lines(per_iter: bool) -> list[str]:
    """The group header, the column names and the units, as nccl-tests prints them (trailing
    spaces included)."""
    lead = f"# {'':>10s}  {'':>12s}  {'':>8s}  {'':>6s}  {'':>6s}"
    if per_iter:
        group = (lead + "              out-of-place (+ per-iteration)"
                 "                                in-place (+ per-iteration)")
        one = ("{t:>7s}  {a:>6s}  {b:>6s}  {w:>6s}  {i0:>7s}  {i1:>7s}  {i2:>7s}  {i3:>7s}")
        names = dict(t="time", a="algbw", b="busbw", w="#wrong", i0="i_min", i1="i_max", i2="i_p99", i3="i_cv%")
        units = dict(t="(us)", a="(GB/s)", b="(GB/s)", w="", i0="(us)", i1="(us)", i2="(us)", i3="(%)")
    else:
        group = lead + "           out-of-place                       in-place          "
        one = "{t:>7s}  {a:>6s}  {b:>6s}  {w:>6s}"
        names = dict(t="time", a="algbw", b="busbw", w="#wrong")
        units = dict(t="(us)", a="(GB/s)", b="(GB/s)", w="")
    cols = f"# {'size':>10s}  {'count':>12s}  {'type':>8s}  {'redop':>6s}  {'root':>6s}  " \
           f"{one.format(**names)}  {one.format(**names)} "
    unit = f"# {'(B)':>10s}  {'(elements)':>12s}  {'':>8s}  {'':>6s}  {'':>6s}  " \
           f"{one.format(**units)}  {one.format(**units)} "
    return ["#", group, cols, unit]


def row_line(row: dict, per_iter: bool) -> str:
    text = f"{row['size']:12d}  {row['count']:12d}  {row['type']:>8s}  {row['redop']:>6s}  {row['root']:6d}"
    for key in PLACEMENTS:
        p = row[key]
        wrong = "  N/A" if p["wrong"] is None else f"{float(p['wrong']):6g}"
        text += f"  {float_str(p['time_us'], 7)}  {float_str(p['algbw'], 6)}  {float_str(p['busbw'], 6)}  {wrong}"
        if per_iter:
            st = iter_stats(p["times_us"])
            text += "".join(f"  {float_str(v, 7)}" for v in (st["min_us"], st["max_us"], st["p99_us"], st["cv_pct"]))
    return text


def summary(rows: list[dict]) -> tuple[int, float]:
    """(the checks that found a wrong element, one per rank, row and placement; the average busbw
    over every row and placement): nccl-tests' two footer figures."""
    wrong = sum(int(r[k].get("failed") or 0) for r in rows for k in PLACEMENTS)
    bws = [r[k]["busbw"] for r in rows for k in PLACEMENTS]
    return wrong, (sum(bws) / len(bws) if bws else 0.0)


def footer_lines(rows: list[dict], name: str) -> list[str]:
    wrong, avg = summary(rows)
    return [f"# {'Out of bounds values':<20s} : {wrong} {'FAILED' if wrong else 'OK'}",
            f"# {'Avg bus bandwidth':<20s} : {avg:g} ",
            "#", f"# Collective test concluded: {name}", "#"]


def size_text(n: int) -> str:
    """Bytes as a reader says them: 64 KiB, 16 MiB, 1000 B."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def versus(label: str, rows: list[dict], baseline: str, base_rows: list[dict]) -> tuple[str, list[dict]]:
    """The one-line summary of a table against the baseline's table of the same run: per row
    (matched by size, type and redop), busbw over the baseline's busbw, out of place and in
    place; and the same figures for the JSON. Rows the baseline lacks are left out."""
    base = {(r["size"], r["type"], r["redop"]): r for r in base_rows}
    kinds = {(r["type"], r["redop"]) for r in rows}
    parts, ratios = [], []
    for r in rows:
        b = base.get((r["size"], r["type"], r["redop"]))
        if b is None:
            continue
        x = {k: r[k]["busbw"] / b[k]["busbw"] if b[k]["busbw"] > 0 else None for k in PLACEMENTS}
        ratios.append(dict(size=r["size"], type=r["type"], redop=r["redop"], **x))
        where = size_text(r["size"]) + (f" {r['type']} {r['redop']}" if len(kinds) > 1 else "")
        parts.append(where + " " + " / ".join("N/A" if x[k] is None else f"{x[k]:.2f}x" for k in PLACEMENTS))
    return f"# {label} vs {baseline}, busbw out-of-place / in-place: {', '.join(parts) or 'no common rows'}", ratios


# ---- JSON ---------------------------------------------------------------------------------------------------

def _num(x: float) -> float:
    """A double as nccl-tests writes it (%lf: six decimals)."""
    return float(f"{x:.6f}")


def _placement(p: dict) -> dict:
    return {"time": _num(p["time_us"]), "alg_bw": _num(p["algbw"]), "bus_bw": _num(p["busbw"]),
            "nwrong": None if p["wrong"] is None else _num(p["wrong"])}


def _per_iter(p: dict) -> dict:
    out = {k: (v if k == "skipped_iterations" else _num(v)) for k, v in iter_stats(p["times_us"]).items()}
    out["times_us"] = [_num(t) for t in p["times_us"]]
    if len(p["per_process"]) > 1:
        out["per_process_max_times_us"] = [[_num(t) for t in proc] for proc in p["per_process"]]
    return out


def result_json(row: dict, per_iter: bool) -> dict:
    out = {"size": row["size"], "count": row["count"], "type": row["type"], "redop": row["redop"],
           "root": f"{row['root']:6d}"}
    for key in PLACEMENTS:
        out[key] = _placement(row[key])
        if per_iter:
            out[key + "_per_iter"] = _per_iter(row[key])
    out["actual_iterations"] = row["iterations"]
    out["experiment_name"] = ""
    out["zipccl"] = row["zipccl"]
    return out


def environment() -> list[str]:
    """The launch-related environment (nccl-tests writes all of it; zipccl keeps to the variables
    that shape a run, so that a results file carries no one's secrets)."""
    return [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)]


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def document(start_time: str, argv: list[str], cfg: dict, devices: list[dict], tables: list[dict],
             zipccl: dict, nccl_version: int = 0) -> dict:
    """The whole run as one nccl-tests JSON document: ``tables`` (one per codec, each with name,
    codec, rows, notes and its summary against the baseline, "versus", or None) share its
    results list, and its footer figures cover them all as nccl-tests' cover every type and op
    of a run; each table's own footer sits under "zipccl" ("tables")."""
    per_iter = cfg.get("per_iter_timing") == "true"
    rows = [r for t in tables for r in t["rows"]]
    wrong, avg = summary(rows)
    per_table = []
    for t in tables:
        w, a = summary(t["rows"])
        per_table.append({"name": t["name"], "codec": t["codec"], "results": len(t["rows"]),
                          "out_of_bounds": {"count": w, "okay": "true" if w == 0 else "false"},
                          "average_bus_bandwidth": {"bandwidth": _num(a), "okay": "unchecked"},
                          "notes": t["notes"], "versus": t.get("versus")})
    return {"version": JSON_FILE_VERSION, "start_time": start_time, "args": list(argv), "env": environment(),
            "nccl_version": nccl_version, "config": dict(cfg, devices=devices),
            "results": [result_json(r, per_iter) for r in rows],
            "out_of_bounds": {"count": wrong, "okay": "true" if wrong == 0 else "false"},
            "average_bus_bandwidth": {"bandwidth": _num(avg), "okay": "unchecked"},
            "errors": [], "end_time": now(), "zipccl": dict(zipccl, tables=per_table)}


def write_json(doc: dict, path: Path) -> None:
    """Written whole or not at all (a run killed while writing leaves the last document)."""
    part = Path(path).with_name(Path(path).name + ".part")
    part.write_text(json.dumps(doc, indent=1) + "\n")
    part.replace(path)
