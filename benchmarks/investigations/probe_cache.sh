#!/bin/bash
# The probe credit's extra forward tokens with the rollout's KV cache on and off (issue 49,
# item 1): a few `rredcot train` steps of cl_cheap (gather_lr.py's SPECS) per testbed, the
# 12-step arithmetic task from the shipped low warm-start and the default task, one thread each,
# then the per-step figures of every run's metrics.jsonl (probe_cache_summary.py).
#   probe_cache.sh ROOT [STEPS]
here=$(cd "$(dirname "$0")" && pwd)
root=$1 steps=${2:-3}
mkdir -p "$root" || exit 1
export OMP_NUM_THREADS=1
cl="--credit_method continuation_likelihood --credit.lam 0 --credit.anchor none"
cl="$cl --credit.handover.smoothing 0.5 --credit.continuation_likelihood.window 1 --lr 1e-4"
common="--steps $steps --threads 1 --eval_every 0 --eval_size 8 --progress false"
for testbed in arith12_low arith4_default; do
  task="--task arithmetic"
  [ "$testbed" = arith12_low ] && task="$task --task.num_steps 12 --model.tiny_warmstart low"
  for cache in true false; do
    nice -n 19 python -m rredcot train $task $cl $common --probe_from_cache $cache \
      --out "$root/$testbed/cache_$cache" --overwrite > "$root/$testbed.cache_$cache.log" 2>&1
  done
done
python "$here/probe_cache_summary.py" "$root"
