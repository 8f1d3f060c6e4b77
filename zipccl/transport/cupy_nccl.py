"""Transport over an NCCL communicator of CuPy (``cupy.cuda.nccl``): the GPU path of zipccl.

One communicator per process group, made once (``NcclTransport.of(group)``) on the device of
``torch.cuda.current_device()``: rank 0's unique id reaches the group's other ranks through a
broadcast on the group itself (its torch backend), so no store or start method of CuPy's own is
needed. Making it is collective, and every rank then tells every other whether it succeeded
(one small all-gather on the group): where any failed, every rank raises the same ZipcclError
carrying NCCL's message, and no rank is left waiting in NCCL. A failed communicator is aborted.

Operations run on a stream of zipccl's, ordered after torch's current stream by an event, so
the host does not wait for the device, except where the pipeline needs a size on the host: CPU
tensors (metadata, sizes) are staged through device memory and copied back when waited for.
NCCL's rules hold (DESIGN.md invariant 12): exact-size receives, no tags (messages between two
ranks match in issue order), sends and receives issued inside ``grouped()`` (groupStart/End).
Codec "native" is NCCL's own collective: torch's, on the group, where its backend is nccl
(``native_by_torch``), else on this communicator.

GPU-only beyond construction: what runs without a GPU (the bootstrap, its agreed error, the type
and op tables) is tested in CI (tests/test_nccl.py); the rest is covered by the ``gpu`` suite
(tests/test_nccl_gpu.py, tests/test_gpu_lab.py, docs/GPU.md), which needs a CUDA device: its
collectives passed on 1, 2 and 4 ranks of one H100 (2026-11-26), several ranks sharing the GPU
in the one-GPU lab (zipccl.launch.spawn(..., share_gpu=True), docs/GPU.md); its killed-rank test
hung there before the bounded device waits below.
"""

from __future__ import annotations

import atexit
import contextlib
import time

import torch
import torch.distributed as dist

from .. import config
from ..errors import UnsupportedError, ZipcclError
from . import nccl_stack
from .base import Transport, wait_limit
from .torch_dist import TorchTransport

__all__ = ["NcclTransport", "NcclError", "native_by_torch"]

_transports: dict = {}
atexit.register(_transports.clear)


def native_by_torch(backend: str) -> bool:
    """Whether codec "native" (the backend's own collective) on a group of torch backend
    ``backend`` is torch's collective on the group (nccl: torch's own NCCL, the baseline that
    "auto" measures zipccl against) rather than NCCL's on zipccl's communicator (any other
    group, whose torch backend takes no CUDA tensors)."""
    return backend == "nccl"


class NcclError(ZipcclError, RuntimeError):
    """NCCL failed (its own message is in the text); the communicator has been aborted."""


def _aborted() -> NcclError:
    return NcclError("the NCCL communicator was aborted after an earlier failure: rebuild the group")


class _Work:
    """An operation issued in a group: done when the event recorded after the group's end has
    passed. ``host``: a CPU tensor to fill from ``staged`` once done (a received size)."""
    __slots__ = ("event", "keep", "host", "staged")

    def __init__(self, keep, host=None, staged=None):
        self.event, self.keep, self.host, self.staged = None, keep, host, staged


class NcclTransport(Transport):
    """``group``'s ranks over one NCCL communicator of CuPy. Raises ZipcclError, the same on every
    rank, where it cannot be made (no GPU, NCCL's own failure); never falls back to another transport."""

    loose_receives = False
    tags = False

    @classmethod
    def of(cls, group=None) -> "NcclTransport":
        key = group if group is not None else dist.GroupMember.WORLD
        t = _transports.get(key)
        if t is None:
            t = _transports.setdefault(key, cls(group))
        return t

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call zipccl.launch.init() or "
                               "torch.distributed.init_process_group() first")
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._ranks = dist.get_process_group_ranks(group if group is not None else dist.GroupMember.WORLD)
        backend = dist.get_backend(group)
        self._cpu = backend != "nccl"  # where the group's own collectives take CPU tensors
        self._by_torch = native_by_torch(backend)
        self._open: list | None = None
        self.comm, error = None, None
        try:
            self.nccl = nccl_stack.load()
        except UnsupportedError as e:
            self.nccl, error = None, e
        uid = self._share_id()
        if error is None:
            error = self._connect(uid)
        self._agree(error)

    # ---- bootstrap ------------------------------------------------------------------------------------------

    def _device_tensor(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._cpu else x.to("cuda")

    def _share_id(self) -> bytes:
        """Rank 0's unique id (128 bytes), broadcast on the group; zeros where rank 0 has no NCCL."""
        ids = torch.zeros(128, dtype=torch.int64)
        if self.rank == 0 and self.nccl is not None:
            ids[:] = torch.tensor(list(self.nccl.get_unique_id()), dtype=torch.int64)
        ids = self._device_tensor(ids)
        dist.broadcast(ids, group=self.group, group_src=0)
        self.unique_id = bytes(ids.cpu().tolist())
        return self.unique_id

    def _connect(self, uid: bytes) -> Exception | None:
        """This rank's communicator; the exception where NCCL or CUDA refused it."""
        if not any(uid):
            return UnsupportedError("rank 0 could not load NCCL")
        try:
            if not torch.cuda.is_available():  # NCCL is still asked, so that its own error is the one reported
                self.comm = self.nccl.NcclCommunicator(self.size, uid, self.rank)
                raise UnsupportedError("torch has no CUDA device here: NcclTransport takes torch CUDA tensors")
            import cupy
            self.device = torch.cuda.current_device()
            with cupy.cuda.Device(self.device):
                self.comm = self.nccl.NcclCommunicator(self.size, uid, self.rank)
            self.stream = torch.cuda.Stream(self.device)
        except Exception as e:  # noqa: BLE001 - NcclError, CUDARuntimeError: every rank must hear of it
            self._abort()
            return e
        return None

    def _agree(self, error: Exception | None) -> None:
        """Every rank learns whether every rank has a communicator; the same error everywhere if not."""
        text = "" if error is None else f"{type(error).__name__}: {error}"
        texts = [None] * self.size
        dist.all_gather_object(texts, text, group=self.group)
        failed = [r for r, t in enumerate(texts) if t]
        if failed:
            self._abort()
            first = texts[failed[0]]
            raise NcclError(f"zipccl: no NCCL communicator for this group of {self.size} ranks: rank(s) {failed} "
                            f"failed; rank {failed[0]}: {first} ({nccl_stack.detect()})")

    def _abort(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            with contextlib.suppress(Exception):
                comm.abort()

    def _fail(self, e: Exception) -> NcclError:
        self._abort()
        return NcclError(f"NCCL failed on rank {self.global_rank(self.rank)}: {e}; the communicator is aborted")

    # ---- Transport --------------------------------------------------------------------------------------------

    def global_rank(self, rank: int) -> int:
        return self._ranks[rank]

    def _ready(self) -> int:
        """This transport's stream, after torch's current stream's work so far."""
        if self.comm is None:
            raise _aborted()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return self.stream.cuda_stream

    @contextlib.contextmanager
    def grouped(self):
        """NCCL's group call. On an aborted communicator an empty one, whose every operation raises
        NcclError: zipccl.failure counts those peers lost, and the call still ends in RankFailure
        on this rank (the status round included) rather than in this transport's error."""
        if self._open is not None:
            raise ZipcclError("NcclTransport.grouped() inside another group")
        if self.comm is None:
            self._open = []
            try:
                yield
            finally:
                self._open = None
            return
        self._ready()
        self._open = []
        self.nccl.groupStart()
        try:
            yield
        finally:
            works, self._open = self._open, None
            try:
                self.nccl.groupEnd()
            except Exception as e:  # noqa: BLE001
                raise self._fail(e) from e
            event = torch.cuda.Event()
            event.record(self.stream)
            for w in works:
                w.event = event

    def _p2p(self, tensor: torch.Tensor, peer: int, send: bool) -> _Work:
        if self._open is None:
            raise ZipcclError("NcclTransport: sends and receives are issued inside grouped() (NCCL's group call)")
        if self.comm is None:
            raise _aborted()
        host = None
        if tensor.device.type == "cpu":  # metadata: staged through device memory, on this transport's stream
            with torch.cuda.stream(self.stream):
                host, tensor = tensor, tensor.to(f"cuda:{self.device}") if send \
                    else torch.empty_like(tensor, device=f"cuda:{self.device}")
        flat = tensor.view(-1).view(torch.uint8)
        name, _ = nccl_stack.DTYPES[torch.uint8]
        try:
            if send:
                self.comm.send(flat.data_ptr(), flat.numel(), getattr(self.nccl, name), peer, self.stream.cuda_stream)
            else:
                self.comm.recv(flat.data_ptr(), flat.numel(), getattr(self.nccl, name), peer, self.stream.cuda_stream)
        except Exception as e:  # noqa: BLE001
            raise self._fail(e) from e
        work = _Work(tensor, None if send else host, None if send else tensor)
        self._open.append(work)
        return work

    def isend(self, send, dst, tag=0):
        return self._p2p(send, dst, True)

    def irecv(self, recv, src, tag=0):
        return self._p2p(recv, src, False)

    def wait(self, work, timeout: float | None = None) -> None:
        """Device tensors: torch's current stream waits for the operation; the host waits too,
        bounded, where ZIPCCL_TIMEOUT is set (a peer that died leaves its receive pending for
        ever: the stream would hang the next host read, with no one to name). Staged CPU
        tensors: the host waits. A host wait takes at most ZIPCCL_TIMEOUT seconds (or
        ``timeout`` where that is shorter), checking NCCL's async errors; a timeout or an error
        aborts the communicator (ncclCommAbort), and the error of a timeout says so
        (``timed_out``, as for TorchTransport)."""
        if work.event is None:
            raise ZipcclError("NcclTransport: an operation waited for inside its group, before NCCL issued it")
        limit = wait_limit(timeout)
        if work.host is None:
            if limit is not None:
                self._host_wait(work, limit)
            torch.cuda.current_stream(self.device).wait_event(work.event)
            return
        self._host_wait(work, limit)
        work.host.copy_(work.staged)

    def _host_wait(self, work, limit: float | None) -> None:
        deadline = None if limit is None else time.monotonic() + limit
        while not work.event.query():
            if self.comm is None:  # aborted by another wait of the call
                raise _aborted()
            try:
                self.comm.check_async_error()
            except Exception as e:  # noqa: BLE001
                raise self._fail(e) from e
            if deadline is not None and time.monotonic() > deadline:
                error = self._fail(TimeoutError(f"no progress within {limit:g} s (ZIPCCL_TIMEOUT={config.TIMEOUT})"))
                error.timed_out = True  # this rank gave up; the peer may live (zipccl.failure)
                raise error
            time.sleep(1e-4)

    def all_to_all(self, send, send_splits, recv_splits):
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=send.device)
        so = ro = 0
        with self.grouped():
            works = []
            for j in range(self.size):
                if send_splits[j]:
                    works.append(self.isend(send[so:so + send_splits[j]], j))
                if recv_splits[j]:
                    works.append(self.irecv(recv[ro:ro + recv_splits[j]], j))
                so, ro = so + send_splits[j], ro + recv_splits[j]
        for w in works:
            self.wait(w)
        return recv

    def native(self, name, *tensors, op=None):
        if self._by_torch:
            TorchTransport.of(self.group).native(name, *tensors, op=op)
            return
        out = tensors[0]
        inp = tensors[1] if len(tensors) > 1 else out
        if out.dtype not in nccl_stack.DTYPES:
            raise UnsupportedError(f"NCCL has no type for {out.dtype}")
        dtype = getattr(self.nccl, nccl_stack.DTYPES[out.dtype][0])
        stream = self._ready()
        try:
            if name == "all_reduce":
                self.comm.allReduce(inp.data_ptr(), out.data_ptr(), out.numel(), dtype,
                                    getattr(self.nccl, nccl_stack.OPS[op][0]), stream)
            elif name == "reduce_scatter":
                self.comm.reduceScatter(inp.data_ptr(), out.data_ptr(), out.numel(), dtype,
                                        getattr(self.nccl, nccl_stack.OPS[op][0]), stream)
            elif name == "all_gather":
                self.comm.allGather(inp.data_ptr(), out.data_ptr(), inp.numel(), dtype, stream)
            else:
                raise ValueError(f"unknown collective {name!r}")
        except (ValueError, KeyError):
            raise
        except Exception as e:  # noqa: BLE001
            raise self._fail(e) from e
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
