"""Sizes of alternative exponent codings on a gradient bucket: the table in docs/FORMAT.md.

    python bench/format_alternatives.py [path/to/grads.npy]
    python bench/format_alternatives.py --float16 [path/to/grads.npy]

--float16 prints what float16 gains by coding the top mantissa bits with the exponent (the
float16 table in docs/FORMAT.md; format version 3 codes the top one). The layout modelled otherwise is format version 1's (code tables per packet, up to 8): the measurements
that chose the coding. Version 2 takes its codes from a fixed bank; bench/bank_design.py
measures that against this model's packets.
"""
import argparse

import numpy as np
import torch

from zipccl.bench.common import DEFAULT_DATA
from zipccl.format import HEADER_SIZE, INDEX_ENTRY, LAYOUTS, NSYM, SYM_ESC, TABLE_BYTES
from zipccl.reference import tables as T



def entropy(counts) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def huffman_size(bits: np.ndarray, bs: int, ntables: int, stride: int = 1, zero_symbol: bool = True) -> int:
    """Bytes of a packet of our layout: reference exponent and tables chosen from every
    ``stride``-th element of each block, sizes from all of them."""
    lay = LAYOUTS[torch.bfloat16]
    n = bits.size
    nb = -(-n // bs)
    padded = np.zeros(nb * bs, np.int64)
    padded[:n] = bits
    valid = (np.arange(nb * bs) < n).reshape(nb, bs)
    b2 = padded.reshape(nb, bs)
    exp, zero = (b2 >> lay.mbits) & lay.emax, b2 == 0
    sample = valid & (np.arange(bs) % stride == 0)[None, :]
    rows = np.repeat(np.arange(nb), bs).reshape(nb, bs)
    counts = np.zeros((nb, lay.emax + 1), np.int64)
    np.add.at(counts, (rows[sample & ~zero], exp[sample & ~zero]), 1)
    d = exp - counts.argmax(axis=1)[:, None]
    sym = np.where((d >= lay.min_offset) & (d <= lay.max_offset), d + lay.offset_bias, SYM_ESC)
    sym = np.where(zero, 0, sym)
    exact, sampled = np.zeros((nb, NSYM), np.int64), np.zeros((nb, NSYM), np.int64)
    np.add.at(exact, (rows[valid], sym[valid]), 1)
    np.add.at(sampled, (rows[sample], sym[sample]), 1)
    lengths, assign, _ = T.choose_tables(sampled, ntables, lay)
    cost = (exact * (lengths + T.extra_bits(lay))[assign]).sum(axis=1)
    nzero = (zero & valid).sum(axis=1) if zero_symbol else 0
    coded = 4 * -(-cost // 32) + valid.sum(axis=1) - nzero
    return HEADER_SIZE + ntables * TABLE_BYTES + nb * INDEX_ENTRY + int(np.minimum(coded, 2 * valid.sum(axis=1)).sum())


def float16_splits(x: torch.Tensor, bs: int = 4096) -> list[tuple[str, float]]:
    """Ratios of float16 with a free Huffman code per block (lengths up to 15 bits, no table or
    index cost: a bound) over three symbols: the exponent field, as version 2 codes it with its
    three other bits raw (sign and top two mantissa bits), or joined with the top one or two
    mantissa bits. The low mantissa byte is raw, +0.0 has its own symbol and no rest."""
    bits = x.to(torch.float16).view(torch.int16).numpy().view(np.uint16).astype(np.int64)
    n = bits.size // bs * bs  # whole blocks
    b = bits[:n].reshape(-1, bs)
    zero, exp, top2 = b == 0, (b >> 10) & 31, (b >> 8) & 3
    rows = []
    for name, sym, raw_bits in (("exponent (version 2's symbol)", exp, 3), ("exponent and top mantissa bit", exp * 2 + (top2 >> 1), 2),
                                ("exponent and top two mantissa bits", exp * 4 + top2, 1)):
        sym = np.where(zero, 128, sym)
        coded = sum((c * T.limited_lengths(c, 15)).sum() for c in (np.bincount(row, minlength=129) for row in sym))
        rows.append((name, (coded + (raw_bits + 8) * (~zero).sum()) / (16 * n)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="?", default=DEFAULT_DATA, help="the fp32 gradient bucket (.npy)")
    ap.add_argument("--float16", action="store_true", help="float16 with its top mantissa bits in the symbol")
    args = ap.parse_args()
    if args.float16:
        x = torch.from_numpy(np.load(args.data))
        for name, ratio in float16_splits(x):
            print(f"| {name} | {ratio:.4f} |")
        return
    x = torch.from_numpy(np.load(args.data)).to(torch.bfloat16)
    bits = x.view(torch.int16).numpy().view(np.uint16).astype(np.int64)
    n, raw = bits.size, 2 * bits.size
    e = (bits >> 7) & 255
    bs = 4096
    nb = -(-n // bs)
    rows = [("exponent entropy, one table per bucket (bound)", (n + entropy(np.bincount(e, minlength=256)) * n / 8))]
    per_block = sum(entropy(np.bincount(e[b * bs:(b + 1) * bs], minlength=256)) * min(bs, n - b * bs)
                    for b in range(nb))
    rows.append(("exponent entropy, own table per 4096 block (bound)", n + per_block / 8))
    window = 0
    for b in range(nb):  # a fixed 3-bit window of 7 exponents per block + escape (3 bits + 8 raw)
        c = np.bincount(e[b * bs:(b + 1) * bs], minlength=256)
        m = c.sum()
        window += 3 * m + 8 * (m - max(c[s:s + 7].sum() for s in range(250)))
    rows.append(("fixed 3-bit window of 7 per 4096 block, escapes", n + window / 8 + nb))
    for K in (1, 2, 4, 8, 16):
        rows.append((f"Huffman, mode-relative offsets, {K} table(s), block 4096, whole blocks",
                     huffman_size(bits, bs, K)))
    for size in (1024, 2048, 8192, 16384):
        rows.append((f"Huffman, 8 tables, block {size}, whole blocks", huffman_size(bits, size, 8)))
    rows.append(("8 tables, whole blocks, storing the rest byte of +0.0 too",
                 huffman_size(bits, bs, 8, zero_symbol=False)))
    for stride in (2, 4, 8, 16):
        rows.append((f"8 tables, block 4096, choices from every {stride}th element", huffman_size(bits, bs, 8, stride)))
    for name, size in rows:
        print(f"| {name} | {size / raw:.4f} |")


if __name__ == "__main__":
    main()
