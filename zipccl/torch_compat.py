"""The torch.distributed names that changed between the torch versions zipccl supports (>= 2.4),
and the ways of its functions that zipccl's keep.

torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to
``all_gather_single`` and ``reduce_scatter_single`` (the old names warn there); torch 2.11,
the CUDA image's, has only the old ones.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single", "not_in"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def not_in(group, name: str) -> bool:
    """Whether this rank is outside ``group`` (what ``new_group`` gives the ranks it leaves out):
    torch.distributed's functions then warn and do nothing (return None; a receive -1), and so
    do zipccl's."""
    if group is None or group != dist.GroupMember.NON_GROUP_MEMBER:
        return False
    world = dist.GroupMember.WORLD
    warnings.warn(f"Running {name} on global rank {-1 if world is None else world.rank()} which does not belong "
                  "to the given group.", stacklevel=3)
    return True
