"""Shared memory between the ranks of one node: the intra-node level of the hierarchical collectives.

gloo has no shared-memory transport: two ranks of one machine talk over TCP loopback, and a
64 MiB bf16 reduce-scatter between two of them took 185 ms in the 2x2 lab, its all-gather
148 ms (the CPU copies every byte through the kernel several times). Through a shared file in
/dev/shm each rank writes its data once and reads its peers' where it needs them, as NCCL's
SHM transport does between processes of one machine.

Each rank owns one slot of the node's area, in two halves used by alternate phases: a phase
writes its half, waits on the node's group (one barrier), then reads; the next phase writes the
other half, so a rank never overwrites data that a peer may still be reading (that peer has
since passed the next phase's barrier). The area grows by re-mapping, identically on every
rank (sizes come from the call, the same on every rank). Local rank 0 allocates a file's pages
before any rank maps it, so that a full /dev/shm (a container's 64 MiB) fails there, on every
rank alike, instead of killing the ranks with SIGBUS at their first write into pages that tmpfs
cannot back. Files are unlinked as soon as every rank has mapped them, or failed to: nothing is
left behind where a peer dies meanwhile, nor after a crash that follows. A file whose local
rank 0 was killed in that window (SIGKILL, the OOM killer) names that process: the next area
made on the machine removes it once the process is gone (``_remove_left_behind``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time

import torch
import torch.distributed as dist

from ..kernels import reduce
from .torch_dist import TorchTransport

_DIR = "/dev/shm"
_ALIGN = 4096
_MAGIC_BYTES = 8


def _round_up(n: int) -> int:
    return max(_ALIGN, 1 << (max(1, n) - 1).bit_length())


#: An area file: its local rank 0's process id, the area's random name, its generation.
_AREA = re.compile(r"zipccl-(\d+)-[0-9a-f]{32}-\d+")
#: Seconds an area file of a process that is gone stays before another removes it: its node's
#: ranks map it within a call's barriers, and its maker unlinks it then.
LEFT_BEHIND_S = 60.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _remove_left_behind() -> None:
    """Remove the area files in _DIR whose local rank 0 died before it could unlink them (killed
    while its node's ranks mapped them): its process is gone and the file is older than
    LEFT_BEHIND_S. Where a process of that id lives (reused, or one of another job's in the same
    /dev/shm), its files stay."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(_DIR):
            match = _AREA.fullmatch(entry.name)
            if match and not _alive(int(match[1])):
                with contextlib.suppress(OSError):
                    if time.time() - entry.stat(follow_symlinks=False).st_mtime > LEFT_BEHIND_S:
                        os.unlink(entry.path)


def _allocate(path: str, size: int) -> None:
    """``path``, ``size`` bytes whose pages are allocated now (OSError where the file system
    cannot hold them: ENOSPC on a full tmpfs)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


class NodeMemory:
    """The shared area of one node's ranks (``group``: the node's process group, ranks in local
    order). ``available(group)`` builds it, or returns None where the ranks cannot share memory
    (not on one machine, no /dev/shm)."""

    def __init__(self, group, local_rank: int, local_size: int, name: str):
        self.group, self.local_rank, self.local_size, self.name = group, local_rank, local_size, name
        self.capacity, self.generation, self.area, self.phase = 0, 0, None, 0
        self.failed = False  # a call's area could not grow: auto keeps this group's node level to the backend's

    @classmethod
    def available(cls, group, local_rank: int, local_size: int, agree) -> "NodeMemory | None":
        """Try the node's area: local rank 0 names it and writes a random token, the others map it
        and check the token; ``agree(ok)`` returns whether every rank of the job succeeded (so that
        all nodes choose alike). None where any failed."""
        name = torch.zeros(64, dtype=torch.uint8)
        if local_rank == 0:
            _remove_left_behind()
            text = f"{os.getpid()}-{secrets.token_hex(16)}".encode()  # the maker's id: _remove_left_behind
            name[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        dist.broadcast(name, group=group, group_src=0)
        memory = cls(group, local_rank, local_size, f"zipccl-{bytes(name.tolist()).rstrip(bytes(1)).decode()}")
        return memory if agree(memory._map(_ALIGN, check=True)) else None

    def _path(self) -> str:
        return os.path.join(_DIR, f"{self.name}-{self.generation}")

    def _map(self, capacity: int, check: bool = False) -> bool:
        """Map an area of ``capacity`` bytes per half-slot (a collective call on the node's group).
        With ``check``, local rank 0 writes a token that every other rank must read back."""
        path, size = self._path(), 2 * capacity * self.local_size
        ok, area = True, None
        try:
            if self.local_rank == 0:
                try:
                    _allocate(path, size)
                    area = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                    if check:
                        area[:_MAGIC_BYTES] = torch.frombuffer(bytearray(self.name[-_MAGIC_BYTES:].encode()),
                                                               dtype=torch.uint8)
                except (OSError, RuntimeError):
                    ok = False  # still at both barriers below, or the node's other ranks would wait forever
            self._barrier()
            if self.local_rank != 0:
                try:
                    if not os.path.exists(path) or os.path.getsize(path) != size:
                        raise OSError(f"{path} is not this node's area")
                    area = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                    if check:
                        ok = bytes(area[:_MAGIC_BYTES].tolist()) == self.name[-_MAGIC_BYTES:].encode()
                except (OSError, RuntimeError):
                    ok, area = False, None
            self._barrier()
        finally:  # every rank has it mapped, or has failed, or a barrier broke: the memory lives until unmapped
            if self.local_rank == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        if not check:  # the node's ranks agree, so that all of them fail alike, or none
            flag = torch.tensor([int(ok)], dtype=torch.int64)
            TorchTransport.of(self.group).wait(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group,
                                                               async_op=True))
            ok = bool(flag[0])
        if ok:
            self.area, self.capacity = area, capacity
        elif not check:
            raise OSError(f"the node's shared memory could not grow to {size} bytes ({path}) on one of its ranks")
        self.generation += 1
        return ok

    def _slots(self, nbytes: int) -> torch.Tensor:
        """(local size, nbytes) views of every rank's slot in this phase's half, after growing the
        area where ``nbytes`` does not fit."""
        if nbytes > self.capacity:
            self._map(_round_up(nbytes))
        half = self.phase % 2
        self.phase += 1
        return self.area.view(self.local_size, 2, self.capacity)[:, half, :nbytes]

    def stage(self, inp: torch.Tensor) -> torch.Tensor:
        """Put ``inp`` in this rank's slot and wait for the node's other ranks to do the same;
        returns every rank's data, (local size, inp.numel()), to reduce from with ``reduce``."""
        slots = self._slots(inp.numel() * inp.element_size())
        slots[self.local_rank].copy_(inp.view(-1).view(torch.uint8))
        self._barrier()
        return slots.view(inp.dtype)

    def reduce(self, staged: torch.Tensor, a: int, b: int, out: torch.Tensor, op_code: int,
               sum_in_rank_order) -> None:
        """out = the reduction over the node's ranks of columns [a, b) of ``staged``, in local rank
        order (``sum_in_rank_order(parts, op_code, n, dtype)`` for what the numba kernel does not
        take). Reads only: no barrier."""
        parts = staged[:, a:b]
        if op_code in (1, 2) and out.dtype in reduce.DTYPES:
            reduce.sum_in_rank_order(parts, parts[self.local_rank], self.local_rank, op_code == 2, out.view(-1))
        else:
            out.view(-1).copy_(sum_in_rank_order(list(parts), op_code, self.local_size, out.dtype))

    def claim(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """This phase's slots, for a rank that writes its own in place (the hierarchical
        collectives let the nodes' level write there): (this rank's, numel elements; every
        rank's, (local size, numel)), readable once ``publish`` returns."""
        every = self._slots(numel * torch.empty(0, dtype=dtype).element_size()).view(dtype)
        return every[self.local_rank], every

    def publish(self) -> None:
        """Every rank of the node has written its claimed slot."""
        self._barrier()

    def _barrier(self) -> None:
        TorchTransport.of(self.group).barrier()  # within ZIPCCL_TIMEOUT
