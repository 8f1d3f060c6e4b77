"""The entropy-driven density: warm-up, bounds, direction of change, rank consistency."""

import threading

import pytest
import torch

from zipccl.entropy import EntropyRate


def stream(step: int, power: float, n: int = 200_000) -> torch.Tensor:
    """Gradients whose shape sets the entropy: sign(g) |g|^power is Gaussian at power 1 and
    more peaked, with heavier tails (lower entropy at the same robust scale), as power grows."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(step))
    return torch.sign(g) * g.abs() ** power


def run(rate: EntropyRate, powers, allreduce=lambda t: None):
    return [rate.update(step, stream(step, p), allreduce) for step, p in enumerate(powers)]


def test_entropy_of_the_synthetic_streams_differs():
    r = EntropyRate(sample=0.05)
    flat = r.entropy(r.histogram(stream(0, 1.0), 0, lambda t: None))
    peaked = r.entropy(r.histogram(stream(0, 3.0), 0, lambda t: None))
    assert flat - peaked > 0.3


def test_warmup_stays_lossless_and_bounds_hold():
    rate = EntropyRate(min_density=0.02, max_density=0.2, warmup=10, every=2, start=0.2)
    dens = run(rate, [1.0] * 10 + [4.0] * 30)
    assert all(d is None for d in dens[:10])
    assert all(0.02 <= d <= 0.2 for d in dens[10:])
    assert dens[10] == 0.2 and dens[-1] < 0.1  # entropy fell after warm-up: the density followed
    assert dens[12] == 0.1  # ... by at most max_step (2x) per decision
    assert all(set(d) == {"step", "entropy", "density", "error"} for d in rate.decisions)


def test_falling_entropy_lowers_density_and_rising_raises_it():
    down = EntropyRate(min_density=0.001, max_density=0.5, warmup=4, every=2, window=1, start=0.05)
    dens = run(down, [1.0] * 6 + [2.5] * 10)
    assert dens[-1] < 0.05
    up = EntropyRate(min_density=0.001, max_density=0.5, warmup=4, every=2, window=1, start=0.05)
    dens = run(up, [2.5] * 6 + [1.0] * 10)
    assert dens[-1] > 0.05


class TwoRanks:
    """An in-process stand-in for dist.all_reduce(SUM) between two threads."""

    def __init__(self):
        self.barrier = threading.Barrier(2)
        self.slots = [None, None]

    def allreduce_for(self, rank):
        def allreduce(t):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            t.copy_(total)
        return allreduce


def test_ranks_with_different_gradients_choose_identical_densities():
    comm, out = TwoRanks(), {}

    def rank(r):
        rate = EntropyRate(min_density=0.005, max_density=0.5, warmup=3, every=1, window=2, start=0.1)
        out[r] = [rate.update(step, stream(step * 10 + r, 1.0 + 0.1 * step + r), comm.allreduce_for(r))
                  for step in range(12)]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out[0] == out[1] and out[0][-1] is not None


def test_sample_tracks_the_full_entropy(real_grads):
    rate, full = EntropyRate(sample=0.01), EntropyRate(sample=1.0)
    h_sample = rate.entropy(rate.histogram(real_grads, 7, lambda t: None))
    h_full = full.entropy(full.histogram(real_grads, 7, lambda t: None))
    assert abs(h_sample - h_full) < 0.1


def test_bad_configuration():
    for kwargs in (dict(min_density=0.5, max_density=0.1), dict(min_density=0.0), dict(every=0),
                   dict(start=0.9, max_density=0.5)):
        with pytest.raises(ValueError):
            EntropyRate(**kwargs)
