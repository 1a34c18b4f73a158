"""The batch contract between data_pipeline (producer), the model and the trainer (consumers).

A batch is a plain ``dict[str, torch.Tensor]``. Every key except ``labels`` is a keyword argument of the
model's ``forward``; the trainer pops ``labels`` and computes the loss from the returned logits.

Conventions:
- ``labels`` are aligned with the (decoder) input positions: ``labels[b, t]`` is the token the model must
  predict at position ``t`` (the data pipeline does the shift); ``IGNORE_INDEX`` marks positions without loss.
  Labels never cross a document boundary.
- ``segment_ids`` number the documents of a packed row 1, 2, ...; padding is segment 0. A query attends only to
  keys of its own segment (padding queries attend anywhere: their outputs carry no loss).
- ``position_ids`` restart at 0 for every document.
"""

from __future__ import annotations

from typing import TypedDict

import torch

IGNORE_INDEX = -100
PAD_SEGMENT = 0


class Batch(TypedDict, total=False):
    input_ids: torch.Tensor  # [B, T] int64: decoder-only / encoder-only input, or the encoder input
    labels: torch.Tensor  # [B, T] (or [B, T_dec]) int64, IGNORE_INDEX where there is no loss
    position_ids: torch.Tensor  # [B, T] int64
    segment_ids: torch.Tensor  # [B, T] int64, PAD_SEGMENT for padding
    prefix_len: torch.Tensor  # [B, T] int64: prefix_lm on a decoder, where the bidirectional prefix of each
    # position's document ends (an index into the row; the model also takes one prefix per row, [B])
    decoder_input_ids: torch.Tensor  # [B, T_dec] int64 (encoder_decoder)
    decoder_position_ids: torch.Tensor  # [B, T_dec] int64
    decoder_segment_ids: torch.Tensor  # [B, T_dec] int64, matching the encoder's segment numbers


MODEL_INPUT_KEYS = tuple(k for k in Batch.__annotations__ if k != "labels")
