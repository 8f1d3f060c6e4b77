"""Code tables: package-merge lengths and the per-block table choice.

Every implementation takes its tables from zipccl/reference/tables.py, so the
cross-implementation tests cannot catch a fault here: these check the tables
against independent definitions (Huffman by a heap, the optimal length-limited
cost by dynamic programming over the code tree, package-merge spelled out with
explicit member counts, the cheapest table by brute force).
"""

from __future__ import annotations

import heapq
import math
from functools import lru_cache

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from zipccl.format import LAYOUTS, MAXLEN, NSYM
from zipccl.reference import tables as T

FREQS = st.lists(st.integers(0, 1 << 20), min_size=NSYM, max_size=NSYM).map(lambda f: np.array(f, np.int64))


def obvious_package_merge(freqs: np.ndarray, maxlen: int) -> np.ndarray:
    """Package-merge with each item's member counts: the slow, plain statement of the rule
    (stable order by weight, ties by symbol, leaves before packages of equal weight)."""
    active = [s for s in sorted(range(len(freqs)), key=lambda s: (freqs[s], s)) if freqs[s]]
    lengths = np.zeros(len(freqs), np.int64)
    if len(active) == 1:
        lengths[active[0]] = 1
    if len(active) <= 1:
        return lengths
    leaves = [(int(freqs[s]), np.eye(len(freqs), dtype=np.int64)[s]) for s in active]
    items = list(leaves)
    for _ in range(maxlen - 1):
        packages = [(items[2 * k][0] + items[2 * k + 1][0], items[2 * k][1] + items[2 * k + 1][1])
                    for k in range(len(items) // 2)]
        merged, i, k = [], 0, 0
        while i < len(leaves) or k < len(packages):
            if k >= len(packages) or (i < len(leaves) and leaves[i][0] <= packages[k][0]):
                merged.append(leaves[i])
                i += 1
            else:
                merged.append(packages[k])
                k += 1
        items = merged
    for _, members in items[:2 * len(active) - 2]:
        lengths += members
    return lengths


def huffman_cost(freqs: np.ndarray) -> int:
    heap = [int(f) for f in freqs if f]
    if len(heap) == 1:
        return heap[0]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


@settings(max_examples=300, deadline=None)
@given(FREQS, st.sampled_from([MAXLEN, 8, 6]))
def test_package_merge_matches_the_obvious_rule(freqs, maxlen):
    assert np.array_equal(T.limited_lengths(freqs, maxlen), obvious_package_merge(freqs, maxlen))


def optimal_limited_cost(freqs, maxlen: int) -> int:
    """The least cost sum(freq * length) of any prefix code with lengths <= maxlen, by dynamic
    programming over the code tree level by level (no package-merge involved).

    Some optimal code gives heavier symbols lengths no longer than lighter ones, so with weights
    sorted heaviest first, each level of the tree takes the next k symbols as leaves and splits its
    other free nodes into twice as many at the level below. A symbol pays its weight once for every
    level it reaches, so a level costs the weight of the symbols not yet placed above it.
    """
    w = sorted((int(f) for f in freqs if f), reverse=True)
    n = len(w)
    if n <= 1:
        return sum(w)  # one symbol still takes a 1-bit code
    unplaced = [sum(w[i:]) for i in range(n + 1)]

    @lru_cache(maxsize=None)
    def best(depth: int, placed: int, free: int) -> float:
        # More free nodes than symbols left is no better than as many, hence the min() below.
        if depth > maxlen or free == 0:
            return math.inf
        options = []
        for k in range(min(free, n - placed) + 1):
            if placed + k == n:
                options.append(0)
            else:
                options.append(best(depth + 1, placed + k, min(2 * (free - k), n - placed - k)))
        return unplaced[placed] + min(options)

    return best(1, 0, 2)


# Powers of two spread over 30 octaves: unconstrained Huffman codes get much longer than 12 bits.
SKEWED = st.lists(st.integers(-1, 30), min_size=NSYM, max_size=NSYM).map(
    lambda e: np.array([0 if x < 0 else 1 << x for x in e], np.int64))


def test_the_dp_optimum_is_huffman_when_the_limit_is_loose():
    # The independent optimum checked against the textbook one, so that it can be trusted below.
    rng = np.random.default_rng(3)
    for _ in range(20):
        freqs = rng.integers(0, 1 << 20, NSYM) * (rng.random(NSYM) < 0.8)
        assert optimal_limited_cost(freqs, NSYM) == huffman_cost(freqs)
    assert optimal_limited_cost(np.ones(NSYM), 5) == 5 * NSYM  # a full tree: every code 5 bits
    # Huffman gives 1,2,3,4,4 bits (cost 30); within 3 bits the best is 1,3,3,3,3 (2,2,2,3,3 costs 34).
    assert huffman_cost(np.array([1, 1, 2, 4, 8])) == 30
    assert optimal_limited_cost([1, 1, 2, 4, 8], 3) == 1 * 8 + 3 * (4 + 2 + 1 + 1)


@settings(max_examples=120, deadline=None)
@given(st.one_of(FREQS, SKEWED), st.sampled_from([MAXLEN, 8, 6]))
def test_lengths_are_an_optimal_length_limited_prefix_code(freqs, maxlen):
    lengths = T.limited_lengths(freqs, maxlen)
    used = lengths[freqs > 0]
    assert (lengths[freqs == 0] == 0).all() and (used >= 1).all() and (used <= maxlen).all()
    assert int((1 << (maxlen - used)).sum()) <= 1 << maxlen  # Kraft: a prefix code exists
    assert int((lengths * freqs).sum()) == optimal_limited_cost(freqs, maxlen)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(100, 400), min_size=NSYM, max_size=NSYM))
def test_optimal_when_the_limit_cannot_bind(freqs):
    # Weights within a factor 4: a symbol of probability >= 1/128 sits at depth < log_phi(128) + 1 < 12.
    freqs = np.array(freqs, np.int64)
    assert int((T.limited_lengths(freqs) * freqs).sum()) == huffman_cost(freqs)


def test_limit_binds_on_fibonacci_weights():
    fib = [1, 1]
    while len(fib) < NSYM:
        fib.append(fib[-1] + fib[-2])
    freqs = np.array(fib, np.int64)
    lengths = T.limited_lengths(freqs)
    assert lengths.max() == MAXLEN  # unconstrained Huffman would reach 31 bits
    assert np.array_equal(lengths, obvious_package_merge(freqs, MAXLEN))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8), st.sampled_from(list(LAYOUTS)), st.integers(0, 2**32 - 1))
def test_each_block_gets_its_cheapest_table(nblocks, ntables, dtype, seed):
    rng = np.random.default_rng(seed)
    hist = rng.integers(0, 200, (nblocks, NSYM)) * (rng.random((nblocks, NSYM)) < 0.5)
    hist[:, 28] += rng.integers(1, 4000, nblocks)
    layout = LAYOUTS[dtype]
    lengths, assign, cost = T.choose_tables(hist.astype(np.int64), ntables, layout)
    assert lengths.shape == (ntables, NSYM) and (lengths >= 1).all() and (lengths <= MAXLEN).all()
    bits = hist @ (lengths + T.extra_bits(layout)).T  # (blocks, tables), by brute force
    assert np.array_equal(cost, bits.min(axis=1))
    assert np.array_equal(assign, bits.argmin(axis=1))  # ties to the lowest id
    for t in range(ntables):  # every table is a prefix code
        assert int((1 << (MAXLEN - lengths[t])).sum()) <= 1 << MAXLEN


def test_table_choice_is_deterministic_across_calls():
    rng = np.random.default_rng(5)
    hist = rng.integers(0, 300, (50, NSYM)).astype(np.int64)
    a = T.choose_tables(hist, 8, LAYOUTS[torch.bfloat16])
    b = T.choose_tables(hist.copy(), 8, LAYOUTS[torch.bfloat16])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
