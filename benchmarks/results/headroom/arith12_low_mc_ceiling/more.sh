#!/bin/bash
cd /work/logs/mc12
export PYTHONPATH=/work/wt/base/src
for s in "$@"; do
  python -m rredcot bench learn --task arithmetic --task.num_steps 12 --set model.tiny_warmstart=low --set threads=1 --methods "oracle_mc=oracle:oracle.values=monte_carlo:oracle.rollouts=16" --seeds 1 --first-seed $s --budget-tokens 170000 --eval-every 4 --eval-size 128 --lr 5e-5 --steps-max 40 --progress false --out /work/logs/mc12/lr5e-5 > /work/logs/mc12/s$s.log 2>&1
done
