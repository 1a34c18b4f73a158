"""The run's state in and out of the engine: checkpoints, the resume decision, the run directory's lock, the
random generators."""
