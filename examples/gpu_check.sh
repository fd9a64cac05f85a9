#!/usr/bin/env bash
# GPU checks of the engine adapters (documented in docs/scaling.md; not run in CI).
#
#   bash examples/gpu_check.sh                 # every path
#   ONLY=trl_vllm bash examples/gpu_check.sh   # one of the names below
#
# Needs a GPU machine with rredcot, `trl[vllm]`, `trl[deepspeed]` and verl installed by its own
# instructions, the model below reachable (hub or local path) and GSM8K for the TRL and verl
# examples (examples/verl/prepare_gsm8k.py). Each path runs a few steps of a small model and
# prints PASS or FAIL with its log file; the script exits non-zero if any path failed.
#
#   trl_vllm         TRL + vLLM colocated, DDP, value head
#   trl_zero3        TRL + DeepSpeed ZeRO-3, value head, advantage_tail_floor
#   trl_sft_ddp      TRL, DDP, references.mode sft (a reference on some processes only)
#   trl_luffy_zero3  TRL + ZeRO-3, references.mode luffy, credit.normalization whiten
#   train_ddp        rredcot train under accelerate launch (DDP): references sft, the update cut
#                    with advantage_tail_floor, agreeing_update_fraction
#   train_bread_ddp  rredcot train under accelerate launch (DDP): references bread, luffy
#   equivalence      the CPU two-process equivalence tests
#                    (tests/training/test_several_processes.py)
#   verl             verl's example with the rredcot estimator (advantage_tail_floor)
#
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct  NGPUS=<visible GPUs, at least 2 for the several-process
#   paths>  STEPS=3  OUT=/tmp/rredcot_gpu_check
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
    "$HERE/trl_gsm8k.py" "${common[@]}" --output_dir "$OUT/trl_zero3" --bf16 \
    --advantage_tail_floor 0.01

# references under several processes: a group's reference lives on one process, the others run
# stand-in passes (a missing one hangs the step: the timeout fails the path)
check trl_sft_ddp "rredcot/references/sft_nll" \
    accelerate launch --config_file "$TRL_CFG/multi_gpu.yaml" --num_processes "$NGPUS" \
    "$HERE/trl_gsm8k.py" "${common[@]}" --output_dir "$OUT/trl_sft_ddp" --bf16 \
    --references '{"mode": "sft"}' --advantage_tail_floor 0.01

check trl_luffy_zero3 "rredcot/references/groups" \
    accelerate launch --config_file "$TRL_CFG/zero3.yaml" --num_processes "$NGPUS" \
    "$HERE/trl_gsm8k.py" "${common[@]}" --output_dir "$OUT/trl_luffy_zero3" --bf16 \
    --references '{"mode": "luffy"}' --credit '{"normalization": "whiten"}'

# rredcot train's own loop under accelerate launch (DDP); the run's metrics go into the log
train=(-m rredcot train --model.name_or_path "$MODEL" --model.dtype bfloat16 --task arithmetic
       --steps "$STEPS" --prompts_per_step 8 --sampling.num_generations 4
       --sampling.max_new_tokens 128 --eval_size 8 --eval_every 0 --progress false --overwrite)
check train_ddp "references/sft_nll" \
    bash -c 'accelerate launch --multi_gpu --num_processes "$0" "${@:2}" && cat "$1/metrics.jsonl"' \
    "$NGPUS" "$OUT/train_ddp" "${train[@]}" --out "$OUT/train_ddp" --references.mode sft \
    --advantage_tail_floor 0.01 --agreeing_update_fraction 0.5 --credit_method value_head

check train_bread_ddp "references/branch_tokens" \
    bash -c 'for mode in luffy bread; do accelerate launch --multi_gpu --num_processes "$0" \
        "${@:2}" --out "$1/$mode" --references.mode $mode || exit 1; done; cat "$1"/*/metrics.jsonl' \
    "$NGPUS" "$OUT/train_refs" "${train[@]}" --credit_method uniform

check equivalence " passed" \
    python -m pytest "$HERE/../tests/training/test_several_processes.py" -q -p no:cacheprovider

check verl "rredcot/mean_segments" \
    env NGPUS="$NGPUS" DATA="${DATA:-$HOME/data/rredcot_gsm8k}" bash "$HERE/verl/run_gsm8k.sh" \
    actor_rollout_ref.model.path="$MODEL" critic.model.path="$MODEL" \
    trainer.total_training_steps="$STEPS" trainer.logger='[console]' trainer.val_before_train=false \
    +algorithm.rredcot.advantage_tail_floor=0.01

exit $failed
