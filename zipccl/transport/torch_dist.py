"""Transport over any torch.distributed ProcessGroup (gloo in tests, nccl on GPUs)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Transport


class TorchTransport(Transport):
    """Collectives of ``torch.distributed`` on ``group`` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call zipccl.launch.init() or "
                               "torch.distributed.init_process_group() first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self.meta_device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def exchange(self, meta: torch.Tensor) -> torch.Tensor:
        meta = meta.to(self.meta_device, torch.int64)
        out = torch.empty(self.size * meta.numel(), dtype=torch.int64, device=self.meta_device)
        dist.all_gather_single(out, meta, group=self.group)
        return out.reshape(self.size, -1).cpu()

    def all_to_all(self, send, send_splits, recv_splits):
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=send.device)
        if sum(send_splits) or sum(recv_splits):
            dist.all_to_all_single(recv, send, output_split_sizes=list(recv_splits),
                                   input_split_sizes=list(send_splits), group=self.group)
        return recv

    def isend(self, send, dst, tag=0):
        return dist.isend(send, group=self.group, group_dst=dst, tag=tag)

    def irecv(self, recv, src, tag=0):
        return dist.irecv(recv, group=self.group, group_src=src, tag=tag)

    def native(self, name, *tensors, op=None):
        if name == "all_reduce":
            dist.all_reduce(tensors[0], op=op, group=self.group)
        elif name == "reduce_scatter":
            dist.reduce_scatter_single(tensors[0], tensors[1], op=op, group=self.group)
        elif name == "all_gather":
            dist.all_gather_single(tensors[0], tensors[1], group=self.group)
        else:
            raise ValueError(f"unknown collective {name!r}")
