"""The host out of the data path, counted on CPU stand-ins of the CUDA path.

Four gloo ranks run zipccl's collectives over a transport that keeps NCCL's rules (strict mode:
exact receives, no tags, grouped) and reports its waits as NcclTransport's would happen on a
GPU: the messages of one ``grouped()`` block complete at one event per channel; a wait for a
host mail (metadata, a size, a status) polls that event, a host wait; a wait for device data
makes a stream wait on it, which the host does not (zipccl.transport.cupy_nccl). Every event
poll and synchronisation, and every read of a data tensor by the host (``.cpu()``, ``.item()``,
``.tolist()``, ...: the codecs read the device through ``to_host``, which calls ``.cpu()``), is
recorded by tests/host_waits.py; a copy between tensors is not (here every tensor is on the
CPU, on a GPU those are copies on the device). What reached the wire is written down too.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import zipccl
from host_waits import recording
from zipccl import lifetime
from zipccl.collectives import pipeline
from zipccl.reference import packet
from zipccl.reference.packet import Verdict
from zipccl.transport import torch_dist
from zipccl.transport.base import DeviceMail

pytestmark = pytest.mark.timeout(300)

#: Host tensors (metadata, sizes, statuses) are int64; every other dtype here is data "on the device".
_DATA = (torch.uint8, torch.bfloat16, torch.float16, torch.float32)


class _Event:
    """A CUDA event stand-in: passed once its group's messages are waited for (gloo does the work)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Stream:
    def wait_event(self, event) -> None:
        pass


class _Work:
    __slots__ = ("inner", "event", "mail")

    def __init__(self, inner, event, mail: bool):
        self.inner, self.event, self.mail = inner, event, mail


class _Copy:
    """A read-back handle: the copy happens when it is waited for."""

    def __init__(self, values, host):
        self.values, self.host = values, host

    def wait(self, *args):
        self.host.copy_(self.values)
        return True


class DeviceLike(torch_dist.TorchTransport):
    """gloo in strict mode (NCCL's rules), its waits as on CUDA (module docstring); ``wire``:
    (peer, dtype, numel) of every message sent."""

    def __init__(self, group):
        super().__init__(group)
        self.wire, self._events, self._stream = [], None, _Stream()

    @contextlib.contextmanager
    def grouped(self):
        self._events = {True: _Event(), False: _Event()}  # one per channel, as NcclTransport's groups
        try:
            with super().grouped():
                yield
        finally:
            self._events = None

    def _mark(self, work, tensor):
        mail = tensor.dtype == torch.int64
        return _Work(work, self._events[mail] if self._events else _Event(), mail)

    def isend(self, send, dst, tag=0):
        tensor = send.tensor if isinstance(send, DeviceMail) else send
        self.wire.append((dst, tensor.dtype, tensor.numel()))
        return self._mark(super().isend(send, dst, tag), tensor)

    def read_back(self, values, host):
        """As NcclTransport's: done with the group's mails, copied when waited for."""
        if self._events is None:
            return super().read_back(values, host)
        return _Work(_Copy(values, host), self._events[True], True)

    def irecv(self, recv, src, tag=0):
        return self._mark(super().irecv(recv, src, tag), recv)

    def wait(self, work, timeout=None):
        if work.mail:
            work.event.query()  # the host waits for the mail channel
        else:
            self._stream.wait_event(work.event)  # torch's stream waits; the host goes on
        super().wait(work.inner, timeout)


@contextlib.contextmanager
def device_like(group, monkeypatch_attrs: dict):
    """The stand-in transport for ``group`` (what TorchTransport.of returns), torch.cuda's Event and
    Stream the stand-ins', strict mode on, and ``monkeypatch_attrs`` {(object, name): value} set;
    all undone on exit."""
    key = group if group is not None else dist.GroupMember.WORLD
    # a process's first sweep forgets every transport (a new world): take it before the stand-in
    # goes in, or the first zipccl call in a fresh worker would forget the stand-in and make its own
    lifetime.sweep()
    saved = {(obj, name): getattr(obj, name) for obj, name in monkeypatch_attrs}
    saved_cuda = torch.cuda.Event, torch.cuda.Stream
    old_strict, old_transport = zipccl.config.STRICT_TRANSPORT, torch_dist._transports.get(key)
    zipccl.config.STRICT_TRANSPORT = True
    torch.cuda.Event, torch.cuda.Stream = _Event, _Stream
    try:
        for (obj, name), value in monkeypatch_attrs.items():
            setattr(obj, name, value)
        t = torch_dist._transports[key] = DeviceLike(group)
        yield t
    finally:
        torch.cuda.Event, torch.cuda.Stream = saved_cuda
        for (obj, name), value in saved.items():
            setattr(obj, name, value)
        zipccl.config.STRICT_TRANSPORT = old_strict
        if old_transport is None:
            torch_dist._transports.pop(key, None)
        else:
            torch_dist._transports[key] = old_transport


def _counted(call):
    """(host waits of ``call()``, the recorder's table): data tensors count as on the device, and
    every ``to_host`` (the codecs' one way to read the device) as a host copy; copies between
    tensors do not count (module docstring)."""
    with recording(is_device=lambda t: t.dtype in _DATA, cupy=False) as rec:
        torch.Tensor.copy_ = torch.Tensor.copy_.__wrapped__  # undone with the rest on exit
        read = rec._wrap("host_copy", "to_host", packet.to_host)
        saved = packet.to_host, pipeline.to_host
        packet.to_host = pipeline.to_host = read
        try:
            call()
        finally:
            packet.to_host, pipeline.to_host = saved
    return rec.host_waits(), rec.table()


def _reference(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` summed in rank order in fp32, rounded once: plain torch on the gathered inputs."""
    every = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, x, group=group)
    total = torch.zeros_like(x, dtype=torch.float32)
    for part in every:
        total += part.float()
    return total.to(x.dtype)


def _plain_raw(rank, groups, piece_bytes):
    g = groups[4]
    n = dist.get_world_size(g)
    numel = 4 * 40_000  # bf16 elements
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 0.01).to(torch.bfloat16)
    want = _reference(x, g)
    with device_like(g, {(pipeline, "PLAIN_PIECE_BYTES"): piece_bytes}) as t:
        chunks = pipeline.pieces(numel // n, n, 2, plain=True)
        got = x.clone()
        waits, table = _counted(lambda: zipccl.all_reduce(got, group=g, codec="raw"))
        wire = list(t.wire)
    return dict(pieces=len(chunks), waits=waits, table=table, same=torch.equal(got.view(torch.int16),
                                                                                want.view(torch.int16)),
                data=[(peer, dtype, numel) for peer, dtype, numel in wire if dtype != torch.int64],
                mails=[(peer, numel) for peer, dtype, numel in wire if dtype == torch.int64], m=numel // n)


def test_raw_moves_the_tensors_bytes_with_no_host_wait_per_piece(pool):
    """zipccl's raw all-reduce in 8 pieces: the rank-order sum on every rank, and the host
    waits only for the call's own exchange and its status round (two mails), never per piece or
    per packet: no packet copies the data behind a header (each message is the piece's bytes,
    exactly), no size is mailed, nothing is decoded, nothing of the data is read."""
    res = pool.run(_plain_raw, 2 * 4 * 40_000 // 8, timeout=240)
    for rank, r in enumerate(res):
        assert not isinstance(r, BaseException), r
        assert r["pieces"] == 8 and r["same"], (rank, r["pieces"], r["same"])
        assert r["waits"] <= 2, f"rank {rank}: {r['waits']} host waits\n{r['table']}"
        step = r["m"] * 2 // 8  # bytes of one piece of one chunk
        # each piece: this rank's chunk of every peer to that peer, then its reduced piece to every peer
        assert sorted(r["data"]) == sorted((peer, torch.uint8, step) for peer in range(4) if peer != rank
                                           for _ in range(2 * 8)), (rank, r["data"][:6])
        assert len(r["mails"]) == 2 * 3, (rank, r["mails"])  # the exchange and the status round, to each peer


class Trim:
    """A lossless codec with the Triton codec's host behaviour, on CPU: a packet is its length
    (8 bytes) and the tensor's bytes up to the last nonzero one. ``encode_into`` and
    ``decode_into`` work with tensor operations alone (on a GPU, on the device) and read nothing;
    ``encode`` reads its packet's size once, as the Triton encoder does."""
    name, exact = "trim", True

    def max_encoded_size(self, numel: int, dtype) -> int:
        return 8 + numel * torch.empty(0, dtype=dtype).element_size()

    def encode_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        data = x.reshape(-1).view(torch.uint8)
        used = (torch.arange(1, data.numel() + 1) * (data != 0)).max() if data.numel() else torch.zeros((),
                                                                                                     dtype=torch.int64)
        out[:8] = used.reshape(1).view(torch.uint8)
        out[8:8 + data.numel()] = data
        return used + 8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(self.max_encoded_size(x.numel(), x.dtype), dtype=torch.uint8)
        return buf[:int(packet.to_host(self.encode_into(x, buf)))]

    def decode_into(self, packet: torch.Tensor, out: torch.Tensor) -> Verdict:
        data = out.reshape(-1).view(torch.uint8)
        data.zero_()
        data[:packet.numel() - 8] = packet[8:]
        return Verdict(None, packet.numel(), out.numel(), out.dtype, 0)

    def decode(self, packet, out=None, *, max_numel=None):
        raise AssertionError("the stand-in decodes only as the Triton codec does: decode_into")


def _lossless(rank, groups, piece_bytes):
    g = groups[4]
    n = dist.get_world_size(g)
    numel = 4 * 40_000
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 0.01).to(torch.bfloat16)
    x[-1000:] = 0  # the last rank's chunk ends in zeros: its packets are shorter
    want = _reference(x, g)
    out = {}
    with device_like(g, {(pipeline, "PIECE_BYTES"): piece_bytes, (pipeline, "MIN_RAMP"): 1 << 30,
                         (pipeline, "_without_host_reads"): lambda codec, x, method: isinstance(codec, Trim)}) as t:
        pieces = len(pipeline.pieces(numel // n, n, 2))
        for name in ("all_reduce", "reduce_scatter", "all_gather"):
            t.wire.clear()
            if name == "all_reduce":
                got = x.clone()
                call = lambda: zipccl.all_reduce(got, group=g, codec=Trim())  # noqa: E731
            elif name == "reduce_scatter":
                got = torch.empty(numel // n, dtype=x.dtype)
                call = lambda: zipccl.reduce_scatter(got, x, group=g, codec=Trim())  # noqa: E731
            else:  # a chunk from each rank: as many pieces as the others' phases
                got = torch.empty(numel, dtype=x.dtype)
                call = lambda: zipccl.all_gather(got, x[-(numel // n):], group=g, codec=Trim())  # noqa: E731
            waits, table = _counted(call)
            if name == "all_reduce":
                same = torch.equal(got.view(torch.int16), want.view(torch.int16))
            elif name == "reduce_scatter":
                same = torch.equal(got.view(torch.int16), want.view(n, -1)[rank].view(torch.int16))
            else:
                every = [torch.empty_like(x[-(numel // n):]) for _ in range(n)]
                dist.all_gather(every, x[-(numel // n):].clone(), group=g)
                same = torch.equal(got, torch.cat(every))
            data = sum(k for _, dtype, k in t.wire if dtype != torch.int64)
            out[name] = dict(waits=waits, table=table, same=same, data=data)
    return pieces, out


def test_lossless_waits_once_per_piece_for_its_sizes(pool):
    """A codec that codes on the device (the Triton codec's host behaviour: Trim) in 4 pieces
    a phase: the host waits once per piece, for that piece's sizes (its own, which it never reads
    alone, and its peers', in one mail), plus the call's exchange and status round; every result
    is plain torch's; the packets on the wire are shorter than the data where it ends in zeros."""
    res = pool.run(_lossless, 2 * 4 * 40_000 // 4, timeout=240)
    for rank, r in enumerate(res):
        assert not isinstance(r, BaseException), r
        pieces, out = r
        assert pieces == 4
        phases = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
        for name, got in out.items():
            assert got["same"], (rank, name)
            assert got["waits"] <= phases[name] * pieces + 2, \
                f"rank {rank} {name}: {got['waits']} host waits for {phases[name] * pieces} pieces\n{got['table']}"
        # 1000 trailing zeros (2000 bytes) not on the wire, to each of the 3 peers, in the last piece's packets
        full = 3 * 2 * 40_000 + 3 * 8 * pieces
        assert out["all_gather"]["data"] == full - 3 * 2000, (rank, out["all_gather"]["data"], full)


def _all_to_all(rank, groups, piece_bytes):
    g = groups[4]
    n = dist.get_world_size(g)
    per = 40_000  # bf16 elements to each peer
    x = (torch.randn(n * per, generator=torch.Generator().manual_seed(rank)) * 0.01).to(torch.bfloat16)
    x.view(n, per)[:, -1000:] = 0  # each chunk ends in zeros: its packets are shorter
    want = torch.empty_like(x)
    dist.all_to_all_single(want, x.clone(), group=g)  # plain torch
    zipccl.all_to_all_single(torch.empty_like(x), x, group=g, codec="raw")  # the group's nodes found, once
    out = {}
    with device_like(g, {(pipeline, "PIECE_BYTES"): piece_bytes, (pipeline, "MIN_RAMP"): 1 << 30,
                         (pipeline, "_without_host_reads"): lambda codec, x, method: isinstance(codec, Trim)}) as t:
        pieces = len(pipeline.pieces(per, n, 2))
        for name, codec in (("raw", "raw"), ("trim", Trim())):
            t.wire.clear()
            got = torch.empty_like(x)
            waits, table = _counted(lambda: zipccl.all_to_all_single(got, x, group=g, codec=codec))
            out[name] = dict(waits=waits, table=table, same=torch.equal(got.view(torch.int16), want.view(torch.int16)),
                             data=sum(k for _, dtype, k in t.wire if dtype != torch.int64),
                             mails=sum(dtype == torch.int64 for _, dtype, _ in t.wire))
    return pieces, out


def test_all_to_all_waits_once_per_piece_at_most(pool):
    """zipccl's all-to-all in 4 pieces per peer: plain torch's result on every rank. Raw mails
    nothing but the call's exchange of counts and its status round, and the host waits for those
    alone; a codec that codes on the device (Trim) mails each piece's sizes, and the host waits
    once per piece more, for its own sizes and its peers' in one (never once per peer or packet,
    nor a read of its sizes before the mail)."""
    res = pool.run(_all_to_all, 2 * 4 * 40_000 // 4, timeout=240)
    for rank, r in enumerate(res):
        assert not isinstance(r, BaseException), r
        pieces, out = r
        assert pieces == 4
        raw, trim = out["raw"], out["trim"]
        assert raw["same"] and trim["same"], rank
        assert raw["waits"] <= 2, f"rank {rank} raw: {raw['waits']} host waits\n{raw['table']}"
        assert raw["mails"] == 2 * 3 and raw["data"] == 3 * 2 * 40_000, (rank, raw["mails"], raw["data"])
        assert trim["waits"] <= pieces + 2, f"rank {rank} trim: {trim['waits']} host waits\n{trim['table']}"
        # each packet: 8 bytes and its piece up to the chunk's 1000 trailing zeros (2000 bytes, in the last piece)
        assert trim["mails"] == (2 + pieces) * 3 and trim["data"] == 3 * (2 * 40_000 - 2000 + 8 * pieces), \
            (rank, trim["mails"], trim["data"])
