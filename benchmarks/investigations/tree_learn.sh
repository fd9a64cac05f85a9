#!/usr/bin/env bash
# The tree benchmark (issue 29) on the 12-step testbed, as it was run: one thread per process,
# niced, resumable (a re-run skips complete runs). STAGE=tune | report; OUT=directory.
#   tune:   fork rule of tree + node values, tuning seed 0 (seeds < 100), smaller budget
#   report: the four arms on reporting seeds from 100 (FIRST, SEEDS), equal token budget
set -euo pipefail
STAGE=${STAGE:-report}
OUT=${OUT:-bench/tree}
BUDGET=${BUDGET:-200000}
COMMON=(--task.num_steps 12 --eval-size 128 --eval-every 4 --set threads=1 --progress false
        --budget-tokens "$BUDGET")
TREE="sampling.tree.enabled=true"
if [ "$STAGE" = tune ]; then
  rredcot bench learn "${COMMON[@]}" --seeds 1 --first-seed "${FIRST:-0}" --out "$OUT" --methods \
"nodes_entropy=node_values:$TREE:sampling.tree.fork_rule=entropy,\
nodes_even=node_values:$TREE:sampling.tree.fork_rule=even,\
nodes_random=node_values:$TREE:sampling.tree.fork_rule=random"
else
  RULE=${RULE:-entropy}
  METHODS=${METHODS:-"grpo=uniform,\
tree_uniform=uniform:$TREE:sampling.tree.fork_rule=$RULE,\
tree_nodes=node_values:$TREE:sampling.tree.fork_rule=$RULE,\
tree_nodes_vh=value_head:$TREE:sampling.tree.fork_rule=$RULE"}
  rredcot bench learn "${COMMON[@]}" --seeds "${SEEDS:-2}" --first-seed "${FIRST:-100}" \
    --out "$OUT" --methods "$METHODS"
fi
