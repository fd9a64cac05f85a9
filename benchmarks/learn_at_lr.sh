#!/bin/bash
# One learn-bench run per job, each lr in its own --out (the layout gather_lr.py reads), on the
# 12-step low warm-start (or, with INIT=DIR in the environment, from that checkpoint). The
# variant specs are gather_lr.py's SPECS.
#   [INIT=DIR] [TASK=default] [EVAL_SIZE=N] learn_at_lr.sh ROOT BUDGET EVAL_EVERY STEPS_MAX SEED:LR:VARIANT ...
# TASK=default: the default task instead (4-step arithmetic from its shipped warm-start).
# Per-second figures read a run between the two evaluations around the reference's last second
# (bench/learn.py accuracy_at_second): on runs of ~15 steps EVAL_EVERY 2 keeps them close.
# The runs of arith12_low16_tuning and arith12_low27_tuning: ROOT 170000 4 40;
# arith12_low27_500k_tuning and arith12_low27_500k_report: ROOT 500000 5 80 (all four made when
# the low preset was an accuracy band; it is now the shipped 450-step build); the build screen
# (INIT=each build), arith12_low450_tuning and arith12_low450_report: ROOT 170000 4 40.
here=$(cd "$(dirname "$0")" && pwd)
root=$1 budget=$2 eval_every=$3 steps_max=$4; shift 4
mkdir -p "$root" && cd "$root" || exit 1
export OMP_NUM_THREADS=1
task="--task arithmetic --task.num_steps 12" policy="--set model.tiny_warmstart=low"
[ "$TASK" = default ] && task="--task arithmetic" && policy=""
[ -n "$INIT" ] && policy="--set init=$INIT"
common="$task $policy --set threads=1 --budget-tokens $budget --eval-every $eval_every --eval-size ${EVAL_SIZE:-128} --steps-max $steps_max --progress false"
for job in "$@"; do
  seed=${job%%:*}; rest=${job#*:}; lr=${rest%%:*}; name=${rest#*:}
  spec=$(python "$here/gather_lr.py" spec "$name") || exit 1
  echo "$(date +%T) start $seed $lr $name" >> tune.log
  rredcot bench learn $common --methods "$spec" --seeds 1 --first-seed "$seed" --lr "$lr" --out "$root/lr$lr" >> "run_$$.log" 2>&1; rc=$?
  echo "$(date +%T) done $seed $lr $name rc=$rc" >> tune.log
done
