#!/bin/bash
# reporting seeds on the 12-step low warm-start, each variant at the lr chosen on tuning seeds 0-1
# (results/headroom/arith12_low_report_tuned); runs this checkout's rredcot.
#   headroom_report_stream.sh ROOT SEED ...        # runs under ROOT/lr<LR>, log ROOT/stream_<first seed>.log
here=$(cd "$(dirname "$0")" && pwd)
root=$1; shift
mkdir -p "$root" && cd "$root" || exit 1
export PYTHONPATH="$here/../../src${PYTHONPATH:+:$PYTHONPATH}"
common="--task arithmetic --task.num_steps 12 --set model.tiny_warmstart=low --set threads=1 --budget-tokens 170000 --eval-every 4 --eval-size 128 --steps-max 40 --progress false"
for seed in "$@"; do
  python -m rredcot bench learn $common --methods uniform --seeds 1 --first-seed $seed --lr 2.5e-5 --out "$root/lr2.5e-5" >> stream_$1.log 2>&1
  python -m rredcot bench learn $common --methods "oracle_pooled=oracle:oracle.values=pooled,value_head,vh_flow=value_head:lam=0:handover.smoothing=0.5" --seeds 1 --first-seed $seed --lr 5e-5 --out "$root/lr5e-5" >> stream_$1.log 2>&1
done
echo DONE >> stream_$1.log
