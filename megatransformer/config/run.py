"""A complete training run: every section, and the checks between them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from data_pipeline.settings import DataSettings, ObjectiveArgs
from megatransformer.config.core import Section, require
from megatransformer.config.model import ModelConfig
from megatransformer.config.training import (
    CheckpointConfig,
    OptimConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
    WandbConfig,
)


class RunConfig(Section):
    """A complete training run."""

    run_dir: Annotated[str, Field(min_length=1)] = "runs/default"
    """Directory for config.yaml, metrics.jsonl, checkpoints and W&B files."""
    seed: Annotated[int, Field(ge=0, lt=1 << 63)] = 0
    """Seed of weights, data order and objectives."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataSettings = Field(default_factory=DataSettings)  # (data_pipeline's, like objective_args)
    objective: Literal["autoregressive", "masked_lm", "prefix_lm", "span_corruption"] = "autoregressive"
    """Training objective (batch builder)."""
    objective_args: ObjectiveArgs = Field(default_factory=ObjectiveArgs)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Training precision; bf16 keeps fp32 master weights, fp16 adds loss scaling (GPU)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: bool = False
    """Also write the metrics as TensorBoard event files into run_dir/tensorboard (needs the tensorboard package:
    pip install 'megatransformer[tensorboard]'; off by default, W&B and metrics.jsonl being always there)."""
    resume: str | None = None
    """auto: the latest complete checkpoint in run_dir/checkpoints (fresh start if none); or a checkpoint path."""
    resume_elastic: Literal["keep_batch", "allow_batch_change"] = "keep_batch"
    """A resume may change the data-parallel size, tensor_parallel and zero_stage (micro batch and grad_accum
    are derived again from train.global_batch_size); keep_batch refuses a global batch other than the
    checkpoint's, allow_batch_change continues the same data, step count and schedule with the new batch
    (not an exact continuation)."""
    init_from: str | None = None
    """Checkpoint whose weights (only) initialise this run, for fine-tuning."""

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        m, tp = self.model, self.parallel.tensor_parallel
        for name, value in (
            ("n_heads", m.n_heads),
            ("n_kv_heads", m.kv_heads),
            ("d_ff", m.d_ff),
            ("vocab_size", m.vocab_size),
        ):
            require(value % tp == 0, f"parallel.tensor_parallel={tp} does not divide model.{name}={value}")
        self._sequence_parallel_fits()
        local = self.data.seq_len // self.parallel.sequence_parallel
        require(
            m.mlp_tiles <= local,
            f"model.mlp_tiles={m.mlp_tiles} exceeds the {local} positions of a sequence each rank holds "
            "(data.seq_len / parallel.sequence_parallel)",
        )
        allowed = {
            "autoregressive": ("decoder",),
            "prefix_lm": ("decoder", "encoder_decoder"),
            "masked_lm": ("encoder",),
            "span_corruption": ("encoder_decoder",),
        }[self.objective]
        require(
            m.arch in allowed,
            f"objective={self.objective} needs model.arch in {list(allowed)}, got model.arch={m.arch}",
        )
        require(
            self.data.seq_len <= m.max_seq_len or m.position == "alibi",
            f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
        )
        require(
            self.resume is None or self.init_from is None,
            "resume and init_from are exclusive: resume continues a run, init_from starts a new one",
        )
        self._schedule_fits()
        require(
            m.attention_window is None or (self.objective, m.arch) != ("prefix_lm", "decoder"),
            "model.attention_window does not combine with objective=prefix_lm on a decoder (its "
            "bidirectional prefix has no sliding window); drop one of them",
        )
        require(
            self.precision != "fp16" or m.attention_backend != "flex",
            "precision=fp16 is not supported with model.attention_backend=flex; use bf16",
        )
        return self

    def _schedule_fits(self) -> None:
        s, total = self.schedule, self.train.max_steps
        if s.decay_from is not None:
            require(s.name == "wsd", f"schedule.decay_from needs schedule.name=wsd, got schedule.name={s.name}")
            require(
                self.resume in (None, "auto") and self.init_from is None,
                "schedule.decay_from continues its checkpoint: it excludes init_from and a resume path "
                "(resume=auto continues the decay run itself)",
            )
        if s.name == "wsd" and s.decay_from is None and s.decay_steps is not None:
            require(
                s.warmup_steps + s.decay_steps <= total,
                f"schedule.warmup_steps={s.warmup_steps} + schedule.decay_steps={s.decay_steps} exceed "
                f"train.max_steps={total}; shorten the decay or lengthen the run",
            )

    def _sequence_parallel_fits(self) -> None:
        m, sp = self.model, self.parallel.sequence_parallel
        if sp == 1:
            return
        require(
            self.parallel.tensor_parallel == 1,
            f"parallel.sequence_parallel={sp} with parallel.tensor_parallel={self.parallel.tensor_parallel}: "
            "sequence and tensor parallelism are not combined; set one of them to 1",
        )
        require(m.n_heads % sp == 0, f"parallel.sequence_parallel={sp} does not divide model.n_heads={m.n_heads}")
        require(
            m.kv_heads % sp == 0 or sp % m.kv_heads == 0,
            f"parallel.sequence_parallel={sp} and model.n_kv_heads={m.kv_heads}: one must divide the other",
        )
        require(
            self.data.seq_len % sp == 0,
            f"parallel.sequence_parallel={sp} does not divide data.seq_len={self.data.seq_len}",
        )
