#!/usr/bin/env bash
# GPU checks of the engine adapters (documented in docs/scaling.md; not run in CI).
#
#   bash examples/gpu_check.sh                 # all three paths
#   ONLY=trl_vllm bash examples/gpu_check.sh   # one of: trl_vllm, trl_zero3, verl
#
# Needs a GPU machine with rredcot, `trl[vllm]`, `trl[deepspeed]` and verl installed by its own
# instructions, the model below reachable (hub or local path) and GSM8K for the verl example
# (examples/verl/prepare_gsm8k.py). Each path runs a few steps of a small model and prints
# PASS or FAIL with its log file; the script exits non-zero if any path failed.
#
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct  NGPUS=<visible GPUs>  STEPS=3  OUT=/tmp/rredcot_gpu_check
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
NGPUS="${NGPUS:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
STEPS="${STEPS:-3}"
OUT="${OUT:-/tmp/rredcot_gpu_check}"
ONLY="${ONLY:-}"
TRL_CFG="$(python -c 'import trl, os; print(os.path.dirname(trl.__file__))')/accelerate_configs"
mkdir -p "$OUT"
failed=0

common=(--model "$MODEL" --max_steps "$STEPS" --num_generations 4 --per_device_train_batch_size 4
        --max_completion_length 128 --logging_steps 1 --save_strategy no --report_to none
        --credit_method value_head)

# A run passes when it exits 0 and logged the credit (and, for TRL, no extra forward).
check() {
    local name="$1" log="$OUT/$1.log" pattern="$2"
    shift 2
    if [ -n "$ONLY" ] && [ "$ONLY" != "$name" ]; then return; fi
    echo "== $name: $*" >"$log"
    if timeout "${TIMEOUT:-1800}" "$@" >>"$log" 2>&1 && grep -q "$pattern" "$log"; then
        echo "PASS $name ($log)"
    else
        echo "FAIL $name ($log)"; tail -n 20 "$log"; failed=1
    fi
}

check trl_vllm "'rredcot/extra_forward': '0'" \
    accelerate launch --config_file "$TRL_CFG/multi_gpu.yaml" --num_processes "$NGPUS" \
    "$HERE/trl_gsm8k.py" "${common[@]}" --output_dir "$OUT/trl_vllm" \
    --use_vllm --vllm_mode colocate --vllm_gpu_memory_utilization 0.3 --bf16

check trl_zero3 "'rredcot/extra_forward': '0'" \
    accelerate launch --config_file "$TRL_CFG/zero3.yaml" --num_processes "$NGPUS" \
    "$HERE/trl_gsm8k.py" "${common[@]}" --output_dir "$OUT/trl_zero3" --bf16

check verl "rredcot/mean_segments" \
    env NGPUS="$NGPUS" DATA="${DATA:-$HOME/data/rredcot_gsm8k}" bash "$HERE/verl/run_gsm8k.sh" \
    actor_rollout_ref.model.path="$MODEL" critic.model.path="$MODEL" \
    trainer.total_training_steps="$STEPS" trainer.logger='[console]' trainer.val_before_train=false

exit $failed
