"""Which tensors may travel lossy: layer-selective compression (after TAGC).

Biases, normalisation weights and other small tensors are a sliver of the bytes
but sensitive to sparsification; sending them lossless costs little and keeps
them exact. ``LayerRules`` decides per parameter, by shape and (when the model
is known) by name; ``segments`` turns the decisions into element ranges of a
DDP bucket, whose buffer holds its parameters' gradients back to back.
"""

from __future__ import annotations

import torch

__all__ = ["LayerRules", "segments"]


class LayerRules:
    """A parameter goes lossy only if it has 2+ dimensions, at least ``min_numel`` elements, and
    a name containing none of ``keep`` (case-insensitive). ``LayerRules(min_numel=0, keep=())``
    with ``exact_1d=False`` makes everything lossy."""

    def __init__(self, min_numel: int = 4096, keep=("bias", "norm", "ln"), exact_1d: bool = True):
        if min_numel < 0:
            raise ValueError(f"min_numel must be >= 0, got {min_numel}")
        self.min_numel, self.keep, self.exact_1d = int(min_numel), tuple(k.lower() for k in keep), exact_1d

    def lossy(self, name: str, param: torch.Tensor) -> bool:
        if self.exact_1d and param.dim() < 2:
            return False
        return param.numel() >= self.min_numel and not any(k in name.lower() for k in self.keep)

    def __repr__(self) -> str:
        return f"LayerRules(min_numel={self.min_numel}, keep={self.keep}, exact_1d={self.exact_1d})"


def segments(rules: LayerRules, params, names: dict, numel: int):
    """(lossy ranges, exact ranges) of a bucket holding ``params`` back to back, each a list of
    (start, end) element ranges with neighbours merged, or None when the parameters do not tile
    ``numel`` elements (then the whole bucket is lossy)."""
    lossy, exact, offset = [], [], 0
    for p in params:
        ranges = lossy if rules.lossy(names.get(id(p), ""), p) else exact
        if ranges and ranges[-1][1] == offset:
            ranges[-1] = (ranges[-1][0], offset + p.numel())
        else:
            ranges.append((offset, offset + p.numel()))
        offset += p.numel()
    return (lossy, exact) if offset == numel else None
