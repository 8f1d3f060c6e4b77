#!/bin/bash
# loopback: gloo, drop-in auto old (/tmp/zc_e2e) and new (/tmp/zc_fix), alternating
out=/tmp/e2e_loopab; mkdir -p $out; cd /tmp
for round in 1 2 3; do
  for v in "new gloo" "old drop" "new drop"; do
    set -- $v
    tree=/tmp/zc_e2e; [ $1 = new ] && tree=/tmp/zc_fix
    if [ $2 = drop ]; then flags="--backend zipccl --comm torch"; else flags="--backend gloo --comm torch"; fi
    ZIPCCL_CODEC=auto PYTHONPATH=$tree timeout 600 python $tree/examples/train_gpt.py --nranks 4 --batch 1 --ctx 64 \
      --dtype bf16 --d-model 384 --steps 40 $flags --json $out/$1_$2_$round.json > $out/$1_$2_$round.log 2>&1
    python -c "import json,sys; d=json.load(open('$out/$1_$2_$round.json')); print('$1 $2 $round', round(d['later_median_step_seconds']*1e3,1), d['param_sha256'][:8], d.get('wire_bytes'))"
  done
done
