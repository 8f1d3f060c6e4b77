"""Nodes: which ranks of a process group share a machine, and the two levels of groups over them.

A cluster has two kinds of link: inside a node (NVLink, shared memory, loopback: hundreds of
GB/s, where coding never pays) and between nodes (Ethernet or InfiniBand, often the
bottleneck). ``topology(group)`` finds the nodes once per group, identically on every rank,
from the first source that applies on this rank:

1. ``ZIPCCL_TOPOLOGY=NxM``: N nodes of M consecutive ranks (emulation, or a user who knows better);
2. the launcher: torchrun (``GROUP_RANK`` with ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``), Open MPI
   (the host name, with ``OMPI_COMM_WORLD_LOCAL_RANK``/``_LOCAL_SIZE``; not
   ``OMPI_COMM_WORLD_NODE_RANK``, which is a rank within the node, not the node's number), Slurm (``SLURM_NODEID``, ``SLURM_LOCALID``; the
   latter repeats where one task spawns the ranks, and then only the node counts);
3. the host name.

Every rank sends its claim in one small all-gather; ranks that disagree (a different override,
a different source, a launcher's local size that does not match the ranks found on the node,
the settings their calls share: ``config.SHARED``) raise ``MismatchError`` on every rank. ``levels(group)`` then creates, once and in the same
order on every rank, one gloo/NCCL group per node ("intra") and one per local index across the
nodes ("inter"): the groups of the hierarchical algorithms (zipccl.hierarchical). Creating a
group is a collective over the whole job, so levels exist only for groups that span the job.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import config, lifetime
from .errors import MismatchError, UnsupportedError
from .transport import heartbeat
from .transport.shm import NodeMemory
from .transport.torch_dist import group_collective, timeout_of, wire_device

__all__ = ["Topology", "Levels", "topology", "levels", "known", "parse", "claim", "from_claims", "nvml_link",
           "link_between", "forget", "on_forget", "LINKS", "agreed_link", "shares_memory", "same_node", "publish_node"]

_SOURCES = ("ZIPCCL_TOPOLOGY", "torchrun", "mpirun", "slurm", "hostname")


@dataclass(frozen=True)
class Topology:
    """The nodes of a group: ``nodes[i]`` lists the group ranks on node i, in rank order."""
    nodes: tuple[tuple[int, ...], ...]
    source: str
    link: str = "unknown"  # between the nodes' GPUs, from NVML, the same on every rank: one of LINKS

    @property
    def uniform(self) -> bool:
        """Every node holds the same number of ranks (the hierarchical algorithms need it)."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def local_size(self) -> int:
        if not self.uniform:
            raise UnsupportedError(f"nodes hold different numbers of ranks: {[len(n) for n in self.nodes]}")
        return len(self.nodes[0])

    @property
    def hierarchical(self) -> bool:
        """Two real levels: more than one node, more than one rank per node, every node alike."""
        return len(self.nodes) > 1 and self.uniform and len(self.nodes[0]) > 1

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def __str__(self) -> str:
        shape = f"{len(self.nodes)}x{len(self.nodes[0])}" if self.uniform else \
            "+".join(str(len(n)) for n in self.nodes)
        return f"{shape} ({self.source}{', ' + self.link if self.link != 'unknown' else ''})"


def parse(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4): N nodes of M consecutive ranks (config.nodes_of)."""
    return config.nodes_of(text)


def _key(text: str) -> int:
    """A stable 62-bit number for a node's name (the same on every rank that names it alike)."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little") >> 2


def claim(env=None) -> tuple[str, int, int, int]:
    """What this rank knows of its node: (source, node key, local rank, local size); -1 where the
    source does not say."""
    env = os.environ if env is None else env
    if "GROUP_RANK" in env and "LOCAL_RANK" in env:
        return "torchrun", int(env["GROUP_RANK"]), int(env["LOCAL_RANK"]), int(env.get("LOCAL_WORLD_SIZE", -1))
    if "OMPI_COMM_WORLD_LOCAL_RANK" in env:
        # Open MPI names no node: OMPI_COMM_WORLD_NODE_RANK is this process's rank on its node
        # across all jobs (a local rank), so the host name tells the node.
        return ("mpirun", _key(socket.gethostname()), int(env["OMPI_COMM_WORLD_LOCAL_RANK"]),
                int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", -1)))
    if "SLURM_NODEID" in env and "SLURM_LOCALID" in env:
        return "slurm", int(env["SLURM_NODEID"]), int(env["SLURM_LOCALID"]), -1
    return "hostname", _key(socket.gethostname()), -1, -1


def from_claims(rows: list[list[int]], ranks: list[int] | None = None, world: int | None = None) -> Topology:
    """The topology from every rank's row [override N, override M, source, node key, local rank,
    local size] (group rank order); raises MismatchError where the ranks disagree. ``ranks``: the
    group's ranks in the job (default: the job's first ones), ``world``: the job's size (default:
    the group's), for ZIPCCL_TOPOLOGY, which describes the job's ranks, of which a group may hold
    some."""
    n = len(rows)
    ranks = list(range(n)) if ranks is None else list(ranks)
    overrides = {(r[0], r[1]) for r in rows}
    if len(overrides) > 1:
        raise MismatchError(f"ranks disagree on ZIPCCL_TOPOLOGY: {sorted(overrides)}")
    (nodes_n, local_m), = overrides
    if nodes_n > 0:
        world = n if world is None else world
        if nodes_n * local_m != world:
            raise MismatchError(f"ZIPCCL_TOPOLOGY={nodes_n}x{local_m} describes {nodes_n * local_m} ranks, "
                                f"the job has {world}")
        by_node: dict[int, list[int]] = {}
        for rank, job_rank in enumerate(ranks):
            by_node.setdefault(job_rank // local_m, []).append(rank)
        return Topology(tuple(tuple(by_node[k]) for k in sorted(by_node)), "ZIPCCL_TOPOLOGY")
    sources = {r[2] for r in rows}
    if len(sources) > 1:
        raise MismatchError(f"ranks found their node in different ways: {sorted(_SOURCES[s] for s in sources)} "
                            "(set ZIPCCL_TOPOLOGY=NxM on every rank)")
    found: dict[int, list[int]] = {}
    for rank, row in enumerate(rows):
        found.setdefault(row[3], []).append(rank)
    nodes = tuple(tuple(ranks) for ranks in found.values())
    if len(nodes) == 1 or all(r[4] < 0 for r in rows):
        return Topology(nodes, _SOURCES[rows[0][2]])
    for ranks in nodes:
        locals_ = sorted(rows[r][4] for r in ranks)
        sizes = {rows[r][5] for r in ranks} - {-1}
        if len(set(locals_)) != len(locals_) and _SOURCES[rows[0][2]] == "slurm":
            # processes spawned under one Slurm task (mp.spawn, a launcher Slurm does not know) share
            # its SLURM_LOCALID; its SLURM_NODEID still tells the node, which is all the levels need
            continue
        if len(set(locals_)) != len(locals_) or (sizes and sizes != {len(ranks)} and n == _world()):
            raise MismatchError(f"the launcher's local ranks {locals_} (local size {sorted(sizes)}) do not match "
                                f"the {len(ranks)} ranks found on one node ({list(ranks)})")
    return Topology(nodes, _SOURCES[rows[0][2]])


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else -1


def _bus(value) -> tuple[int, ...] | None:
    """A PCI bus id ("00000000:3B:00.0" or "0000:3b:00.0", bytes or str) as numbers (domain, bus,
    device, function), so that NVML's spellings of one device compare equal."""
    text = value.decode() if isinstance(value, bytes) else str(value)
    m = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)\s*", text.rstrip("\x00"))
    return tuple(int(g, 16) for g in m.groups()) if m else None


def link_between(gpus: list, peers: dict) -> str:
    """"nvlink" where every local GPU (``gpus``: their PCI bus ids) has an active NVLink to another
    of them or to an NVSwitch (``peers``: bus id -> the bus ids at the far end of its active links,
    "switch" for an NVSwitch), "pcie" where some has none, "unknown" for fewer than two GPUs."""
    ids = {_bus(g) for g in gpus} - {None}
    if len(ids) < 2:
        return "unknown"
    for g in gpus:
        far = peers.get(g, ())
        if "switch" not in far and not ({_bus(p) for p in far if p != "switch"} & (ids - {_bus(g)})):
            return "pcie"
    return "nvlink"


#: What NVML can say of the links between a node's GPUs (``nvml_link``).
LINKS = ("unknown", "pcie", "nvlink")


def agreed_link(links: list[str]) -> str:
    """The link of a group from each rank's ``nvml_link``: theirs where every rank saw the same,
    else "unknown" (decisions that follow from it must be the same on every rank)."""
    return links[0] if len(set(links)) == 1 else "unknown"


def nvml_link() -> str:
    """How this machine's GPUs are linked, from NVML, each GPU and each link's far end named by
    PCI bus id (never by index, which CUDA_VISIBLE_DEVICES and NVML may order differently): see
    ``link_between``. "unknown" without NVML or where it fails (the normal case on CPU machines:
    one failed import or init); it never raises."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return "unknown"
    try:
        gpus, peers = [], {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            gpus.append(bus)
            far = peers.setdefault(bus, [])
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if not pynvml.nvmlDeviceGetNvLinkState(handle, link):
                        continue
                except Exception:
                    break  # no such link (or no NVLink at all)
                try:
                    if pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link) == 1:  # NVML_NVLINK_DEVICE_TYPE_SWITCH
                        far.append("switch")
                        continue
                except Exception:
                    pass
                far.append(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        return link_between(gpus, peers)
    except Exception:
        return "unknown"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


_found: dict = lifetime.keep({})
_levels: dict = lifetime.keep({}, on_drop=lambda made: made is not None and lifetime.destroy(made.intra, made.inter))
_lock = threading.Lock()
# Drop the groups made here before the interpreter's final teardown: a gloo group destroyed
# then, with its threads still running, aborts the process ("terminate called without an
# active exception", seen at the end of lab runs).
atexit.register(_levels.clear)


def _group_key(group):
    return group if group is not None else dist.GroupMember.WORLD


def topology(group=None) -> Topology:
    """The nodes of ``group`` (None: the default group), found on the first call (a collective
    call: every rank of the group must make it at the same point) and kept."""
    key = _group_key(group)
    with _lock:
        if key in _found:
            return _found[key]
    lifetime.sweep()
    override = (-1, -1) if config.TOPOLOGY is None else parse(config.TOPOLOGY)
    source, node, local, local_size = claim()
    backend = dist.get_backend(group)
    mine = torch.tensor([*override, _SOURCES.index(source), node, local, local_size, int(shares_memory(backend)),
                         LINKS.index(nvml_link()), *config.codes()], dtype=torch.int64)
    device = wire_device(backend)
    size = dist.get_world_size(group)
    rows = torch.empty(size * mine.numel(), dtype=torch.int64, device=device)
    ranks = dist.get_process_group_ranks(key)
    heartbeat.bounded(lambda: group_collective("all_gather", group, rows, mine.to(device), async_op=False), ranks,
                      "finding the group's nodes, at its first call")
    table, shared = rows.view(size, -1).cpu().tolist(), len(config.SHARED)
    claims, settings = [row[:-shared] for row in table], [row[-shared:] for row in table]
    found = from_claims([row[:-2] for row in claims], ranks, dist.get_world_size())
    shm = sorted({row[-2] for row in claims})
    if len(shm) > 1:  # the levels' shared memory is set up by the ranks that allow it, with each other
        raise MismatchError(f"ranks disagree on ZIPCCL_SHM: ranks {[ranks[r] for r, row in enumerate(claims) if not row[-2]]} "
                            "have it off, the others on")
    _agree_on_settings(settings, ranks)
    found = Topology(found.nodes, found.source, agreed_link([LINKS[row[-1]] for row in claims]))
    with _lock:
        return _found.setdefault(key, found)


def _agree_on_settings(rows: list[list[int]], ranks: list[int]) -> None:
    """MismatchError, on every rank alike, where the ranks' ``config.codes()`` differ."""
    for k, name in enumerate(config.SHARED):
        held: dict[int, list[int]] = {}
        for rank, row in zip(ranks, rows):
            held.setdefault(row[k], []).append(rank)
        if len(held) > 1:
            raise MismatchError(f"ranks disagree on {config.variable(name)}: " + "; ".join(
                f"ranks {rs}: {config.shown(name, code)}" for code, rs in held.items()))


@dataclass(frozen=True)
class Levels:
    """This rank's two groups of a hierarchical collective: ``intra`` (its node's ranks, in node
    order) and ``inter`` (the ranks of the same local rank on every node, in node order)."""
    topology: Topology
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    node: int
    local_rank: int
    memory: NodeMemory | None = None  # the node's shared memory, where its ranks can map one (ZIPCCL_SHM)


def shares_memory(backend: str) -> bool:
    """Whether the hierarchical levels of a group of torch backend ``backend`` try the nodes'
    shared memory: where ZIPCCL_SHM allows, not on nccl, whose tensors live on the GPU (and
    whose groups cannot carry the CPU tensors that set the memory up); the CUDA calls of other
    groups do not use it either (zipccl.api)."""
    return config.SHM and backend != "nccl"


def levels(group=None) -> Levels | None:
    """The intra- and inter-node groups of ``group``, created on the first call (every rank of the
    job, in the same order: each node's group in node order, then each local rank's group), or
    None where there is no second level, ``group`` does not span the job, or its nodes interleave
    their ranks so that a local rank's group would not be in node order. Then, where
    ``shares_memory``, each node's shared memory (zipccl.transport.shm), used only if every
    node could map its own."""
    key = _group_key(group)
    with _lock:
        if key in _levels:
            return _levels[key]
    lifetime.sweep()
    topo = topology(group)
    made = None
    ranks = dist.get_process_group_ranks(key)  # group rank -> global rank
    # torch numbers a new group's ranks in ascending order: each local rank's group across the nodes
    # must then be in node order, as the algorithms take it (nodes of interleaved ranks are not),
    # and each node's group in local order (a group made with sort_ranks=False may number a node's
    # ranks otherwise: its intra rank would not be its local rank)
    placed = [[ranks[r] for r in n] for n in topo.nodes]
    in_order = all(sorted(line) == list(line) for line in (*placed, *zip(*placed)))
    if topo.hierarchical and in_order and dist.get_world_size(group) == dist.get_world_size():
        backend = dist.get_backend(group)
        me = dist.get_rank(group)

        def agree(ok: bool) -> bool:
            flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
            group_collective("all_reduce", group, flag, op=dist.ReduceOp.MIN, async_op=False)
            return bool(flag.item())

        def make() -> Levels:
            timeout = timeout_of(group)  # the group's own: new_group's default is its backend's
            intra = [dist.new_group([ranks[r] for r in node], backend=backend, **timeout) for node in topo.nodes]
            inter = [dist.new_group([ranks[node[j]] for node in topo.nodes], backend=backend, **timeout)
                     for j in range(topo.local_size)]
            node, local = topo.node_of(me), topo.local_rank(me)
            memory = NodeMemory.available(intra[node], local, topo.local_size, agree) if shares_memory(backend) \
                else None
            return Levels(topo, intra[node], inter[local], node, local, memory)
        made = heartbeat.bounded(make, ranks, "making the group's levels, at its first hierarchical call")
    with _lock:
        return _levels.setdefault(key, made)


def found(group=None) -> Topology | None:
    """The nodes of ``group`` where ``topology`` has found them (no communication), else None."""
    with _lock:
        return _found.get(_group_key(group))


def known(group=None) -> bool:
    """Whether ``levels(group)`` has been made (then calling it communicates no more)."""
    with _lock:
        return _group_key(group) in _levels


def _node_of_rank(rank: int) -> int | None:
    """The node of the job's ``rank`` where the environment says it for every rank alike:
    ZIPCCL_TOPOLOGY's N nodes of M consecutive ranks; else None. (Not torchrun's
    LOCAL_WORLD_SIZE: a rank knows only its own node's size, and where nodes differ in size,
    ranks that counted with their own would answer a pair's question differently.)"""
    if config.TOPOLOGY is not None:
        return rank // parse(config.TOPOLOGY)[1]
    return None


def _claim_text() -> str:
    source, node, _, _ = claim()
    return f"{source}:{node}"


_peer_nodes: dict = lifetime.keep({}, group_of=None)  # job rank -> its node's claim
_published: dict = lifetime.keep({}, group_of=None)  # "node" -> True, once written into this world's store


def publish_node() -> None:
    """Write this rank's node into the job's store, once, for ``same_node`` on its peers: at
    zipccl.launch.init(), a drop-in group's first call, a collective's and a message's (before
    anything of it could wait on a peer), so that a peer's first message under auto need not
    wait for this rank's first message."""
    lifetime.sweep()
    if not _published and _node_of_rank(dist.get_rank()) is None:
        dist.distributed_c10d._get_default_store().set(f"zipccl/node/{dist.get_rank()}", _claim_text())
        _published["node"] = True


def same_node(group, peer: int, wait: bool = True) -> bool | None:
    """Whether ``peer`` (a rank of ``group``) runs on this rank's node, found without a collective
    call (a send has only two ranks): from the group's topology where it has been found, else
    from ZIPCCL_TOPOLOGY, else from the claims (the launcher's, the host name) that each rank
    writes once into the job's store (publish_node); two claims from different sources count as
    different nodes. Both ranks of a pair answer alike. ``wait=False``: None where that takes a
    claim the peer has not written yet."""
    key = _group_key(group)
    with _lock:
        found = _found.get(key)
    if found is not None:
        return found.node_of(dist.get_rank(group)) == found.node_of(peer)
    other = dist.get_global_rank(key, peer)
    mine = _node_of_rank(dist.get_rank())
    if mine is not None:
        return mine == _node_of_rank(other)
    lifetime.sweep()
    with _lock:
        known = _peer_nodes.get(other)
    if known is None:
        publish_node()
        store = dist.distributed_c10d._get_default_store()
        if not wait and not store.check([f"zipccl/node/{other}"]):
            return None
        reader = heartbeat.own_connection(store, config.wait_bound() + 1)  # a step left behind holds it, not the job's
        known = heartbeat.bounded(lambda: reader.get(f"zipccl/node/{other}"), [dist.get_rank(), other],
                                  f"reading rank {other}'s node, at its first message").decode()
        with _lock:
            _peer_nodes[other] = known
    return known == _claim_text()


#: Run by ``forget``: caches built on what was found (zipccl.api's routes), which would otherwise
#: keep sending a group's calls where its old topology sent them.
_on_forget: list = []


def on_forget(callback) -> None:
    """Call ``callback()`` whenever ``forget`` drops what was found."""
    _on_forget.append(callback)


def forget(group=None) -> None:
    """Drop what was found for ``group`` (tests that change ZIPCCL_TOPOLOGY in live workers), and
    the routes decided from it; the groups already created stay alive."""
    key = _group_key(group)
    with _lock:
        _found.pop(key, None)
        _levels.pop(key, None)
        _peer_nodes.clear()
    for callback in _on_forget:
        callback()
