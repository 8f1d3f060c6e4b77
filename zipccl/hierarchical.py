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
backend does). AVG is SUM at both levels, then one division by the group's size. For 16-bit
types this differs from a flat all-reduce in the last bits (two roundings instead of one);
lossless still equals raw under the same algorithm, bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import run_flat
from .topology import Levels
from .transport import TorchTransport

__all__ = ["run"]


def _transports(levels: Levels) -> tuple[TorchTransport, TorchTransport]:
    return TorchTransport(levels.intra), TorchTransport(levels.inter)


def _arrangement(levels: Levels) -> torch.Tensor:
    """Group ranks ordered by (local rank, node): row k of the arranged chunks belongs to rank
    index[k], so that local rank j's slice holds the chunks of the ranks (node i, local j)."""
    nodes = levels.topology.nodes
    return torch.tensor([nodes[i][j] for j in range(len(nodes[0])) for i in range(len(nodes))], dtype=torch.long)


def run(name: str, levels: Levels, output: torch.Tensor, input: torch.Tensor, op, codecs: tuple, acc: dict) -> None:
    """``name`` (all_reduce in place on ``input``, reduce_scatter, all_gather) over both levels;
    ``codecs`` = (intra, inter), each NATIVE, None or a codec object."""
    intra, inter = _transports(levels)
    nodes = len(levels.topology.nodes)
    local = levels.topology.local_size
    size = nodes * local
    avg = op == dist.ReduceOp.AVG
    level_op = dist.ReduceOp.SUM if avg else op
    if name == "all_reduce":
        flat = input.view(-1)
        numel = flat.numel()
        m = -(-numel // local)
        padded = flat if m * local == numel else torch.cat([flat, flat.new_zeros(m * local - numel)])
        shard = torch.empty(m, dtype=flat.dtype, device=flat.device)
        run_flat("reduce_scatter", intra, shard, padded, level_op, codecs[0], acc)
        run_flat("all_reduce", inter, shard, shard, level_op, codecs[1], acc)
        if avg:
            shard.div_(size)
        run_flat("all_gather", intra, padded, shard, None, codecs[0], acc)
        if padded is not flat:
            flat.copy_(padded[:numel])
        return
    index = _arrangement(levels)
    if name == "reduce_scatter":
        m = output.numel()
        arranged = input.view(size, m)[index].view(-1)
        node_sums = torch.empty(nodes * m, dtype=input.dtype, device=input.device)
        run_flat("reduce_scatter", intra, node_sums, arranged, level_op, codecs[0], acc)
        run_flat("reduce_scatter", inter, output.view(-1), node_sums, level_op, codecs[1], acc)
        if avg:
            output.div_(size)
        return
    m = input.numel()
    across = torch.empty(nodes * m, dtype=input.dtype, device=input.device)
    run_flat("all_gather", inter, across, input.view(-1), None, codecs[1], acc)
    arranged = torch.empty(size * m, dtype=input.dtype, device=input.device)
    run_flat("all_gather", intra, arranged, across, None, codecs[0], acc)
    output.view(size, m).index_copy_(0, index, arranged.view(size, m))
