#!/usr/bin/env bash
# rredcot credit in verl (Ray + FSDP + vLLM) on GSM8K. Needs a GPU node with verl installed by
# its own instructions, then `pip install rredcot` (plus `rredcot[data]` for math-verify).
#
#   bash examples/verl/run_gsm8k.sh                         # 8 GPUs, one node
#   NGPUS=4 bash examples/verl/run_gsm8k.sh algorithm.rredcot.credit_method=uniform critic.enable=false
#
# Several nodes: export VERL_USE_EXTERNAL_MODULES=rredcot.integrations.verl on every node
# *before* `ray start` (Ray workers inherit the environment of their raylet), start the head
# with `ray start --head`, the others with `ray start --address=HEAD:6379`, then run this
# script on the head with NNODES=<nodes>.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DATA="${DATA:-$HOME/data/rredcot_gsm8k}"

# Every verl process (driver, TaskRunner, Ray workers) imports this module when it imports
# verl: it registers the `rredcot` advantage estimator and the `rredcot_sync` trainer mode.
export VERL_USE_EXTERNAL_MODULES=rredcot.integrations.verl

if [ ! -f "$DATA/train.parquet" ]; then
    python "$HERE/prepare_gsm8k.py" --out "$DATA"
fi

python -m verl.trainer.main_ppo \
    --config-path="$HERE" --config-name=rredcot_gsm8k \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
    reward.custom_reward_function.path="$HERE/reward.py" \
    trainer.n_gpus_per_node="${NGPUS:-8}" trainer.nnodes="${NNODES:-1}" \
    "$@"
