"""Hierarchical collectives on N nodes of M ranks: the fast links inside a node, the slow ones between.

Each algorithm is three flat collectives (zipccl.collectives.run_flat) on the groups of
zipccl.topology.levels, each level with its own codec, so that only 1/M of the data crosses
the slow links per rank and the codec works where it pays:

- all-reduce = reduce-scatter inside the node (local rank j ends with the node's sum of
  shard j), all-reduce of shard j across the nodes (the ranks of local rank j, one per node),
  all-gather of the shards inside the node. Each node's link carries 2(N-1)/N of the tensor
  each way, where a flat ring over the n = NM ranks puts 2(n-1)/n on it (2x2: 1 against 1.5).
- reduce-scatter = the input's chunks arranged by destination local rank, reduce-scatter
  inside the node, reduce-scatter across the nodes;
- all-gather = all-gather across the nodes, all-gather inside the node, chunks put back in
  rank order.

Summation order (the same bits on every rank, DESIGN.md invariant 3): each node's
contributions in local rank order, rounded to the dtype, then the nodes' sums in node order,
rounded once (zipccl's levels accumulate 16-bit types in fp32; a "native" level sums as the
backend does). AVG is SUM at both levels, then one division by the group's size. This can
differ from a flat all-reduce in the last bits (another order of additions, and for 16-bit
types two roundings instead of one); lossless still equals raw under the same algorithm,
bit for bit.

On CUDA tensors a level whose codec compresses goes over zipccl's NCCL transport
(zipccl.transport.select), and a native level is the level group's own collective (torch's
NCCL, NVLink where it exists). For CPU tensors the
intra-node level may also be the node's shared memory (SHM, zipccl.transport.shm), which
sums like zipccl's raw level; the all-reduce then makes each piece of the node's sum just
before the nodes' pipeline encodes it (_shm_all_reduce).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives as C
from .collectives import run_flat
from .errors import UnsupportedError
from .failure import MEMORY, REDUCE, Fate
from .topology import Levels
from .transport import TorchTransport

__all__ = ["run", "SHM"]


class _Shm:
    """The intra-node level's codec "shm": the node's shared memory (zipccl.transport.shm), exact,
    summing in local rank order like zipccl's raw level."""
    name = "shm"

    def __repr__(self) -> str:
        return "shm"


SHM = _Shm()


def _transports(levels: Levels, device: torch.device, codecs: tuple) -> tuple:
    """Each level's transport for tensors on ``device`` with its codec (collectives.carrier): the
    level's group itself where the codec is native (NCCL's own collective on CUDA) or shared
    memory, the carrier of compressed packets (on CUDA zipccl's NCCL transport) where it compresses."""
    return tuple(C.carrier(group, device, None if codec is SHM else codec)
                 for group, codec in zip((levels.intra, levels.inter), codecs))


_ARRANGEMENTS: dict = {}  # (nodes, device) -> _arrangement's index there


def _arrangement(levels: Levels, device: torch.device) -> torch.Tensor:
    """Group ranks ordered by (local rank, node): row k of the arranged chunks belongs to rank
    index[k], so that local rank j's slice holds the chunks of the ranks (node i, local j). On
    ``device`` (index_copy_ takes no index from elsewhere), uploaded once per topology."""
    nodes = tuple(tuple(node) for node in levels.topology.nodes)
    key = (nodes, device)
    if key not in _ARRANGEMENTS:
        _ARRANGEMENTS[key] = torch.tensor([nodes[i][j] for j in range(len(nodes[0])) for i in range(len(nodes))],
                                          dtype=torch.long).to(device)
    return _ARRANGEMENTS[key]


def _node(fate: Fate, acc: dict, intra, fn, *args):
    """``fn(*args)``, an operation on the node's shared memory (a collective call on the node's
    group: every rank of the node makes it, in a failed call too), or None where it failed: the
    area could not grow (the node's ranks agree on that) or a rank of the node is lost."""
    if fate.broken(intra):
        return None
    try:
        return C.timed(acc, "comm_seconds", fn, *args)
    except OSError as e:
        fate.fail(MEMORY, e)
    except RuntimeError as e:  # gloo: a closed connection, or ZIPCCL_TIMEOUT
        fate.lose(intra, -1, e)
    return None


def run(name: str, levels: Levels, output: torch.Tensor, input: torch.Tensor, op, codecs: tuple, acc: dict,
        fate: Fate) -> tuple:
    """``name`` (all_reduce in place on ``input``, reduce_scatter, all_gather) over both levels;
    ``codecs`` = (intra, inter), each NATIVE, None or a codec object; the intra level may also be SHM.
    A failure on any level goes on poisoned through the others (zipccl.failure); the caller
    settles ``fate`` on the whole group, after the levels' transports, which this returns."""
    nodes = len(levels.topology.nodes)
    local = levels.topology.local_size
    size = nodes * local
    avg = op == dist.ReduceOp.AVG
    level_op = dist.ReduceOp.SUM if avg else op
    memory = levels.memory
    if codecs[0] is SHM and input.device.type != "cpu":
        raise UnsupportedError(f"the intra-node codec 'shm' (host shared memory) takes CPU tensors, not tensors on "
                               f"{input.device}: use 'native' (NCCL's own collective inside the node)")
    if codecs[0] is SHM and memory is None:
        raise UnsupportedError("the intra-node codec 'shm' needs the nodes' shared memory, which this group does not "
                               "have (ranks of a node on different machines, no /dev/shm, or ZIPCCL_SHM=0)")
    intra, inter = _transports(levels, input.device, codecs)

    def intra_reduce_scatter(out, inp):
        if codecs[0] is SHM:
            staged = _node(fate, acc, intra, memory.stage, inp)
            if staged is not None:
                k, m = levels.local_rank, out.numel()
                C.timed(acc, "codec_seconds", fate.guard, REDUCE, memory.reduce, staged, k * m, (k + 1) * m, out,
                        C.check_op(level_op), C.reduce_in_rank_order)
        else:
            run_flat("reduce_scatter", intra, out, inp, level_op, codecs[0], acc, fate=fate)

    if name == "all_reduce":
        flat = input.view(-1)
        numel = flat.numel()
        m = -(-numel // (local * nodes)) * nodes  # the shard: whole chunks for the nodes' all-reduce
        padded = flat if m * local == numel else torch.cat([flat, flat.new_zeros(m * local - numel)])
        if codecs[0] is SHM:
            _shm_all_reduce(levels, flat, padded, m, level_op, size if avg else 1, codecs[1], inter, acc, fate)
            return intra, inter
        shard = torch.empty(m, dtype=flat.dtype, device=flat.device)
        intra_reduce_scatter(shard, padded)
        run_flat("all_reduce", inter, shard, shard, level_op, codecs[1], acc, fate=fate)
        if avg:
            shard.div_(size)
        run_flat("all_gather", intra, padded, shard, None, codecs[0], acc, fate=fate)
        if padded is not flat:
            flat.copy_(padded[:numel])
        return intra, inter
    index = _arrangement(levels, (output if name == "all_gather" else input).device)
    if name == "reduce_scatter":
        m = output.numel()
        arranged = input.view(size, m)[index].view(-1)
        node_sums = torch.empty(nodes * m, dtype=input.dtype, device=input.device)
        intra_reduce_scatter(node_sums, arranged)
        run_flat("reduce_scatter", inter, output.view(-1), node_sums, level_op, codecs[1], acc, fate=fate)
        if avg:
            output.div_(size)
        return intra, inter
    m = input.numel()
    rows = output.view(size, m)
    if codecs[0] is SHM:  # the nodes' level gathers straight into this rank's slot
        claimed = _node(fate, acc, intra, memory.claim, nodes * m, input.dtype)
        across, every = claimed if claimed is not None else (input.new_empty(nodes * m), None)
        run_flat("all_gather", inter, across, input.view(-1), None, codecs[1], acc, fate=fate)
        _node(fate, acc, intra, memory.publish)
        if fate.failed:
            return intra, inter
        for j in range(local):  # local rank j's slot: the ranks (node i, local j), by node
            rows.index_copy_(0, index[j * nodes:(j + 1) * nodes], every[j].view(nodes, m))
        return intra, inter
    across = torch.empty(nodes * m, dtype=input.dtype, device=input.device)
    run_flat("all_gather", inter, across, input.view(-1), None, codecs[1], acc, fate=fate)
    arranged = torch.empty(size * m, dtype=input.dtype, device=input.device)
    run_flat("all_gather", intra, arranged, across, None, codecs[0], acc, fate=fate)
    rows.index_copy_(0, index, arranged.view(size, m))
    return intra, inter


def _shm_all_reduce(levels: Levels, flat, padded, m: int, op, divide: int, inter_codec, inter, acc: dict,
                    fate: Fate) -> None:
    """The all-reduce with the node's shared memory: every rank's data goes in once (stage); the
    node's sum of this rank's shard is made piece by piece, straight into this rank's slot of
    the next phase, just before the nodes' pipeline encodes each piece (``ready``), so that
    summing overlaps the pieces on the wire; the nodes' all-reduce works in that slot, and
    every rank reads the whole result from the node's slots."""
    memory, nodes = levels.memory, len(levels.topology.nodes)
    intra = TorchTransport.of(levels.intra)
    staged = _node(fate, acc, intra, memory.stage, padded)
    claimed = _node(fate, acc, intra, memory.claim, m, flat.dtype)
    shard, every = claimed if claimed is not None else (flat.new_zeros(m), None)
    base, per_node, op_code = levels.local_rank * m, m // nodes, C.check_op(op)

    def ready(a: int, b: int) -> None:
        for j in range(nodes):
            lo = j * per_node
            C.timed(acc, "codec_seconds", memory.reduce, staged, base + lo + a, base + lo + b,
                    shard[lo + a:lo + b], op_code, C.reduce_in_rank_order)

    run_flat("all_reduce", inter, shard, shard, op, inter_codec, acc, ready=ready, fate=fate)
    if divide > 1:
        shard.div_(divide)
    _node(fate, acc, intra, memory.publish)
    if fate.failed:
        return
    if padded is flat:
        flat.view(every.shape).copy_(every)
    else:
        flat.copy_(every.reshape(-1)[:flat.numel()])
