"""A strict reader of nccl-tests' (2.19) standard output, written from the format (nccl-tests'
src/util.cu and its README), not from zipccl's writer: the tests hold zipccl-perf's tables
to it. It reads what the tools that parse nccl-tests read, at the places they read it (the
size in field 0, out-of-place busbw in field 7, in-place algbw and busbw in fields 10 and
11), and refuses anything those tools could misread: a data row of the wrong field count or
width, a missing or altered header line, footers without nccl-tests' padding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TYPES = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16"}
REDOPS = {"sum", "prod", "max", "min", "avg", "none"}

RUN_LINE = re.compile(r"# nThread (\d+) nGpus (\d+) minBytes (\d+) maxBytes (\d+) "
                      r"step: (\d+(?:\.\d+)?)\((factor|bytes)\) "
                      r"warmup iters: (\d+) iters: (\d+) agg iters: (\d+) validation: (\d+) graph: (\d+) unalign: (\d+)")
DEVICE = re.compile(r"#  Rank +(\d+) Group +(\d+) Pid +(\d+) on +(\S+) device +(-?\d+) \[([^\]]+)\] (.+)")
OOB = re.compile(r"# Out of bounds values : (\d+) (OK|FAILED)")
AVG = re.compile(r"# Avg bus bandwidth    : (\S+) ")  # %-20s, then "%g " (nothing after the space: no MIN_BW set)


def _c(fmt: str, *values) -> str:
    """printf, spelled with Python's % operator."""
    return fmt % values


def _expected_headers(per_iter: bool) -> list[str]:
    """The group header, column line and units line as nccl-tests prints them (src/util.cu,
    writeResultHeader, no timestamps: "%*s" of "" with width 0 leaves the trailing space)."""
    lead = _c("# %10s  %12s  %8s  %6s  %6s", "", "", "", "", "")
    if not per_iter:
        fmt = "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %s"
        return [lead + "           out-of-place                       in-place          ",
                _c(fmt, "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                   "time", "algbw", "busbw", "#wrong", ""),
                _c(fmt, "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
                   "", "")]
    fmt = ("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s  "
           "%7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s %s")
    return [lead + "              out-of-place (+ per-iteration)" + " " * 32 + "in-place (+ per-iteration)",
            _c(fmt, "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "i_min", "i_max",
               "i_p99", "i_cv%", "time", "algbw", "busbw", "#wrong", "i_min", "i_max", "i_p99", "i_cv%", ""),
            _c(fmt, "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)", "(%)",
               "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)", "(%)", "")]


@dataclass
class Table:
    version: str
    name: str
    run: dict
    devices: list[dict]
    mode_lines: list[str]            # the `#` lines between the run line and "#" (nccl-tests' optional modes)
    per_iter: bool
    rows: list[dict] = field(default_factory=list)
    out_of_bounds: int = 0
    ok: bool = True
    avg_busbw: float = 0.0
    trailer: list[str] = field(default_factory=list)  # `#` lines after the footer (zipccl's own figures)


class FormatError(AssertionError):
    pass


def _expect(cond: bool, what: str, line: str) -> None:
    if not cond:
        raise FormatError(f"{what}: {line!r}")


def _num(text: str) -> float:
    return float(text)


def _row(line: str, per_iter: bool) -> dict:
    """One data row: 13 fields (21 with -I 1), at nccl-tests' fixed widths."""
    f = line.split()
    n = 21 if per_iter else 13
    _expect(len(f) == n, f"data row with {len(f)} fields, not {n}", line)
    step = 8 if per_iter else 4
    na = sum(f[at] == "N/A" for at in (8, 8 + step))  # "    N/A" is one character shorter than "  %6g"
    _expect(len(line) == 52 + 2 * (33 + (36 if per_iter else 0)) - na, "data row not at nccl-tests' column widths",
            line)
    _expect(f[2] in TYPES and f[3] in REDOPS, "unknown type or redop", line)
    size, count, root = int(f[0]), int(f[1]), int(f[4])
    places = {}  # busbw at fields 7 and 11 (0-based; field 10 is the in-place algbw), as in nccl-tests' rows
    for key, at in (("out_of_place", 5), ("in_place", 5 + step)):
        wrong = f[at + 3]
        _expect(wrong == "N/A" or re.fullmatch(r"\d+", wrong) is not None, "#wrong is neither a count nor N/A", line)
        places[key] = dict(time=_num(f[at]), algbw=_num(f[at + 1]), busbw=_num(f[at + 2]),
                           wrong=None if wrong == "N/A" else int(wrong))
        if per_iter:
            places[key].update(i_min=_num(f[at + 4]), i_max=_num(f[at + 5]), i_p99=_num(f[at + 6]),
                               i_cv=_num(f[at + 7]))
    return dict(size=size, count=count, type=f[2], redop=f[3], root=root, **places)


def parse(stdout: str) -> list[Table]:
    """Every table in ``stdout``; lines between tables may only be `#` lines or empty."""
    lines, i, tables = stdout.split("\n"), 0, []
    while i < len(lines):
        line = lines[i]
        if not line.startswith("# Collective test starting: "):
            _expect(line == "" or line.startswith("#"), "a line outside any table that is not a comment", line)
            i += 1
            continue
        version = lines[i - 1] if i else ""
        _expect("version" in version and version.startswith("# "), "no version line before the test start", version)
        name = line[len("# Collective test starting: "):]
        _expect(re.fullmatch(r"\S+", name) is not None, "test name", line)
        m = RUN_LINE.fullmatch(lines[i + 1])
        _expect(m is not None, "run line", lines[i + 1])
        keys = ("nthread", "ngpus", "min_bytes", "max_bytes", "step", "step_kind", "warmup", "iters", "agg", "check",
                "graph", "unalign")
        run = {k: (v if k == "step_kind" else float(v) if k == "step" else int(v)) for k, v in zip(keys, m.groups())}
        i += 2
        modes = []
        while lines[i] != "#":
            _expect(lines[i].startswith("# "), "mode line", lines[i])
            modes.append(lines[i])
            i += 1
        _expect(lines[i + 1] == "# Using devices", "'# Using devices'", lines[i + 1])
        i += 2
        devices = []
        while (m := DEVICE.fullmatch(lines[i])) is not None:
            r, g, pid, host, dev, hexid, info = m.groups()
            devices.append(dict(rank=int(r), group=int(g), pid=int(pid), hostname=host, device=int(dev),
                                device_hex=hexid, device_info=info))
            i += 1
        _expect(bool(devices), "no device lines", lines[i])
        _expect(lines[i] == "#", "'#' before the group header", lines[i])
        per_iter = "per-iteration" in lines[i + 1]
        for want, got in zip(_expected_headers(per_iter), lines[i + 1:i + 4]):
            _expect(got == want, f"header line differs from nccl-tests' {want!r}", got)
        i += 4
        table = Table(version[2:], name, run, devices, modes, per_iter)
        while not lines[i].startswith("#"):
            table.rows.append(_row(lines[i], per_iter))
            i += 1
        m = OOB.fullmatch(lines[i])
        _expect(m is not None, "'# Out of bounds values : %d OK|FAILED'", lines[i])
        table.out_of_bounds, table.ok = int(m.group(1)), m.group(2) == "OK"
        m = AVG.fullmatch(lines[i + 1])
        _expect(m is not None, "'# Avg bus bandwidth    : %g '", lines[i + 1])
        table.avg_busbw = float(m.group(1))
        _expect(lines[i + 2] == "#", "'#' after the footer", lines[i + 2])
        _expect(lines[i + 3] == f"# Collective test concluded: {name}", "test conclusion", lines[i + 3])
        _expect(lines[i + 4] == "#", "'#' after the conclusion", lines[i + 4])
        i += 5
        while i < len(lines) and lines[i].startswith("#") and not (
                i + 1 < len(lines) and lines[i + 1].startswith("# Collective test starting")):
            table.trailer.append(lines[i])
            i += 1
        tables.append(table)
    return tables
