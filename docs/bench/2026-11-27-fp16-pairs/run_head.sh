#!/bin/bash
export PYTHONPATH=/tmp/head  # git worktree add /tmp/head d540f11
D=/work/shared/data/grads_step050_bucket0_fp32.npy
python -c "
import torch, numpy as np
from zipccl.codecs import Lossless
x = torch.from_numpy(np.load('$D'))
for d in (torch.float16, torch.bfloat16, torch.float32): Lossless().decode(Lossless().encode(x.to(d)))
"
date -u; uptime
for r in 1 2; do
  python -m zipccl.bench.codec --no-zstd --repeat 15 --dtypes bf16,fp16,fp32 --data $D --json codec_head-$r.json | grep -v "\.\.\.$"
done
for n in 32768 524288 33554432; do
  python -m zipccl.bench.codec --no-zstd --repeat 9 --size $n --dtypes bf16,fp16,fp32 --data $D --json codec_size$n.json | grep -v "\.\.\.$"
done
date -u; uptime
