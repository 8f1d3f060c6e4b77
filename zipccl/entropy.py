"""Top-k density driven by gradient entropy (the EDGC idea, arXiv 2511.10333, applied to top-k).

EDGC sets a compression rate from the entropy trend: r_new = g^-1(exp(H0 - H1) g(r0)),
where g maps the rate to the compression error. Here the rate is the top-k
density d and g(d) is the share of gradient energy top-k at density d leaves out.
When entropy falls (H1 < H0) gradients concentrate, the allowed error grows by
exp(H0 - H1), and the density falls; when entropy rises the density rises.

Every number comes from rank-consistent inputs, or the ranks would choose
different densities and deadlock: the sample positions are drawn from a
generator seeded by (seed, step), the scale is quantised and summed across
ranks, and the value histogram (from which both H and g are computed) is summed
across ranks through ``allreduce`` (an in-place int64 sum, e.g. dist.all_reduce).
"""

from __future__ import annotations

import math

import torch

__all__ = ["EntropyRate"]

START = 0.1  # default density right after warm-up


class EntropyRate:
    """Density schedule: lossless during ``warmup`` steps, then EDGC's update every ``every`` steps.

    sample: fraction of elements in the estimate (at least 4096); bins: histogram
    bins over +-4 robust sigmas; window: estimates averaged before a decision;
    bounds: [min_density, max_density]; start: the density right after warm-up
    (None: START clamped into the bounds); a decision moves the density by at most
    ``max_step`` x. The defaults (warm-up 20, start 0.1) are the best of the
    convergence benchmark in docs/PERFORMANCE.md.
    """

    def __init__(self, min_density: float = 0.01, max_density: float = 0.25, warmup: int = 20, every: int = 10,
                 sample: float = 0.01, bins: int = 256, window: int = 3, max_step: float = 2.0, seed: int = 0,
                 start: float | None = None):
        if not 0 < min_density <= max_density <= 1:
            raise ValueError(f"need 0 < min_density <= max_density <= 1, got {min_density}, {max_density}")
        self.start = min(max(START, min_density), max_density) if start is None else start
        if not min_density <= self.start <= max_density:
            raise ValueError(f"start density {self.start} outside [{min_density}, {max_density}]")
        if warmup < 0 or every < 1 or not 0 < sample <= 1 or bins < 8 or window < 1 or max_step <= 1:
            raise ValueError("warmup >= 0, every >= 1, 0 < sample <= 1, bins >= 8, window >= 1, max_step > 1")
        self.min_density, self.max_density = min_density, max_density
        self.warmup, self.every, self.sample, self.bins = warmup, every, sample, bins
        self.window, self.max_step, self.seed = window, max_step, seed
        self.density: float | None = None
        self.entropies: list[float] = []
        self.reference: float | None = None
        self.decisions: list[dict] = []
        self.nonfinite = 0  # NaN and Inf samples seen (all ranks), left out of the estimates

    def histogram(self, grad: torch.Tensor, step: int, allreduce) -> torch.Tensor | None:
        """Summed over ranks: counts of sampled values in ``bins`` bins over +-4 sigma; None
        where no rank sampled a finite value (NaN and Inf are counted in ``nonfinite`` and left
        out, the same way on every rank)."""
        flat = grad.reshape(-1)
        count = min(flat.numel(), max(4096, int(self.sample * flat.numel())))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        values = flat[torch.randint(0, flat.numel(), (count,), generator=gen)].float() if count else flat.float()
        values = values[torch.isfinite(values)]
        # Robust scale (a heavy-tailed sample biases the standard deviation): 1.4826 x median |v|,
        # quantised to 1/16 of a binade and averaged over ranks in integers, so all ranks agree.
        q = torch.tensor([0, 0, count - values.numel()], dtype=torch.int64)
        if values.numel():
            q[0], q[1] = round(16 * math.log2(max(float(values.abs().median()) * 1.4826, 1e-30))), 1
        allreduce(q)
        self.nonfinite += int(q[2])
        if not q[1]:
            return None
        sigma = 2.0 ** (q[0].item() / q[1].item() / 16)
        edges = torch.clamp(((values / (8 * sigma) + 0.5) * self.bins).floor(), 0, self.bins - 1).long()
        hist = torch.bincount(edges, minlength=self.bins).to(torch.int64).cpu()  # error() works on the host
        allreduce(hist)
        return hist

    def entropy(self, hist: torch.Tensor) -> float:
        p = hist[hist > 0].double() / hist.sum()
        return float(-(p * p.log2()).sum())

    def error(self, hist: torch.Tensor, density: float) -> float:
        """g(d): the share of energy outside the largest-magnitude ``density`` of the histogram."""
        centers = ((torch.arange(self.bins, dtype=torch.float64) + 0.5) / self.bins - 0.5) * 8
        order = torch.argsort(centers.abs(), descending=True, stable=True)
        counts = hist.double()[order]
        energy = counts * centers[order] ** 2
        total = float(energy.sum()) or 1.0
        keep = density * float(counts.sum())
        cum = torch.cumsum(counts, 0)
        full = int((cum <= keep).sum())
        kept = float(energy[:full].sum())
        if full < self.bins:  # part of the next bin
            prev = float(cum[full - 1]) if full else 0.0
            kept += float(energy[full]) * (keep - prev) / max(float(counts[full]), 1.0)
        return max(0.0, 1.0 - kept / total)

    def _inverse(self, hist: torch.Tensor, target: float) -> float:
        """The smallest density in the bounds whose error is <= target (bisection; g falls with d)."""
        lo, hi = self.min_density, self.max_density
        if self.error(hist, lo) <= target:
            return lo
        for _ in range(40):
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if self.error(hist, mid) <= target else (mid, hi)
        return hi

    def update(self, step: int, grad: torch.Tensor, allreduce=lambda t: None) -> float | None:
        """The density to use at ``step`` (None: stay lossless); call with the same step on all ranks."""
        if step % self.every and not (step >= self.warmup and self.density is None):
            return self.density
        hist = self.histogram(grad, step, allreduce)
        if hist is None:  # nothing finite on any rank: no estimate this time, the density stays
            self.decisions.append(dict(step=step, entropy=None, density=self.density, error=None, skipped=True))
            return self.density
        self.entropies.append(self.entropy(hist))
        smoothed = sum(self.entropies[-self.window:]) / len(self.entropies[-self.window:])
        if step < self.warmup:
            self.decisions.append(dict(step=step, entropy=smoothed, density=None, error=None))
            return None
        if self.density is None:
            self.density, self.reference = self.start, smoothed
        else:
            target = min(0.999, math.exp(self.reference - smoothed) * self.error(hist, self.density))
            proposal = self._inverse(hist, target)
            self.density = min(self.max_density, max(self.min_density, self.density / self.max_step,
                                                     min(self.density * self.max_step, proposal)))
            self.reference = smoothed
        self.decisions.append(dict(step=step, entropy=smoothed, density=self.density,
                                   error=self.error(hist, self.density)))
        return self.density
