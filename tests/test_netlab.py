"""The network lab: up, ranks over it at a shaped rate, down, nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zipccl.bench import netlab

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
x = torch.full((1000,), float(r + 1))
dist.all_reduce(x)
assert bool((x == 3).all()), x[:4]
buf = torch.zeros(5 << 20, dtype=torch.uint8)   # 5 MiB one way: rank 0 -> rank 1
dist.barrier()
t = time.perf_counter()
if r == 0:
    dist.send(buf, 1)
else:
    dist.recv(buf, 0)
dist.barrier()
if r == 1:
    print(f"rate {buf.numel() * 8 / (time.perf_counter() - t):.0f}", flush=True)
dist.destroy_process_group()
"""


_WHY_NOT = netlab.unavailable()  # probed once per process, at import

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT)),
              pytest.mark.usefixtures("lab_lock")]


def test_rate_parsing_and_refusals(monkeypatch):
    assert netlab.rate_bits("1gbit") == 1e9 and netlab.rate_bits("500mbit") == 5e8
    for bad in ("fast", "1gbt", "0bit", "0"):
        with pytest.raises(ValueError):
            netlab.rate_bits(bad)
    assert netlab.worst([0, 0]) == 0 and netlab.worst([-9, 0]) == 137 and netlab.worst([1, -15]) == 143
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netlab.LabError, match="root"):
        netlab.check_host()
    assert netlab.main(["up", "2", "1gbit"]) == 2


def test_probes_at_once_do_not_see_each_other():
    """Test workers import this module together, each probing: a shared probe name made one of them
    see a refusal (and CI fail on the skip)."""
    code = "from zipccl.bench import netlab\nfor _ in range(10):\n    assert netlab.unavailable() is None\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errors
    assert netlab.namespaces() == [] and "zipccl-probe" not in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_two_ranks_over_a_shaped_link(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / "out.txt"
    try:
        with netlab.NetLab(2, "200mbit") as lab:
            assert set(netlab.namespaces()) == {"zcl-br", "zcl-r0", "zcl-r1"}
            assert "tbf" in netlab.status()
            with open(out, "w") as f:
                procs = [lab.popen(r, [sys.executable, str(script)], lab.env(r, 29541), stdout=f) for r in range(2)]
                codes = [p.wait(timeout=120) for p in procs]
        assert codes == [0, 0]
        rate = float(out.read_text().split()[-1])
        assert rate <= 1.2 * 200e6, rate  # shaped (unshaped veth moves GB/s); no lower bound: load may slow it
    finally:
        netlab.down()
    assert netlab.namespaces() == []
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert "zcl-" not in links
    assert netlab.main(["down"]) == 0  # idempotent


def _perf_at_64k(*args: str) -> str:
    """zipccl-perf's output at 64 KiB, one iteration, with ``args`` (the ranks, codec, lab), checked."""
    res = subprocess.run([sys.executable, "-m", "zipccl.bench", "-b", "64K", "-e", "64K", "-n", "1", "-w", "0", *args],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=200)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "# Out of bounds values : 0 OK" in res.stdout
    return res.stdout


def test_perf_over_the_lab(capfd):
    assert "# netlab: 2 ranks, 500mbit" in _perf_at_64k("--nranks", "2", "--codec", "lossless", "--netlab", "500mbit")
    assert netlab.namespaces() == []


def test_two_nodes_of_two_ranks(tmp_path):
    """`up 2x2`: one namespace and one shaped link per node, ranks of a node inside it; a
    hierarchical run over it; down leaves nothing behind."""
    assert netlab.shape("2x2") == (2, 2) and netlab.shape("4") == (4, 1)
    with pytest.raises(ValueError):
        netlab.shape("2x")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        res = subprocess.run([sys.executable, "-m", "zipccl.bench", "-b", "256K", "-e", "256K", "-n", "1", "-w", "1",
                              "--nranks", "4", "--nodes", "2", "--algorithm", "hierarchical", "--codec", "lossless",
                              "--netlab", "500mbit"], capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "# netlab: 2 nodes of 2 ranks, 500mbit per node" in res.stdout
        assert "# topology: 2x2" in res.stdout and "# Out of bounds values : 0 OK" in res.stdout
        assert netlab.namespaces() == []
        assert netlab.main(["up", "2x2", "500mbit"]) == 0
        assert set(netlab.namespaces()) == {"zcl-br", "zcl-r0", "zcl-r1"}  # one namespace per node
    finally:
        netlab.down()
    assert netlab.namespaces() == []
    assert "zcl-" not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def test_ten_gigabit_lab_of_four_ranks_each_in_its_namespace():
    """The shaped one-GPU lab's network (docs/GPU.md): 4 ranks, each in its own namespace whose
    veth is shaped to 10 Gbit/s both ways with a bucket of a millisecond of traffic, and whose
    sockets (gloo's, NCCL's) use that veth; gloo ranks run zipccl-perf over it at 64 KiB here (2
    cores cannot drive 10 Gbit/s: no rate is asserted); nothing is left behind."""
    assert netlab.burst(10e9) == 1_250_000 and netlab.burst(1e9) == 128 << 10
    try:
        with netlab.NetLab(4, "10gbit") as lab:
            assert set(netlab.namespaces()) == {"zcl-br"} | {f"zcl-r{r}" for r in range(4)}
            for r in range(4):
                shown = subprocess.run(["ip", "netns", "exec", f"zcl-r{r}", "tc", "qdisc", "show", "dev",
                                        netlab.rank_if(r)], capture_output=True, text=True).stdout
                assert "tbf" in shown and "rate 10Gbit" in shown, shown
                env = lab.env(r, 29551)
                assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == netlab.rank_if(r)
        out = _perf_at_64k("--nranks", "4", "--codec", "raw", "--netlab", "10gbit")
        assert "# netlab: 4 ranks, 10gbit per rank" in out
    finally:
        netlab.down()
    assert netlab.namespaces() == []
    assert "zcl-" not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def _sleeping_ranks() -> list[int]:
    """The lab's processes that are the killed run's ranks: while a lab is built, its own `ip` and
    `tc` calls inside the namespaces are the lab's processes for a moment too."""
    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return ""
    return [p for p in netlab.pids() if "sleep(300)" in cmdline(p)]


@pytest.mark.timeout(420)
def test_a_failed_rank_ends_the_run_and_a_killed_run_leaves_no_rank(tmp_path, monkeypatch):
    """A rank that fails: the others get RANK_GRACE seconds, then are killed, not left waiting on
    it. A run killed outright (SIGKILL): its ranks die with it; the lab it left is torn down by
    the next run, which refuses only a lab whose ranks still run.

    The killed run is a process that imports torch and builds a lab: on 2 loaded cores that took
    over 60 s once, so it gets its own generous wait, and it is killed before the lab is torn
    down (else it builds its lab after the teardown and its ranks find no namespace)."""
    import signal
    import time
    monkeypatch.setattr(netlab, "RANK_GRACE", 2.0)
    runner = None
    try:
        with netlab.NetLab(2, "1gbit") as lab:
            t0 = time.monotonic()
            codes = lab.run_ranks([sys.executable, "-c", "import os, time; os.environ['RANK'] == '0' and exit(3); "
                                   "time.sleep(60)"], timeout=120)
            assert codes == [3, -9] and time.monotonic() - t0 < 20, codes
        runner = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom zipccl.bench import netlab\n"
                                   "lab = netlab.NetLab(2, '1gbit').__enter__()\n"
                                   "lab.run_ranks([sys.executable, '-c', 'import time; time.sleep(300)'], 400)\n"],
                                  env=dict(os.environ, PYTHONPATH=str(ROOT)))
        t0 = time.monotonic()
        while len(_sleeping_ranks()) < 2 and runner.poll() is None and time.monotonic() - t0 < 240:
            time.sleep(0.2)
        assert len(_sleeping_ranks()) == 2, (f"after {time.monotonic() - t0:.0f} s the run's ranks are not up "
                                             f"(its status: {runner.poll()})\n{netlab.status()}")
        with pytest.raises(netlab.LabError, match="in use"):
            netlab.run_in_lab("1gbit", 2, ["-b", "8", "-e", "8"])
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=30)
        t0 = time.monotonic()
        while netlab.pids() and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert netlab.pids() == [] and netlab.namespaces(), netlab.status()  # the ranks died; the lab stayed
        out = _perf_at_64k("--nranks", "2", "--codec", "raw", "--netlab", "1gbit")
        assert "# netlab: 2 ranks, 1gbit" in out
    finally:
        if runner is not None and runner.poll() is None:
            runner.kill()
            runner.wait()
        netlab.down()
    assert netlab.namespaces() == []
