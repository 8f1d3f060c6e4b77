"""The GPU codec's per-block bookkeeping, computed with torch operations on the device.

Encode (``plan``): reference/plan.py's choice of each block's bank entry (the one that codes
its sample in the fewest bits) and its layout (raw blocks, offsets, the block index), with the
same integer arithmetic and tie-breaking on the tensor's device, so the bytes are the host
plan's (tests/test_device_plan.py). The host reads only the packet's two data section sizes,
which size the packet: one read.

Costs are products of counts (at most 32768) and bit widths (at most 31) summed over 32
symbols, below 2^53: the float64 matrix products that compute them are exact. Ties between
entries go to the lowest id, by making every compared key unique.

Decode (``read_index``): reference/packet.py's checks of the block index and its prefix sums,
where the packet is; three numbers (the first invalid entry, the stream and rest totals) stay
there for the decoder to check with its one read at the end, instead of 8 bytes per block
crossing to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..bank import BANK, BANK_SIZE
from ..format import INDEX_ENTRY, LAYOUTS, RAW_BLOCK, SYM_ZERO, FloatLayout
from ..reference import tables as T
from ..reference.packet import to_host
from ..reference.plan import _encoder_codes

__all__ = ["DevicePlan", "bank", "plan", "read_index"]

_BANKS: dict = {}  # (dtype, device) -> the bank's tensors there, uploaded once


def bank(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bank of ``dtype`` on ``device``: (code lengths, canonical codes) as int32 and each symbol's
    bits (code plus inline raw bits) as float64, all (BANK_SIZE, NSYM); uploaded once per device."""
    key = (dtype, device)
    if key not in _BANKS:
        lengths = BANK[dtype]
        _BANKS[key] = tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (
            lengths.astype(np.int32), _encoder_codes(dtype).astype(np.int32),
            (lengths + T.extra_bits(LAYOUTS[dtype])).astype(np.float64)))
    return _BANKS[key]


@dataclass
class DevicePlan:
    lengths: torch.Tensor      # (BANK_SIZE, NSYM) int32 code lengths, on the device
    codes: torch.Tensor        # (BANK_SIZE, NSYM) int32 canonical codes, LSB first
    index: torch.Tensor        # section 1 (uint8, on the device)
    blocks: torch.Tensor       # (nblocks, 4) int64 ref, entry, word start, rest start: the encoder's
    sizes: tuple[int, int, int, int] | None  # the sections' bytes, read by the host; None: not read,
    totals: torch.Tensor                      # their stream words and rest bytes, int64 on the device


def plan(sampled: torch.Tensor, exact: torch.Tensor, ref: torch.Tensor, numel: int, block_size: int,
         dtype: torch.dtype, read: bool = True) -> DevicePlan:
    """reference/plan.py's choose and plan from the blocks' sampled and whole symbol histograms
    ((nblocks, NSYM) int64) and reference exponents (int64), all on one device. ``read``: the
    host reads the packet's size (the one read); otherwise it stays on the device."""
    nb, dev = ref.shape[0], ref.device
    layout = LAYOUTS[dtype]
    lengths, codes, bits = bank(dtype, dev)
    ids = torch.arange(BANK_SIZE, device=dev)
    sample_cost = (sampled.to(torch.float64) @ bits.T).to(torch.int64)  # exact: see the module's docstring
    assign = (sample_cost * BANK_SIZE + ids).min(dim=1).values % BANK_SIZE  # unique keys: ties to the lowest id
    cost = (exact.to(torch.float64) * bits[assign]).sum(dim=1).to(torch.int64)  # coded bits from the whole block
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
    totals = torch.stack([nwords.sum(), rest.sum()])
    sizes = None
    if read:
        words, rest_bytes = (int(v) for v in to_host(totals))  # the one read
        sizes = (0, nb * INDEX_ENTRY, words * 4, rest_bytes)
    entries = torch.stack([ref | (table << 8), nwords, nzero, zero], dim=1).to(torch.int16)  # u16 fields
    index = entries.view(torch.uint8).reshape(-1)  # little-endian, as the format's
    blocks = torch.stack([ref, table, word_start, rest_start], dim=1)
    return DevicePlan(lengths, codes, index, blocks, sizes, totals)


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
    return (ref, table, nwords, nzero, nvalid, word_start, rest_start), \
        torch.stack([first_bad, word_start[-1], rest_start[-1]])  # checked by the decoder, with its last read
