"""Per-link codecs: which codec carries each peer's messages of an all-to-all or a send.

Inside a node (loopback, shared memory, NVLink) the link outruns any codec, so a peer there
gets ``PLAIN``: the tensor's own bytes, sent as they are and received straight into the
caller's buffer (no header, no copy: the sizes are known on both ends). Across nodes a peer
gets the call's codec. ``per_peer`` makes that list from a group's nodes (zipccl.topology).
"""

from __future__ import annotations

import torch

from ..errors import FormatError
from .resolve import Composite


class _Plain:
    """The link's codec "native": the bytes of the tensor itself, no header (both ends know the
    size). ``encode`` is a view, ``decode`` a copy (only where a receive could not land in place)."""
    name = "plain"
    exact = True

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1).view(torch.uint8)

    def decode(self, packet: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        dest = out.view(-1).view(torch.uint8)
        if packet.numel() != dest.numel():
            raise FormatError(f"a plain message of {packet.numel()} bytes for {dest.numel()} bytes of {out.dtype}")
        if packet.data_ptr() != dest.data_ptr():
            dest.copy_(packet)
        return out

    def max_encoded_size(self, numel: int, dtype: torch.dtype) -> int:
        return numel * torch.empty(0, dtype=dtype).element_size()

    def __repr__(self) -> str:
        return "plain"


PLAIN = _Plain()


def per_peer(nodes, rank: int, intra, inter) -> list:
    """Each group rank's codec as seen from ``rank``: ``intra`` for the ranks of its node
    (``nodes``: group ranks per node, zipccl.topology.Topology.nodes), ``inter`` for the others
    (None for ``rank`` itself, whose chunk is copied)."""
    mine = next(node for node in nodes if rank in node)
    size = sum(len(node) for node in nodes)
    return [None if j == rank else intra if j in mine else inter for j in range(size)]


class Links(Composite):
    """The plan of a call whose peers use different codecs: inside the nodes, between them."""
    __slots__ = ()

    def __init__(self, intra, inter):
        super().__init__("links", (intra, inter))
