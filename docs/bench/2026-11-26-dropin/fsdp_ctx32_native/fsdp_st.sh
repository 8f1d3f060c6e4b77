#!/bin/bash
# FSDP2, 4 ranks, 1 Gbit/s lab, ctx 32: torch vs auto, auto with the status round after native calls (old) and without (new)
out=/tmp/fsdp_st; mkdir -p $out; cd /tmp
for round in 1 2; do
  for v in "new torch" "old auto" "new auto"; do
    set -- $v
    tree=/tmp/zc_fix; [ $1 = new ] && tree=/tmp/zc_fix2
    PYTHONPATH=$tree timeout 900 python $tree/examples/fsdp_gpt.py --mesh 4 --netlab 1gbit --mp bf16 --batch 1 \
      --comm $2 --steps 30 --bf16-values --warmup 6 --ctx 32 --json $out/$1_$2_$round.json > $out/$1_$2_$round.log 2>&1
    python -c "import json,sys; d=json.load(open('$out/$1_$2_$round.json')); print('$1 $2 $round', round(d['later_median_step_seconds']*1e3,1), d.get('wire_bytes_per_step'))"
  done
done
