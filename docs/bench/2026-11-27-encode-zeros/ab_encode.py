"""Encode of the real bucket by zipccl's CPU codec against ZipNN (one thread), in turn, in one
process: each round one zipccl encode after ZipNN's (caches as the other left them), a second
zipccl encode, then one ZipNN compress. Run it from outside the checkout on each copy:

    PYTHONPATH=/tmp/old python ab_encode.py fp16 21
"""
import sys
import time

import numpy as np
import torch
import zipnn

from zipccl.codecs import Lossless

DATA = "/work/shared/data/grads_step050_bucket0_fp32.npy"
NAMES = {"bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16"), "fp32": (torch.float32, "float32")}

torch.set_num_threads(1)
dtype, zname = NAMES[sys.argv[1]]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
x = torch.from_numpy(np.load(DATA)).to(dtype)
z, zn = Lossless(), zipnn.ZipNN(input_format="byte", bytearray_dtype=zname, threads=1)
raw = x.view(torch.uint8).numpy().tobytes()
z.encode(x)
zn.compress(bytearray(raw))
first, again, other = [], [], []
for _ in range(rounds):
    for times, fn, arg in ((first, z.encode, x), (again, z.encode, x), (other, zn.compress, bytearray(raw))):
        t = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t)
f = lambda v: f"min {min(v) * 1e3:.2f} med {np.median(v) * 1e3:.2f}"  # noqa: E731
print(sys.argv[1], "zipccl", f(first), "| again", f(again), "| zipnn", f(other),
      f"| ratio med {np.median(other) / np.median(first):.2f}")
