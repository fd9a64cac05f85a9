#!/bin/bash
# SmolLM2 step cost of the credit-price levers (issue 49): 5 training steps of the SmolLM2
# protocol per method, seed 0 (a tuning seed), evaluation on 16 problems at the start and end only.
#   smollm2_step_cost.sh ROOT LR:VARIANT ...   (VARIANT: a name of gather_lr.py SPECS)
here=$(cd "$(dirname "$0")" && pwd)
root=$1; shift
mkdir -p "$root" && cd "$root" || exit 1
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
common="--init smollm2-135m-instruct --task word_problems --set threads=1 --set prompts_per_step=8 \
--set sampling.num_generations=8 --set sampling.max_new_tokens=72 --budget-tokens 40000 \
--eval-every 100 --eval-size 16 --steps-max 5 --progress false"
for job in "$@"; do
  lr=${job%%:*}; name=${job#*:}
  spec=$(python "$here/gather_lr.py" spec "$name") || exit 1
  echo "$(date +%T) start 0 $lr $name" >> tune.log
  rredcot bench learn $common --methods "$spec" --seeds 1 --first-seed 0 --lr "$lr" --out "$root/lr$lr" >> "run_$$.log" 2>&1; rc=$?
  echo "$(date +%T) done 0 $lr $name rc=$rc" >> tune.log
done
