"""Lossy all-reduce with error feedback and a density policy, kept across training steps.

``Compressor`` is what ``codec="topk"`` / ``"entropy"`` mean when a tensor is
sent again and again: residuals per tensor (what was not sent is added to the
next gradient), the density (fixed, or driven by the gradient entropy), and the
layer rules that keep small tensors lossless. The DDP hook (zipccl.ddp) uses it
per bucket; ``zipccl.all_reduce(t, codec="entropy", name="layer.weight")`` uses a
process-wide one per codec.

    comp = zipccl.lossy.Compressor("entropy")
    for name, p in model.named_parameters():          # every step, same order on every rank
        comp.all_reduce(p.grad, name, op=dist.ReduceOp.AVG)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives
from .entropy import EntropyRate
from .feedback import Residuals
from .rules import LayerRules
from .stats import stats as _snapshot
from .topk import TopK

__all__ = ["Compressor", "default"]

_DEFAULTS: dict = {}


class Compressor:
    """codec: "topk" (``density`` fixed), "entropy" (density from ``rate``, an EntropyRate) or a
    TopK instance. residual_dtype: float32, or bfloat16 for half the memory. rules: which
    tensors may go lossy (None: all); the others are sent lossless. sampled: select by a
    sampled threshold (TopK(sampled=True): about k entries, several times faster).
    value_dtype: send the values in this dtype (torch.bfloat16 for fp32 gradients: 6 instead
    of 8 bytes per entry); error feedback keeps the rounding, the sum is rounded once more."""

    def __init__(self, codec="topk", density: float = 0.01, rate: EntropyRate | None = None,
                 residual_dtype: torch.dtype = torch.float32, rules: LayerRules | None = LayerRules(),
                 sampled: bool = False, value_dtype: torch.dtype | None = None):
        if not (codec in ("topk", "entropy") or isinstance(codec, TopK)):
            raise ValueError(f"lossy codec must be 'topk', 'entropy' or a TopK instance, got {codec!r}")
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if value_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"value_dtype must be None, float32, bfloat16 or float16, got {value_dtype}")
        self.codec, self.density, self.rules, self.sampled = codec, density, rules, sampled
        self.value_dtype = value_dtype
        self.rate = rate if rate is not None else (EntropyRate() if codec == "entropy" else None)
        self.residuals = Residuals(residual_dtype)
        self.densities: list = []   # per step: the density used (None: lossless warm-up)
        self.step = -1              # all_reduce's step counter (the DDP hook passes its own)
        self.anchor = None          # the first lossy tensor's name: seeing it again starts a step

    def choose(self, step: int, first: bool, grad: torch.Tensor, group) -> float | None:
        """This step's density; the first tensor of a step decides (identically on every rank)."""
        if isinstance(self.codec, TopK):
            density = self.codec.density
        elif self.codec == "topk":
            density = self.density
        elif first:
            density = self.rate.update(step, grad, lambda t: dist.all_reduce(t, group=group))
        else:
            density = self.rate.density
        if first:
            self.densities.append(density)
        return density

    def reduce(self, flat: torch.Tensor, key, step: int, first: bool, group, op=dist.ReduceOp.AVG) -> dict:
        """Average (or sum) ``flat`` in place: residual added, top-k sent, the rest kept for later."""
        density = self.choose(step, first, flat, group)
        if density is None:  # entropy warm-up: lossless
            collectives.all_reduce(flat, op=op, group=group, codec="lossless")
            return _snapshot()["last"]
        codec = self.codec if isinstance(self.codec, TopK) else TopK(density, sampled=self.sampled)
        compensated = self.residuals.compensate(key, flat)
        wire = flat if self.value_dtype in (None, flat.dtype) else torch.empty_like(flat, dtype=self.value_dtype)
        wire.copy_(compensated)
        idx, values = codec.select(wire, remember=True)  # the collective below reuses it
        sent = torch.zeros_like(compensated)
        sent[idx.long()] = values.float()
        self.residuals.update(key, compensated, sent)
        collectives.all_reduce(wire, op=op, group=group, codec=codec)
        if wire is not flat:
            flat.copy_(wire)
        return _snapshot()["last"]

    def all_reduce(self, tensor: torch.Tensor, name: str, op=dist.ReduceOp.AVG, group=None) -> dict:
        """All-reduce one named tensor in place (same names, same order on every rank); returns the
        call's counters. Tensors the rules keep exact go lossless."""
        if self.rules is not None and not self.rules.lossy(name, tensor):
            collectives.all_reduce(tensor, op=op, group=group, codec="lossless")
            return _snapshot()["last"]
        if not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} must be contiguous")
        if self.anchor is None:
            self.anchor = name
        if name == self.anchor:
            self.step += 1
        return self.reduce(tensor.view(-1), name, self.step, name == self.anchor, group, op)

    def stats(self) -> dict:
        return dict(densities=list(self.densities), residual_bytes=self.residuals.memory_bytes(),
                    decisions=list(self.rate.decisions) if self.rate else [])


def default(codec: str) -> Compressor:
    """The process-wide compressor behind ``zipccl.all_reduce(..., codec=codec, name=...)``."""
    if codec not in _DEFAULTS:
        _DEFAULTS[codec] = Compressor(codec)
    return _DEFAULTS[codec]
