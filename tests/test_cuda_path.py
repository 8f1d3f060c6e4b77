"""The CUDA path's decisions, on a machine without a GPU: which transport each (device, group
backend, ZIPCCL_TRANSPORT, GPU extra) gets, which combinations are refused and how, where
codec "native" runs, that no CPU tensor is sent on an NCCL group (the pipeline's messages are
staged onto the group's device, and strict mode checks every message's device), the
hierarchical levels on CUDA, the drop-in's routing, the lossy path's devices and the planner's
clock. Where a device is needed, ``meta`` stands for the GPU: a tensor there has a device other
than the CPU and no data; the expected values are written out."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

import zipccl
from zipccl import api, auto, backend, config, hierarchical, lossy, p2p, topology
from zipccl import collectives as C
from zipccl.codecs import Raw
from zipccl.collectives import autoplan, metadata, sparse_reduce, validation
from zipccl.collectives.links import PLAIN
from zipccl.collectives.resolve import NATIVE
from zipccl.errors import RankFailure, UnsupportedError, ZipcclError
from zipccl.failure import Fate
from zipccl.transport import NcclTransport, TorchTransport, cupy_nccl, select, torch_dist
from zipccl.transport.strict import HEADER as STRICT_HEADER, Strict, TransportRuleError

META = torch.device("meta")

# ---- transport selection: the table --------------------------------------------------------------------------

#: (device, group backend, ZIPCCL_TRANSPORT, GPU extra installed) -> transport, or the error's text.
TABLE = {
    # CPU tensors, and calls without a tensor: torch.distributed, whatever else holds
    **{("cpu", b, s, e): "torch" for b in ("nccl", "zipccl", "gloo") for s in ("auto", "nccl", "torch")
       for e in (True, False)},
    **{(None, b, s, e): "torch" for b in ("nccl", "zipccl", "gloo") for s in ("auto", "nccl", "torch")
       for e in (True, False)},
    # CUDA tensors, default setting: NCCL whatever the group's backend, where the extra is there
    ("cuda", "nccl", "auto", True): "nccl",
    ("cuda", "zipccl", "auto", True): "nccl",
    ("cuda", "gloo", "auto", True): "nccl",
    ("cuda", "nccl", "auto", False): "torch",  # torch's own NCCL group carries it all
    ("cuda", "zipccl", "auto", False): "install",
    ("cuda", "gloo", "auto", False): "install",
    # ZIPCCL_TRANSPORT=nccl: NCCL, and NCCL's own error where it cannot load
    ("cuda", "nccl", "nccl", True): "nccl",
    ("cuda", "zipccl", "nccl", True): "nccl",
    ("cuda", "gloo", "nccl", True): "nccl",
    ("cuda", "nccl", "nccl", False): "nccl",
    ("cuda", "zipccl", "nccl", False): "nccl",
    ("cuda", "gloo", "nccl", False): "nccl",
    # ZIPCCL_TRANSPORT=torch: only an nccl group's torch backend carries CUDA tensors
    ("cuda", "nccl", "torch", True): "torch",
    ("cuda", "nccl", "torch", False): "torch",
    ("cuda", "zipccl", "torch", True): "torch-only-nccl",
    ("cuda", "zipccl", "torch", False): "torch-only-nccl",
    ("cuda", "gloo", "torch", True): "torch-only-nccl",
    ("cuda", "gloo", "torch", False): "torch-only-nccl",
}
ERRORS = {"install": r"CUDA tensors on a group of backend '\w+' need zipccl's NCCL transport.*"
                     r"pip install 'zipccl\[cuda12\]'",
          "torch-only-nccl": r"ZIPCCL_TRANSPORT=torch carries CUDA tensors only on a group whose backend is nccl; "
                             r"this group's is '\w+'.*pip install 'zipccl\[cuda12\]'"}


def test_table_covers_every_case():
    assert len(TABLE) == 3 * 3 * 3 * 2


@pytest.mark.parametrize("case", sorted(TABLE, key=str), ids=str)
def test_transport_choice(case):
    expected = TABLE[case]
    if expected in ERRORS:
        with pytest.raises(UnsupportedError, match=ERRORS[expected]):
            select.choose(*case)
    else:
        assert select.choose(*case) == expected


@pytest.fixture
def routed(monkeypatch):
    """transport_for with the group's backend, the extra and both transports' ``of`` faked:
    returns a function (backend, setting, extra, device) -> the name of what it made."""
    made = []

    def setup(backend_name, setting, extra, nccl_fails=False):
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend_name)
        monkeypatch.setattr(config, "TRANSPORT", setting)
        monkeypatch.setattr(select.nccl_stack, "extra_installed", lambda: extra)
        monkeypatch.setattr(select, "_refused", {})

        def nccl_of(group=None):
            made.append("nccl")
            if nccl_fails == "lost":
                raise RankFailure("rank 3 did not join (test)", 3, "lost", True)
            if nccl_fails:
                raise ZipcclError("no communicator (test)")
            return "NcclTransport"
        def pair_of(group, src, dst):
            made.append("pair")
            if nccl_fails:
                raise ZipcclError("no communicator (test)")
            return f"NcclPair {src}>{dst}"
        monkeypatch.setattr(NcclTransport, "of", staticmethod(nccl_of))
        monkeypatch.setattr(select.NcclPair, "of", staticmethod(pair_of))
        monkeypatch.setattr(TorchTransport, "of", staticmethod(lambda group=None, messages=False: made.append(
            "torch messages" if messages else "torch") or "TorchTransport"))
        return made
    return setup


@pytest.mark.parametrize("backend_name,setting,extra,device,expected", [
    ("nccl", "auto", True, "cuda", "NcclTransport"),
    ("zipccl", "auto", True, "cuda", "NcclTransport"),
    ("gloo", "auto", True, "cuda", "NcclTransport"),
    ("nccl", "auto", False, "cuda", "TorchTransport"),
    ("nccl", "torch", True, "cuda", "TorchTransport"),
    ("nccl", "nccl", False, "cuda", "NcclTransport"),
    ("nccl", "auto", True, "cpu", "TorchTransport"),
    ("zipccl", "auto", True, "cpu", "TorchTransport"),
])
def test_transport_for_follows_the_table(routed, backend_name, setting, extra, device, expected):
    """A collective's transport is the group's; a point-to-point direction's (``pair``) is made by
    its two ranks alone: on CPU the group's TorchTransport for messages, which has no second gloo
    group (made by the whole job); on CUDA NcclPair where the group's would be NcclTransport, and
    nothing where it would be torch's NCCL (one stream for both directions of a pair: framed
    messages both ways would block each other): an error saying so, which auto avoids."""
    made = routed(backend_name, setting, extra)
    assert select.transport_for(None, torch.device(device)) == expected
    assert made == [expected.removesuffix("Transport").lower()]
    made.clear()
    if device == "cpu":
        assert select.transport_for(None, torch.device(device), pair=(2, 1)) == "TorchTransport"
        assert made == ["torch messages"] and select.frames_messages(None, torch.device(device))
    elif expected == "NcclTransport":
        assert select.transport_for(None, torch.device(device), pair=(2, 1)) == "NcclPair 2>1"
        assert made == ["pair"] and select.frames_messages(None, torch.device(device))
    else:
        with pytest.raises(UnsupportedError, match="block each other; use codec='native'"):
            select.transport_for(None, torch.device(device), pair=(2, 1))
        assert made == [] and not select.frames_messages(None, torch.device(device))


def test_transport_for_refuses_what_nothing_carries(routed):
    made = routed("zipccl", "auto", False)
    with pytest.raises(UnsupportedError, match=r"pip install 'zipccl\[cuda12\]'"):
        select.transport_for(None, torch.device("cuda"))
    assert made == []  # nothing made, nothing sent: the same error on every rank, at once


def test_a_failed_communicator_falls_back_only_on_nccl_groups(routed):
    made = routed("nccl", "auto", True, nccl_fails=True)
    with pytest.warns(RuntimeWarning, match="go through torch.distributed"):
        assert select.transport_for(None, torch.device("cuda")) == "TorchTransport"
    assert made == ["nccl", "torch"]
    assert select.transport_for(None, torch.device("cuda")) == "TorchTransport"  # not asked again
    assert made == ["nccl", "torch", "torch"]
    made.clear()
    with pytest.raises(ZipcclError, match="no communicator"):  # a pair's: no fallback (see the table's test)
        select.transport_for(None, torch.device("cuda"), pair=(0, 1))
    assert made == ["pair"]
    for backend_name in ("zipccl", "gloo"):  # no torch backend there carries CUDA tensors: NCCL's error
        made = routed(backend_name, "auto", True, nccl_fails=True)
        made.clear()
        with pytest.raises(ZipcclError, match="no communicator"):
            select.transport_for(None, torch.device("cuda"))
        assert made == ["nccl"]


def test_a_rank_that_never_joins_the_communicator_is_no_reason_to_fall_back(routed):
    """Where a rank never joined NCCL's communicators (RankFailure, broken), the group is broken,
    not without NCCL: the error is raised, nothing falls back to torch's NCCL and nothing is kept."""
    made = routed("nccl", "auto", True, nccl_fails="lost")
    for _ in range(2):
        with pytest.raises(RankFailure, match="rank 3 did not join") as e:
            select.transport_for(None, torch.device("cuda"))
        assert e.value.rank == 3 and e.value.broken
    assert made == ["nccl", "nccl"] and select._refused == {}


# ---- codec "native" on CUDA: the group's own collective, no communicator of CuPy -------------------------------

def test_nccl_transport_hands_native_to_the_group(monkeypatch):
    """What the caller gets from codec "native" through an NcclTransport is the group's own
    collective's result (never one on zipccl's communicators): here a stand-in group of two ranks
    whose peer holds 10, 20, 30, 40."""
    peer = torch.tensor([10.0, 20.0, 30.0, 40.0])

    def native(name, *tensors, op=None):
        if name == "all_reduce":
            assert op == dist.ReduceOp.SUM
            tensors[0].add_(peer)
        else:  # all_gather(output, input): rank 0's input, then the peer's
            tensors[0].copy_(torch.cat([tensors[1], peer]))
    groups = {"the group": types.SimpleNamespace(native=native)}
    monkeypatch.setattr(TorchTransport, "of", staticmethod(lambda group=None: groups[group]))
    t = object.__new__(NcclTransport)  # no communicator: the group's collective must not need one
    t.group = "the group"
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    gathered = torch.zeros(8)
    t.native("all_gather", gathered, x)
    t.native("all_reduce", x, op=dist.ReduceOp.SUM)
    assert gathered.tolist() == [1, 2, 3, 4, 10, 20, 30, 40] and x.tolist() == [11, 22, 33, 44]


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on cuda:0: what zipccl's routing reads of a CUDA tensor."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):
        return True


def _on_gpu(numel: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype).as_subclass(_OnGpu)


class _Made(Exception):
    """Raised where the stand-in makes an NcclTransport: the call stops there."""


class _DropInGroup:
    """A stand-in process group whose backend under the drop-in records the calls made on it."""

    def __init__(self, seen):
        group = self

        class Underneath:
            def allreduce(self, tensors, opts):
                seen.append(("all_reduce", group, tensors[0], opts.reduceOp))
                return _Work()

            def _reduce_scatter_base(self, out, inp, opts):
                seen.append(("reduce_scatter", group, inp, opts.reduceOp))
                return _Work()

            def _allgather_base(self, out, inp, opts):
                seen.append(("all_gather", group, inp, None))
                return _Work()
        self.underneath = Underneath()

    def _get_backend(self, device):
        return self.underneath


@pytest.fixture(params=["nccl", "zipccl"])
def gpu_group(request, monkeypatch):
    """A group of four ranks of backend nccl (or the drop-in's) seen from rank 0, with the GPU
    extra installed: the group's own collectives (torch.distributed's, faked) write down
    (collective, group, tensor, op); making an NcclTransport (CuPy's communicators) writes
    "communicator" down and fails, as it would on this machine. Under the drop-in ("zipccl") the
    group's own collectives are those of the backend under it (``_get_backend``), faked alike."""
    seen = []
    group = _DropInGroup(seen)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: request.param)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group=None: [0, 1, 2, 3])
    monkeypatch.setattr(config, "STRICT_TRANSPORT", False)
    monkeypatch.setattr(config, "TIMEOUT", None)
    monkeypatch.setattr(config, "TRANSPORT", "auto")
    monkeypatch.setattr(torch_dist, "_twin", lambda group: None)
    monkeypatch.setattr(torch_dist, "wire_device", lambda b: torch.device("cuda", 0) if b == "nccl"
                        else torch.device("cpu"))
    monkeypatch.setattr(select.nccl_stack, "extra_installed", lambda: True)
    monkeypatch.setattr(torch_dist, "_transports", {})
    monkeypatch.setattr(api, "_routes", {})
    monkeypatch.setattr(dist, "all_reduce", lambda x, op=None, group=None, async_op=False:
                        seen.append(("all_reduce", group, x, op)))
    monkeypatch.setattr(torch_dist, "reduce_scatter_single", lambda out, inp, op=None, group=None, async_op=False:
                        seen.append(("reduce_scatter", group, inp, op)))
    monkeypatch.setattr(torch_dist, "all_gather_single", lambda out, inp, group=None, async_op=False:
                        seen.append(("all_gather", group, inp, None)))

    def communicator(group=None):
        seen.append("communicator")
        raise _Made("a communicator is being made")
    monkeypatch.setattr(NcclTransport, "of", staticmethod(communicator))
    monkeypatch.setattr(topology, "known", lambda group=None: True)
    monkeypatch.setattr(topology, "publish_node", lambda: None)  # a stand-in world has no store
    monkeypatch.setattr(topology, "levels", lambda group=None: None)
    monkeypatch.setattr(topology, "topology", lambda group=None: topology.Topology(((0, 1, 2, 3),), "test", "nvlink"))
    return group, seen


def test_native_traffic_on_cuda_is_the_groups_own_and_makes_no_communicator(gpu_group):
    """Every call that does not compress (auto below its probe floor, auto over NVLink inside one
    node, codec "native" at any size, flat or async) reaches the group's own collective with the
    caller's tensor, and no NcclTransport is made; the first plan that compresses makes it."""
    group, seen = gpu_group
    one, big, four = _on_gpu(1), _on_gpu(1 << 21), _on_gpu(4)  # 2 bytes, 4 MiB
    zipccl_calls = [
        (one, lambda: zipccl.all_reduce(one, group=group)),
        (one, lambda: zipccl.all_reduce(one, group=group, algorithm="flat")),
        (big, lambda: zipccl.all_reduce(big, group=group)),                  # auto: NVLink, one node
        (big, lambda: zipccl.all_reduce(big, group=group, codec="native")),
        (one, lambda: zipccl.all_reduce(one, group=group, async_op=True).wait(timeout=30)),
        (big, lambda: zipccl.all_reduce(big, group=group, async_op=True).wait(timeout=30)),
        (four, lambda: zipccl.reduce_scatter(one, four, group=group)),
        (one, lambda: zipccl.all_gather(four, one, group=group, codec="native")),
    ]
    for k, (input, call) in enumerate(zipccl_calls):
        call()
        assert len(seen) == k + 1 and seen[-1][1] is group, (k, seen)
        assert seen[-1][2].data_ptr() == input.data_ptr()  # the caller's tensor, as it is
    assert [s[0] for s in seen] == ["all_reduce"] * 6 + ["reduce_scatter", "all_gather"]
    with pytest.raises(_Made):
        zipccl.all_reduce(big, group=group, codec="lossless")
    assert seen[-1] == "communicator"


def test_all_to_all_on_cuda_is_checked_on_the_group_and_compresses_on_a_communicator(gpu_group, monkeypatch):
    """zipccl.all_to_all_single on CUDA tensors: auto on one node and codec "native" (async, so
    through zipccl's queue and checks) reach the group's own all-to-all with the caller's tensors
    and make no communicator; a lossless call makes one, in the call."""
    group, seen = gpu_group
    monkeypatch.setattr(zipccl.alltoall, "underneath", lambda group, device: None)
    monkeypatch.setattr(zipccl.alltoall, "direct_group", lambda group: None)

    def all_to_all_single(out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
        seen.append(("all_to_all", group, inp, None))
        return _Work()
    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    out, x = _on_gpu(8), _on_gpu(8)
    zipccl.all_to_all_single(out, x, group=group)
    zipccl.all_to_all_single(out, x, group=group, codec="native", async_op=True).wait(timeout=30)
    assert [s[0] for s in seen] == ["all_to_all"] * 2 and all(s[1] is group and s[2] is x for s in seen), seen
    with pytest.raises(_Made):
        zipccl.all_to_all_single(out, x, group=group, codec="lossless")
    assert seen[-1] == "communicator"


def test_all_to_all_auto_where_nothing_carries_packets_is_the_backends(gpu_group, monkeypatch):
    """Across nodes, auto on CUDA tensors of a gloo group without the GPU extra (nothing can
    carry zipccl's packets) is the backend's all-to-all, as auto's collectives are; an explicit
    codec raises the install hint."""
    group, seen = gpu_group
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(select.nccl_stack, "extra_installed", lambda: False)
    monkeypatch.setattr(topology, "topology", lambda group=None: topology.Topology(((0, 1), (2, 3)), "test", "pcie"))
    monkeypatch.setattr(zipccl.alltoall, "underneath", lambda group, device: None)
    monkeypatch.setattr(zipccl.alltoall, "direct_group", lambda group: None)
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, inp, out_splits=None, in_splits=None, group=None,
                        async_op=False: seen.append(("all_to_all", group, inp, None)) or _Work())
    out, x = _on_gpu(1 << 20), _on_gpu(1 << 20)
    zipccl.all_to_all_single(out, x, group=group)
    assert [s[0] for s in seen] == ["all_to_all"] and seen[0][2] is x, seen
    with pytest.raises(UnsupportedError, match=r"pip install 'zipccl\[cuda12\]'"):
        zipccl.all_to_all_single(out, x, group=group, codec="lossless")


def test_auto_over_a_slower_link_makes_the_communicator_for_its_compressing_plan(gpu_group, monkeypatch):
    """Where auto may compress (PCIe: native and lossless), its native plan makes nothing; the
    communicator comes with the first lossless plan, in the call that runs it."""
    group, seen = gpu_group
    monkeypatch.setattr(topology, "topology", lambda group=None: topology.Topology(((0, 1, 2, 3),), "test", "pcie"))
    big = _on_gpu(1 << 21)
    _Device(monkeypatch)  # the planner's timing events
    zipccl.all_reduce(big, group=group)  # auto's first try: native
    assert [s[0] for s in seen] == ["all_reduce"]
    with pytest.raises(_Made):
        zipccl.all_reduce(big, group=group)  # its second: lossless
    assert seen[-1] == "communicator"


@pytest.mark.parametrize("backend, extra, codec, want", [
    ("gloo", True, "auto", "plain"),          # gloo cannot carry it: the bytes framed on zipccl's NCCL pair
    ("gloo", True, "raw", "plain"),
    ("gloo", True, "native", "refused"),
    ("gloo", False, "auto", "refused"),       # and without the GPU extra nothing can
    ("gloo", True, {"intra": "native", "inter": "lossless"}, "refused"),
    ("nccl", True, "auto", "native"),         # NCCL's own send and receive
    ("nccl", False, "native", "native"),
    ("zipccl", True, "auto", "plain"),        # the drop-in's: torch hands it a batch's messages one at a time
    ("zipccl", False, "auto", "native"),      # nothing else can carry them (USAGE.md: the drop-in's limits)
    ("zipccl", True, "native", "native"),
])
def test_point_to_point_of_cuda_tensors_never_goes_to_gloo(monkeypatch, backend, extra, codec, want):
    """A send or receive of a CUDA tensor on a gloo group is never gloo's own (which would read
    device memory as the host's): "auto" frames its bytes on zipccl's NCCL transport, "native"
    is refused with a clear error; on an NCCL group "auto" is NCCL's own (same node, 2 MiB). On
    the drop-in's group (NCCL underneath for CUDA), whose batch torch hands over a message at a
    time, "auto" frames them too, where it can: issued singly on NCCL, two ranks that each
    receive before they send would wait for good."""
    class ProcessGroupNCCL:  # what the drop-in's group has underneath for CUDA tensors
        supports_coalescing = True

    group = types.SimpleNamespace(_get_backend=lambda device: ProcessGroupNCCL()) if backend == "zipccl" else None
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(select.nccl_stack, "extra_installed", lambda: extra)
    monkeypatch.setattr(config, "TRANSPORT", "auto")
    monkeypatch.setattr(topology, "same_node", lambda group, peer: True)
    x = _on_gpu(1 << 20)
    if want == "refused":
        with pytest.raises(UnsupportedError, match=r"cannot send or receive tensors on cuda:0|NCCL transport"):
            p2p._decide(codec, x, group, 1)
    else:
        assert p2p._decide(codec, x, group, 1) is {"plain": PLAIN, "native": NATIVE}[want]
    if backend == "zipccl":  # an integer tensor (the drop-in's ``_message``: "auto") the same way
        assert p2p._decide(codec, _on_gpu(1 << 19, torch.int32), group, 1) is {"plain": PLAIN, "native": NATIVE}[want]


def _batch_stand_ins(monkeypatch, backend: str, batches: bool):
    """torch.distributed's ranks, groups and P2POp for a batch of rank 0's with peer 1, the
    backend ``backend`` (batching where ``batches``); the work every post returns."""
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_group_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(topology, "publish_node", lambda: None)
    monkeypatch.setattr(topology, "same_node", lambda group, peer: True)
    monkeypatch.setattr(p2p, "underneath", lambda group, device: None)
    monkeypatch.setattr(p2p, "_batches", lambda group, device: batches)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, group=None, tag=0, group_peer=None: types.SimpleNamespace(
        op=op, group=group, group_peer=group_peer))  # torch's checks the group is registered
    return types.SimpleNamespace(wait=lambda timeout=None: True, is_completed=lambda: True)


@pytest.mark.parametrize("backend, batches, ops", [
    ("nccl", True, ("recv", "send")), ("nccl", True, ("send",)), ("nccl", True, ("recv", "send", "other send")),
    ("nccl", True, ("other send", "recv", "send")), ("gloo", False, ("recv", "send")),
    ("zipccl", True, ("recv", "send"))])
def test_a_batchs_native_messages_are_one_batch_where_the_backend_batches(monkeypatch, backend, batches, ops):
    """Issued one by one on NCCL, a rank's receive and send to one peer queue on one stream (two
    ranks that each receive first wait for good), and a message issued alone never matches one
    batched by the peer (torch runs them on different communicators): where the backend batches,
    a batch's native messages, even one, go in one ``dist.batch_isend_irecv`` per group, each
    handle its batch's work (NCCL's coalesced one), the groups' batches in the order of their
    names, which every rank shares, not the list's; on gloo, and on the drop-in's group (whose
    batch would come back to zipccl), one by one, receives first."""
    group, other, calls = types.SimpleNamespace(group_name="1"), types.SimpleNamespace(group_name="2"), []
    work = _batch_stand_ins(monkeypatch, backend, batches)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: calls.append(
        [("send" if o.op is dist.isend else "recv", o.group is group, o.group_peer) for o in ops]) or [work])
    monkeypatch.setattr(p2p, "_native_send", lambda op: calls.append(("send", op.peer)) or work)
    monkeypatch.setattr(p2p, "_native_recv", lambda op: calls.append(("recv", op.peer)) or work)
    make = {"recv": lambda: zipccl.P2POp(zipccl.irecv, torch.zeros(4), 1, group=group),
            "send": lambda: zipccl.P2POp(zipccl.isend, torch.ones(4), 1, group=group),
            "other send": lambda: zipccl.P2POp(zipccl.isend, torch.ones(4), 1, group=other)}
    handles = zipccl.batch_isend_irecv([make[kind]() for kind in ops])
    if backend == "nccl":
        mine = [(kind, True, 1) for kind in ops if kind != "other send"]
        assert calls == [mine] + [[("send", False, 1)]] * ("other send" in ops), calls
    else:
        assert calls == [(kind, 1) for kind in ops], calls
    assert len(handles) == len(ops) and all(h is work for h in handles)


def test_no_native_post_joins_a_batchs_coalescing_window(monkeypatch):
    """torch's coalescing window (``dist.batch_isend_irecv`` on NCCL) is its process group's, not
    its thread's: a native receive that zipccl's async thread posted to the group meanwhile would
    join the batch, on this rank alone. Such a post waits until the batch is issued."""
    group = types.SimpleNamespace(group_name="1")
    work = _batch_stand_ins(monkeypatch, "nccl", True)
    window, posted, opened = [], [], threading.Event()

    def batch(ops):
        start = time.monotonic()
        opened.set()
        time.sleep(0.3)
        window.append((start, time.monotonic()))
        return [work]

    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(dist, "irecv", lambda tensor, group=None, group_src=None, tag=0: posted.append(
        time.monotonic()) or work)
    receive = types.SimpleNamespace(group=group, tensor=torch.zeros(4), peer=1, tag=0)
    thread = threading.Thread(target=lambda: (opened.wait(5), p2p._native_recv(receive)))  # inside the window
    thread.start()
    zipccl.batch_isend_irecv([zipccl.P2POp(zipccl.isend, torch.ones(4), 1, group=group, codec="native")])
    thread.join(5)
    (start, end), (at,) = window[0], posted
    assert not start <= at < end, (start, at, end)


def test_a_post_waits_for_another_at_most_a_bound(monkeypatch):
    """A post waits for another thread's only while that one posts (microseconds); a first use, in
    which NCCL makes a communicator and waits for the peers, holds the others at most POSTING_S,
    so that two first uses never wait for each other through zipccl."""
    monkeypatch.setattr(p2p, "POSTING_S", 0.2)
    with p2p._posting_window():  # another thread's post, held in NCCL's making
        start = time.monotonic()
        with p2p._posting_window():
            waited = time.monotonic() - start
    assert 0.2 <= waited < 2, waited


# ---- no CPU tensor on an NCCL group ----------------------------------------------------------------------------

def test_strict_mode_rejects_a_message_off_the_groups_device():
    posted = []

    def post(x, peer):
        posted.append((x.device.type, x.dtype, x.numel()))
        return None

    s = Strict(0, META)
    with s.grouped():
        s.send(post, torch.zeros(8, dtype=torch.uint8, device=META), 1, 3)
        s.recv(post, torch.empty(2, dtype=torch.int64, device=META), 1, 3)
        with pytest.raises(TransportRuleError, match=r"a tensor on cpu, but this group carries tensors on meta"):
            s.send(post, torch.zeros(8, dtype=torch.uint8), 1, 3)
    # each message behind its header, the headers on the group's device too
    assert posted == [("meta", torch.int64, STRICT_HEADER), ("meta", torch.uint8, 8), ("meta", torch.int64, STRICT_HEADER),
                      ("meta", torch.int64, 2)]
    gloo = Strict(0)  # gloo: the CPU, and a CUDA-like tensor is refused alike
    with gloo.grouped(), pytest.raises(TransportRuleError, match="a tensor on meta, but this group carries tensors "
                                                                 "on cpu"):
        gloo.send(post, torch.zeros(8, dtype=torch.uint8, device=META), 1, 0)


class _Work:
    def wait(self, timeout=None):
        return True


@pytest.fixture(params=[True, False], ids=["strict", "plain"])
def nccl_group(request, monkeypatch):
    """A TorchTransport on a fake group of two ranks whose backend is nccl, ``meta`` standing for
    its GPU: every tensor handed to torch.distributed is recorded as (call, device, dtype, numel)."""
    sent = []
    monkeypatch.setattr(config, "STRICT_TRANSPORT", request.param)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group=None: [0, 1])
    monkeypatch.setattr(torch_dist, "wire_device", lambda b: META if b == "nccl" else torch.device("cpu"))
    for name in ("isend", "irecv"):
        monkeypatch.setattr(dist, name, lambda x, *a, _n=name, **k: sent.append((_n, x.device.type, x.dtype,
                                                                                x.numel())) or _Work())
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, **k: types.SimpleNamespace(op=op, tensor=tensor, **k))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [  # what torch's NCCL takes as one group
        sent.append((op.op.__name__, op.tensor.device.type, op.tensor.dtype, op.tensor.numel())) or _Work()
        for op in ops])
    t = TorchTransport(object())
    assert t.meta_device == META and (t.strict is not None) == request.param
    return t, sent, request.param


def _expected(strict: bool, *messages):
    """The recorded calls of ``messages`` ((call, numel) of int64 tensors), each behind its strict header."""
    out = []
    for name, numel in messages:
        out += ([(name, "meta", torch.int64, STRICT_HEADER)] if strict else []) + [(name, "meta", torch.int64, numel)]
    return out


def test_metadata_exchange_sends_no_cpu_tensor_on_nccl(nccl_group):
    t, sent, strict = nccl_group
    fate = Fate.of("all_reduce", t)
    metadata.Call("all_reduce", torch.bfloat16, 1000, dist.ReduceOp.SUM, Raw()).start(t, [10, 12], None, fate)
    row = 1 + 7 + 2 * autoplan.REPORT_SLOTS + 2  # status, signature (7 fields), auto reports, sizes
    assert sent == _expected(strict, ("isend", row), ("irecv", row))


def test_size_mails_and_status_round_send_no_cpu_tensor_on_nccl(nccl_group):
    t, sent, strict = nccl_group
    fate, acc = Fate.of("all_reduce", t), C.new_acc()
    mail = metadata._SizeMail(t, [5, 7], metadata._TAG_AG_SIZES, acc, fate)
    assert isinstance(mail.recvs[1], torch_dist._Staged) and mail.recvs[1].host.device.type == "cpu"
    assert mail.recvs[1].wire.device == META  # received on the device, copied to the host when waited for
    assert sent == _expected(strict, ("isend", 1), ("irecv", 1))
    sent.clear()
    t.wait = lambda work, timeout=None: None  # a meta tensor has no data to copy back
    fate.settle(t)
    assert sent == _expected(strict, ("isend", 1), ("irecv", 1))


def test_a_device_message_is_sent_as_it_is(nccl_group):
    t, sent, strict = nccl_group
    payload = torch.zeros(16, dtype=torch.uint8, device=META)
    with t.grouped():
        t.isend(payload, 1)
        work = t.irecv(payload, 1)
    assert not isinstance(work, torch_dist._Staged)
    header = [("meta", torch.int64, STRICT_HEADER)] if strict else []
    assert [s[1:] for s in sent] == header + [("meta", torch.uint8, 16)] + header + [("meta", torch.uint8, 16)]


def test_a_call_on_the_wrong_device_for_its_group_is_refused():
    t = object.__new__(TorchTransport)
    t.backend, t.meta_device = "nccl", torch.device("cuda", 0)
    with pytest.raises(UnsupportedError, match=r"backend \(nccl\) takes CUDA tensors here, got a tensor on cpu"):
        validation._check_device(t, torch.zeros(4))
    t.backend, t.meta_device = "gloo", torch.device("cpu")
    with pytest.raises(UnsupportedError, match=r"backend \(gloo\) takes CPU tensors here, got a tensor on meta"):
        validation._check_device(t, torch.zeros(4, device=META))
    validation._check_device(t, torch.zeros(4))
    validation._check_device(t, _on_gpu(4))  # CUDA tensors: the group's own collective, or zipccl's NCCL


def test_a_plan_runs_on_the_groups_own_transport_unless_it_compresses(monkeypatch):
    """collectives.carrier: the group itself (TorchTransport) for native plans and the backend's
    collective after an exchange (None), on every device; transport_for's (on CUDA the NCCL
    transport) only for a codec that compresses on CUDA."""
    monkeypatch.setattr(validation.TorchTransport, "of", staticmethod(lambda group=None: ("own", group)))
    monkeypatch.setattr(validation, "transport_for", lambda group, device: ("carrier", group, device.type))
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert validation.carrier("g", cuda, C.NATIVE) == ("own", "g")
    assert validation.carrier("g", cuda, None) == ("own", "g")
    assert validation.carrier("g", cpu, Raw()) == ("own", "g")
    assert validation.carrier("g", cuda, Raw()) == ("carrier", "g", "cuda")
    assert validation.carrier("g", None, Raw()) == ("own", "g")


# ---- hierarchical on CUDA: NCCL's collective inside the node, no host shared memory --------------------------

def test_shared_memory_only_off_nccl(monkeypatch):
    monkeypatch.setattr(config, "SHM", True)
    assert [topology.shares_memory(b) for b in ("nccl", "zipccl", "gloo")] == [False, True, True]
    monkeypatch.setattr(config, "SHM", False)
    assert [topology.shares_memory(b) for b in ("nccl", "zipccl", "gloo")] == [False, False, False]


def test_auto_intra_level_is_native_on_cuda():
    with_memory, without = types.SimpleNamespace(memory=types.SimpleNamespace(failed=False)), \
        types.SimpleNamespace(memory=None)
    assert api._intra(with_memory, torch.device("cpu")) is hierarchical.SHM
    assert api._intra(with_memory, torch.device("cuda", 0)) is C.NATIVE
    failed = types.SimpleNamespace(memory=types.SimpleNamespace(failed=True))  # its area could not grow once
    assert api._intra(failed, torch.device("cpu")) is C.NATIVE
    assert api._intra(without, torch.device("cpu")) is C.NATIVE
    assert api._intra(without, torch.device("cuda", 0)) is C.NATIVE


def _levels():
    topo = types.SimpleNamespace(nodes=[[0, 1], [2, 3]], local_size=2)
    return types.SimpleNamespace(topology=topo, intra="intra group", inter="inter group", memory=object(),
                                 local_rank=0, node=0)


def test_hierarchical_refuses_shared_memory_for_device_tensors(monkeypatch):
    monkeypatch.setattr(C, "carrier", lambda g, d, c: pytest.fail("no transport before the check"))
    x = torch.zeros(16, device=META)
    with pytest.raises(UnsupportedError, match=r"'shm' \(host shared memory\) takes CPU tensors, not tensors on meta"):
        hierarchical.run("all_reduce", _levels(), x, x, dist.ReduceOp.SUM, (hierarchical.SHM, C.NATIVE), C.new_acc(),
                         Fate("all_reduce", 0))


def test_hierarchical_levels_take_their_codecs_carriers(monkeypatch):
    asked = []
    monkeypatch.setattr(C, "carrier", lambda g, d, c: asked.append((g, d, c)) or g)
    lossless = C.PLAN_CODECS["lossless"]
    assert hierarchical._transports(_levels(), META, (C.NATIVE, lossless)) == ("intra group", "inter group")
    assert asked == [("intra group", META, C.NATIVE), ("inter group", META, lossless)]
    asked.clear()
    hierarchical._transports(_levels(), META, (hierarchical.SHM, lossless))
    assert asked[0] == ("intra group", META, None)  # shared memory: the node's group itself


# ---- the drop-in backend's routing ----------------------------------------------------------------------------

@pytest.mark.parametrize("extra,setting", [(True, "auto"), (False, "auto"), (True, "torch")])
def test_point_to_point_frames_cuda_messages_only_on_zipccls_nccl(monkeypatch, extra, setting):
    """Across nodes auto frames a 4 MiB CUDA message losslessly where each direction gets its
    NcclPair, and otherwise sends it natively; an explicit codec there is refused at the call,
    on both ends alike, naming what to install or "native"."""
    from zipccl import p2p
    from zipccl.codecs import Lossless
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(select.nccl_stack, "extra_installed", lambda: extra)
    monkeypatch.setattr(config, "TRANSPORT", setting)
    monkeypatch.setattr(topology, "same_node", lambda group, peer: False)
    x = _on_gpu(1 << 21)
    framed = extra and setting == "auto"
    assert isinstance(p2p._decide("auto", x, None, 1), Lossless) if framed else p2p._decide("auto", x, None, 1) is C.NATIVE
    for codec in ("lossless", "raw"):
        if framed:
            assert p2p._decide(codec, x, None, 1) is not C.NATIVE
        else:
            with pytest.raises(UnsupportedError, match="use codec='native'"):
                p2p._decide(codec, x, None, 1)
    assert p2p._decide("native", x, None, 1) is C.NATIVE


def test_drop_in_takes_cuda_tensors_unless_transport_torch():
    # (device, ZIPCCL_TRANSPORT, GPU extra installed) -> zipccl takes the call
    cases = {("cpu", "auto", False): True, ("cpu", "torch", False): True, ("cpu", "nccl", True): True,
             ("cuda", "auto", True): True, ("cuda", "nccl", True): True, ("cuda", "torch", True): False,
             ("cuda", "auto", False): False,  # no extra: torch's NCCL underneath carries it, uncompressed
             ("cuda", "nccl", False): True,   # asked for explicitly: the transport raises, naming the extra
             ("meta", "auto", True): False, ("mps", "auto", True): False}
    with pytest.warns(UserWarning, match="uncompressed"):
        assert {k: backend.takes_device(*k) for k in cases} == cases


def test_drop_in_routing_asks_takes_device(monkeypatch):
    takes = backend.ProcessGroupZipccl._takes  # the decision alone: a group needs a store and ranks
    pg = types.SimpleNamespace(codec="auto")
    x = torch.zeros(8, dtype=torch.bfloat16, device=META)
    assert not takes(pg, [x], dist.ReduceOp.SUM)
    monkeypatch.setattr(backend, "takes_device", lambda device: device in ("cpu", "meta"))
    assert takes(pg, [x], dist.ReduceOp.SUM)
    assert not takes(pg, [x.int()], dist.ReduceOp.SUM)  # still float tensors only
    pg.codec = "native"
    assert not takes(pg, [x], dist.ReduceOp.SUM)


def test_drop_in_carries_messages_of_any_dense_cuda_tensor(monkeypatch):
    """The drop-in's messages through zipccl.p2p (``_message``): a float tensor with the group's
    codec; any other dense CUDA tensor (integer, bool) with "auto", which frames its bytes where
    the NCCL underneath would get a batch's messages one at a time (above); torch's NCCL for
    the rest: CPU tensors (gloo), sparse ones, every message under "native", and CUDA where the
    drop-in does not take it (no GPU extra, ZIPCCL_TRANSPORT=torch)."""
    cls = backend.ProcessGroupZipccl

    class DropIn:  # the group's decisions without its store and ranks
        codec = "lossless"
        _takes, _message = cls._takes, cls._message

    pg = DropIn()
    cuda = {"float": _on_gpu(8), "int64": _on_gpu(8, torch.int64), "bool": _on_gpu(8, torch.bool)}
    cpu = {"cpu float": torch.zeros(8), "cpu int64": torch.zeros(8, dtype=torch.int64),
           "sparse": torch.zeros(8, dtype=torch.int64).to_sparse()}
    monkeypatch.setattr(backend, "takes_device", lambda device: True)
    assert {k: pg._message([x]) for k, x in {**cuda, **cpu}.items()} == {
        "float": "lossless", "int64": "auto", "bool": "auto", "cpu float": "lossless", "cpu int64": None,
        "sparse": None}
    assert pg._message([cuda["int64"], cuda["int64"]]) is None  # one tensor a message
    pg.codec = "native"
    assert {k: pg._message([x]) for k, x in cuda.items()} == dict.fromkeys(cuda)
    pg.codec = "lossless"
    monkeypatch.setattr(backend, "takes_device", lambda device: device == "cpu")
    assert {k: pg._message([x]) for k, x in cuda.items()} == dict.fromkeys(cuda)


def test_drop_in_hands_its_native_calls_to_its_nccl_underneath(gpu_group, monkeypatch):
    """On the drop-in, a call whose signature zipccl runs natively (auto below the probe floor)
    goes to the backend underneath for its device (ProcessGroupNCCL for CUDA tensors), from the
    override itself, and that backend's Work is returned: no zipccl queue, no communicator. A
    lossy group's calls and a call behind a queued async one keep zipccl's path."""
    group, seen = gpu_group
    works = []

    class Nccl:  # the backend underneath: each call returns its own Work
        def __getattr__(self, name):
            def call(*args):
                works.append((name, args[0]))
                return f"work {len(works)}"
            return call

    monkeypatch.setattr(backend, "takes_device", lambda device: True)
    cls = backend.ProcessGroupZipccl

    class DropIn:  # the group's decisions without its store and ranks
        codec, options, _compressor, _inner = "auto", backend.Options(), None, {"cpu": None, "cuda": Nccl()}
        _takes, _own, _inner_for, _passed = cls._takes, cls._own, cls._inner_for, cls._passed

    pg = DropIn()
    x, many = _on_gpu(1), _on_gpu(4)
    assert cls.allreduce(pg, [x], dist.AllreduceOptions()) == "work 1"
    assert cls.all_gather_single(pg, many, x, None) == "work 2"
    assert cls.reduce_scatter_single(pg, x, many, None) == "work 3"
    assert [name for name, _ in works] == ["allreduce", "_allgather_base", "_reduce_scatter_base"]
    assert works[0][1][0] is x and works[1][1] is many and works[2][1] is x  # the caller's tensors
    assert "communicator" not in seen and not [s for s in seen if s[1] is pg]  # nothing went through zipccl
    pg._compressor = object()  # lossy: zipccl's, with its error feedback
    assert not pg._own("all_reduce", x, x, dist.ReduceOp.SUM)
    pg._compressor = None
    monkeypatch.setattr(backend.executor, "idle", lambda: False)  # an async call queued: after it, in order
    assert not pg._own("all_reduce", x, x, dist.ReduceOp.SUM)


# ---- the lossy path on CUDA ---------------------------------------------------------------------------------

def test_failed_selection_is_refused_on_the_calls_transport(monkeypatch):
    """The refusal that tells the peers of a failed selection goes on the transport of the
    call's group and device, and the caller sees the selection's error."""
    refused = []
    monkeypatch.setattr(lossy, "transport_for", lambda group, device: f"{group}'s transport for {device}")

    def refuse(name, t, input, op, error):
        refused.append((name, t, input.device))
        raise error
    monkeypatch.setattr(lossy.collectives, "refuse", refuse)
    comp = lossy.Compressor("topk")
    monkeypatch.setattr(comp, "_select", lambda *a: (_ for _ in ()).throw(RuntimeError("selection failed")))
    flat = torch.zeros(64, device=META)
    with pytest.raises(RuntimeError, match="selection failed"):
        comp._selected("all_reduce", flat, "w", 0.1, None, "the group", dist.ReduceOp.SUM)
    assert refused == [("all_reduce", "the group's transport for meta", META)]


def test_entropy_sums_go_on_the_groups_device(monkeypatch):
    summed = []

    def all_reduce(t, group=None):
        summed.append((t.device.type, group))
        t.mul_(2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    x = torch.tensor([1, 2, 3], dtype=torch.int64)
    lossy._sum_across("g")(x)
    assert x.tolist() == [2, 4, 6] and summed == [("cpu", "g")]
    summed.clear()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # torch without CUDA here: the move to cuda:0 fails, and nothing reached the NCCL group from the host
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        lossy._sum_across("g")(x)
    assert summed == []


def test_entropy_density_sums_through_the_groups_device(monkeypatch):
    summed = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: summed.append(t.device.type))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    comp = lossy.Compressor("entropy")
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):  # the estimate's first sum, moved to cuda:0
        comp.choose(0, True, torch.randn(10_000, generator=torch.Generator().manual_seed(0)), "g")
    assert summed == []


def test_scatter_cuts_are_made_on_the_index_device():
    idx = torch.tensor([1, 5, 9, 10], dtype=torch.int32)
    assert sparse_reduce._cuts(idx, [0, 4, 8, 12]).tolist() == [0, 1, 2, 4]
    assert sparse_reduce._cuts(idx.to(META), [0, 4, 8, 12]).device == META


# ---- the planner's clock ----------------------------------------------------------------------------------------

class _Device:
    """A fake clock and GPU: a call queues ``device`` seconds of work and returns after ``host``;
    timing events record when the queued work before them ends; the host's waits for the device
    (an event synchronised, or polled in a loop that sleeps while it has not passed) are counted,
    once per event; the host's sleeps pass the fake time."""

    def __init__(self, monkeypatch):
        self.now, self.free_at = 100.0, 0.0  # free_at: when the device's queued work ends
        self.waited: set = set()
        self.polled = None  # the event last queried, where it had not passed
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self, stream):
                assert stream == "current"
                self.at = max(fake.now, fake.free_at)

            def query(self):
                fake.polled = id(self) if self.at > fake.now else None
                return self.at <= fake.now

            def synchronize(self):
                fake.waited.add(id(self))
                fake.now = max(fake.now, self.at)

            def elapsed_time(self, end):  # milliseconds, as torch's
                assert self.query() and end.query()
                return (end.at - self.at) * 1e3

        monkeypatch.setattr(autoplan, "time", types.SimpleNamespace(perf_counter=lambda: self.now,
                                                                    monotonic=lambda: self.now, sleep=self.sleep))
        monkeypatch.setattr(config, "TIMEOUT", None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("a device-wide wait"))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current")
        monkeypatch.setattr(torch.cuda, "Event", Event)

    @property
    def syncs(self) -> int:
        return len(self.waited)

    def sleep(self, seconds: float) -> None:
        """The host sleeps: in a loop on an event that has not passed, it waits for it."""
        if self.polled is not None:
            self.waited.add(self.polled)
        self.now += seconds

    def call(self, host: float, device: float):
        def run(plan):
            self.free_at = max(self.now, self.free_at) + device
            self.now += host
        return run


@pytest.mark.parametrize("device,nbytes,expected_us,syncs", [
    (torch.device("cuda", 0), 4 << 20, 500_000, 1),  # its 500 ms on the device, waited for at the report only
    (torch.device("cpu"), 4 << 20, 1_000, 0),
    (torch.device("cuda", 0), 64 << 10, 1_000, 0),   # below the probe floor: never measured, never waited for
])
def test_planner_times_cuda_calls_by_events_on_the_callers_stream(monkeypatch, device, nbytes, expected_us, syncs):
    """A measured CUDA call is its span between two events on the caller's stream: the queued
    work's time on the device, not the host's 1 ms; the host waits for no device work in the
    call, and for the end event only once a metadata exchange takes the report."""
    fake = _Device(monkeypatch)
    group = object()
    autoplan.planned(group, "all_reduce", torch.bfloat16, nbytes, C.FLAT_PLANS, fake.call(0.001, 0.5), device)
    assert fake.syncs == 0 and fake.now == 100.001
    key = auto.Policy.key("all_reduce", torch.bfloat16, nbytes, device)
    assert autoplan._auto_group(group).take() == [((key, "native"), expected_us)]
    assert fake.syncs == syncs


def test_cuda_spans_that_have_passed_fold_into_the_lowest(monkeypatch):
    """Native calls carry no exchange, so their times wait: a span whose end has passed is read
    at the next call and only the lowest kept, so the pending spans stay few."""
    fake = _Device(monkeypatch)
    group, key = autoplan._AutoGroup(), auto.Policy.key("all_reduce", torch.bfloat16, 4 << 20)
    for seconds in (0.3, 0.2, 0.4):
        span = autoplan.DeviceSpan("current")
        fake.call(0.0, seconds)("native")
        group.done(key, "native", span.close("current"))
        fake.now += 1.0  # the host does other work; the device finishes the call
    (entry,) = group.pending.values()
    assert entry[0] == 200_000 and len(entry[1]) == 1  # the last call's span: read at the report,
    assert group.take() == [((key, "native"), 200_000)] and fake.syncs == 0  # passed by then: no wait


def test_a_span_that_never_ends_is_reported_unknown_after_zipccl_timeout(monkeypatch):
    """A measured call whose peer died never ends on the device: the next exchange waits for it
    at most ZIPCCL_TIMEOUT (unset: config.DEFAULT_TIMEOUT), then reports -1 (no rank learns from
    it), rather than hanging."""
    fake = _Device(monkeypatch)
    for setting in (0.05, None):  # unset: config.DEFAULT_TIMEOUT, never an unbounded wait
        monkeypatch.setattr(config, "TIMEOUT", setting)
        monkeypatch.setattr(config, "DEFAULT_TIMEOUT", 0.07)
        group, key = autoplan._AutoGroup(), auto.Policy.key("all_reduce", torch.bfloat16, 4 << 20)
        span = autoplan.DeviceSpan("current").close("current")
        span.end.query = lambda: False
        group.done(key, "native", span)
        start = fake.now
        assert group.take() == [((key, "native"), -1)]
        assert (setting or 0.07) <= fake.now - start < (setting or 0.07) + 0.01


def test_measures_follows_the_probe_floor():
    p = auto.Policy(probe_min_bytes=1 << 20)
    assert [p.measures(n, c) for n, c in [((1 << 20) - 1, ("native", "raw")), (1 << 20, ("native", "raw")),
                                          (1 << 30, ("native",))]] == [False, True, False]


# ---- failures on NCCL: a hung peer is named, the communicator aborted, never the transport's own error ---------

class _Comm:
    """A CuPy communicator that never fails and counts its aborts."""

    def __init__(self):
        self.aborted = 0

    def check_async_error(self):
        return None

    def abort(self):
        self.aborted += 1


class _Pending:
    """A CUDA event that never passes: the peer's message never comes."""

    def query(self):
        return False


def test_a_hung_peer_on_nccl_fails_the_call_with_the_communicator_aborted(monkeypatch):
    """Rank 0 of three gives up on its wait for group rank 1's mail (no heartbeat board: no
    evidence): the communicators are aborted, and the call raises RankFailure, broken, naming no
    rank (NCCL's operations of one group end together, so the peer waited on is only the first in
    this rank's order), never NcclError."""
    monkeypatch.setattr(config, "TIMEOUT", 0.05)
    comm, mail = _Comm(), _Comm()
    t = object.__new__(NcclTransport)  # three ranks, this one the job's rank 5; no GPU needed from here on
    t.rank, t.size, t._ranks, t.comm, t.mail_comm, t._open = 0, 3, [5, 9, 11], comm, mail, None
    size = cupy_nccl._Work(None, host=torch.zeros(1, dtype=torch.int64), staged=None, mail=True)
    size.event = _Pending()
    fate = Fate.of("all_reduce", t)
    assert not fate.wait(t, size, 1)  # gave up on group rank 1 after ZIPCCL_TIMEOUT
    assert comm.aborted == mail.aborted == 1 and t.comm is None and t.mail_comm is None and fate.gave_up
    # the status round on the aborted communicator: rank 2's operations fail and count it lost too
    with pytest.raises(RankFailure, match=r"a rank the backend could not name failed: it stopped answering"
                                          r".*must be rebuilt") as e:
        fate.settle(t)
    assert (e.value.rank, e.value.kind, e.value.broken) == (-1, "lost", True)
    assert (id(t), 2) in fate.lost


def test_a_tensor_on_another_gpu_than_the_communicators_is_refused():
    """NcclTransport's communicators live on the device that was current when they were made; a
    tensor on another GPU is refused before anything is sent (NCCL would read it through that
    device's pointers), with what to do."""
    class OnGpu:  # what the check reads of a CUDA tensor
        device = torch.device("cuda", 1)

    t = object.__new__(NcclTransport)
    t.rank, t.size, t._ranks, t.comm, t.mail_comm, t._open, t.device = 0, 2, [0, 1], _Comm(), _Comm(), [], 0
    for send in (True, False):
        with pytest.raises(UnsupportedError, match=r"cuda:1.*cuda:0.*set_device"):
            t._p2p(OnGpu(), 1, send)


# ---- NVML's view of the links feeds the planner -----------------------------------------------------------------

def test_the_link_is_agreed_by_every_rank():
    assert topology.agreed_link(["nvlink", "nvlink", "nvlink"]) == "nvlink"
    assert topology.agreed_link(["pcie", "pcie"]) == "pcie"
    assert topology.agreed_link(["nvlink", "pcie", "nvlink"]) == "unknown"  # ranks that disagree: nothing follows
    assert topology.agreed_link(["nvlink", "unknown"]) == "unknown"


@pytest.mark.parametrize("plans,device,link,nodes,expected", [
    ("flat", "cuda", "nvlink", 1, ("native",)),                        # NVLink inside one node: NCCL's own
    ("flat", "cuda", "nvlink", 2, ("native", "lossless")),             # single-rank nodes: the slow level is flat
    ("both", "cuda", "nvlink", 2, ("native", "hierarchical/lossless")),  # compression between the nodes only
    ("both", "cuda", "pcie", 2, ("native", "hierarchical/lossless")),
    ("hier", "cuda", "unknown", 2, ("hierarchical/native", "hierarchical/lossless")),
    ("flat", "cuda", "pcie", 1, ("native", "lossless")),
    ("flat", "cuda", "unknown", 1, ("native", "lossless")),
    ("flat", "cpu", "nvlink", 1, ("native", "raw", "lossless")),      # CPU: every plan, measured
    ("both", "cpu", "unknown", 2, ("native", "raw", "lossless") + api.HIERARCHICAL_PLANS),
])
def test_auto_on_cuda_measures_only_plans_that_can_pay(plans, device, link, nodes, expected):
    plans = {"flat": C.FLAT_PLANS, "hier": api.HIERARCHICAL_PLANS,
             "both": C.FLAT_PLANS + api.HIERARCHICAL_PLANS}[plans]
    assert C.plans_for(plans, device, link, nodes) == expected


def _found_link(rank, groups, links):
    """The link that topology() finds on a fresh group of the pool's four ranks, where rank r's
    NVML says ``links[r]``."""
    g = dist.new_group([0, 1, 2, 3], backend="gloo")
    real, topology.nvml_link = topology.nvml_link, lambda: links[rank]
    try:
        return topology.topology(g).link
    finally:
        topology.nvml_link = real


@pytest.mark.timeout(300)
def test_every_rank_finds_the_agreed_link(pool):
    assert pool.run(_found_link, ["nvlink"] * 4, timeout=120) == ["nvlink"] * 4
    assert pool.run(_found_link, ["nvlink", "nvlink", "pcie", "nvlink"], timeout=120) == ["unknown"] * 4


# ---- async calls on CUDA: ordered after the caller's stream, on zipccl's own, as torch's NCCL backend ------------

class _CudaStandIns:
    """torch.cuda as the executor sees it, without a GPU: the issuing thread is on cuda:3 and its
    current stream is "caller@3"; a new stream is "zipccl@3". A stream is the list of what is
    queued on it: work (``queue``), and waits for an event, which stands for the work its stream
    had queued when it was recorded. ``before(a, b)``: whether work ``a`` must end before work
    ``b`` may start, by stream order and waits; the futures' devices are written down."""

    def __init__(self, monkeypatch):
        import contextlib
        import threading

        from zipccl import executor
        self.streams, self.futures, self.active = {}, [], threading.local()
        main, stand_in = threading.main_thread(), self

        class Stream:
            def __init__(self, name):
                self.name, self.ops = name, []
                stand_in.streams[name] = self

            def __str__(self):
                return self.name

            def wait_event(self, event):
                self.ops.append(("wait", event.stream, event.upto))

        class Event:
            def record(self, stream):
                self.stream, self.upto = stream, len(stream.ops)

        caller = Stream("caller@3")

        def current_stream(device=None):
            active = getattr(self.active, "stream", None)
            return active or (caller if threading.current_thread() is main else
                              self.streams.get("worker-default@0") or Stream("worker-default@0"))

        @contextlib.contextmanager
        def entered(kind, value):
            setattr(self.active, kind, value)
            try:
                yield
            finally:
                setattr(self.active, kind, None)

        real_future = torch.futures.Future

        def future(devices=None):
            self.futures.append(devices)
            return real_future()

        self.current_stream = current_stream
        monkeypatch.setattr(executor, "_streams", {})
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream(f"zipccl@{device.index}"))
        monkeypatch.setattr(torch.cuda, "device", lambda d: entered("device", d))
        monkeypatch.setattr(torch.cuda, "stream", lambda s: entered("stream", s))
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.futures, "Future", future)

    def queue(self, work: str) -> None:
        """``work`` queued on the current thread's current stream, as a kernel launch would be."""
        self.current_stream().ops.append(("work", work))

    def where(self) -> tuple:
        import threading
        return (threading.current_thread().name, str(getattr(self.active, "device", None)),
                str(getattr(self.active, "stream", None)))

    def _ends_before(self, stream, upto: int) -> set:
        """The work that must end before position ``upto`` of ``stream`` starts."""
        out = set()
        for op in stream.ops[:upto]:
            out |= {op[1]} if op[0] == "work" else self._ends_before(op[1], op[2])
        return out

    def before(self, a: str, b: str) -> bool:
        stream, at = next((s, i) for s in self.streams.values() for i, op in enumerate(s.ops) if op == ("work", b))
        return a in self._ends_before(stream, at)


def test_an_async_call_runs_on_zipccls_stream_after_the_callers(monkeypatch):
    """An async call on CUDA runs on the worker thread, on the issuing thread's device and on a
    stream of zipccl's: after the work the caller queued before issuing it, and before the work
    the caller queues after ``wait()``, while the caller's stream, meanwhile, is not held back
    (no host wait either: the stand-ins have none). Its future is CUDA-aware on that device."""
    from zipccl import executor
    cuda = _CudaStandIns(monkeypatch)

    def collective():
        cuda.queue("collective")
        return cuda.where()
    cuda.queue("input written")
    handle = executor.run(collective, True)
    cuda.queue("caller's next kernel")
    handle.wait(timeout=30)
    cuda.queue("output read")
    assert handle.get_future().value() == ("zipccl-async", "cuda:3", "zipccl@3")
    assert cuda.before("input written", "collective") and cuda.before("collective", "output read")
    assert not cuda.before("collective", "caller's next kernel")
    assert ("work", "collective") in cuda.streams["zipccl@3"].ops
    assert cuda.futures[-1] == [torch.device("cuda", 3)]


def test_without_cuda_an_async_call_touches_no_stream(monkeypatch):
    from zipccl import executor
    cuda = _CudaStandIns(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    handle = executor.run(cuda.where, True)
    handle.wait(timeout=30)
    assert handle.get_future().value() == ("zipccl-async", "None", "None")
    assert list(cuda.streams) == ["caller@3"] and cuda.streams["caller@3"].ops == [] and cuda.futures[-1] is None


@pytest.mark.parametrize("codec", ["lossless", "raw"])
def test_an_invalid_call_on_cuda_refuses_on_the_transport_its_peers_exchange_on(gpu_group, codec):
    """Rank 0's CUDA tensor is strided where its peers' valid calls compress: they exchange on
    the communicator that compressing plans run on (made in that call), so the refusal must go
    there too; on the group's own it would wait for peers that never come."""
    group, seen = gpu_group
    with pytest.raises(_Made):
        zipccl.all_reduce(_on_gpu(8)[::2], group=group, codec=codec, algorithm="flat")
    assert seen == ["communicator"], seen


@pytest.mark.parametrize("algorithm", ["auto", "flat"])
def test_an_invalid_call_where_auto_compresses_refuses_on_the_communicator(gpu_group, monkeypatch, algorithm):
    """Over PCIe auto tries native, then lossless: rank 0's strided tensor at the lossless step
    refuses where its peers' lossless calls exchange (the communicator, made there), and at the
    native step goes to the group's own collective, as theirs."""
    group, seen = gpu_group
    monkeypatch.setattr(topology, "topology", lambda group=None: topology.Topology(((0, 1, 2, 3),), "test", "pcie"))
    _Device(monkeypatch)
    strided = _on_gpu(1 << 22)[::2]  # 4 MiB
    zipccl.all_reduce(strided, group=group, algorithm=algorithm)  # native: the backend takes it as it is
    assert [s[0] for s in seen] == ["all_reduce"], seen
    with pytest.raises(_Made):
        zipccl.all_reduce(strided, group=group, algorithm=algorithm)  # lossless
    assert seen[-1] == "communicator", seen
