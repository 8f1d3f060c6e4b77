"""A reader of nccl-tests' -J JSON (file version 3, nccl-tests 2.19.6's src/util.cu), written
from that schema and not from zipccl's writer: every key nccl-tests writes, at its place and
of its type (booleans are the strings "true"/"false", "root" is the "%6i" string, "nwrong" a
number or null), and the per-iteration block its analysis script (analyze_perf_json.py)
reads. Keys nccl-tests does not write are allowed: that is where zipccl keeps its own.
"""

from __future__ import annotations

import re

BOOL = ("true", "false")
TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
CONFIG = {"nthreads": int, "ngpus": int, "minimum_bytes": int, "maximum_bytes": int, "warmup_iters": int,
          "iterations": int, "aggregated_iterations": int, "validation": int, "graph": int,
          "blocking_collectives": BOOL, "per_iter_timing": BOOL, "per_iter_skip": int, "parallel_init": BOOL,
          "devices": list}
DEVICE = {"rank": int, "group": int, "pid": int, "hostname": str, "device": int, "device_hex": str,
          "device_info": str}
PER_ITER = ("min_us", "max_us", "avg_us", "p50_us", "p95_us", "p99_us", "stdev_us", "cv_pct")


class SchemaError(AssertionError):
    pass


def _check(obj: dict, spec: dict, where: str) -> None:
    for key, kind in spec.items():
        if key not in obj:
            raise SchemaError(f"{where}: no {key!r}")
        value = obj[key]
        ok = value in kind if isinstance(kind, tuple) else \
            isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise SchemaError(f"{where}.{key}: {value!r} is not {kind}")


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def read(doc: dict) -> dict:
    """Validate ``doc`` and return what a tool takes from it: the config, the devices, and per
    result and placement (time, alg_bw, bus_bw, nwrong) plus the per-iteration series."""
    _check(doc, {"version": int, "start_time": str, "args": list, "env": list, "nccl_version": int,
                 "config": dict, "results": list, "out_of_bounds": dict, "average_bus_bandwidth": dict,
                 "errors": list, "end_time": str}, "document")
    if doc["version"] != 3:
        raise SchemaError(f"file version {doc['version']}, not 3")
    for key in ("start_time", "end_time"):
        if not TIME.fullmatch(doc[key]):
            raise SchemaError(f"{key} {doc[key]!r} is not %Y-%m-%d %H:%M:%S")
    if not all(isinstance(a, str) for a in doc["args"] + doc["env"]):
        raise SchemaError("args and env are lists of strings")
    cfg = doc["config"]
    _check(cfg, CONFIG, "config")
    if ("step_factor" in cfg) == ("step_bytes" in cfg):
        raise SchemaError("config has exactly one of step_factor and step_bytes")
    for i, dev in enumerate(cfg["devices"]):
        _check(dev, DEVICE, f"config.devices[{i}]")
    per_iter = cfg["per_iter_timing"] == "true"
    results = []
    for i, r in enumerate(doc["results"]):
        where = f"results[{i}]"
        _check(r, {"size": int, "count": int, "type": str, "redop": str, "root": str, "out_of_place": dict,
                   "in_place": dict, "actual_iterations": int, "experiment_name": str}, where)
        if not re.fullmatch(r" *-?\d+", r["root"]) or len(r["root"]) < 6:
            raise SchemaError(f"{where}.root {r['root']!r} is not a %6i string")
        out = dict(size=r["size"], count=r["count"], type=r["type"], redop=r["redop"], root=int(r["root"]))
        for place in ("out_of_place", "in_place"):
            p = r[place]
            if not ({"time", "alg_bw", "bus_bw", "nwrong"} <= set(p) and all(_is_num(p[k]) for k in
                                                                            ("time", "alg_bw", "bus_bw"))):
                raise SchemaError(f"{where}.{place}: {p}")
            if p["nwrong"] is not None and not _is_num(p["nwrong"]):
                raise SchemaError(f"{where}.{place}.nwrong: {p['nwrong']!r}")
            out[place] = dict(time=p["time"], alg_bw=p["alg_bw"], bus_bw=p["bus_bw"], nwrong=p["nwrong"])
            key = place + "_per_iter"
            if per_iter != (key in r):
                raise SchemaError(f"{where}: {key} present iff per_iter_timing")
            if per_iter:
                it = r[key]
                _check(it, {"skipped_iterations": int, "times_us": list}, f"{where}.{key}")
                if not all(_is_num(it[k]) for k in PER_ITER) or len(it["times_us"]) != r["actual_iterations"]:
                    raise SchemaError(f"{where}.{key}: {it}")
                rows = it.get("per_process_max_times_us", [])
                if rows and any(len(row) != len(it["times_us"]) for row in rows):
                    raise SchemaError(f"{where}.{key}: a process row of another length")
                out[key] = dict(it)
        results.append(out)
    oob, avg = doc["out_of_bounds"], doc["average_bus_bandwidth"]
    _check(oob, {"count": int, "okay": BOOL}, "out_of_bounds")
    _check(avg, {"okay": ("true", "false", "unchecked")}, "average_bus_bandwidth")
    if not _is_num(avg.get("bandwidth")):
        raise SchemaError(f"average_bus_bandwidth.bandwidth: {avg}")
    return dict(config=cfg, devices=cfg["devices"], results=results, out_of_bounds=oob["count"],
                okay=oob["okay"] == "true", average_bus_bandwidth=avg["bandwidth"])
