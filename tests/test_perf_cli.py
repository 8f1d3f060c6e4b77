"""zipccl-perf smoke runs: real data, ops, hierarchical runs, auto's report, flag validation
(the nccl-tests format itself: test_perf_format.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nccl_text
from zipccl.bench import common

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
    (["-n", "0"], "-n must be"),
    (["-d", "double"], "invalid choice"),
    (["--data", "/nonexistent.npy"], "does not exist"),
    (["-g", "2"], "-g takes 1 only"),
    (["-t", "4"], "-t takes 1 only"),
    (["-I", "2"], "invalid choice"),
])
def test_flag_validation(args, message, capsys):
    from zipccl.bench.perf import main
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_sizes_and_verifiable_data():
    assert common.parse_size("64M") == 64 << 20 and common.parse_size("1K") == 1024
    assert common.sizes(1 << 20, 16 << 20, 4, 0) == [1 << 20, 4 << 20, 16 << 20]
    assert common.sizes(1, 3, 1, 1) == [1, 2, 3]
    import torch
    for dtype in common.DTYPES.values():
        xs = [common.verifiable(10000, dtype, r, 8) for r in range(8)]
        exact = sum(x.double() for x in xs)
        assert torch.equal(exact.to(dtype).double(), exact)  # the sum is representable: order cannot matter
        assert (xs[0] != 0).float().mean() > 0.9 and xs[0].double().std() > 0.5


@pytest.mark.timeout(300)
def test_auto_reports_what_it_learned():
    """Past its probing calls, the footer gives every plan's time and what auto runs now: on
    loopback, where coding cannot pay, the backend's own collective (zipccl's pipeline costs
    CPU and saves nothing on a link this fast: 2-3x slower in every loopback run so far)."""
    res = run_perf("-b", "2M", "-e", "2M", "-n", "2", "-w", "8", "--nranks", "2", "--codec", "auto")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "# auto plans" in res.stdout and "# topology: 1x2" in res.stdout
    learned = [line for line in res.stdout.splitlines() if line.startswith("#   all_reduce bfloat16 2097152-")]
    assert len(learned) == 1 and all(p in learned[0] for p in ("native", "raw", "lossless")), res.stdout
    assert learned[0].rstrip().endswith("-> native (fastest)"), learned


@pytest.mark.timeout(300)
def test_hierarchical_on_emulated_nodes():
    """--nodes 2 on four spawned ranks: ZIPCCL_TOPOLOGY=2x2; hierarchical rows checked exactly (verifiable
    data), the footer names the topology and auto's plans."""
    res = run_perf("-b", "2M", "-e", "2M", "-n", "1", "-w", "14", "--nranks", "4", "--nodes", "2", "--baseline",
                   "--algorithm", "hierarchical", "--codec", "all")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = parse_rows(res.stdout)
    assert [r["codec"] for r in rows] == ["torch", "raw", "lossless", "auto"]
    assert all(r["wrong"] == ("0", "0") for r in rows)
    assert "# topology: 2x2 (ZIPCCL_TOPOLOGY)" in res.stdout
    assert "hierarchical/lossless" in res.stdout and "-> hierarchical/" in res.stdout  # auto: hierarchical plans only
    bad = run_perf("--nranks", "4", "--nodes", "3")
    assert bad.returncode == 2 and "must divide" in bad.stderr


def test_never_a_loss_smoke(tmp_path):
    """bench/never_a_loss.py on loopback at two small sizes, one round: it runs, and its table
    has a row per size with auto's ratios."""
    out = tmp_path / "n.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "never_a_loss.py"), "--lab", "loopback", "--sizes",
                          "64K,2M", "--rounds", "1", "--min-seconds", "0", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=280)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["size"] for r in rows] == [65536, 2 << 20]
    assert [r["rounds"] for r in rows] == [1, 1]  # --min-seconds 0: the rounds asked for, no more
    assert set(rows[1]["medians_s"]) == {"torch", "auto", "flat/raw", "flat/lossless"}
    assert rows[0]["auto_plan"] == "native" and all(r["auto_vs_torch"] > 0 for r in rows)
