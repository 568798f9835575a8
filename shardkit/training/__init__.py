"""Training-loop state: Checkpoint, CheckpointManager."""
