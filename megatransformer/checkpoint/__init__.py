"""The checkpoint format, without DeepSpeed: directory layout, integrity, trainer state and weights.

Inference, export, averaging and the Hugging Face conversion read checkpoints through this package alone; the
training side (``training/checkpointer.py``) adds DeepSpeed's states. Design: docs/checkpoints.md.
"""

from megatransformer.checkpoint.directory import (COMPLETE, CONFIG, LATEST, OPTIMIZER, TOKENIZER, TRAINER_STATE,
                                                  WEIGHTS, WEIGHTS_FILES, atomic_write, checkpoints_dir,
                                                  complete_before, complete_checkpoints, find_checkpoint,
                                                  latest_checkpoint, prune, rank_file, rewind_to, step_name,
                                                  step_of, warn)
from megatransformer.checkpoint.files import (SHAPE_FIELDS, TrainerState, check_same_shapes, load_safetensors,
                                              load_weights, read_trainer_state, save_safetensors, saved_config,
                                              write_trainer_state, write_weights_checkpoint)
from megatransformer.checkpoint.integrity import (DEEPSPEED_STATE_GLOBALS, CheckpointDamaged, CheckpointUnsafe, checkpoint_files, file_entry,
                                                  newest_intact, read_manifest, resume_candidates, safe_load,
                                                  verify_checkpoint, write_manifest)

__all__ = [
    "COMPLETE", "CONFIG", "DEEPSPEED_STATE_GLOBALS", "LATEST", "OPTIMIZER", "SHAPE_FIELDS", "TOKENIZER", "TRAINER_STATE", "WEIGHTS",
    "WEIGHTS_FILES", "CheckpointDamaged", "CheckpointUnsafe", "TrainerState", "atomic_write", "check_same_shapes",
    "checkpoint_files", "checkpoints_dir", "complete_before", "complete_checkpoints", "file_entry", "find_checkpoint",
    "latest_checkpoint", "load_safetensors", "load_weights", "newest_intact", "prune", "rank_file",
    "read_manifest", "read_trainer_state", "resume_candidates", "rewind_to", "safe_load", "save_safetensors", "saved_config",
    "step_name", "step_of", "verify_checkpoint", "warn", "write_manifest", "write_trainer_state",
    "write_weights_checkpoint",
]
