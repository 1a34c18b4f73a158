"""The streaming loader: shards -> documents -> windows -> objective samples -> rows -> batches; the order of
the rows does not depend on how many ranks and workers read them, and it resumes exactly on any of them.

``sources`` resolves a split's datasets into shard sets, ``blocks`` opens and verifies shards, ``reader`` serves
one stream's documents, ``windows`` cuts them into the objective's samples, ``streaming`` makes the rows and
batches, ``state`` merges the ranks' states; ``spec`` holds what they share. Streams, the global row order,
exact and elastic resume, skipped rows, memory, instruction data, remote shards: docs/data.md.
"""

from data_pipeline.loader.spec import LoaderSettings
from data_pipeline.loader.state import merge_states
from data_pipeline.loader.streaming import StreamingLoader, build_loader, check_data

__all__ = ["LoaderSettings", "StreamingLoader", "build_loader", "check_data", "merge_states"]
