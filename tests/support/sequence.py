"""Small batches whose sequences sequence parallelism splits: a packed prefix-LM decoder batch, a packed
encoder-decoder batch."""

from __future__ import annotations

import torch


def decoder_batch() -> dict[str, torch.Tensor]:
    segments = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 2, 2, 2]])
    return {
        "input_ids": torch.arange(16).view(2, 8),
        "segment_ids": segments,
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 2]]),
        "prefix_len": torch.tensor([[2, 2, 2, 5, 5, 5, 5, 0], [3, 3, 3, 3, 3, 6, 6, 6]]),
        "labels": torch.arange(100, 116).view(2, 8),
    }


def encoder_decoder_batch() -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.arange(8).view(1, 8),
        "segment_ids": torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
        "decoder_input_ids": torch.tensor([[7, 8, 9, 7, 8]]),
        "decoder_segment_ids": torch.tensor([[1, 1, 2, 2, 2]]),
        "decoder_position_ids": torch.tensor([[0, 1, 0, 1, 2]]),
        "labels": torch.tensor([[8, 9, 8, 9, 3]]),
    }
