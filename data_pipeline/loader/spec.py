"""What a loader reads and how: the run's settings, and the spec the loader's workers share."""

from __future__ import annotations

from dataclasses import dataclass, field

from data_pipeline.loader.sources import ShardSet
from data_pipeline.objectives import Objective
from data_pipeline.remote import Retry
from data_pipeline.settings import DataSettings, ObjectiveArgs

SPLIT_SALT = {"train": 0, "valid": 1}


@dataclass(frozen=True)
class LoaderSettings:
    """Everything the loader needs to know: the data settings (a run config's ``data`` section) and the run's
    choices they are read with (megatransformer.training.data passes a run config's)."""

    data: DataSettings  # which shards, and how they become rows
    objective: str  # autoregressive | masked_lm | prefix_lm | span_corruption
    arch: str  # decoder | encoder | encoder_decoder
    vocab_size: int  # the model's; shards must fit it
    seed: int = 0
    objective_args: ObjectiveArgs = field(default_factory=ObjectiveArgs)
    retry_wait: float = 1.0  # remote reads: seconds before the first retry (doubled each time)
    pin_memory: bool = False  # batches in page-locked memory (a CUDA run copies them without waiting)


@dataclass
class LoaderSpec:
    shard_sets: list[ShardSet]
    objective: Objective
    eos: int
    seed: int
    salt: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    num_workers: int
    shuffle: bool
    block: int
    on_corrupt: str
    epochs: int | None
    streams: int
    retry: Retry
    pin_memory: bool = False

    @property
    def workers_per_rank(self) -> int:
        return max(1, self.num_workers)

    def stream_of(self, local_row: int) -> int:
        """The stream of this rank's local row ``local_row`` (global row dp_rank + dp_size * local_row)."""
        return (self.dp_rank + self.dp_size * local_row) % self.streams
