#!/bin/bash
# One job of the credit-price block (issue 49, results/credit_price/PLAN.md), for
# queue_worker.sh: credit_price_job.sh ROOT TESTBED:SEED:LR:VARIANT, TESTBED 12 (the 12-step
# chains from the shipped low warm-start, evaluation every 2 steps) or 4 (the default task).
# Runs land in ROOT/arith12_low or ROOT/arith4_default (gather_lr.py reads each). E.g.:
#   for s in 700 701; do for j in 5e-5:uniform 1e-4:cl_cheap; do echo "12:$s:$j"; done; done > q
#   benchmarks/queue_worker.sh q benchmarks/investigations/credit_price_job.sh ROOT &   (twice: a pair at a time)
here=$(cd "$(dirname "$0")" && pwd)
root=$1 job=$2
testbed=${job%%:*} rest=${job#*:}
case $testbed in
  12) exec bash "$here/../learn_at_lr.sh" "$root/arith12_low" 170000 2 40 "$rest" ;;
  4) TASK=default EVAL_SIZE=256 exec bash "$here/../learn_at_lr.sh" "$root/arith4_default" 250000 5 90 "$rest" ;;
  *) echo "credit_price_job.sh: testbed '$testbed' is not 12 or 4 (job $job)" >&2; exit 2 ;;
esac
