"""zipccl-perf smoke runs: real data, ops, hierarchical runs, auto's report, flag validation
(the nccl-tests format itself: test_perf_format.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nccl_text
from zipccl.bench import common, report

ROOT = Path(__file__).resolve().parents[1]


def run_perf(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "zipccl.bench", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def parse_rows(stdout: str) -> list[dict]:
    """Every data row of every table (strictly parsed), with its table's codec and #wrong per
    placement as printed ("N/A" where not checked)."""
    rows = []
    for t in nccl_text.parse(stdout):
        for r in t.rows:
            wrong = tuple("N/A" if r[p]["wrong"] is None else str(r[p]["wrong"]) for p in ("out_of_place", "in_place"))
            rows.append(dict(r, codec=t.name.split(":", 1)[1], wrong=wrong))
    return rows


@pytest.mark.timeout(300)
def test_real_data_and_ops(tmp_path, real_grads):
    """Real data, every op, dtype and codec, checked against plain torch on all ranks' inputs: MAX
    and MIN for everything (the backend included), SUM and AVG where zipccl promises rank order
    (raw and lossless); the backend's sums (torch, auto's native plan) are its own: N/A."""
    from conftest import GRADS
    res = run_perf("-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--nranks", "2", "-o", "all", "-d", "all",
                   "--codec", "all", "--baseline", "--data", str(GRADS))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = parse_rows(res.stdout)
    assert {(r["type"], r["redop"]) for r in rows} == {(t, o) for t in common.DTYPES for o in common.OPS}
    for r in rows:
        unchecked = r["redop"] in ("sum", "avg") and r["codec"] in ("torch", "auto")
        assert r["wrong"] == (("N/A", "N/A") if unchecked else ("0", "0")), r


@pytest.mark.timeout(300)
def test_real_data_hierarchical_sums_node_by_node():
    """Hierarchical sums of real data: each node's sum rounded, then the nodes' in node order,
    which differs from a flat sum in the last bits; the check models it (rank_order_reduce)."""
    from conftest import GRADS
    if not GRADS.exists():
        pytest.skip(f"real gradients not found at {GRADS} (set ZIPCCL_DATA)")
    res = run_perf("-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--nranks", "4", "--nodes", "2", "-o", "avg",
                   "--algorithm", "hierarchical", "--codec", "lossless", "--data", str(GRADS))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = parse_rows(res.stdout)
    assert [(r["redop"], r["wrong"]) for r in rows] == [("avg", ("0", "0"))]


def test_a_checked_call_that_writes_nothing_counts_every_element_wrong():
    """#wrong checks what the checked call wrote, not what the timed calls left in the buffer:
    an all-gather that writes its output on the timed calls alone, one rank. As in nccl-tests,
    of -c 3 checks the first that finds a wrong element is reported (and ends the checks), and
    "Out of bounds values" counts that failed check once."""
    import argparse
    import dataclasses

    import torch
    import torch.distributed as dist

    from zipccl.bench.all_gather import SPEC
    calls = []

    def timed_only(out, inp, op, group, codec, algorithm="auto"):
        calls.append(1)
        if len(calls) <= 3:  # the untimed first call and the two timed ones
            out.copy_(inp)

    spec = dataclasses.replace(SPEC, run=timed_only)
    args = argparse.Namespace(iters=2, check=3, device="cpu", algorithm="auto", average=1, per_iter_timing=False)
    data = torch.arange(64, dtype=torch.bfloat16)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = common.measure_placement(spec, args, False, 64, 64, torch.bfloat16, None,
                                          [common.Variant("torch", None, reference=data.clone())], data, 0, 1)[0][0]
    finally:
        dist.destroy_process_group()
    assert len(calls) == 4 and result["wrong"] == 64 and result["failed"] == 1, result
    clean = dict(result, wrong=0, failed=0)
    assert report.summary([{"out_of_place": result, "in_place": clean}])[0] == 1


def test_rank_order_reduce_is_the_promised_order():
    import torch
    import torch.distributed as dist
    big, tiny = torch.tensor([256.0]), torch.tensor([2.0 ** -9])  # bf16 keeps 8 bits: 256 + 2^-9 is 256
    ins = [x.to(torch.bfloat16) for x in (big, tiny, tiny, -big)]
    assert common.rank_order_reduce(ins, dist.ReduceOp.SUM).item() == 2.0 ** -8  # fp32 sum, rounded once
    assert common.rank_order_reduce(ins, dist.ReduceOp.SUM, ((0, 1), (2, 3))).item() == 0.0  # node sums rounded
    assert common.rank_order_reduce(ins, dist.ReduceOp.AVG).item() == 2.0 ** -10
    assert common.rank_order_reduce(ins, dist.ReduceOp.MAX).item() == 256.0
    assert common.count_wrong(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 2.0]), dist.ReduceOp.MAX) == 1
    assert common.count_wrong(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]), dist.ReduceOp.SUM) == 1


@pytest.mark.parametrize("args,message", [
    (["-b", "2M", "-e", "1M"], "must not be larger"),
    (["-b", "1X"], "not a size"),
    (["-e", "inf"], "not a size"),
    (["--collective", "sendrecv", "--nranks", "1"], "needs two ranks or more"),
    (["-n", "0"], "-n must be"),
    (["-d", "double"], "invalid choice"),
    (["--data", "/nonexistent.npy"], "does not exist"),
    (["-g", "2"], "-g takes 1 only"),
    (["-t", "4"], "-t takes 1 only"),
    (["-m", "4"], "-m takes 1 only"),
    (["-G", "1"], "-G takes 0 only"),
    (["-x", "0"], "-x takes -1 only"),
    (["-I", "2"], "invalid choice"),
    (["--netlab", "1gbt"], "--netlab: rate '1gbt'"),
    (["--netlab", "0bit"], "at least 1kbit"),
    (["-f", "1.5"], "not a whole number"),
    (["-J", "/nonexistent/folder/out.json"], "cannot write there"),
    (["-e", "1024G", "--nranks", "4"], "more than this host's memory"),  # 16 TiB of buffers, refused at once
    (["--codec", "lossless,zip"], "give 'all', or codecs of raw, lossless, auto once each"),
    (["--codec", "auto,raw,auto"], "once each"),
])
def test_flag_validation(args, message, capsys):
    from zipccl.bench.perf import main
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("given,tables", [
    ([], ["raw", "lossless", "auto"]),
    (["--codec", "all", "--baseline"], ["torch", "raw", "lossless", "auto"]),
    (["--codec", "lossless,auto", "--baseline"], ["torch", "lossless", "auto"]),
    (["--codec", "auto,raw"], ["auto", "raw"]),
])
def test_codecs_are_timed_in_the_order_given(given, tables):
    from zipccl.bench import cuda
    from zipccl.bench.perf import _plan
    ap = common.parser("zipccl-perf")
    cuda.add_options(ap)
    args = ap.parse_args(given)
    common.validate(ap, args)
    assert [label for label, _, _ in _plan(args)[2]] == tables


def test_sizes_and_verifiable_data():
    assert common.parse_size("64M") == 64 << 20 and common.parse_size("1K") == 1024
    assert [common.parse_size(t) for t in ("64KB", "64kib", "1MB", "128B", "0.5GiB")] == [64 << 10, 64 << 10, 1 << 20,
                                                                                          128, 1 << 29]
    for bad in ("B", "KB", "MBB", "1KBB"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.parse_size(bad)
    assert common.sizes(1 << 20, 16 << 20, 4, 0) == [1 << 20, 4 << 20, 16 << 20]
    assert common.sizes(1, 3, 1, 1) == [1, 2, 3]
    assert common.sizes(8, 16, 1.1, 0) == [8, 9, 10, 11, 12, 13, 14, 15, 16]  # a fraction never stalls the sweep
    assert common.sizes(0, 8, 2, 0) == [0, 1, 2, 4, 8]  # nor a start at 0
    import torch
    for dtype in common.DTYPES.values():
        xs = [common.verifiable(10000, dtype, r, 8) for r in range(8)]
        exact = sum(x.double() for x in xs)
        assert torch.equal(exact.to(dtype).double(), exact)  # the sum is representable: order cannot matter
        assert (xs[0] != 0).float().mean() > 0.9 and xs[0].double().std() > 0.5


@pytest.mark.timeout(300)
def test_auto_reports_what_it_learned():
    """With no warm-up at all, auto has learned before the timed calls, and the footer says how
    (calls per placement, the plans the timed calls ran), every plan's time and what auto runs
    now: on loopback, where coding cannot pay, the backend's own collective (zipccl's pipeline
    costs CPU and saves nothing on a link this fast: 2-3x slower in every loopback run so far)."""
    res = run_perf("-b", "2M", "-e", "2M", "-n", "2", "-w", "0", "--nranks", "2", "--codec", "auto")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "# auto plans" in res.stdout and "# topology: 1x2" in res.stdout
    learned = [line for line in res.stdout.splitlines() if line.startswith("#   all_reduce bfloat16 2097152-")]
    assert len(learned) == 1 and all(p in learned[0] for p in ("native", "raw", "lossless")), res.stdout
    assert learned[0].rstrip().endswith("-> native (fastest)"), learned
    how = re.search(r"^#   2097152 B bfloat16 sum: (\d+) \+ 0 calls; timed calls ran native / native$", res.stdout, re.M)
    assert how and int(how.group(1)) >= 2 * 3, res.stdout  # each of the three plans twice, out of place only


def _drifting_pair(rank, groups, iters):
    """Two tables of one and the same call, on a host that slows down call by call (each call
    sleeps 1 ms more than the one before): their times as measure_side_by_side reports them."""
    import dataclasses
    import time

    import torch
    import torch.distributed as dist

    from zipccl.bench import all_reduce
    made = [0]

    def slower_each_call(out, inp, op, group, codec, algorithm):
        made[0] += 1
        time.sleep(0.001 * made[0])

    spec = dataclasses.replace(all_reduce.SPEC, run=slower_each_call)
    args = argparse.Namespace(iters=iters, warmup_iters=1, check=1, average=1, per_iter_timing=0, algorithm="auto",
                              device="cpu")
    rows = common.measure_side_by_side(spec, args, 16, 16, torch.float32, dist.ReduceOp.SUM,
                                       [common.Variant("a", None), common.Variant("b", None)],
                                       torch.zeros(16), rank, dist.get_world_size())
    return [[row[k]["time_us"] for k in ("out_of_place", "in_place")] for row in rows]


@pytest.mark.timeout(120)
def test_side_by_side_tables_share_the_hosts_drift(pool):
    """One call timed as two tables while the host slows down: as the tables' calls take turns,
    each table reads the other's time (run one table after the other, the second would read
    twice the first's)."""
    iters = 10
    for (a_out, a_in), (b_out, b_in) in pool.run(_drifting_pair, iters, timeout=90):
        assert 0.9 < b_out / a_out < 1.1 and 0.9 < b_in / a_in < 1.1, ((a_out, a_in), (b_out, b_in))
        assert a_in > 1.5 * a_out  # the drift is there: in place ran after out of place

def _auto_row(rank, groups, iters, warmup):
    """One zipccl-perf row of codec "auto" at 1 MiB of bf16 (auto's smallest learned size) on a
    new group, whose policy has learned nothing; with the policy's own count of the class's
    calls and the index of each plan's last call."""
    import argparse

    import torch
    import torch.distributed as dist

    from zipccl.bench import all_reduce
    from zipccl.collectives import auto_policy
    n, nranks = 1 << 19, dist.get_world_size()
    group = dist.new_group(list(range(nranks)))
    args = argparse.Namespace(iters=iters, warmup_iters=warmup, check=1, average=1, per_iter_timing=0,
                              algorithm="auto", device="cpu")
    inputs = [common.verifiable(n, torch.bfloat16, r, nranks) for r in range(nranks)]
    exact = torch.stack([x.double() for x in inputs]).sum(0).to(torch.bfloat16)  # exact: verifiable()
    row = common.measure(all_reduce.SPEC, args, n, n, torch.bfloat16, dist.ReduceOp.SUM, "auto", inputs[rank],
                         exact, rank, nranks, group)
    policy = auto_policy(group)
    return row, dict(policy.calls), {plan: i for (_, plan), i in policy.last.items()}


@pytest.mark.timeout(300)
def test_auto_learns_before_the_timed_calls(pool):
    """Counted by the policy itself: every call of the class beyond the reported learning calls
    is a warm-up, timed or checked one, and every plan but the one auto settled on last ran
    within the learning calls; out of place and in place are one class, learned once."""
    iters, warmup = 3, 1
    res = pool.run(_auto_row, iters, warmup, timeout=240)
    for r in res:
        assert not isinstance(r, BaseException), r
    assert all(r[1:] == res[0][1:] for r in res)  # every rank's policy made the same choices
    row, calls, last = res[0]
    assert len(calls) == 1, calls  # one size class for both placements
    (total,) = calls.values()
    auto = row["zipccl"]["auto"]
    learned = auto["learning_calls"]["out_of_place"]
    assert auto["learning_calls"]["in_place"] == 0
    assert set(last) == {"native", "raw", "lossless"} and learned >= 2 * len(last)  # each plan tried twice
    assert total == learned + warmup + 2 * (iters + 2)  # + 2: each placement's untimed first call and its check
    settled = max(last, key=last.get)
    assert last[settled] == total - 1 and all(i < learned for p, i in last.items() if p != settled), (last, learned)
    assert auto["timed_plans"] == {"out_of_place": [settled], "in_place": [settled]}
    assert row["zipccl"]["plan"] == settled
    assert row["out_of_place"]["wrong"] == row["in_place"]["wrong"] == 0


def test_learning_waits_out_a_lucky_time():
    """A call's time reaches auto's policy two calls late (with the next call's exchange), and
    the lower of a plan's last two times decides: one lucky raw time (call 4, faster than
    native's) keeps raw chosen for three calls after the probing (which takes one call more than
    its two rounds, until lossless's second time is back). Learning stops only once the choice
    rests on times from after it, and from there on every call runs native."""
    from zipccl.auto import Policy

    policy, nbytes = Policy(), 2 << 20
    key, plans = Policy.key("all_reduce", "torch.bfloat16", nbytes), ("native", "raw", "lossless")
    seconds = {"native": 7e-3, "raw": 10e-3, "lossless": 22e-3}
    ran: list[str] = []

    def call():
        if len(ran) >= 2:
            i = len(ran) - 2
            policy.learn(key, ran[i], 5e-3 if i == 4 else seconds[ran[i]])
        ran.append(policy.choose(key, nbytes, plans))

    while not common.settled(policy, key):
        call()
    learned = len(ran)
    assert ran[6] == "native" and ran[7:10] == ["raw"] * 3 and learned <= 7 + 3 + common.STREAK, ran
    for _ in range(12):
        call()
    assert set(ran[learned:]) == {"native"}, (ran, learned)


@pytest.mark.timeout(300)
def test_hierarchical_on_emulated_nodes():
    """--nodes 2 on four spawned ranks: ZIPCCL_TOPOLOGY=2x2; hierarchical rows checked exactly (verifiable
    data), the footer names the topology and auto's plans."""
    res = run_perf("-b", "2M", "-e", "2M", "-n", "1", "-w", "0", "--nranks", "4", "--nodes", "2", "--baseline",
                   "--algorithm", "hierarchical", "--codec", "all")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = parse_rows(res.stdout)
    assert [r["codec"] for r in rows] == ["torch", "raw", "lossless", "auto"]
    assert all(r["wrong"] == ("0", "0") for r in rows)
    assert "# topology: 2x2 (ZIPCCL_TOPOLOGY)" in res.stdout
    assert "hierarchical/lossless" in res.stdout and "-> hierarchical/" in res.stdout  # auto: hierarchical plans only
    assert re.search(r"^#   2097152 B bfloat16 sum: \d+ \+ 0 calls; timed calls ran hierarchical/\w+ / hierarchical/\w+$",
                     res.stdout, re.M), res.stdout  # learned before the timed calls, with no warm-up


def test_nodes_must_divide_the_ranks(capsys):
    from zipccl.bench import perf
    with pytest.raises(SystemExit) as exit_:
        perf.main(["--nranks", "4", "--nodes", "3"])
    assert exit_.value.code == 2 and "--nodes (3) must divide the ranks (4: --nranks)" in capsys.readouterr().err


@pytest.mark.parametrize("collective", ["all_reduce", "alltoall", "pair"])
def test_never_a_loss_smoke(tmp_path, collective):
    """bench/never_a_loss.py on loopback at two small sizes, one round: it runs, and its table
    has a row per size with auto's ratios (all-to-all and a pair: torch's, auto and the fixed plans)."""
    out = tmp_path / "n.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "never_a_loss.py"), "--lab", "loopback", "--sizes",
                          "64K,2M", "--rounds", "1", "--min-seconds", "0", "--collective", collective, "--json",
                          str(out)], capture_output=True, text=True, env=env, timeout=280)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["size"] for r in rows] == [65536, 2 << 20]
    assert [r["rounds"] for r in rows] == [1, 1]  # --min-seconds 0: the rounds asked for, no more
    assert set(rows[1]["medians_s"]) == {"torch", "auto", "flat/raw", "flat/lossless"}
    assert rows[0]["auto_plan"] == "native" and all(r["auto_vs_torch"] > 0 for r in rows)


def test_call_profile_smoke():
    """bench/call_profile.py on 2 gloo ranks, a few calls: each rank's median and rank 0's
    cProfile tables, which reach zipccl's all-reduce."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "call_profile.py"), "--nranks", "2", "--calls", "3",
                          "--rows", "40"], capture_output=True, text=True, env=env, timeout=280)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "all_reduce of 64K bf16, codec lossless, 2 ranks (CPU, gloo)" in out, out
    assert all(f"# rank {r}: median " in out for r in (0, 1)), out
    assert "by cumulative" in out and "by tottime" in out and "zipccl/api.py" in out, out


def test_native_overhead_smoke(tmp_path):
    """bench/native_overhead.py on 2 ranks, a few calls: a row per collective and variant, each
    with both medians and the extra host time, and the run's facts in the JSON."""
    out = tmp_path / "o.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "native_overhead.py"), "--ranks", "2", "--calls", "20",
                          "--warmup", "5", "--json", str(out)], capture_output=True, text=True, env=env, timeout=280)
    assert res.returncode == 0, res.stderr[-2000:]
    record = json.loads(out.read_text())
    assert (record["device"], record["ranks"], record["calls"]) == ("cpu", 2, 20)
    assert [(r["collective"], r["variant"]) for r in record["rows"]] == [
        (c, v) for c in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "sendrecv")
        for v in ("zipccl auto", "zipccl native", "drop-in")]
    assert all(r["plain_us"] > 0 and r["zipccl_us"] > 0 and len(r["extra_us_by_rank"]) == 2 for r in record["rows"])
    assert "worst extra" in res.stdout
    one = subprocess.run([sys.executable, str(ROOT / "bench" / "native_overhead.py"), "--ranks", "1"],
                         capture_output=True, text=True, env=env, timeout=120)  # the exchanges need a peer
    assert one.returncode == 2 and "need 2 ranks or more" in one.stderr, one.stderr[-2000:]


def test_peak_memory_smoke(tmp_path):
    """bench/peak_memory.py on 2 ranks, 4 MiB: a row per collective, dtype and codec; a lossless
    message holds its packets on both ends, where torch's send holds nothing more."""
    out = tmp_path / "peak.json"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "peak_memory.py"), "--ranks", "2", "--size-mib", "4",
                          "--collectives", "all_reduce,send_recv", "--json", str(out)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=200)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {(r["collective"], r["codec"]): r["peak_mib"] for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(c, k) for c in ("all_reduce", "send_recv") for k in ("torch", "raw", "lossless")}
    assert rows["send_recv", "lossless"] > rows["send_recv", "torch"] + 1, rows
    assert "peak memory of one call" in res.stdout


def _row(size, oop, ip, dtype="bfloat16", redop="sum"):
    return dict(size=size, type=dtype, redop=redop, out_of_place={"busbw": oop}, in_place={"busbw": ip})


def test_summary_line_against_torch():
    """One line per table: busbw over the baseline's, per size, out of place / in place; rows the
    baseline lacks left out, a zero baseline N/A, the type and op named where a table has several."""
    from zipccl.bench import report
    base = [_row(1 << 20, 2.0, 4.0), _row(16 << 20, 1.0, 0.0)]
    line, ratios = report.versus("auto", [_row(1 << 20, 3.0, 2.0), _row(16 << 20, 1.52, 0.5), _row(64 << 20, 9, 9)],
                                 "torch", base)
    assert line == "# auto vs torch, busbw out-of-place / in-place: 1 MiB 1.50x / 0.50x, 16 MiB 1.52x / N/A"
    assert ratios == [dict(size=1 << 20, type="bfloat16", redop="sum", out_of_place=1.5, in_place=0.5),
                      dict(size=16 << 20, type="bfloat16", redop="sum", out_of_place=1.52, in_place=None)]
    line, _ = report.versus("raw", [_row(65536, 1.0, 1.0), _row(65536, 0.5, 2.0, "float")], "torch-gloo",
                            [_row(65536, 1.0, 1.0), _row(65536, 1.0, 1.0, "float")])
    assert line == ("# raw vs torch-gloo, busbw out-of-place / in-place: 64 KiB bfloat16 sum 1.00x / 1.00x, "
                    "64 KiB float sum 0.50x / 2.00x")
    assert [report.size_text(n) for n in (1000, 1024, 3 << 20, 1 << 30)] == ["1000 B", "1 KiB", "3 MiB", "1 GiB"]


def test_lab_unavailable_says_why(monkeypatch):
    """No root, namespaces refused, or a lab up already (another run's: left alone)."""
    from zipccl.bench import netlab
    monkeypatch.setattr(netlab.os, "geteuid", lambda: 1000)
    assert "needs root" in netlab.unavailable()
    monkeypatch.setattr(netlab, "check_host", lambda: None)
    monkeypatch.setattr(netlab, "namespaces", lambda: ["zcl-br"])
    monkeypatch.setattr(netlab, "_sh", lambda *cmd, **kw: pytest.fail(f"ran {cmd}"))
    assert "a lab is up already" in netlab.unavailable()
    monkeypatch.setattr(netlab, "namespaces", lambda: [])
    monkeypatch.setattr(netlab, "_sh", _refused)
    assert netlab.unavailable() == ("network namespaces cannot be created here (mount --make-shared /run/netns "
                                    "failed: Operation not permitted)")


def _refused(*cmd, ns=None, check=True):
    """`ip netns add` as a container without CAP_SYS_ADMIN answers it; nothing else may run."""
    assert cmd[:3] == ("ip", "netns", "add"), cmd
    return subprocess.CompletedProcess(cmd, 1, "", "mount --make-shared /run/netns failed: Operation not permitted\n")


@pytest.mark.timeout(300)
def test_make_bench_flow_where_namespaces_fail(tmp_path, monkeypatch, capfd):
    """make bench's flow at a tiny size: the loopback tables, each ended by its line against
    torch (the JSON's busbw ratios), then, as root where namespace creation fails, one line with
    the command that shows the lab, no traceback, and the plot of what ran."""
    from zipccl.bench import netlab, tour
    monkeypatch.setattr(netlab, "check_host", lambda: None)
    monkeypatch.setattr(netlab, "namespaces", lambda: [])
    monkeypatch.setattr(netlab, "_sh", _refused)
    monkeypatch.setattr(netlab, "run_in_lab", lambda *a, **k: pytest.fail("the lab was started"))
    status = tour.main(["--out", str(tmp_path), "-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--nranks", "2",
                        "--codec", "auto"])
    cap = capfd.readouterr()
    assert status == 0, cap.err[-2000:]
    assert "Traceback" not in cap.out + cap.err
    assert [t.name for t in nccl_text.parse(cap.out)] == ["all_reduce_perf:torch", "all_reduce_perf:auto"]
    lines = cap.out.splitlines()
    lab = [line for line in lines if "lab" in line and "not run" in line]
    assert lab == ["# network lab not run (network namespaces cannot be created here (mount --make-shared "
                   "/run/netns failed: Operation not permitted)); to see zipccl win on a 1 Gbit/s network, as root: "
                   + tour.lab_command(["-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--nranks", "2", "--codec",
                                       "auto"])], lab
    assert lab[0].endswith("--netlab 1gbit") and "--nodes 2" in lab[0]
    results = json.loads((tmp_path / "loopback.json").read_text())["results"]
    busbw = {r["zipccl"]["codec"]: (r["out_of_place"]["bus_bw"], r["in_place"]["bus_bw"]) for r in results}
    at = lines.index("# Collective test concluded: all_reduce_perf:auto")
    summary = [line for line in lines[at:] if line.startswith("# auto vs torch")]
    m = re.fullmatch(r"# auto vs torch, busbw out-of-place / in-place: 64 KiB (\S+)x / (\S+)x", summary[0])
    assert m and lines[lines.index(summary[0]) + 1] == "", summary  # the table's last line
    for got, auto, torch_ in zip(m.groups(), busbw["auto"], busbw["torch"]):
        assert abs(float(got) - auto / torch_) < 0.006, (got, auto, torch_)
    assert not (tmp_path / "lab.json").exists()
    png = tmp_path / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"# plot: {png}" in cap.out


def test_make_bench_fails_where_the_lab_fails(tmp_path, monkeypatch, capfd):
    """A lab that was built but failed (its ranks out of time) fails make bench, and says so;
    it is not reported as a lab that could not run."""
    from zipccl.bench import netlab, perf, tour
    monkeypatch.setattr(perf, "main", lambda argv: 0)
    monkeypatch.setattr(netlab, "unavailable", lambda: None)

    def timed_out(*a, **k):
        raise netlab.LabError("ranks did not finish within 600 s")
    monkeypatch.setattr(netlab, "run_in_lab", timed_out)
    monkeypatch.setattr(tour, "activations", lambda out: [])
    assert tour.main(["--out", str(tmp_path)]) == 1
    out = capfd.readouterr().out
    assert "# network lab failed (ranks did not finish within 600 s)" in out and "not run" not in out, out


def test_make_bench_runs_alltoall_and_sendrecv_in_the_lab(tmp_path, monkeypatch):
    """Where the lab can be built, make bench runs, after the lab's all-reduce, nccl-tests'
    alltoall_perf and sendrecv_perf there: 16 MiB per rank, torch against auto, 2 nodes of 2
    ranks, on the real activations of bench/activations.py (the lab itself stubbed here)."""
    from zipccl.bench import netlab, perf, tour
    runs = []
    monkeypatch.setattr(perf, "main", lambda argv: 0)  # the loopback tables (their own test)
    monkeypatch.setattr(netlab, "unavailable", lambda: None)
    monkeypatch.setattr(netlab, "run_in_lab", lambda rate, nranks, argv, timeout, nodes: runs.append(
        (rate, nranks, nodes, argv)) or 0)
    monkeypatch.setattr(tour, "activations", lambda out: ["--data", str(out / "activations.npy")])
    assert tour.main(["--out", str(tmp_path)]) == 0
    assert [(rate, nranks, nodes) for rate, nranks, nodes, _ in runs] == [("1gbit", 4, 2)] * 3
    lab, *exchanges = [argv for *_, argv in runs]
    assert "--collective" not in lab
    for argv, collective in zip(exchanges, ("alltoall", "sendrecv")):
        args = perf.parser("zipccl-perf").parse_args(argv)
        assert (args.collective, args.minbytes, args.maxbytes, args.codec, args.baseline, args.nodes) == \
            (collective, 16 << 20, 16 << 20, "auto", True, 2)
        assert str(args.data) == str(tmp_path / "activations.npy")
        assert str(args.output_file) == str(tmp_path / f"lab_{collective}.json")


def test_data_that_is_no_tensor_or_empty_is_refused_before_any_rank_starts(tmp_path, capsys):
    import numpy as np
    from zipccl.bench.perf import main
    (tmp_path / "empty.npy").write_bytes(b"")
    np.save(tmp_path / "none.npy", np.zeros(0, np.float32))
    for name, message in (("empty.npy", "not a tensor file"), ("none.npy", "holds no elements")):
        with pytest.raises(SystemExit) as e:
            main(["--data", str(tmp_path / name)])
        assert e.value.code == 2 and message in capsys.readouterr().err, name


def test_nodes_divide_the_launchers_ranks(monkeypatch, capsys):
    """Under a launcher, --nodes is checked against the launcher's world (6 ranks), not --nranks."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    ap = common.parser("zipccl-perf")
    common.validate(ap, ap.parse_args(["--nodes", "3"]))  # 4 (--nranks' default) it does not divide
    with pytest.raises(SystemExit):
        common.validate(ap, ap.parse_args(["--nodes", "4"]))
    assert "must divide the ranks (6: the launcher's)" in capsys.readouterr().err


@pytest.mark.parametrize("dtype_name,most", [("bfloat16", 32), ("float16", 256)])
def test_check_data_sums_exactly_and_is_not_zeros_on_many_ranks(dtype_name, most):
    """verifiable() on 2 to 1024 ranks: every sum over the ranks is representable (so no order
    can change it), each element takes values from at most ``most`` ranks, and the data is no
    grid of zeros: most elements of the sum, and each rank's share of its elements, are nonzero."""
    import torch
    dtype = getattr(torch, dtype_name)
    for n in (2, most, most + 1, 256, 1024):
        xs = torch.stack([common.verifiable(1024, dtype, r, n).double() for r in range(n)])
        total = xs.sum(0)
        assert torch.equal(total.to(dtype).double(), total), n
        assert int((xs != 0).sum(0).max()) <= most, n
        assert (total != 0).float().mean() > 0.9, n
        assert (xs != 0).float().mean() > 0.7 * min(1.0, most / n), n


def test_timed_data_does_not_depend_on_the_ranks():
    """The timed calls' default data: the same on 2 ranks and on 256, with every bit of a
    gaussian draw (its low mantissa bits set as often as not), not the checks' grid."""
    import argparse

    import torch
    from zipccl.bench import all_reduce
    from zipccl.bench.perf import _inputs
    args = argparse.Namespace(check=1)
    few = _inputs(all_reduce.SPEC, args, None, torch.bfloat16, None, 4096, 0, 2)
    many = _inputs(all_reduce.SPEC, args, None, torch.bfloat16, None, 4096, 0, 256)
    assert torch.equal(few[0].view(torch.int16), many[0].view(torch.int16))
    assert 0.4 < float((few[0].view(torch.int16) & 1).float().mean()) < 0.6
    assert torch.equal(few[1], common.verifiable(4096, torch.bfloat16, 0, 2))  # the checks' input


def test_each_placements_first_call_is_untimed():
    """A first call that takes 0.4 s (a buffer's first use) is in no row's time, even with -w 0."""
    import argparse
    import dataclasses
    import time

    import torch
    import torch.distributed as dist

    from zipccl.bench.all_gather import SPEC
    calls = []

    def slow_first(out, inp, op, group, codec, algorithm="auto"):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.4)
        out.copy_(inp)

    spec = dataclasses.replace(SPEC, run=slow_first)
    args = argparse.Namespace(iters=2, check=0, device="cpu", algorithm="auto", average=1, per_iter_timing=False,
                              warmup_iters=0)
    data = torch.arange(64, dtype=torch.bfloat16)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = common.measure_placement(spec, args, False, 64, 64, torch.bfloat16, None, [common.Variant("torch", None)],
                                          data, 0, 1)[0][0]
    finally:
        dist.destroy_process_group()
    assert len(calls) == 3 and result["time_us"] < 100_000, result
