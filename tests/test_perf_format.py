"""zipccl-perf speaks nccl-tests: every collective, placement and codec parses under
a strict reader of nccl-tests' text (nccl_text.py) and its JSON round-trips through a reader of
nccl-tests' schema (nccl_json.py); the bus bandwidth the tools read from a row (0-based
fields 7 and 11, nccl-tests' places; field 10 is the in-place algbw) is the one the run
measured; `mpirun -np 4` prints one table per codec."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nccl_json
import nccl_text

ROOT = Path(__file__).resolve().parents[1]
CODECS = ["torch", "raw", "lossless", "auto"]
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n, "sendrecv": lambda n: 1.0}
#: How many counts a row's size holds (nccl-tests: all-gather and all-to-all count per rank or peer).
COUNTS_PER_SIZE = {"all_reduce": lambda n: 1, "reduce_scatter": lambda n: n, "all_gather": lambda n: n,
                   "alltoall": lambda n: n, "sendrecv": lambda n: 1}
ELEMENT = {"float": 4, "half": 2, "bfloat16": 2}


def run_perf(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "zipccl.bench", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _close(printed: float, value: float, width: int = 6) -> bool:
    """``printed`` is ``value`` as nccl-tests prints it in ``width`` characters: two decimals
    where they fit, then one, then none, then an exponent (two significant digits)."""
    for decimals in (2, 1, 0):
        if len(f"{value:.{decimals}f}") <= width:
            return abs(printed - value) <= 0.5 * 10 ** -decimals + 1e-9
    return abs(printed - value) <= 0.05 * abs(value)


def check_against_json(tables: list, doc: dict, collective: str, nranks: int) -> None:
    """The numbers of the text tables are the run's own, as the JSON records them: size and
    count as nccl-tests defines them, time, algbw = size / time and busbw = algbw * factor;
    fields 7 and 11 carry that busbw (10 the in-place algbw); each footer's average is its table's."""
    got = nccl_json.read(doc)
    rows = [r for t in tables for r in t.rows]
    assert len(rows) == len(got["results"]) == len(doc["results"])
    factor = FACTOR[collective](nranks)
    for row, res, raw in zip(rows, got["results"], doc["results"]):
        assert (row["size"], row["count"], row["type"], row["redop"], row["root"]) == \
            (res["size"], res["count"], res["type"], res["redop"], res["root"])
        assert row["count"] * ELEMENT[row["type"]] * COUNTS_PER_SIZE[collective](nranks) == row["size"]
        for place in ("out_of_place", "in_place"):
            m = res[place]
            assert m["time"] > 0
            assert m["alg_bw"] == pytest.approx(row["size"] / m["time"] / 1e3, rel=1e-4, abs=2e-6)
            assert m["bus_bw"] == pytest.approx(m["alg_bw"] * factor, rel=1e-4, abs=2e-6)
            printed = row[place]
            assert _close(printed["busbw"], m["bus_bw"]) and _close(printed["algbw"], m["alg_bw"])
            assert _close(printed["time"], m["time"], 7)
            assert printed["wrong"] == (None if m["nwrong"] is None else int(m["nwrong"]))
    at = 0
    for t, per_table in zip(tables, doc["zipccl"]["tables"]):
        mine = got["results"][at:at + len(t.rows)]
        at += len(t.rows)
        bws = [r[p]["bus_bw"] for r in mine for p in ("out_of_place", "in_place")]
        assert t.avg_busbw == pytest.approx(sum(bws) / len(bws), rel=1e-4, abs=2e-6)
        assert per_table["name"] == t.name and per_table["results"] == len(t.rows)
        assert {r["zipccl"]["codec"] for r in doc["results"][at - len(t.rows):at]} == {t.name.split(":")[1]}
    everything = [r[p]["bus_bw"] for r in got["results"] for p in ("out_of_place", "in_place")]
    assert got["average_bus_bandwidth"] == pytest.approx(sum(everything) / len(everything), abs=2e-6)
    assert got["out_of_bounds"] == sum(t.out_of_bounds for t in tables)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_every_placement_and_codec_parses(tmp_path, collective):
    out_json, png = tmp_path / "r.json", tmp_path / "r.png"
    res = run_perf("-b", "8200", "-e", "32800", "-f", "4", "-n", "2", "-w", "1", "--nranks", "2", "--baseline",
                   "--collective", collective, "-d", "all", "-g", "1", "-t", "1", "-J", str(out_json),
                   "--plot", str(png), timeout=580)
    assert res.returncode == 0, res.stderr[-2000:]
    tables = nccl_text.parse(res.stdout)
    assert [t.name for t in tables] == [f"{collective}_perf:{c}" for c in CODECS]
    for t in tables:
        assert t.run["nthread"] == 1 and t.run["ngpus"] == 1 and t.run["iters"] == 2 and t.run["step"] == 4
        assert [d["rank"] for d in t.devices] == [0, 1] and all("CPU" in d["device_info"] for d in t.devices)
        assert len(t.rows) == 2 * 3  # sizes x dtypes
        # as nccl-tests, reduce-scatter and all-gather take each rank's part in whole 16-byte lines:
        # 8200 B over 2 ranks is 4100 B each, 4096 in lines
        assert [r["size"] for r in t.rows] == ([8200, 32800] if collective == "all_reduce" else [8192, 32800]) * 3
        assert t.out_of_bounds == 0 and t.ok
        for r in t.rows:  # verifiable data: every placement of every codec, the baseline too, checked exactly
            assert r["out_of_place"]["wrong"] == 0 and r["in_place"]["wrong"] == 0, r
        assert all(line.startswith("#") for line in t.trailer)
    doc = json.loads(out_json.read_text())
    check_against_json(tables, doc, collective, 2)
    for r in doc["results"]:
        z = r["zipccl"]
        if z["codec"] == "lossless":
            assert z["ratio"] < 0.95 and 0 < z["wire_bytes"] < z["raw_bytes"]
        if z["codec"] == "torch":
            assert z["wire_bytes"] is None and z["plan"] is None
    lossless = next(t for t in tables if t.name.endswith(":lossless"))
    assert any(line.startswith("# zipccl ") and "lossless" in line for line in lossless.trailer)
    assert "[1/" in res.stderr and "[1/" not in res.stdout  # progress on stderr: stdout is the tables alone
    assert png.stat().st_size > 1000


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_backend_zipccl_times_plain_calls_on_gloo_and_on_the_drop_in(tmp_path, collective):
    """--backend zipccl: two tables (plain dist.* on a gloo group, then on the zipccl world),
    each parsing alone; with ZIPCCL_CODEC=lossless the drop-in's rows report what zipccl sent."""
    out_json = tmp_path / "r.json"
    env_codec = os.environ.get("ZIPCCL_CODEC")
    os.environ["ZIPCCL_CODEC"] = "lossless"
    try:
        res = run_perf("-b", "64K", "-e", "64K", "-n", "2", "-w", "1", "--nranks", "2", "--backend", "zipccl",
                       "--collective", collective, "-d", "bfloat16", "-J", str(out_json))
    finally:
        os.environ.pop("ZIPCCL_CODEC") if env_codec is None else os.environ.update(ZIPCCL_CODEC=env_codec)
    assert res.returncode == 0, res.stderr[-2000:]
    tables = nccl_text.parse(res.stdout)
    assert [t.name for t in tables] == [f"{collective}_perf:torch-gloo", f"{collective}_perf:drop-in"]
    for t in tables:
        assert t.ok and all(r["out_of_place"]["wrong"] == 0 and r["in_place"]["wrong"] == 0 for r in t.rows)
    doc = json.loads(out_json.read_text())
    check_against_json(tables, doc, collective, 2)
    gloo, dropin = ([r["zipccl"] for r in doc["results"] if r["zipccl"]["codec"] == c] for c in ("torch-gloo", "drop-in"))
    assert all(z["wire_bytes"] is None for z in gloo)
    assert all(z["plan"] == "lossless" and 0 < z["wire_bytes"] < z["raw_bytes"] for z in dropin), dropin


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collective", ["alltoall", "sendrecv"])
def test_alltoall_and_sendrecv_tables(tmp_path, collective):
    """nccl-tests' alltoall_perf and sendrecv_perf: one table per codec after torch's, parsing
    alone; the count column per peer (alltoall, each peer's part in whole 16-byte lines) or per
    rank (sendrecv), busbw factors (n-1)/n and 1, redop none for alltoall and the -o op for
    sendrecv; out of place checked for every codec (data moved: one right answer), in place
    timed and N/A, as nccl-tests; lossless moving fewer bytes."""
    out_json = tmp_path / "r.json"
    res = run_perf("-b", "25000", "-e", "100000", "-f", "4", "-n", "2", "-w", "1", "--nranks", "3", "--baseline",
                   "--collective", collective, "-d", "all", "-J", str(out_json), timeout=580)
    assert res.returncode == 0, res.stderr[-2000:]
    tables = nccl_text.parse(res.stdout)
    assert [t.name for t in tables] == [f"{collective}_perf:{c}" for c in CODECS]
    for t in tables:
        assert len(t.rows) == 2 * 3 and t.ok and t.out_of_bounds == 0
        for r in t.rows:
            assert r["redop"] == ("none" if collective == "alltoall" else "sum") and r["root"] == -1, r
            assert r["out_of_place"]["wrong"] == 0 and r["in_place"]["wrong"] is None, r
    # auto's learning lines: no size here is one auto learns (below 1 MiB), and messages it never learns
    said = re.findall(r"^#   \d+ B \w+ \w+: 0 \+ 0 calls; (.*)$", res.stdout, re.M)
    expect = ("auto does not learn messages: it sends by link and size (rank 0's last: native)"
              if collective == "sendrecv" else "a size auto does not learn: the backend's own call")
    assert said == [expect] * 6, said
    # alltoall: 25000 B over 3 ranks is 8333 B per peer, 8320 in whole 16-byte lines (nccl-tests' paramcount)
    assert [r["size"] for r in tables[0].rows] == ([24960, 99984] if collective == "alltoall" else [25000, 100000]) * 3
    doc = json.loads(out_json.read_text())
    check_against_json(tables, doc, collective, 3)
    for r in doc["results"]:
        z = r["zipccl"]
        if z["codec"] == "lossless" and r["type"] == "bfloat16":
            assert 0 < z["wire_bytes"] < 0.9 * z["raw_bytes"], z
        if z["codec"] == "torch":
            assert z["wire_bytes"] is None
        if z["codec"] == "raw":  # per call, each rank sends its message (sendrecv), or a part per peer
            assert z["raw_bytes"] == r["size"] * (1 if collective == "sendrecv" else 2 / 3), (r["size"], z)
    # hierarchical on 2 nodes of 2, --intra at its default (shm, the reductions'): plain bytes inside a node
    res = run_perf("-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--nranks", "4", "--nodes", "2", "--collective",
                   collective, "--algorithm", "hierarchical", "--codec", "lossless")
    assert res.returncode == 0, res.stderr[-2000:]
    [table] = nccl_text.parse(res.stdout)
    assert table.ok and table.rows[0]["out_of_place"]["wrong"] == 0, table.rows


@pytest.mark.timeout(300)
def test_a_size_whose_count_rounds_to_zero_is_a_row(tmp_path):
    """As nccl-tests' sweep: a size whose count rounds to 0 (all-gather's parts in whole 16-byte
    lines: 8 B over 2 ranks) is a row of size and count 0, timed, its busbw 0 in the average."""
    out_json = tmp_path / "r.json"
    res = run_perf("-b", "8", "-e", "64", "-f", "8", "-n", "2", "-w", "1", "--nranks", "2", "--codec", "raw",
                   "--collective", "all_gather", "-d", "float", "-J", str(out_json))
    assert res.returncode == 0, res.stderr[-2000:]
    [table] = nccl_text.parse(res.stdout)
    assert [(r["size"], r["count"]) for r in table.rows] == [(0, 0), (64, 8)], table.rows
    check_against_json([table], json.loads(out_json.read_text()), "all_gather", 2)
    png = tmp_path / "zero.png"  # every row of size 0: the plot says so (a log axis has no 0)
    res = run_perf("-b", "8", "-e", "12", "-n", "1", "-w", "0", "--nranks", "2", "--codec", "raw",
                   "--collective", "all_gather", "-d", "float", "--plot", str(png))
    assert res.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", res.stderr[-2000:]


def test_per_iteration_times(tmp_path):
    """-I 1: nccl-tests' i_* columns, and per placement the per-iteration block its analysis
    script reads: times_us is the max over the process rows, one row per process."""
    out_json = tmp_path / "r.json"
    res = run_perf("-b", "64K", "-e", "64K", "-n", "3", "-w", "1", "--nranks", "2", "--codec", "lossless", "-I", "1",
                   "-J", str(out_json))
    assert res.returncode == 0, res.stderr[-2000:]
    [table] = nccl_text.parse(res.stdout)
    assert table.per_iter and any("Per-Iteration Report: wall-clock timing" in line for line in table.mode_lines)  # on CPU; CUDA: events
    doc = json.loads(out_json.read_text())
    check_against_json([table], doc, "all_reduce", 2)
    got = nccl_json.read(doc)
    assert got["config"]["per_iter_timing"] == "true"
    for row, res_ in zip(table.rows, got["results"]):
        for place in ("out_of_place", "in_place"):
            it = res_[place + "_per_iter"]
            procs = it["per_process_max_times_us"]
            assert len(procs) == 2 and all(len(p) == 3 for p in procs)
            assert it["times_us"] == pytest.approx([max(col) for col in zip(*procs)], abs=1e-5)
            assert it["min_us"] == pytest.approx(min(it["times_us"])) and it["max_us"] == pytest.approx(
                max(it["times_us"]))
            assert it["avg_us"] == pytest.approx(sum(it["times_us"]) / 3, abs=1e-5)
            assert _close(row[place]["i_min"], it["min_us"], 7) and _close(row[place]["i_max"], it["max_us"], 7)


@pytest.mark.timeout(300)
def test_mpirun_prints_one_table_per_codec(tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed (make test installs openmpi-bin as root)")
    from zipccl.launch import free_port
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("OMPI_")}
    env.update(PYTHONPATH=str(ROOT), MASTER_PORT=str(free_port()))
    out_json = tmp_path / "r.json"
    res = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", "-x", "MASTER_PORT", "-x",
                          "PYTHONPATH", sys.executable, "-m", "zipccl.bench", "-b", "64K", "-e", "64K", "-n", "1",
                          "-w", "1", "-J", str(out_json)], env=env, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    tables = nccl_text.parse(res.stdout)
    assert [t.name for t in tables] == [f"all_reduce_perf:{c}" for c in ("raw", "lossless", "auto")]
    assert res.stdout.count("# Collective test starting") == 3
    for t in tables:
        assert [d["rank"] for d in t.devices] == [0, 1, 2, 3] and len({d["pid"] for d in t.devices}) == 4
        assert [(r["out_of_place"]["wrong"], r["in_place"]["wrong"]) for r in t.rows] == [(0, 0)]
    check_against_json(tables, json.loads(out_json.read_text()), "all_reduce", 4)


# ---- the readers themselves are strict: what they refuse ------------------------------------------------------

def _sample() -> str:
    """A two-row nccl-tests table, written with the C formats of src/util.cu (data, not zipccl)."""
    head = ["# nccl-tests version 2.19.0 nccl-headers=22703 nccl-library=22703",
            "# Collective test starting: all_reduce_perf",
            "# nThread 1 nGpus 1 minBytes 8 maxBytes 16 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 "
            "validation: 1 graph: 0 unalign: 0", "#", "# Using devices",
            "#  Rank %2d Group %2d Pid %6d on %10s device %2d [%s] %s" % (0, 0, 4242, "node1", 0, "0000:1a:00",
                                                                        "NVIDIA H100 80GB HBM3")]
    rows = ["%12d  %12d  %8s  %6s  %6s  %7s  %6s  %6s  %6g  %7s  %6s  %6s    N/A" %
            (s, s // 4, "float", "sum", "%6i" % -1, "12.34", "0.00", "0.00", 0, "11.90", "0.00", "0.00")
            for s in (8, 16)]
    foot = ["# %-20s : %d %s" % ("Out of bounds values", 0, "OK"), "# %-20s : %g %s" % ("Avg bus bandwidth", 0.0, ""),
            "#", "# Collective test concluded: all_reduce_perf", "#", ""]
    return "\n".join(head + ["#"] + nccl_text._expected_headers(False) + rows + foot)


#: What nccl-tests 2.19.4 printed for `./build/all_reduce_perf -b 8 -e 128M -f 2 -g 8` on one machine
#: with 8 A100-SXM4-80GB (NCCL 2.19.3), byte for byte, trailing spaces included, as a public note on
#: building and running nccl-tests shows it (the block after its shell prompt). nccl-tests' own
#: repository has no sample output.
GOLDEN = Path(__file__).resolve().parent / "golden" / "nccl_tests_2.19.4_all_reduce_perf.txt"


def test_text_reader_reads_real_nccl_tests_output():
    text = GOLDEN.read_text()
    [t] = nccl_text.parse(text)
    assert t.version == "nccl-tests version 2.19.4 nccl-headers=21903 nccl-library=21903"
    assert t.name == "all_reduce_perf" and not t.per_iter and t.mode_lines == []
    assert (t.run["ngpus"], t.run["min_bytes"], t.run["max_bytes"], t.run["step"], t.run["iters"], t.run["unalign"]) \
        == (8, 8, 128 << 20, 2.0, 20, 0)
    assert [d["device"] for d in t.devices] == list(range(8)) and {d["pid"] for d in t.devices} == {584419}
    assert [r["size"] for r in t.rows] == [8 << k for k in range(25)]
    for r in t.rows:
        assert r["count"] == r["size"] // 4 and (r["type"], r["redop"], r["root"]) == ("float", "sum", -1)
        for place in ("out_of_place", "in_place"):
            m = r[place]
            assert m["wrong"] == 0
            assert m["algbw"] == pytest.approx(r["size"] / m["time"] / 1e3, abs=0.006)  # GB/s from bytes and us
            assert m["busbw"] == pytest.approx(m["algbw"] * FACTOR["all_reduce"](8), abs=0.02)
    assert (t.rows[-1]["out_of_place"]["busbw"], t.rows[-1]["in_place"]["busbw"]) == (181.32, 182.90)
    assert t.out_of_bounds == 0 and t.ok and t.avg_busbw == 34.9024
    bws = [r[p]["busbw"] for r in t.rows for p in ("out_of_place", "in_place")]
    assert sum(bws) / len(bws) == pytest.approx(t.avg_busbw, abs=0.01)
    assert t.trailer == []
    for broken in (text.replace("#wrong \n", "#wrong\n", 1),                      # a trailing space lost
                   text.replace(" unalign: 0", ""),                                  # the 2.19 run line cut
                   text.replace("       0    36.18", "      0    36.18", 1)):        # a row off its widths
        with pytest.raises(nccl_text.FormatError):
            nccl_text.parse(broken)


def test_text_reader_is_strict():
    [t] = nccl_text.parse(_sample())
    assert [(r["size"], r["in_place"]["wrong"]) for r in t.rows] == [(8, None), (16, None)]
    good = _sample()
    broken = {
        "a 12-field row": good.replace("    N/A\n", "\n", 1),
        "a 14th field": good.replace("    N/A\n", "    N/A  lossless\n", 1),
        "no out-of-place group header": good.replace("out-of-place", "out_of_place"),
        "footer without the padding": good.replace("# Avg bus bandwidth    :", "# Avg bus bandwidth :"),
        "footer without the trailing space": good.replace("bandwidth    : 0 \n", "bandwidth    : 0\n"),
        "a column renamed": good.replace("#wrong", "wrong", 1),
        "no conclusion": good.replace("# Collective test concluded: all_reduce_perf", "#"),
        "a stray line": good.replace("# Out of bounds", "progress 1/2\n# Out of bounds"),
    }
    for what, text in broken.items():
        with pytest.raises(nccl_text.FormatError):
            nccl_text.parse(text)
            pytest.fail(what)


def test_json_reader_is_strict():
    doc = {"version": 3, "start_time": "2026-11-25 23:00:00", "args": ["all_reduce_perf"], "env": [],
           "nccl_version": 22703,
           "config": {"nthreads": 1, "ngpus": 1, "minimum_bytes": 8, "maximum_bytes": 8, "step_factor": 2,
                      "warmup_iters": 5, "iterations": 20, "aggregated_iterations": 1, "validation": 1, "graph": 0,
                      "blocking_collectives": "false", "per_iter_timing": "false", "per_iter_skip": 0,
                      "parallel_init": "false",
                      "devices": [{"rank": 0, "group": 0, "pid": 1, "hostname": "h", "device": 0,
                                   "device_hex": "0000:1a:00", "device_info": "GPU"}]},
           "results": [{"size": 8, "count": 2, "type": "float", "redop": "sum", "root": "    -1",
                        "out_of_place": {"time": 12.3, "alg_bw": 0.0, "bus_bw": 0.0, "nwrong": 0.0},
                        "in_place": {"time": 11.9, "alg_bw": 0.0, "bus_bw": 0.0, "nwrong": None},
                        "actual_iterations": 20, "experiment_name": ""}],
           "out_of_bounds": {"count": 0, "okay": "true"},
           "average_bus_bandwidth": {"bandwidth": 0.0, "okay": "unchecked"}, "errors": [],
           "end_time": "2026-11-25 23:00:01"}
    assert nccl_json.read(json.loads(json.dumps(doc)))["results"][0]["in_place"]["nwrong"] is None
    for mutate in (lambda d: d["config"].update(per_iter_timing=False),          # a JSON boolean, not "false"
                   lambda d: d["results"][0].update(root=-1),                     # root is the "%6i" string
                   lambda d: d["results"][0]["in_place"].pop("nwrong"),
                   lambda d: d["results"][0].pop("out_of_place"),
                   lambda d: d["config"].update(step_bytes=1),                     # both step keys
                   lambda d: d["config"].update(per_iter_timing="true"),          # no *_per_iter blocks
                   lambda d: d.update(version=1)):
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        with pytest.raises(nccl_json.SchemaError):
            nccl_json.read(bad)


def test_nccl_version_is_the_code_nccl_tests_writes(monkeypatch):
    """The JSON's nccl_version: NCCL_VERSION_CODE of the NCCL torch loaded (2.28.9 -> 22809), 0
    where torch has none (this CPU build)."""
    import torch

    from zipccl.bench import cuda
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    assert cuda.nccl_version() == 22809

    def missing():
        raise AttributeError("module 'torch._C' has no attribute '_nccl_version'")
    monkeypatch.setattr(torch.cuda.nccl, "version", missing)
    assert cuda.nccl_version() == 0
