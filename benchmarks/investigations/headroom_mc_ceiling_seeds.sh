#!/bin/bash
# The Monte Carlo oracle (K = 16) on the 12-step low warm-start, one seed per job, at lr 5e-5
# (results/headroom/arith12_low_mc_ceiling); runs this checkout's rredcot.
#   headroom_mc_ceiling_seeds.sh ROOT SEED ...     # runs under ROOT/lr5e-5, logs ROOT/s<SEED>.log
here=$(cd "$(dirname "$0")" && pwd)
root=$1; shift
mkdir -p "$root" && cd "$root" || exit 1
export PYTHONPATH="$here/../../src${PYTHONPATH:+:$PYTHONPATH}"
for s in "$@"; do
  python -m rredcot bench learn --task arithmetic --task.num_steps 12 --set model.tiny_warmstart=low --set threads=1 --methods "oracle_mc=oracle:oracle.values=monte_carlo:oracle.rollouts=16" --seeds 1 --first-seed $s --budget-tokens 170000 --eval-every 4 --eval-size 128 --lr 5e-5 --steps-max 40 --progress false --out "$root/lr5e-5" > "$root/s$s.log" 2>&1
done
