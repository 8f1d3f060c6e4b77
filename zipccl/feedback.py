"""Error feedback for lossy codecs: keep what was not sent and add it to the next gradient.

``residual = (grad + residual) - sent``, per key. Keys name a tensor (a parameter
name, or a DDP bucket as (index, numel): DDP rebuilds its buckets after the first
iteration, and a key whose numel changed starts from zero). Residuals are kept
in fp32 (exact) or bf16 (half the memory).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Residuals", "rank_in", "check_saved_by"]


class Residuals:
    __slots__ = ("dtype", "store")

    def __init__(self, dtype: torch.dtype = torch.float32):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"residual dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        self.store: dict = {}

    def get(self, key, numel: int, device: torch.device | None = None) -> torch.Tensor | None:
        """The residual kept for ``key`` if it has ``numel`` elements, else None (start afresh);
        moved to ``device`` once where it is elsewhere (a checkpoint loaded onto the CPU)."""
        old = self.store.get(key)
        if old is None or old.numel() != numel:
            return None
        if device is not None and old.device != device:
            old = self.store[key] = old.to(device)
        return old

    def compensate(self, key, grad: torch.Tensor) -> torch.Tensor:
        """``grad + residual`` in fp32 (a new tensor; ``grad`` is not modified)."""
        out = grad.reshape(-1).to(torch.float32, copy=True)
        old = self.get(key, out.numel(), out.device)
        if old is not None:
            out += old.float()
        return out

    def update(self, key, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep ``compensated - sent`` (``sent`` dense: zeros where nothing was sent), 0 where that
        is not finite: an overflowed step's value (which GradScaler skips) is not carried, or it
        would stay NaN for good (Inf - Inf)."""
        residual = compensated - sent.reshape(-1).float()
        self.store[key] = residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).to(self.dtype)

    def restore(self, key, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Add back the values at ``idx`` that a failed call was to send (finite ones: as in
        ``update``, an overflowed value is not carried)."""
        residual = self.store[key]
        residual.index_add_(0, idx.to(residual.device).long(),
                            values.to(residual.device, residual.dtype).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0))

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.store.values())

    def __getstate__(self):
        return {"dtype": self.dtype, "store": self.store}

    def __setstate__(self, state):
        self.dtype, self.store = state["dtype"], state["store"]


def rank_in(group=None) -> tuple[int, int] | None:
    """(this process's rank in ``group``, its size), or None without a process group: what a
    checkpoint of residuals records."""
    if not dist.is_initialized():
        return None
    return dist.get_rank(group), dist.get_world_size(group)


def check_saved_by(saved, here, holds: bool) -> None:
    """Residuals are a rank's own (what it did not send; under FSDP, laid out by its shard): a
    state that ``holds`` some, saved by another rank or world size, is refused, not applied at
    the wrong positions or silently dropped."""
    if holds and saved is not None and here is not None and tuple(saved) != tuple(here):
        raise ValueError(f"these error-feedback residuals were saved by rank {saved[0]} of {saved[1]}, and this is "
                         f"rank {here[0]} of {here[1]}: load each rank's own state, or start the residuals afresh "
                         "(a new state)")
