#!/bin/bash
# A/B: the codec benchmark on copies outside the checkout (/tmp/old, /tmp/new), alternating.
for r in 1 2 3; do
  for v in old new; do
    PYTHONPATH=/tmp/$v timeout 900 python -m zipccl.bench.codec --no-zstd --repeat 15 --dtypes bf16,fp16,fp32 \
      --data /work/shared/data/grads_step050_bucket0_fp32.npy --json codec_$v-$r.json | grep "^# grads_step050"
  done
done
