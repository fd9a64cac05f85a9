#!/bin/bash
# issue 30: newline+merge in learning, 170k tokens on the 25-40% low warm-start
# (results/paper_method/learn12_low_merge); runs this checkout's rredcot.
#   paper_method_merge_tune.sh ROOT SEED:LR:VARIANT ...   # runs under ROOT/lines and ROOT/merge
here=$(cd "$(dirname "$0")" && pwd)
root=$1; shift
mkdir -p "$root" && cd "$root" || exit 1
export PYTHONPATH="$here/../../src${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
common="--task arithmetic --task.num_steps 12 --set model.tiny_warmstart=low --set threads=1 --budget-tokens 170000 --eval-every 4 --eval-size 128 --steps-max 40 --progress false"
for job in "$@"; do
  seed=${job%%:*}; rest=${job#*:}; lr=${rest%%:*}; m=${rest#*:}
  case $m in
    uniform|value_head) extra=(--methods $m); out=$root/lines/lr$lr;;
    vh_merge) extra=(--methods value_head --credit.segmenter "newline+merge:fraction=0.5"); out=$root/merge/lr$lr;;
    cl_rw_merge) extra=(--methods "cl_rw=continuation_likelihood:form=reweight" --credit.segmenter "newline+merge:fraction=0.5"); out=$root/merge/lr$lr;;
    *) echo "unknown variant $m (uniform, value_head, vh_merge, cl_rw_merge)" >&2; exit 1;;
  esac
  echo "$(date +%T) start $seed $lr $m" >> tune.log
  python -m rredcot bench learn $common "${extra[@]}" --seeds 1 --first-seed $seed --lr $lr --out "$out" >> run_$$.log 2>&1; rc=$?
  echo "$(date +%T) done $seed $lr $m rc=$rc" >> tune.log
done
