"""Sizes of alternative exponent codings on a gradient bucket: the table in docs/FORMAT.md.

    python bench/format_alternatives.py [path/to/grads.npy]
"""
import sys
from pathlib import Path

import numpy as np
import torch

import zipccl.kernels.cpu as C
from zipccl.reference import tables as T
from zipccl.format import LAYOUTS
DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "data" / "grads_step050_bucket0_fp32.npy"
g = torch.from_numpy(np.load(sys.argv[1] if len(sys.argv) > 1 else DEFAULT))
x = g.to(torch.bfloat16); lay = LAYOUTS[x.dtype]; n = x.numel(); raw = 2 * n
bits = C._int_view(x).astype(np.int64)
def per_block(bs):
    nb = -(-n // bs)
    ref = np.zeros(nb, np.int64); hist = np.zeros((nb, 32), np.int64); nz = np.zeros(nb, np.int64)
    C._analyse(C._int_view(x), bs, lay.mbits, ref, hist, nz)
    return nb, ref, hist, nz
e = (bits >> 7) & 255
def H(c):
    p = c[c > 0] / c.sum(); return -(p * np.log2(p)).sum()
rows = []
# entropy bounds on exponents (rest byte always 1 byte)
ent_global = H(np.bincount(e, minlength=256))
rows.append(("exponent entropy, one table per bucket (bound)", (n + ent_global * n / 8) / raw))
bs = 4096; nb = -(-n // bs)
eb = sum(H(np.bincount(e[b*bs:(b+1)*bs], minlength=256)) * min(bs, n - b*bs) for b in range(nb))
rows.append(("exponent entropy, own table per 4096 block (bound)", (n + eb / 8) / raw))
# fixed 3-bit window of 7 exponents per block + escape (3 bits + 8 raw)
tot = 0
for b in range(nb):
    c = np.bincount(e[b*bs:(b+1)*bs], minlength=256)
    best = max(c[s:s+7].sum() for s in range(250))
    m = c.sum(); tot += 3 * m + 8 * (m - best)
rows.append(("fixed 3-bit window of 7 per 4096 block, escapes", (n + tot / 8 + nb) / raw))
for K in (1, 2, 4, 8, 16):
    nb_, ref, hist, nz = per_block(4096)
    L, a, cost = T.choose_tables(hist, min(K, nb_), lay)
    size = 56 + 16 * K + 8 * nb_ + (np.ceil(cost / 32) * 4).sum() + (n - nz.sum())
    rows.append((f"Huffman, mode-relative offsets, {K} table(s), block 4096", size / raw))
for bsz in (1024, 2048, 8192, 16384):
    nb_, ref, hist, nz = per_block(bsz)
    L, a, cost = T.choose_tables(hist, 8, lay)
    size = 56 + 16 * 8 + 8 * nb_ + (np.ceil(cost / 32) * 4).sum() + (n - nz.sum())
    rows.append((f"Huffman, 8 tables, block {bsz}", size / raw))
# without the ZERO symbol (zeros coded as exponent 0 with a rest byte)
nb_, ref, hist, nz = per_block(4096)
L, a, cost = T.choose_tables(hist, 8, lay)
size_zero = 56 + 128 + 8 * nb_ + (np.ceil(cost / 32) * 4).sum() + n
rows.append(("as ours but storing the rest byte of +0.0 too", size_zero / raw))
for name, r in rows: print(f"| {name} | {r:.4f} |")
