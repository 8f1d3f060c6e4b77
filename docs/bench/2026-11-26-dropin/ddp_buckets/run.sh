#!/bin/bash
# DDP on 2x2 nodes at 1 Gbit/s, fp32 gradients: bucket size x comm, alternating rounds.
out=/tmp/ddp_ab; mkdir -p $out
cd /tmp
for round in 1 2; do
  for v in "torch 25" "auto 25" "torch 4" "auto 4" "torch 2" "auto 2"; do
    set -- $v
    PYTHONPATH=/tmp/zc_ddp timeout 300 python /tmp/zc_ddp/examples/train_gpt.py --nranks 4 --nodes 2 --netlab 1gbit \
      --dtype fp32 --d-model 384 --batch 1 --ctx 64 --steps 40 --comm $1 --bucket-mb $2 \
      --json $out/$1_$2_r$round.json > $out/$1_$2_r$round.log 2>&1
    python - "$out/$1_$2_r$round.json" <<'PY'
import json,sys
d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], {k:d[k] for k in d if 'step' in k or 'median' in k})
PY
  done
done
