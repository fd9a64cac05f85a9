"""The training loop of `rredcot train` and `rredcot sft`: setup, the RL step, references, checkpoints, evaluation, the run directory."""
