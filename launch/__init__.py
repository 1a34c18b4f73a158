"""Launch ``megatransformer train`` under torchrun, under Slurm's srun, or as a single process.

``python -m launch --config FILE [key.path=value ...]`` reads the launcher's environment (:mod:`launch.env`),
exports RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, and runs the trainer in this process.
"""
