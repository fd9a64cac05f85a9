"""The sampling engine: prompts in, a segmented, verified RolloutBatch out (decoder, shared prompt, tree groups, memory bounds)."""
