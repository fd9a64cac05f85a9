#!/bin/bash
# reporting seeds for the extra variants, each at the lr chosen on tuning seeds 0-1
# (results/headroom/arith12_low_report_tuned); runs this checkout's rredcot.
#   headroom_report_stream_extra.sh ROOT SEED ...  # runs under ROOT/lr<LR>, log ROOT/stream_extra_<first seed>.log
here=$(cd "$(dirname "$0")" && pwd)
root=$1; shift
mkdir -p "$root" && cd "$root" || exit 1
export PYTHONPATH="$here/../../src${PYTHONPATH:+:$PYTHONPATH}"
common="--task arithmetic --task.num_steps 12 --set model.tiny_warmstart=low --set threads=1 --budget-tokens 170000 --eval-every 4 --eval-size 128 --steps-max 40 --progress false"
for seed in "$@"; do
  python -m rredcot bench learn $common --methods "vh_batch=value_head:lam=0:anchor=none:handover.smoothing=0.5,vh_rw=value_head:form=reweight" --seeds 1 --first-seed $seed --lr 5e-5 --out "$root/lr5e-5" >> stream_extra_$1.log 2>&1
  python -m rredcot bench learn $common --methods "cl=continuation_likelihood" --seeds 1 --first-seed $seed --lr 2.5e-5 --out "$root/lr2.5e-5" >> stream_extra_$1.log 2>&1
done
echo DONE >> stream_extra_$1.log
