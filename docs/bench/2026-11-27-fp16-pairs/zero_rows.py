"""A gradient with rows of +0.0 (an embedding's rows that the batch did not touch): 4,096 rows of
768, a fraction of them zero, the rest Laplace-like, encoded and decoded by zipccl's CPU codec and
ZipNN (one thread each) in turn, 15 rounds, medians. Run it from outside the checkout on each copy:

    PYTHONPATH=/tmp/old python zero_rows.py float16 0.5
"""
import sys
import time

import numpy as np
import torch
import zipnn

from zipccl.codecs import Lossless

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
rows, dim = 4096, 768
x = torch.randn(rows, dim, generator=g) * 1e-3
x[torch.rand(rows, generator=g) < float(sys.argv[2])] = 0.0
x = x.to(getattr(torch, sys.argv[1])).reshape(-1)
z, zn = Lossless(), zipnn.ZipNN(input_format="byte", bytearray_dtype=sys.argv[1], threads=1)
raw = bytearray(x.view(torch.uint8).numpy().tobytes())
p, c = z.encode(x), zn.compress(raw)
enc, zenc, dec, zdec = [], [], [], []
for _ in range(15):
    for times, fn, arg in ((enc, z.encode, x), (zenc, zn.compress, raw), (dec, z.decode, p), (zdec, zn.decompress, c)):
        t = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t)
m = np.median
print(sys.argv[1], sys.argv[2], f"ratio {p.numel() / len(raw):.3f} vs {len(c) / len(raw):.3f};",
      f"enc {m(enc) * 1e3:.2f} ms vs {m(zenc) * 1e3:.2f} ({m(zenc) / m(enc):.2f}x);",
      f"dec {m(dec) * 1e3:.2f} vs {m(zdec) * 1e3:.2f} ({m(zdec) / m(dec):.2f}x)")
