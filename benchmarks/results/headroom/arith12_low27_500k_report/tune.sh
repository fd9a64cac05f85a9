#!/bin/bash
# tuning seeds on the 12-step low warm-start: cl_flow at each lr; args: "seed:lr" ...
cd /work/logs/r500
export PYTHONPATH=/work/wt/base/src OMP_NUM_THREADS=1
common="--task arithmetic --task.num_steps 12 --set model.tiny_warmstart=low --set threads=1 --budget-tokens 500000 --eval-every 5 --eval-size 128 --steps-max 80 --progress false"
for job in "$@"; do
  seed=${job%%:*}; rest=${job#*:}; lr=${rest%%:*}; m=${rest#*:}
  case $m in
    cl_flow) spec="cl_flow=continuation_likelihood:lam=0:anchor=none:handover.smoothing=0.5";;
    uniform) spec="uniform";;
    value_head) spec="value_head";;
    oracle_pooled) spec="oracle_pooled=oracle:oracle.values=pooled";;
    *) spec="$m";;
  esac
  echo "$(date +%T) start $seed $lr $m" >> tune.log
  rredcot bench learn $common --methods "$spec" --seeds 1 --first-seed $seed --lr $lr --out /work/logs/r500/lr$lr >> run_$$.log 2>&1
  echo "$(date +%T) done $seed $lr $m rc=$?" >> tune.log
done
