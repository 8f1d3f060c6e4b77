"""Hostile packets, by the hundred thousand: zipccl.bench.fuzz's mutations against every decoder.

    python bench/fuzz.py --cases 100000 [--family raw,topk,numba,reference=20000,triton=300]
                         [--seed 0] [--start 0] [--data PATH] [--json PATH] [--every 5]

Each family (raw, topk, and the lossless decoders numba, reference and triton, the
last under Triton's interpreter on CPU tensors) runs in a child process that reports
progress every few seconds. A case passes when its decoder raises FormatError or
decodes inside its bounds (zipccl/bench/fuzz.py says exactly what is checked). A
child killed by a signal (a decoder reading or writing where it must not: packets
lie against inaccessible pages) or stuck in one case for --case-timeout seconds is
reported as a crash at that case, and the family resumes at the next case. The exit status is 1 if any case failed.
tests/test_fuzz.py runs the same cases (seed 0) at a CI-sized count.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import sys
import time
from pathlib import Path

FAMILIES = ("raw", "topk", "numba", "reference", "triton")
COUNTS = ("cases", "format_error", "decoded_ok", "crashes", "guard_violations", "over_bound_allocations",
          "wrong_decodes", "harness_errors")
FAILURES = COUNTS[3:]
MAX_DEATHS = 20  # child processes a family may lose before it stops


def _child(family: str, cases: int, seed: int, start: int, data: str, every: float, conn, current) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors: the interpreter runs the Triton kernels
    import torch
    torch.set_num_threads(1)
    from zipccl.bench import fuzz
    grads = fuzz.load_grads(data)
    s = fuzz.run(family, cases, seed=seed, grads=grads, start=start, every=every, current=current,
                 progress=lambda s: conn.send(("progress", s.as_dict())))
    conn.send(("done", {**s.as_dict(), "gradients": grads is not None}))


def _merge(total: dict, part: dict) -> dict:
    """Counts of two runs added up."""
    out = dict(total)
    for k in COUNTS:
        out[k] = total[k] + part[k]
    out["seconds"] = round(total["seconds"] + part["seconds"], 2)
    out["failures"] = (total["failures"] + part["failures"])[:40]
    for key in ("mutations", "format_errors"):
        merged = {k: list(v) if isinstance(v, list) else v for k, v in total[key].items()}
        for k, v in part[key].items():
            if isinstance(v, list):
                merged[k] = [a + b for a, b in zip(merged.get(k, [0, 0]), v)]
            else:
                merged[k] = merged.get(k, 0) + v
        out[key] = merged
    return out


def _line(family: str, d: dict, total: int) -> str:
    rate = d["cases"] / d["seconds"] if d["seconds"] else 0.0
    failed = sum(d[k] for k in FAILURES)
    return (f"[{family}] {d['cases']}/{total} cases, {d['seconds']:.0f} s ({rate:.0f}/s): "
            f"{d['format_error']} FormatError, {d['decoded_ok']} decoded, {failed} failures")


def _empty() -> dict:
    return {k: 0 for k in COUNTS} | {"seconds": 0.0, "failures": [], "mutations": {}, "format_errors": {}}


def _run_child(family: str, a: int, b: int, args, so_far: dict, total_cases: int) -> tuple[dict, int | None, str]:
    """Cases a..b-1 in one child: (what it reported last, the case it died at or None, how it ended)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    current = ctx.Value("q", a, lock=False)  # a child that dies must not leave a lock held
    proc = ctx.Process(target=_child, args=(family, b - a, args.seed, a, str(args.data), args.every, child, current),
                       daemon=True)
    proc.start()
    child.close()
    last = _empty()
    case, since = current.value, time.monotonic()
    while True:
        if parent.poll(1.0):
            try:
                kind, d = parent.recv()
            except EOFError:
                break
            last = d
            if kind == "done":
                proc.join()
                return d, None, "done"
            print(_line(family, _merge(so_far, d), total_cases), flush=True)
        elif not proc.is_alive():
            break
        if current.value != case:
            case, since = current.value, time.monotonic()
        elif time.monotonic() - since > args.case_timeout:  # a decoder that loops forever
            proc.kill()
            proc.join()
            return last, case, f"killed: one case ran over {args.case_timeout:.0f} s"
    proc.join()
    return last, current.value, f"exit code {proc.exitcode}"


def run_family(family: str, cases: int, args) -> dict:
    """All cases of one family, in child processes. A child that dies is replaced: the cases it ran
    after its last report run again (they are deterministic), the case it died at counts as a crash,
    and the family goes on after it."""
    ranges = [(args.start, args.start + cases)]
    total, deaths, t0 = _empty(), 0, time.perf_counter()
    while ranges:
        a, b = ranges.pop(0)
        done, dead_at, code = _run_child(family, a, b, args, total, cases)
        total = _merge(total, done)
        if dead_at is None:
            continue
        deaths += 1
        print(f"[{family}] the child died at case {dead_at} ({code})", flush=True)
        total = _merge(total, _empty() | {"cases": 1, "crashes": 1, "failures": [
            f"crash: case {dead_at}: the process died ({code}); replay: python bench/fuzz.py "
            f"--family {family}=1 --start {dead_at} --seed {args.seed}"]})
        if deaths >= MAX_DEATHS:
            print(f"[{family}] {deaths} deaths: stopping this family", flush=True)
            break
        reported = a + done["cases"]
        ranges[:0] = [r for r in ((reported, dead_at), (dead_at + 1, b)) if r[0] < r[1]]
    total |= {"family": family, "wall_seconds": round(time.perf_counter() - t0, 1), "deaths": deaths}
    print(_line(family, total, cases), flush=True)
    return total


def _families(spec: str, cases: int) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, spec.split(",")):
        name, _, count = item.partition("=")
        if name not in FAMILIES:
            raise SystemExit(f"unknown family {name!r}; choose from {', '.join(FAMILIES)}")
        out.append((name, int(count) if count else cases))
    return out


def main(argv=None) -> int:
    from zipccl.bench.common import DEFAULT_DATA
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100_000, help="cases per family (default 100000)")
    ap.add_argument("--family", default="raw,topk,numba,reference",
                    help="comma-separated families, each optionally =CASES (also: triton; default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case number (to replay a range)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="fp32 gradients (.npy); synthetic data only if missing")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between progress lines")
    ap.add_argument("--case-timeout", type=float, default=300.0,
                    help="seconds one case may run before it counts as a hang (crash); the Triton interpreter "
                         "takes minutes on a packet of 32768-element blocks")
    ap.add_argument("--json", type=Path, help="write the summary as JSON")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # exit through atexit, which ends the children
    t0 = time.perf_counter()
    results = [run_family(name, n, args) for name, n in _families(args.family, args.cases)]
    print(f"\n{'family':<10} {'cases':>8} {'FormatError':>11} {'decoded-ok':>10} {'crashes':>7} {'guard':>5} "
          f"{'over-bound':>10} {'wrong':>5} {'harness':>7} {'time s':>7}")
    for d in results:
        print(f"{d['family']:<10} {d['cases']:>8} {d['format_error']:>11} {d['decoded_ok']:>10} {d['crashes']:>7} "
              f"{d['guard_violations']:>5} {d['over_bound_allocations']:>10} {d['wrong_decodes']:>5} "
              f"{d['harness_errors']:>7} {d['wall_seconds']:>7.1f}")
    failed = sum(d[k] for d in results for k in FAILURES)
    for d in results:
        for msg in d["failures"][:10]:
            print(f"  {d['family']}: {msg}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": "python bench/fuzz.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "seed": args.seed, "start": args.start, "data": str(args.data), "data_found": args.data.exists(),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_version()}",
            "total_seconds": round(time.perf_counter() - t0, 1), "failed": failed, "families": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
