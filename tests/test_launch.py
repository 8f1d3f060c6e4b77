"""Launch paths: environment detection, local spawn, torchrun and mpirun running the examples, whose
printed result is checked against plain torch's."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zipccl import launch
from zipccl.errors import UnsupportedError
from zipccl.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "allreduce.py")
LINE = re.compile(r"(\d) ranks: sent ([\d.]+) MB instead of ([\d.]+) MB \(ratio ([\d.]+)\)")


def _clean_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("OMPI_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _torchrun(*args: str) -> list[str]:
    """torchrun from the interpreter running the tests, so that a venv that is not activated works."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            *args]


def _without_torchrun(env: dict[str, str]) -> dict[str, str]:
    """`env` with no directory holding a torchrun script on PATH: the launch must not look for one."""
    path = env.get("PATH", os.defpath).split(os.pathsep)
    return dict(env, PATH=os.pathsep.join(d for d in path if d and not (Path(d) / "torchrun").exists()))


def _plain_torch_result(ranks: int) -> str:
    """The fingerprint of the examples' all-reduce as plain torch computes it from their inputs
    (each rank's seeded 2 MB bf16 "gradient"): the sum in rank order in fp32, rounded once."""
    inputs = [(torch.randn(1 << 20, generator=torch.Generator().manual_seed(r)) * 0.01).to(torch.bfloat16)
              for r in range(ranks)]
    total = inputs[0].float()
    for x in inputs[1:]:
        total += x.float()
    return hashlib.sha256(total.to(torch.bfloat16).view(torch.int16).numpy().tobytes()).hexdigest()[:16]


def _check_result(out: str, ranks: int) -> None:
    """Every rank printed the result plain torch computes."""
    got = dict(re.findall(r"rank (\d+): result sha256 ([0-9a-f]{16})", out))
    assert sorted(got) == [str(r) for r in range(ranks)], out
    want = _plain_torch_result(ranks)
    assert set(got.values()) == {want}, (got, want)


def _check(out: str, ranks: int) -> None:
    m = LINE.search(out)
    assert m, out
    assert int(m.group(1)) == ranks
    assert float(m.group(2)) < 0.75 * float(m.group(3))
    _check_result(out, ranks)


def _no_launcher(monkeypatch) -> None:
    """The launchers' variables (zipccl.launch._LAUNCHERS, and torchrun's marker) unset."""
    for _, rank, size, local in launch._LAUNCHERS:
        for k in (rank, size, *local):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def test_detect(monkeypatch):
    _no_launcher(monkeypatch)
    assert launch.detect() is None
    monkeypatch.setenv("PMI_RANK", "3")  # srun --mpi=pmi2: PMI's rank and size, the node's rank from Slurm
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert launch.detect() == launch.World(3, 4, 1, "mpirun")
    monkeypatch.setenv("SLURM_LOCALID", "0")  # MPICH's mpiexec
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    assert launch.detect() == launch.World(3, 4, 1, "mpirun")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert launch.detect() == launch.World(2, 4, 0, "mpirun")
    monkeypatch.setenv("RANK", "1")  # torchrun's ranks under mpirun (one torchrun per node): torchrun's
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert launch.detect() == launch.World(1, 2, 1, "torchrun")


@pytest.mark.parametrize("env,says", [
    ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
    ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not"),
    ({"PMI_SIZE": "2"}, "PMI_SIZE is set but PMI_RANK is not"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x': a launcher's ranks and sizes are whole numbers"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": ""}, "LOCAL_RANK='':"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 is not a rank of WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
     "RANK=0 and WORLD_SIZE=1, which torchrun did not set, against mpirun's rank 1 of 2"),
])
def test_detect_refuses_what_no_launcher_sets(monkeypatch, env, says):
    """A launcher's variables that do not describe a world (each rank would make one of its own,
    silently): refused, naming them."""
    _no_launcher(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=re.escape(says)):
        launch.detect()


@pytest.mark.timeout(180)
def test_free_port_is_below_the_ephemeral_range_and_free(monkeypatch):
    """A port from launch.PORTS, below the range the kernel hands out to sockets bound to port 0
    and to outgoing connections, that binds; where every one of them is taken, the kernel's pick."""
    import socket
    port = free_port()
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert port in launch.PORTS and port < low, (port, low)
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))  # free indeed
        held.listen()
        monkeypatch.setattr(launch, "PORTS", range(port, port + 1))
        other = free_port()
        assert other != port
        with socket.socket() as s:
            s.bind(("127.0.0.1", other))


def test_local_spawn():
    out = subprocess.run([sys.executable, EXAMPLE, "--nranks", "2"], env=_clean_env(), capture_output=True,
                         text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    _check(out.stdout, 2)


def _what_a_rank_sees(rank, nranks):
    import zipccl.config
    return os.environ.get("ZIPCCL_TOPOLOGY"), zipccl.config.TOPOLOGY, os.getpid()


def _large_result(rank, nranks):
    return bytes([rank]) * (1 << 20)


@pytest.mark.timeout(120)
def test_spawn_returns_results_larger_than_a_pipes_buffer():
    """Ranks that each return 1 MiB: spawn reads the results while the ranks run (a pipe holds
    64 KiB: a rank would block in its put while the launcher waited for it to exit)."""
    assert launch.spawn(_large_result, 2) == [b"\x00" * (1 << 20), b"\x01" * (1 << 20)]


@pytest.mark.timeout(180)
def test_spawned_ranks_see_the_environment_of_their_call(monkeypatch):
    """Two spawns in one process, the environment changed between them: the second's ranks see
    the new value, in os.environ and in what zipccl read from it at import (its ranks fork from
    a fork server that imported zipccl), and are new processes."""
    monkeypatch.setenv("ZIPCCL_TOPOLOGY", "1x2")
    first = launch.spawn(_what_a_rank_sees, 2)
    monkeypatch.setenv("ZIPCCL_TOPOLOGY", "2x1")
    second = launch.spawn(_what_a_rank_sees, 2)
    assert [r[:2] for r in first] == [("1x2", "1x2")] * 2
    assert [r[:2] for r in second] == [("2x1", "2x1")] * 2
    assert not {r[2] for r in first} & {r[2] for r in second}


def test_ranks_are_spawned_where_a_cuda_device_is_visible(monkeypatch):
    """A process forked after CUDA's initialisation cannot use it: with a device visible, no
    fork server."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with launch.fork_server(_what_a_rank_sees) as method:
        assert method == "forkserver"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with launch.fork_server(_what_a_rank_sees) as method:
        assert method == "spawn"


def test_a_fork_server_this_process_already_runs_is_left_alone():
    """Its processes may still need it: spawned ranks instead, and the server still running."""
    import multiprocessing.forkserver as forkserver
    forkserver.ensure_running()
    try:
        pid = forkserver._forkserver._forkserver_pid
        with launch.fork_server(_what_a_rank_sees) as method:
            assert method == "spawn"
        assert forkserver._forkserver._forkserver_pid == pid and _alive(pid)
    finally:
        forkserver._forkserver._stop()


@pytest.mark.timeout(180)
def test_torchrun():
    out = subprocess.run(_torchrun(EXAMPLE), env=_without_torchrun(_clean_env()), capture_output=True, text=True,
                         timeout=170)
    assert out.returncode == 0, out.stderr
    _check(out.stdout, 2)


@pytest.mark.timeout(180)
def test_mpirun():
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed (make test installs openmpi-bin as root)")
    env = _clean_env()
    env["MASTER_PORT"] = str(free_port())
    out = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", "-x", "MASTER_PORT",
                          "-x", "PYTHONPATH", sys.executable, EXAMPLE], env=env, capture_output=True, text=True,
                         timeout=170)
    assert out.returncode == 0, out.stderr + out.stdout
    _check(out.stdout, 4)


DROPIN = str(ROOT / "examples" / "dropin.py")
# (True|False), not \w+: mpirun may join another rank's line to this one without a newline between
DROPIN_LINE = re.compile(r"(\d) ranks: sent ([\d.]+) MB instead of ([\d.]+) MB \(ratio [\d.]+\) on backend (\w+); "
                         r"result equals (the rank-order fp32 sum|gloo.s own all-reduce): (True|False)")


def _check_dropin(out: str, ranks: int, carried: bool = True) -> None:
    """Under lossless zipccl carries the all-reduce, coded, and its result is the rank-order sum;
    under auto on loopback gloo's own all-reduce runs, and its result is gloo's."""
    m = DROPIN_LINE.search(out)
    assert m, out
    assert int(m.group(1)) == ranks and m.group(4) == "zipccl" and m.group(6) == "True", m.group(0)
    if carried:
        assert m.group(5) == "the rank-order fp32 sum" and float(m.group(2)) < 0.75 * float(m.group(3)), m.group(0)
        _check_result(out, ranks)
    else:  # every rank has gloo's result: the same fingerprint on all (the line said it equals gloo's)
        assert m.group(5) == "gloo's own all-reduce" and float(m.group(3)) == 0, m.group(0)
        got = dict(re.findall(r"rank (\d+): result sha256 ([0-9a-f]{16})", out))
        assert sorted(got) == [str(r) for r in range(ranks)] and len(set(got.values())) == 1, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("codec", ["lossless", "auto"])
def test_dropin_backend_under_local_spawn(codec):
    """No launcher: examples/dropin.py starts its ranks with zipccl.launch.spawn(..., backend="zipccl")."""
    ranks = 2 if codec == "lossless" else 4  # (on 2 ranks gloo's bf16 sum is the rank-order sum too)
    out = subprocess.run([sys.executable, DROPIN, "--nranks", str(ranks)], env=dict(_clean_env(), ZIPCCL_CODEC=codec),
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    _check_dropin(out.stdout, ranks, carried=codec == "lossless")


@pytest.mark.timeout(180)
def test_dropin_backend_under_torchrun():
    out = subprocess.run(_torchrun(DROPIN), env=_without_torchrun(dict(_clean_env(), ZIPCCL_CODEC="lossless")),
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    _check_dropin(out.stdout, 2)


@pytest.mark.timeout(180)
def test_dropin_backend_under_mpirun():
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed (make test installs openmpi-bin as root)")
    env = dict(_clean_env(), MASTER_PORT=str(free_port()), ZIPCCL_CODEC="lossless")
    out = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", "-x", "MASTER_PORT",
                          "-x", "PYTHONPATH", "-x", "ZIPCCL_CODEC", sys.executable, DROPIN], env=env,
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr + out.stdout
    _check_dropin(out.stdout, 4)


# ---- the one-GPU lab: what each rank's environment holds, checked without a GPU -------------------------------

def test_lab_env_makes_each_rank_its_own_nccl_host():
    assert launch.lab_env(0) == {"NCCL_HOSTID": "zipccl-lab-rank0", "NCCL_SOCKET_IFNAME": "lo",
                                 "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_MNNVL_ENABLE": "0"}
    assert launch.lab_env(3, "zcl-v1a") == {"NCCL_HOSTID": "zipccl-lab-rank3", "NCCL_SOCKET_IFNAME": "zcl-v1a",
                                            "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_MNNVL_ENABLE": "0"}
    assert len({launch.lab_env(r)["NCCL_HOSTID"] for r in range(64)}) == 64  # a host hash per rank


def test_rank_env():
    assert launch.rank_env(2, 4, 29600) == dict(RANK="2", WORLD_SIZE="4", LOCAL_RANK="2", MASTER_ADDR="127.0.0.1",
                                                MASTER_PORT="29600")
    assert launch.rank_env(2, 4, 29600, share_gpu=True) == dict(
        RANK="2", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29600", GROUP_RANK="2",
        LOCAL_WORLD_SIZE="1")


def test_gpu_for():
    assert launch.gpu_for(0, 1) == 0
    assert launch.gpu_for(3, 8) == 3                       # one GPU per local rank
    assert launch.gpu_for(3, 1, share_gpu=True) == 0       # the lab: every rank on GPU 0
    assert launch.gpu_for(3, 1) == 0                       # one GPU per task (srun --gpus-per-task=1)
    with pytest.raises(UnsupportedError, match="local rank 2 has no CUDA device of its own.*share_gpu=True"):
        launch.gpu_for(2, 2)
    for share in (False, True):
        with pytest.raises(UnsupportedError, match="no CUDA device"):
            launch.gpu_for(0, 0, share_gpu=share)


def _fake_cuda(monkeypatch, count: int) -> list:
    import torch
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    return bound


def test_use_gpu_sets_the_lab_variables(monkeypatch):
    for name in ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_NET", "NCCL_MNNVL_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    bound = _fake_cuda(monkeypatch, 1)
    monkeypatch.setenv("NCCL_HOSTID", "one-host-for-all")  # a job-wide setting would defeat the lab: replaced
    assert launch.use_gpu(2, 0, share_gpu=True) == 0
    assert bound == [0]
    assert {k: os.environ[k] for k in launch.lab_env(2)} == launch.lab_env(2)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "zcl-v1a")   # a network lab's veth is kept
    launch.use_gpu(3, 0, share_gpu=True)
    assert os.environ["NCCL_HOSTID"] == "zipccl-lab-rank3" and os.environ["NCCL_SOCKET_IFNAME"] == "zcl-v1a"


def test_use_gpu_without_the_lab_sets_no_nccl_variable(monkeypatch):
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    bound = _fake_cuda(monkeypatch, 4)
    assert launch.use_gpu(5, 3) == 3
    assert bound == [3] and "NCCL_HOSTID" not in os.environ


def test_spawn_share_gpu_needs_cuda(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    with pytest.raises(UnsupportedError, match=r"share_gpu=True.*no CUDA device"):
        launch.spawn(_never_called, 2, share_gpu=True)


def _never_called(rank, nranks):
    raise AssertionError("spawn started ranks without CUDA")


def _one_raises(rank, nranks):
    import torch.distributed as dist
    if rank == 1:
        raise RuntimeError("rank 1's own error")
    dist.barrier()  # the others fail once rank 1 has gone (gloo: connection closed or reset)


def test_spawn_names_the_rank_that_raised_first():
    """A rank that raises takes its group down with it; its peers fail of that, and torch names
    the lowest rank that ended. spawn raises the first error, with its rank and traceback."""
    import torch.multiprocessing as mp
    with pytest.raises(mp.ProcessRaisedException) as e:
        launch.spawn(_one_raises, 3, timeout=30)
    assert "rank 1 raised first" in str(e.value) and "rank 1's own error" in str(e.value), str(e.value)
    assert e.value.error_index == 1


def _interrupted(rank, nranks):
    raise KeyboardInterrupt("rank 0's own interrupt")


def test_spawn_raises_a_ranks_keyboard_interrupt():
    """torch's spawn ends a rank that raised KeyboardInterrupt with exit code 0 (it takes it for a
    stop its parent asked for): spawn returned [None] as if the rank had returned."""
    import torch.multiprocessing as mp
    with pytest.raises(mp.ProcessRaisedException) as e:
        launch.spawn(_interrupted, 1, timeout=30)
    assert "rank 0 raised first" in str(e.value) and "rank 0's own interrupt" in str(e.value), str(e.value)


_GONE_BEFORE_SHUTDOWN = """
import datetime, os, sys, time
import torch.distributed as dist
from zipccl import launch
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
dist.barrier()
if rank == 1:
    os._exit(0)
time.sleep(1)
try:
    launch.shutdown()
    print("no error")
except RuntimeError:
    print("raised; initialized:", dist.is_initialized())
"""


def test_shutdown_after_a_peer_is_gone_still_destroys_the_groups(tmp_path):
    """launch.shutdown's barrier fails where a peer has gone; the groups are destroyed anyway, so
    that a later init makes new ones instead of returning the broken world."""
    script = tmp_path / "gone.py"
    script.write_text(_GONE_BEFORE_SHUTDOWN)
    env, port = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])), str(launch.free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert outs[0].strip() == "raised; initialized: False", outs


_ORPHAN_LAUNCHER = """
import os, signal, sys, time
from zipccl import launch

def rank(r, n, folder):
    # torch's spawn sends SIGINT to its ranks when their parent dies: a rank blocked inside a C++
    # call (a store's wait) does not act on it, nor one whose shell ignores it (a background job)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(120)

if __name__ == "__main__":
    launch.spawn(rank, 2, sys.argv[1], timeout=60)
"""


def test_ranks_die_with_a_killed_launcher(tmp_path):
    """A launcher killed by SIGKILL (as a timeout kills it) leaves no rank running."""
    import signal
    import time
    script = tmp_path / "launcher.py"
    script.write_text(_ORPHAN_LAUNCHER)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 120
        while len([p for p in tmp_path.iterdir() if p.name.isdigit()]) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks never started"
            time.sleep(0.2)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    ranks = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    deadline = time.monotonic() + 20
    alive = ranks
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in ranks if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"ranks {alive} outlived their launcher"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
