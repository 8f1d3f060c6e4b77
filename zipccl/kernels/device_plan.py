"""The GPU codec's per-block bookkeeping, computed with torch operations on the device.

Encode (``plan``):
reference/plan.py turns the blocks' histograms into code tables (reference/tables.py's
clustering) and a layout (raw blocks, offsets, the block index). Run on the host, it cost the
GPU encoder a read of 132 bytes per block and, on an H200's host, 12 ms of numba per 64 MiB of
bf16: 20 times its two kernels (docs/GPU.md). Here every per-block step runs on the tensor's
device with the same integer arithmetic and tie-breaking, so the bytes are the host plan's
(tests/test_device_plan.py). The host sees only what it must: each clustering round's summed
histograms (tables x 32 counts), from which it builds the Huffman code lengths, and the
packet's two data section sizes, which size the packet.

Costs are products of counts (at most 32768) and bit widths (at most 31) summed over 32
symbols, below 2^53: the float64 matrix products that compute them are exact. Ties between
tables go to the lowest id and ties between blocks' peaks to the lowest block number, as in
tables._choose, by making every compared key unique.

Decode (``read_index``): reference/packet.py's checks of the block index and its prefix sums,
where the packet is; the host reads three numbers (the first invalid entry, the stream and rest
totals) instead of 8 bytes per block, and sends no per-block rows back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..format import (INDEX_ENTRY, MAXLEN, NSYM, OFFSET_BIAS, RAW_BLOCK, SYM_ZERO, TABLE_BYTES, FloatLayout,
                      num_tables)
from ..reference import tables as T
from ..reference.plan import _encoder_tables

__all__ = ["DevicePlan", "plan", "read_index"]


@dataclass
class DevicePlan:
    lengths: np.ndarray        # (ntables, NSYM) code lengths
    codes: np.ndarray          # (ntables, NSYM) canonical codes, LSB first
    packed: np.ndarray         # section 0: the code lengths as nibbles
    index: torch.Tensor        # section 1 (uint8, on the device)
    blocks: torch.Tensor       # (nblocks, 4) int64 ref, table, word start, rest start: the encoder's
    sizes: tuple[int, int, int, int]


def _clusters(sampled: torch.Tensor, ntables: int, extra: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """tables._choose on the device: (code lengths, each block's table)."""
    nb, dev = sampled.shape[0], sampled.device
    blocks = torch.arange(nb, device=dev)
    peak = sampled[:, OFFSET_BIAS] * 65536 // sampled.sum(dim=1).clamp_min(1)
    order = torch.argsort(peak * nb + blocks)  # unique keys: ties by block number
    bounds = torch.tensor([g * nb // ntables for g in range(1, ntables)], dtype=torch.int64, device=dev)
    assign = torch.empty(nb, dtype=torch.int64, device=dev)
    assign[order] = torch.searchsorted(bounds, blocks, right=True)
    counts = sampled.to(torch.float64)
    ids = torch.arange(ntables, device=dev)
    lengths = np.zeros((ntables, NSYM), np.int64)
    for _ in range(T.CLUSTER_ROUNDS):
        sums = torch.ones(ntables, NSYM, dtype=torch.int64, device=dev).index_add_(0, assign, sampled)
        sums_h = sums.cpu().numpy()  # tables x 32 counts: the round's one read
        lengths = np.stack([T._package_merge(row, MAXLEN) for row in sums_h])
        bits = torch.from_numpy(lengths).to(dev) + extra
        cost = (counts @ bits.T.to(torch.float64)).to(torch.int64)  # exact: see the module's docstring
        assign = (cost * ntables + ids).min(dim=1).values % ntables  # unique keys: ties to the lowest id
    return lengths, assign


def plan(sampled: torch.Tensor, exact: torch.Tensor, ref: torch.Tensor, numel: int, block_size: int,
         layout: FloatLayout) -> DevicePlan:
    """reference/plan.py's choose and plan from the blocks' sampled and whole symbol histograms
    ((nblocks, NSYM) int64) and reference exponents (int64), all on one device."""
    nb, dev = ref.shape[0], ref.device
    ntables = num_tables(nb)
    extra = torch.from_numpy(T.extra_bits(layout).copy()).to(dev)
    if nb:
        lengths, assign = _clusters(sampled, ntables, extra)
        codes, packed = _encoder_tables(lengths.tobytes())
    else:
        lengths = codes = np.zeros((0, NSYM), np.int64)
        assign, packed = torch.zeros(0, dtype=torch.int64, device=dev), np.zeros(0, np.uint8)
    bits = torch.from_numpy(lengths).to(dev) + extra
    cost = (exact * bits[assign]).sum(dim=1)  # coded bits from the whole histogram
    nvalid = (numel - torch.arange(nb, device=dev) * block_size).clamp_max(block_size)
    nzero = exact[:, SYM_ZERO]
    nwords = (cost + 31) // 32
    rest = (nvalid - nzero) * layout.rest_bytes
    raw = 4 * nwords + rest >= nvalid * layout.itemsize  # coding would not make the block smaller
    zero = torch.zeros_like(nwords)
    table = torch.where(raw, torch.full_like(assign, RAW_BLOCK), assign)
    ref = torch.where(raw, zero, ref)
    nwords = torch.where(raw, zero, nwords)
    nzero = torch.where(raw, zero, nzero)
    rest = torch.where(raw, nvalid * layout.itemsize, rest)
    word_start = torch.cumsum(nwords, 0) - nwords
    rest_start = torch.cumsum(rest, 0) - rest
    words, rest_bytes = (int(v) for v in torch.stack([nwords.sum(), rest.sum()]).cpu())
    entries = torch.stack([ref | (table << 8), nwords, nzero, zero], dim=1).to(torch.int16)  # u16 fields
    index = entries.view(torch.uint8).reshape(-1)  # little-endian, as the format's
    blocks = torch.stack([ref, table, word_start, rest_start], dim=1)
    sizes = (ntables * TABLE_BYTES, nb * INDEX_ENTRY, words * 4, rest_bytes)
    return DevicePlan(lengths, codes, packed, index, blocks, sizes)


def read_index(packet: torch.Tensor, start: int, stop: int, n: int, bs: int, ntables: int, layout: FloatLayout):
    """reference/packet.py's read_index on the packet's device: the same rows as int64 tensors
    there, the first invalid entry (-1 if none), stream words and rest bytes."""
    e = packet[start:stop].view(-1, INDEX_ENTRY).to(torch.int64)
    nb, dev = e.shape[0], packet.device
    blocks = torch.arange(nb, device=dev)
    ref, table = e[:, 0], e[:, 1]
    nwords, nzero = e[:, 2] | (e[:, 3] << 8), e[:, 4] | (e[:, 5] << 8)
    nvalid = (n - blocks * bs).clamp_max(bs)
    raw = table == RAW_BLOCK
    ok = torch.where(raw, (nwords == 0) & (nzero == 0) & (ref == 0),  # coded: a bit per element at least
                     (table < ntables) & (ref <= layout.emax) & (nzero <= nvalid) & (nvalid <= 32 * nwords))
    ok &= (e[:, 6] == 0) & (e[:, 7] == 0)
    rest = torch.where(raw, nvalid * layout.itemsize, (nvalid - nzero) * layout.rest_bytes)
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    word_start = torch.cat([zero, torch.cumsum(nwords, 0)])
    rest_start = torch.cat([zero, torch.cumsum(rest, 0)])
    first_bad = torch.where(ok, nb, blocks).min() if nb else zero[0] + nb
    bad, words, rest_total = (int(v) for v in torch.stack([first_bad, word_start[-1], rest_start[-1]]).cpu())
    return (ref, table, nwords, nzero, nvalid, word_start, rest_start), (-1 if bad == nb else bad), words, rest_total
