#!/bin/bash
# A worker that takes jobs, one line at a time, from a queue file shared with other workers
# (flock), and runs each with a protocol script: queue_worker.sh QUEUE SCRIPT ROOT
# A queue line is SCRIPT's job spec (SEED:LR:VARIANT). Start two workers for two threads.
queue=$1 script=$2 root=$3
while true; do
  job=$(flock "$queue.lock" bash -c 'j=$(head -n1 "$0"); [ -n "$j" ] && sed -i 1d "$0"; echo "$j"' "$queue")
  [ -z "$job" ] && break
  bash "$script" "$root" "$job"
done
