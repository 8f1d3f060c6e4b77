"""Encode of the bucket's first N elements by zipccl's CPU codec, in turn with ZipNN's compress, in
one process (300 rounds, medians). Run it from outside the checkout on each copy:

    PYTHONPATH=/tmp/old python small_encode.py float16 32768
"""
import sys
import time

import numpy as np
import torch
import zipnn

from zipccl.codecs import Lossless

torch.set_num_threads(1)
x = torch.from_numpy(np.load("/work/shared/data/grads_step050_bucket0_fp32.npy"))[:int(sys.argv[2])]
x = x.to(getattr(torch, sys.argv[1]))
z, zn = Lossless(), zipnn.ZipNN(input_format="byte", bytearray_dtype=sys.argv[1], threads=1)
raw = bytearray(x.view(torch.uint8).numpy().tobytes())
for _ in range(20):
    z.encode(x)
    zn.compress(raw)
ours, theirs = [], []
for _ in range(300):
    t = time.perf_counter()
    z.encode(x)
    ours.append(time.perf_counter() - t)
    t = time.perf_counter()
    zn.compress(raw)
    theirs.append(time.perf_counter() - t)
print(sys.argv[1], sys.argv[2], f"zipccl {np.median(ours) * 1e6:.1f} us, zipnn {np.median(theirs) * 1e6:.1f} us,",
      f"ratio {np.median(theirs) / np.median(ours):.2f}")
