"""The NCCL transport's CPU-runnable parts, on the real CuPy and libnccl of the GPU extra (`make
setup` installs cuda12; a CUDA-13 torch pairs with cuda13): zipccl's type and op tables against
CuPy's constants and the wheel's nccl.h, the stack's detection, and NcclTransport's bootstrap in 2
and 4 real processes: one unique id on every rank, then, without a GPU for each rank (no GPU in
CI: NCCL refuses the communicator), the same ZipcclError carrying NCCL's message on every rank,
in bounded time. What is expected follows what the host has (CuPy's CUDA version, CUDA devices,
NVML), so that the file passes on CPU and on GPU machines. GPU-only parts: tests/test_nccl_gpu.py."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from zipccl.launch import free_port
from workers import spawn

pytestmark = pytest.mark.timeout(300)

nccl = pytest.importorskip("cupy.cuda.nccl", reason="the GPU extra (cuda12 or cuda13) is not installed "
                                                     "(make setup installs cuda12)")

from zipccl.transport import nccl_stack  # noqa: E402

#: nccl.h's enumerator of each CuPy constant that zipccl's tables use.
HEADER_NAMES = {"NCCL_INT8": "ncclInt8", "NCCL_UINT8": "ncclUint8", "NCCL_INT32": "ncclInt32",
                "NCCL_INT64": "ncclInt64", "NCCL_FLOAT16": "ncclFloat16", "NCCL_FLOAT32": "ncclFloat32",
                "NCCL_FLOAT64": "ncclFloat64", "NCCL_BFLOAT16": "ncclBfloat16", "NCCL_SUM": "ncclSum",
                "NCCL_PROD": "ncclProd", "NCCL_MAX": "ncclMax", "NCCL_MIN": "ncclMin", "NCCL_AVG": "ncclAvg"}


def _header() -> str:
    """The nccl.h that the installed nvidia-nccl wheel ships (its folder differs between CUDA versions)."""
    import nvidia
    found = sorted(h for base in nvidia.__path__ for h in Path(base).glob("**/include/nccl.h"))
    assert found, f"no include/nccl.h under {list(nvidia.__path__)}"
    return found[0].read_text()


def _cuda_major() -> int:
    """The CUDA major version CuPy was built for (12 or 13), asked of CuPy's runtime, not of the
    package metadata that nccl_stack.detect reads; no device needed."""
    from cupy.cuda import runtime
    return runtime.runtimeGetVersion() // 1000


def _enum(text: str, name: str) -> dict[str, int]:
    """The enumerators of ``typedef enum { ... } name;`` in a C header, with their values."""
    body = re.search(r"typedef\s+enum\s*(?:\w+\s*)?\{([^}]*)\}\s*" + name + r"\s*;", text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", body, flags=re.S)
    out = {}
    for item in body.split(","):
        if "=" in item:
            key, value = (s.strip() for s in item.split("=", 1))
            if re.fullmatch(r"-?\d+", value):
                out[key] = int(value)
    return out


def test_tables_match_cupy_and_nccl_h():
    types, ops = _enum(_header(), "ncclDataType_t"), _enum(_header(), "ncclRedOp_t")
    assert len(types) >= 10 and len(ops) >= 5, (types, ops)  # the parser found the enums
    for table, enum in ((nccl_stack.DTYPES, types), (nccl_stack.OPS, ops)):
        for key, (name, value) in table.items():
            assert getattr(nccl, name) == value, (key, name, getattr(nccl, name), value)
            assert enum[HEADER_NAMES[name]] == value, (key, name, enum[HEADER_NAMES[name]], value)


def test_detection_reports_the_stack(monkeypatch):
    stack, major = nccl_stack.detect(), _cuda_major()
    assert stack.extra == f"cuda{major}" and stack.problem is None, (stack, major)
    assert f"cupy-cuda{major}x" in str(stack) and f"nvidia-nccl-cu{major}" in str(stack)
    assert nccl.get_version() >= nccl_stack.MIN_VERSION
    installed = {"cupy-cuda12x": "14", "nvidia-nccl-cu12": "2", "nvidia-nccl-cu13": "2"}
    monkeypatch.setattr(nccl_stack, "_installed", installed.get)
    both = nccl_stack.detect()
    assert both.extra is None and "both the cuda12 and the cuda13" in both.problem
    with pytest.raises(Exception, match="both the cuda12 and the cuda13"):
        nccl_stack.load()
    monkeypatch.setattr(nccl_stack, "_installed", {}.get)
    assert "not installed" in nccl_stack.detect().problem


def test_import_zipccl_never_imports_cupy():
    code = ("import sys, zipccl, zipccl.transport, zipccl.collectives, zipccl.topology, zipccl.api; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends')], 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _bootstrap(rank: int, n: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from zipccl.transport.cupy_nccl import NcclTransport
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    if torch.cuda.is_available():  # a GPU each where there are enough; NCCL refuses two ranks on one GPU
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=60))
    t0 = time.perf_counter()
    seen = {}
    real_init = NcclTransport._connect

    def spy(self, uid):  # what each rank is given, before NCCL is asked
        seen["uid"] = uid.hex()
        return real_init(self, uid)

    NcclTransport._connect = spy
    try:
        NcclTransport(None)
        outcome = ("made", "")
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = (type(e).__name__, str(e))
    seconds = time.perf_counter() - t0
    from zipccl import config
    from zipccl.transport import transport_for
    chosen = [type(transport_for(None, torch.device("cpu"))).__name__]
    config.TRANSPORT = "auto"  # a gloo group, which cannot carry CUDA tensors: NCCL's error, no fallback
    try:
        chosen.append(type(transport_for(None, torch.device("cuda"))).__name__)
    except Exception as e:  # noqa: BLE001
        chosen.append(type(e).__name__)
    config.TRANSPORT = "nccl"  # asked for: NCCL's error, never a silent fallback
    try:
        chosen.append(type(transport_for(None, torch.device("cuda"))).__name__)
    except Exception as e:  # noqa: BLE001
        chosen.append(type(e).__name__)
    dist.barrier()  # rank 0 serves the store, where the others may still read the makings' last words
    results.put((rank, (*outcome, seen.get("uid"), seconds, chosen)))
    dist.destroy_process_group()


@pytest.mark.parametrize("n", [2, 4])
def test_bootstrap_alike_on_every_rank(n, monkeypatch):
    """One unique id on every rank; then, with a GPU for each rank, a communicator on every rank,
    and otherwise the same NcclError on every rank."""
    import torch
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    got, _ = spawn(_bootstrap, n, (n, free_port()), seconds=180, stop_on_crash=True)
    assert sorted(got) == list(range(n)), got  # every rank answered: none hung
    uids = {v[2] for v in got.values()}
    uid = next(iter(uids))  # two ids: the bulk channel's and the mail channel's
    assert len(uids) == 1 and uids != {"00" * 256} and len(uid) == 512 and uid[:256] != uid[256:], uids
    outcomes = {v[:2] for v in got.values()}
    assert len(outcomes) == 1, outcomes  # the same outcome on every rank
    kind, message = outcomes.pop()
    assert max(v[3] for v in got.values()) < 60, got
    if torch.cuda.is_available() and torch.cuda.device_count() >= n:
        assert kind == "made", message
        assert all(v[4] == ["TorchTransport", "NcclTransport", "NcclTransport"] for v in got.values()), got
        return
    assert kind == "NcclError" and "NCCL_ERROR" in message and f"group of {n} ranks" in message, message
    assert all(v[4] == ["TorchTransport", "NcclError", "NcclError"] for v in got.values()), got


def _pair(rank: int, port: int, timeout: float, case: str, results) -> None:
    """Ranks 1 and 2 of three make the NcclPair of rank 1's messages to rank 2 (rank 2 only where
    ``timeout`` is over 5 s, which is how long rank 1 waits for it; without NCCL where ``case``
    says "receiver without NCCL"), while rank 0 waits in a barrier: it takes no part."""
    import torch
    import torch.distributed as dist

    from zipccl import config
    from zipccl.transport.nccl_pair import NcclPair
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_SOCKET_IFNAME="lo")
    config.TIMEOUT = timeout
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    outcome, seen = None, {}
    real = NcclPair._connect

    def spy(self, uid):
        seen["uid"] = uid.hex()
        return real(self, uid)

    NcclPair._connect = spy
    if rank == 2 and case == "receiver without NCCL":
        from zipccl.errors import UnsupportedError
        from zipccl.transport import nccl_stack

        def load():
            raise UnsupportedError("no NCCL here (test)")
        nccl_stack.load = load
    if rank == 1 or (rank == 2 and timeout > 5):
        t0 = time.perf_counter()
        try:
            NcclPair(None, 1, 2)
            outcome = ("made", "")
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcome = (type(e).__name__, str(e))
        outcome = (*outcome, seen.get("uid"), time.perf_counter() - t0)
    dist.barrier()
    results.put((rank, outcome))
    dist.destroy_process_group()


def test_a_pair_is_made_by_its_two_ranks_alone(monkeypatch):
    """The communicators of one direction's messages (zipccl.p2p on CUDA) are made by the two
    ranks alone, through the job's store: both get the sender's ids and then the same outcome
    (without a GPU each, the same NcclError), while the third rank of the group does nothing."""
    import torch
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    got, _ = spawn(_pair, 3, (free_port(), 60.0, "both"), seconds=120, stop_on_crash=True)
    assert sorted(got) == [0, 1, 2] and got[0] is None, got
    (kind, message, uid, seconds), theirs = got[1], got[2]
    assert theirs[:3] == (kind, message, uid) and len(uid) == 512 and uid != "00" * 256, got
    assert max(seconds, theirs[3]) < 60, got
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        assert kind == "made", message
        return
    assert kind == "NcclError" and "messages from rank 1 to rank 2: rank 1: " in message and "NCCL_ERROR" in message, \
        message


def test_a_pair_whose_other_end_never_comes_is_given_up_within_the_bound(monkeypatch):
    """The sender's end waits for the receiver's at most ZIPCCL_TIMEOUT, then says whom it waited for."""
    got, _ = spawn(_pair, 3, (free_port(), 2.0, "both"), seconds=60, stop_on_crash=True)
    assert got[0] is None and got[2] is None, got
    kind, message, uid, seconds = got[1]
    assert kind == "NcclError" and "rank 2 did not join" in message and 2 <= seconds < 5, got


def test_an_end_without_nccl_keeps_the_other_out_of_nccl():
    """Where one end cannot load NCCL, the handshake tells the other, which does not enter NCCL
    (whose making of a communicator would wait for that end without a bound): both raise the
    same NcclError, naming the end without NCCL and why."""
    got, _ = spawn(_pair, 3, (free_port(), 60.0, "receiver without NCCL"), seconds=120, stop_on_crash=True)
    assert sorted(got) == [0, 1, 2] and got[0] is None, got
    (kind, message, uid, seconds), theirs = got[1], got[2]
    assert theirs[:2] == (kind, message) and kind == "NcclError" and uid == "00" * 256, got
    assert "rank 2: UnsupportedError: no NCCL here (test)" in message and max(seconds, theirs[3]) < 30, message


class _JoiningNccl:
    """A stand-in for CuPy's NCCL module whose making of a communicator returns, as NCCL's does,
    once every rank of it has come (here: counted in the job's store), and waits for them without
    a bound. ``leaving``: what rank 2 does in the making, from its ``after``-th on: "dies"
    (os._exit), "stays" (alive, never joins) or "hangs" (joins, so that the others' making
    completes, and never returns)."""

    def __init__(self, leaving: str, after: int):
        self.leaving, self.after, self.made = leaving, after, 0
        stand_in = self

        class NcclCommunicator:
            def __init__(self, size, uid, rank):
                import torch.distributed as dist
                stand_in.made += 1
                leaves = dist.get_rank() == 2 and stand_in.made > stand_in.after
                if leaves and stand_in.leaving == "dies":
                    os._exit(0)
                if leaves and stand_in.leaving == "stays":
                    threading.Event().wait()
                store, key = dist.distributed_c10d._get_default_store(), f"test/joined/{bytes(uid).hex()}"
                store.add(key, 1)
                if leaves:
                    threading.Event().wait()
                while store.add(key, 0) < size:
                    time.sleep(0.01)

            def abort(self):
                pass

        self.NcclCommunicator = NcclCommunicator

    @staticmethod
    def get_unique_id():
        return tuple(os.urandom(128))


def _join(rank: int, port: int, timeout: float, leaving: str, results) -> None:
    """Three ranks make NcclTransport's communicators over _JoiningNccl twice: all of them, then
    without rank 2 (``leaving``). Each survivor reports both outcomes."""
    import torch
    import torch.distributed as dist

    from zipccl import config
    from zipccl.transport import cupy_nccl, nccl_stack
    from zipccl.transport.cupy_nccl import NcclTransport
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    config.TIMEOUT = timeout
    if leaving != "dies":
        cupy_nccl.MAKING_S = 0.0  # the bound is ZIPCCL_TIMEOUT alone
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
    per_making = 2 if torch.cuda.is_available() else 1  # the bulk communicator and the mail one (no CUDA: bulk)
    # rank 2 leaves in the second making: at its first communicator, or ("hangs") at its last
    stand_in = _JoiningNccl(leaving, after=2 * per_making - 1 if leaving == "hangs" else per_making)
    nccl_stack.load = lambda: stand_in
    if leaving == "cannot" and rank == 2:
        from zipccl.errors import UnsupportedError

        def load():
            raise UnsupportedError("no NCCL here (test)")
        nccl_stack.load = load
    outcomes = []
    for _ in range(2):
        t0 = time.perf_counter()
        try:
            NcclTransport(None)
            outcomes.append(("made", "", None, None, 0.0))
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcomes.append((type(e).__name__, str(e), getattr(e, "rank", None), getattr(e, "broken", None),
                             time.perf_counter() - t0))
    results.put((rank, outcomes))
    store = dist.distributed_c10d._get_default_store()
    store.add("test/reported", 1)
    deadline = time.monotonic() + 30
    while store.add("test/reported", 0) < (2 if leaving == "dies" else 3) and time.monotonic() < deadline:
        time.sleep(0.05)  # rank 0 serves the store: it stays until every survivor has read the heartbeats


def test_a_rank_without_nccl_keeps_the_others_out_of_nccl():
    """Where one rank cannot load NCCL, it says so before any rank enters NCCL (whose making
    would wait for it): every rank raises the same NcclError naming it, at once, in every making
    (so a group of torch's NCCL can fall back to it), none waiting for the bound."""
    got, _ = spawn(_join, 3, (free_port(), 4.0, "cannot"), seconds=90)
    assert sorted(got) == [0, 1, 2], got
    outcomes = {o[:2] for v in got.values() for o in v}
    assert len(outcomes) == 1, outcomes  # the same on every rank, in both makings
    kind, message = outcomes.pop()
    assert kind == "NcclError" and "rank 2 could not load NCCL (UnsupportedError: no NCCL here (test))" in message, \
        message
    assert max(o[4] for v in got.values() for o in v) < 3, got


@pytest.mark.parametrize("leaving", ["dies", "stays", "hangs"])
def test_a_rank_that_never_joins_the_communicators_is_named_within_the_bound(leaving):
    """NCCL's making of a communicator waits for every rank without a bound: a rank that dies
    there (or before) would keep the others waiting for good. The others give up on it, raising
    RankFailure (lost, broken): a dead rank named from its heartbeat, before ZIPCCL_TIMEOUT (6 s,
    so silent after 3 s); a live one that never joins, with no evidence to name it, at the
    bound (here ZIPCCL_TIMEOUT, 4 s, alone), on every rank. Where the others' making completes
    and rank 2's never returns, rank 2 gives up at the bound and the others, waiting for its
    word in the store, raise its failure with it (its words: "on rank 2"), not at a bound of
    their own nor at the group's timeout. The stand-in's first making, with every rank, completes."""
    import torch
    timeout = 6.0 if leaving == "dies" else 4.0
    got, _ = spawn(_join, 3, (free_port(), timeout, leaving), answers=2 if leaving == "dies" else 3, seconds=90)
    assert sorted(got) == ([0, 1] if leaving == "dies" else [0, 1, 2]), got
    for rank, (first, second) in got.items():
        if torch.cuda.is_available():
            assert first[0] == "made", first
        else:
            assert first[0] == "NcclError" and "torch has no CUDA device" in first[1], first
        kind, message, named, broken, seconds = second
        assert kind == "RankFailure" and broken, second
        if leaving == "dies":
            assert named == 2 and "rank 2 failed: it did not join" in message and "heartbeat" in message, second
            assert 3 <= seconds < timeout, second
        else:
            assert named == -1 and "a rank did not join (no progress within 4 s" in message, second
            assert 4 <= seconds < 7, second
            if leaving == "hangs":
                assert "on rank 2:" in message, second


def test_a_making_given_up_aborts_each_communicator_once(monkeypatch):
    """Where this rank gives up on NCCL's making (its thread left blocked), it aborts the
    communicators made so far, and the thread aborts those it makes later: each exactly once
    (ncclCommAbort twice on one communicator frees it twice)."""
    from zipccl.errors import RankFailure
    from zipccl.transport import heartbeat
    from zipccl.transport.cupy_nccl import NcclTransport
    aborts = []

    class Comm:
        def __init__(self, name):
            self.name = name

        def abort(self):
            aborts.append(self.name)

    def making(size, uid, rank):
        if uid == b"second":
            time.sleep(0.6)  # the second channel's making outlasts the bound
        return Comm(uid.decode())

    t = object.__new__(NcclTransport)
    t.rank, t.size, t._ranks, t._members = 0, 2, [0, 1], [0, 1]
    t.nccl = types.SimpleNamespace(NcclCommunicator=making)
    monkeypatch.setattr(NcclTransport, "_bound", staticmethod(lambda: 0.2))
    monkeypatch.setattr(NcclTransport, "_say_lost", lambda self, failure: None)
    monkeypatch.setattr(heartbeat, "board", lambda: None)
    with pytest.raises(RankFailure, match="did not join"):
        t._made(None, b"first", b"second")
    deadline = time.monotonic() + 5
    while len(aborts) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # a second abort of "first" would come now
    assert sorted(aborts) == ["first", "second"], aborts


def test_nvml_link():
    """pynvml (nvidia-ml-py) is installed. Without a CUDA device there is no driver: NVML cannot
    start, and the topology says "unknown". With one, NVML starts and names the link of its GPUs
    ("unknown" for a single GPU, which has no peer)."""
    import pynvml
    import torch

    from zipccl.topology import nvml_link
    if not torch.cuda.is_available():
        with pytest.raises(pynvml.NVMLError):
            pynvml.nvmlInit()
        assert nvml_link() == "unknown"
        return
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    link = nvml_link()
    assert count >= 1 and (link == "unknown" if count == 1 else link in ("nvlink", "pcie")), (count, link)


def test_links_are_matched_by_bus_id():
    from zipccl.topology import link_between
    a, b, c = "00000000:3B:00.0", "00000000:5E:00.0", "00000000:86:00.0"
    assert link_between([a], {a: []}) == "unknown"
    assert link_between([a, b], {a: ["0000:5e:00.0"], b: [b"0000:3b:00.0"]}) == "nvlink"  # NVML's two spellings
    assert link_between([a, b], {a: [], b: []}) == "pcie"
    assert link_between([a, b, c], {a: [b], b: [a], c: []}) == "pcie"
    assert link_between([a, b], {a: ["switch"], b: ["switch"]}) == "nvlink"
    assert link_between([a, b], {a: [a], b: ["0000:99:00.0"]}) == "pcie"  # a link to itself or elsewhere is no peer


class _Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


class _Comm:
    aborted = False

    def check_async_error(self):
        pass

    def abort(self):
        _Comm.aborted = True


def _pending_transport(monkeypatch, mail: bool = False):
    """An NcclTransport over stand-ins (no GPU): a communicator that never reports an error and
    an operation (on device tensors, or a mail: a host tensor) whose event never passes, as a
    receive from a dead peer."""
    from zipccl.transport.cupy_nccl import NcclTransport, _Work
    t = object.__new__(NcclTransport)
    t.comm, t.mail_comm, t.device, t.rank, t._ranks = _Comm(), _Comm(), "cpu", 0, [0, 1]
    t._members = t._ranks
    _Comm.aborted = False
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    work = _Work(keep=None, host=torch.zeros(1, dtype=torch.int64) if mail else None, mail=mail)
    work.event = type("Pending", (), {"query": lambda self: False})()
    return t, work, stream


@pytest.mark.parametrize("setting", [0.3, None], ids=["ZIPCCL_TIMEOUT", "unset"])
def test_a_pending_mail_times_out_within_the_bound(monkeypatch, setting):
    """A mail (a size, a status) whose peer died never arrives: the host waits for it at most
    ZIPCCL_TIMEOUT, or config.DEFAULT_TIMEOUT where that is unset (here made 0.3 s), then raises a
    timed-out NcclError and aborts the communicator; no wait is unbounded."""
    from zipccl import config
    from zipccl.transport.cupy_nccl import NcclError
    monkeypatch.setattr(config, "TIMEOUT", setting)
    monkeypatch.setattr(config, "DEFAULT_TIMEOUT", 0.3)
    t, work, stream = _pending_transport(monkeypatch, mail=True)
    start = time.monotonic()
    with pytest.raises(NcclError, match="no progress within 0.3 s") as e:
        t.wait(work)
    assert 0.3 <= time.monotonic() - start < 10  # 0.31 s alone; 3.1 s once on a 2-core host under the suite
    assert e.value.timed_out and e.value.anonymous and _Comm.aborted and t.comm is None and not stream.waited


@pytest.mark.parametrize("setting", [0.3, None], ids=["ZIPCCL_TIMEOUT", "unset"])
def test_a_device_wait_leaves_the_host_free(monkeypatch, setting):
    """Waiting for an operation on device tensors only orders torch's current stream after it:
    the host returns at once, with ZIPCCL_TIMEOUT or without (the call's status round, fenced
    after it, is where a peer that died is found)."""
    from zipccl import config
    monkeypatch.setattr(config, "TIMEOUT", setting)
    t, work, stream = _pending_transport(monkeypatch)
    start = time.monotonic()
    t.wait(work)
    assert stream.waited == [work.event] and not _Comm.aborted and time.monotonic() - start < 0.3


@pytest.mark.parametrize("mail", [True, False], ids=["mail", "device"])
def test_a_wait_after_the_abort_raises_whatever_its_event_says(monkeypatch, mail):
    """An operation issued before the communicators were aborted (another wait of the call gave
    up): the abort ends its kernel, so its event passes whether or not its data came; its wait
    raises as a lost peer's does, and a mail copies nothing from its never-written staging."""
    from zipccl.transport.cupy_nccl import NcclError
    t, work, stream = _pending_transport(monkeypatch, mail=mail)
    work.event = type("Passed", (), {"query": lambda self: True})()
    work.pinned = torch.full((1,), 123456, dtype=torch.int64)  # what the staging held: never received
    t._fenced = ()
    t.abort()
    with pytest.raises(NcclError, match="aborted"):
        t.wait(work)
    assert not stream.waited and (not mail or int(work.host) == 0)


def test_communicators_still_held_at_exit_are_aborted_not_destroyed():
    """At exit every communicator that zipccl still holds ends by ncclCommAbort (bounded), never
    by CuPy's garbage collection, whose ncclCommDestroy waits for good for operations pending on
    a peer that died: both communicators of each transport, the cache emptied."""
    from zipccl.transport.cupy_nccl import NcclTransport, ended_at_exit
    ends = []

    class Comm:
        def __init__(self, name):
            self.name = name

        def abort(self):
            ends.append(("abort", self.name))

        def destroy(self):
            ends.append(("destroy", self.name))

    cache = {}
    for key in ("world", "pair"):
        t = object.__new__(NcclTransport)
        t.comm, t.mail_comm = Comm(f"{key} bulk"), Comm(f"{key} mail")
        cache[key] = t
    held = list(cache.values())
    ended_at_exit(cache)()
    assert sorted(ends) == [("abort", f"{k} {c}") for k in ("pair", "world") for c in ("bulk", "mail")], ends
    assert cache == {} and all(t.comm is None and t.mail_comm is None for t in held)
    # where no thread can start (Python 3.12's interpreter shutdown), each is aborted all the same
    ends.clear()
    t = object.__new__(NcclTransport)
    t.comm, t.mail_comm = Comm("late bulk"), Comm("late mail")

    def refused(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(threading.Thread, "start", refused)
        ended_at_exit({"late": t})()
    assert sorted(ends) == [("abort", "late bulk"), ("abort", "late mail")], ends
    # and the interpreter's exit does it, for the groups' transports and the messages' pairs
    code = """if True:
        import os
        from zipccl.transport import cupy_nccl, nccl_pair
        class Comm:  # one write a line: the aborts run on threads of their own, at once
            def __init__(self, name): self.name = name
            def abort(self): os.write(1, f"abort {self.name}\\n".encode())
            def destroy(self): os.write(1, f"destroy {self.name}\\n".encode())
        for cache, key in ((cupy_nccl._transports, "group"), (nccl_pair._pairs, "pair")):
            t = object.__new__(cupy_nccl.NcclTransport)
            t.comm, t.mail_comm = Comm(key + " bulk"), Comm(key + " mail")
            cache[key] = t
        """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(run.stdout.split("\n")[:-1]) == [f"abort {k} {c}" for k in ("group", "pair")
                                                   for c in ("bulk", "mail")], run.stdout


def test_the_status_round_leaves_after_the_calls_packets(monkeypatch):
    """fence: the mail stream waits for the bulk stream, so that a peer's status says its packets
    have gone; abort ends both communicators."""
    t, _, _ = _pending_transport(monkeypatch)
    t.stream, t.mail_stream = "bulk", _Stream()
    t.mail_stream.wait_stream = t.mail_stream.waited.append
    t.fence()
    assert t.mail_stream.waited == ["bulk"]
    inter, gloo = types.SimpleNamespace(stream="the nodes' level's bulk"), types.SimpleNamespace()
    t.fence(t, inter, gloo)  # a hierarchical call's levels: those with streams (NCCL's) are waited for
    assert t.mail_stream.waited == ["bulk", "bulk", "the nodes' level's bulk"]
    t.abort()
    assert _Comm.aborted and t.comm is None and t.mail_comm is None


class _Held:
    """A communicator whose ncclCommAbort frees device memory: CUDA's free waits for every kernel
    of the process, so its abort returns only once each communicator of ``kernels`` (whose kernels
    wait on a dead peer) has had its own abort called, which ends them; else, after 3 s, it
    reports the wait that would have lasted for good."""

    def __init__(self, name: str, called: dict, kernels: tuple = ()):
        self.name, self.called, self.kernels = name, called, kernels
        called[name] = threading.Event()

    def abort(self):
        self.called[self.name].set()
        if not all(self.called[k].wait(3) for k in self.kernels):
            self.called.setdefault("held", []).append(self.name)


def test_a_broken_calls_communicators_are_aborted_at_once(monkeypatch):
    """ncclCommAbort frees device memory, which waits for the kernels of every communicator not
    yet aborted, and one pending on a dead peer ends only at its own abort: a transport that
    fails aborts its two communicators at once, not one after another (here its bulk channel's
    abort waits for the mail channel's kernels); a broken call aborts its levels' together, and
    a level of another kind (gloo's) through its own abort()."""
    from zipccl.transport import cupy_nccl
    from zipccl.transport.cupy_nccl import NcclTransport
    called = {}

    def transport(name: str, kernels: tuple = ()):
        t = object.__new__(NcclTransport)
        t.comm, t.mail_comm = _Held(f"{name} bulk", called, kernels), _Held(f"{name} mail", called)
        return t

    world = transport("world", kernels=("world mail",))
    start = time.monotonic()
    world.abort()
    assert "held" not in called and time.monotonic() - start < 2 and world.comm is world.mail_comm is None, called
    nodes, gloo = transport("nodes", kernels=("local bulk", "local mail")), types.SimpleNamespace(aborted=False)
    gloo.abort = lambda: setattr(gloo, "aborted", True)
    local = transport("local")
    cupy_nccl.abort_together((nodes, gloo, local))
    assert "held" not in called and gloo.aborted and nodes.comm is local.mail_comm is None, called


def test_a_send_that_fails_inside_its_group_is_aborted_once_the_group_has_ended(monkeypatch):
    """NCCL's open group is the opening thread's and lists the communicators posted to; an abort on
    another thread (``_abort_all``'s) would free one under it, and the group's end would then read
    freed memory. A send that fails inside the group marks the transport failed (the group's later
    posts raise at once, and zipccl.failure counts their peers lost), and its communicators are
    aborted only after the group has ended, which NCCL ends with the post's error, launching
    nothing: that error is not raised again, and the group's other operations, which never ran,
    raise when waited for."""
    from zipccl.transport.cupy_nccl import NcclError, NcclTransport
    events = []

    class Comm:
        def __init__(self, name):
            self.name = name

        def send(self, *args):
            events.append(f"{self.name} send")
            raise RuntimeError("NCCL error: remote process exited or there was a network error")

        def abort(self):
            events.append(f"{self.name} abort")

    t = object.__new__(NcclTransport)
    t.rank, t.size, t._ranks, t._open, t.device = 0, 2, [0, 1], None, 0
    t.comm, t.mail_comm = Comm("bulk"), Comm("mail")
    t.stream = types.SimpleNamespace(wait_stream=lambda stream: None, cuda_stream=0)
    def group_end():  # as NCCL's: a group in which a post failed ends with that error, launching nothing
        events.append("group end")
        raise RuntimeError("NCCL error: remote process exited or there was a network error")

    t.nccl = types.SimpleNamespace(groupStart=lambda: events.append("group start"), NCCL_UINT8=1, groupEnd=group_end)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    x = torch.empty(8, device="meta")  # a device tensor that NCCL's stand-in never reads
    t.comm.send = lambda *args: events.append("bulk posted")  # the first post goes in
    with t.grouped():
        posted = t.isend(x, 1)
        t.comm.send = Comm.send.__get__(t.comm)  # the second fails
        with pytest.raises(NcclError, match="aborted at the end of its group"):
            t.isend(x, 1)
        with pytest.raises(NcclError, match="an earlier post of this NCCL group failed"):
            t.isend(x, 1)
        events.append("body ends")
    assert events[:5] == ["group start", "bulk posted", "bulk send", "body ends", "group end"], events
    assert sorted(events[5:]) == ["bulk abort", "mail abort"] and t.comm is t.mail_comm is None, events
    with pytest.raises(NcclError, match="aborted"):  # the posted one never ran: its wait raises, as a lost peer's
        t.wait(posted)
    assert t._failed_in_group is None  # the next group starts clean (and raises: aborted)


class _Logged:
    """A communicator's stand-in that logs its posts and its abort into ``events``."""

    def __init__(self, name: str, events: list):
        self.name, self.events = name, events

    def send(self, *args):
        self.events.append(f"{self.name} posted")

    def abort(self):
        self.events.append(f"{self.name} abort")


def _logged_transport(events: list, group_end):
    """An NcclTransport of 2 ranks (this one rank 0) over _Logged communicators, NCCL's group
    calls logged too, its group's end ``group_end``."""
    from zipccl.transport.cupy_nccl import NcclTransport
    t = object.__new__(NcclTransport)
    t.rank, t.size, t._ranks, t._open, t.device = 0, 2, [0, 1], None, 0
    t._members = t._ranks
    t.comm, t.mail_comm = _Logged("bulk", events), _Logged("mail", events)
    t.stream = types.SimpleNamespace(wait_stream=lambda stream: None, cuda_stream=0)
    t.nccl = types.SimpleNamespace(groupStart=lambda: events.append("group start"), NCCL_UINT8=1, groupEnd=group_end)
    return t


def test_a_group_whose_end_fails_ends_as_one_with_a_failed_post(monkeypatch):
    """NCCL connects a pair inside the first group end that involves it, and that end fails where
    the peer died meanwhile: the error does not leave the schedule (zipccl.failure keeps every
    rank on it); the communicators are aborted and the group's operations, which never ran, raise
    when waited for, as a lost peer's do."""
    from zipccl.transport.cupy_nccl import NcclError
    events = []

    def group_end():
        events.append("group end")
        raise RuntimeError("NCCL error: remote process exited or there was a network error")

    t = _logged_transport(events, group_end)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    with t.grouped():
        posted = t.isend(torch.empty(8, device="meta"), 1)
    assert events[:3] == ["group start", "bulk posted", "group end"], events
    assert sorted(events[3:]) == ["bulk abort", "mail abort"], events
    assert t.comm is t.mail_comm is None
    with pytest.raises(NcclError, match="aborted"):
        t.wait(posted)


def test_a_look_at_nccls_errors_is_never_under_an_abort():
    """ncclCommAbort frees the communicator: a wait's look at its errors (``_check``, from
    another thread than the abort's) ends before the abort begins, and the next look finds it
    aborted."""
    from zipccl.transport.cupy_nccl import NcclError, NcclTransport
    inside, leave, events = threading.Event(), threading.Event(), []

    class Comm:
        def __init__(self, name):
            self.name = name

        def check_async_error(self):
            events.append(f"{self.name} asked")
            inside.set()
            leave.wait(5)
            events.append(f"{self.name} answered")

        def abort(self):
            events.append(f"{self.name} abort")

    t = object.__new__(NcclTransport)
    t.comm, t.mail_comm = Comm("bulk"), Comm("mail")
    checker = threading.Thread(target=t._check)
    checker.start()
    assert inside.wait(5)
    aborter = threading.Thread(target=t._abort)
    aborter.start()
    time.sleep(0.3)
    assert not any("abort" in e for e in events), events
    leave.set()
    checker.join(5)
    aborter.join(5)
    assert events[:4] == ["bulk asked", "bulk answered", "mail asked", "mail answered"], events
    assert sorted(events[4:]) == ["bulk abort", "mail abort"], events
    with pytest.raises(NcclError, match="aborted"):
        t._check()


def test_an_abort_from_another_thread_waits_for_the_open_group_to_end(monkeypatch):
    """NCCL's open group lists the communicators posted on, and its end uses them: an abort from
    another thread (a wait that ran out) comes after the group call of this one has ended, or,
    where that end itself waits on a dead peer, after GROUP_END_S, since only the abort ends it."""
    from zipccl.transport import cupy_nccl
    events, posted, leave, ending = [], threading.Event(), threading.Event(), threading.Event()

    def transport(group_end):
        return _logged_transport(events, group_end)

    def group(t, body_waits: bool):
        with t.grouped():
            t.isend(torch.empty(8, device="meta"), 1)
            posted.set()
            if body_waits:
                leave.wait(10)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(cupy_nccl.NcclTransport, "_landed", lambda self, works: None)
    t = transport(lambda: events.append("group end"))
    poster = threading.Thread(target=group, args=(t, True))
    poster.start()
    assert posted.wait(10)
    aborter = threading.Thread(target=t._abort)
    aborter.start()
    time.sleep(0.5)
    assert "bulk abort" not in events, events  # the group is still open
    leave.set()
    poster.join(10)
    aborter.join(10)
    assert events[:3] == ["group start", "bulk posted", "group end"], events
    assert sorted(events[3:]) == ["bulk abort", "mail abort"] and t.comm is None, events

    def stuck_end():  # as NCCL's, connecting to a dead peer: only the abort ends it
        ending.set()
        deadline = time.monotonic() + 10
        while "bulk abort" not in events and time.monotonic() < deadline:
            time.sleep(0.01)
        events.append("group end")

    monkeypatch.setattr(cupy_nccl, "GROUP_END_S", 0.3)
    events.clear()
    posted.clear()
    t = transport(stuck_end)
    poster = threading.Thread(target=group, args=(t, False))
    poster.start()
    assert ending.wait(10)
    started = time.monotonic()
    t._abort()
    assert 0.25 < time.monotonic() - started < 5 and "bulk abort" in events, events
    poster.join(10)
    # the abort's threads (bulk, mail) run at once: the group's end may come before the mail's abort
    assert "group end" in events and not poster.is_alive(), events


def test_a_status_round_that_gives_up_aborts_the_levels_it_waited_for():
    """The status round's mails wait for the call's levels (``fence``): where a mail never comes,
    the transport aborts those levels with itself, at once, since its abort waits for their
    kernels pending on the dead peer; once the round is over (``unfence``), a later failure
    aborts the transport alone."""
    from zipccl.transport.cupy_nccl import NcclError, NcclTransport
    called, made = {}, []

    def transport(name: str, kernels: tuple = ()):
        t = object.__new__(NcclTransport)
        t.comm, t.mail_comm = _Held(f"{name} bulk", called, kernels), _Held(f"{name} mail", called)
        t.rank, t._ranks, t.stream = 0, [0, 1], f"{name}'s stream"
        t.mail_stream = types.SimpleNamespace(wait_stream=lambda stream: None)
        made.append(t)
        return t

    group, level = transport("group", kernels=("level bulk",)), transport("level")
    group.fence(group, level)
    assert isinstance(group._fail(TimeoutError("no progress")), NcclError)
    assert "held" not in called and group.comm is level.comm is level.mail_comm is None, called
    alone, other = transport("alone"), transport("other")
    alone.fence(alone, other)
    alone.unfence()  # that call's round is over (zipccl.failure.Fate.settle)
    alone._fail(TimeoutError("no progress"))
    assert alone.comm is None and other.comm is not None
