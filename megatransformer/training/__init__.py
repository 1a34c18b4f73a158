"""Training: DeepSpeed engine from a RunConfig, the training loop, checkpoints, metrics."""
