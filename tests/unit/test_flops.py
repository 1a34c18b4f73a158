"""The MFU numerator's arithmetic (``megatransformer.flops``): the matmuls per token plus attention over each
document's own square, as the trainer and ``bench/mfu.py`` count it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatransformer.config import ModelConfig
from megatransformer.flops import document_lengths, documents_flops, model_size

SEQ = 64


def tiny(**fields) -> ModelConfig:
    base = dict(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=SEQ)
    return ModelConfig(**(base | fields))


def linear_weights(cfg: ModelConfig) -> int:
    from megatransformer.model import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_packed_documents_count_their_own_squares():
    cfg = tiny()
    size = model_size(cfg, SEQ)
    per_key = 3 * 2 * cfg.n_layers * 2 * cfg.d_model  # forward + backward, scores and weighted sum, all layers
    assert size.attention_flops_per_key == per_key
    assert size.matmul_flops_per_token == 6 * linear_weights(cfg)
    # one document per row: the per-token figure, the full L x L square of every row
    assert documents_flops(size, [SEQ, SEQ]) == pytest.approx(2 * SEQ * size.flops_per_token)
    # a row of three documents: 6N per token plus the sum of their squares, far less attention than L x L
    packed = documents_flops(size, [10, 20, 34])
    assert packed == size.matmul_flops_per_token * SEQ + per_key * (10**2 + 20**2 + 34**2)
    assert packed < SEQ * size.flops_per_token


def test_windows_narrow_each_documents_square():
    causal = model_size(tiny(attention_window=8), SEQ)
    per_key = causal.attention_flops_per_key
    assert documents_flops(causal, [20, 5]) == causal.matmul_flops_per_token * 25 + per_key * (20 * 8 + 5 * 5)
    encoder = model_size(tiny(arch="encoder", attention_window=8), SEQ)  # a band of 2 * 8 - 1 keys each side
    assert documents_flops(encoder, [20]) == encoder.matmul_flops_per_token * 20 + per_key * 20 * 15
    assert documents_flops(encoder, [SEQ]) == pytest.approx(SEQ * encoder.flops_per_token)


def test_an_encoder_decoder_counts_its_per_token_figure():
    size = model_size(tiny(arch="encoder_decoder", n_decoder_layers=2), SEQ)
    assert size.attention_flops_per_key is None
    assert documents_flops(size, [10, 54]) == size.flops_per_token * 64


def test_documents_are_the_runs_of_segment_ids_without_padding():
    segments = np.array([[1, 1, 2, 2, 2, 0, 0], [0, 3, 3, 4, 0, 5, 5]])
    assert document_lengths(segments, (2, 7)) == [2, 3, 2, 1, 2]
    assert document_lengths(None, (3, 7)) == [7, 7, 7]


def test_the_trainers_numerator_counts_the_documents_of_its_batches():
    from types import SimpleNamespace

    from megatransformer.config import RunConfig
    from megatransformer.training.engine.train_module import TrainModule

    cfg = RunConfig(model=tiny(), data={"seq_len": SEQ})
    size = model_size(cfg.model, SEQ)
    segments = torch.zeros(2, SEQ, dtype=torch.long)
    segments[0, :40], segments[0, 40:60], segments[1] = 1, 2, 3  # row 0: documents of 40 and 20, 4 padding
    batch = {"input_ids": torch.ones(2, SEQ, dtype=torch.long), "segment_ids": segments}
    module = SimpleNamespace(cfg=cfg, size=size)
    assert TrainModule.model_flops(module, batch) == documents_flops(size, [40, 20, SEQ])
    del batch["segment_ids"]  # rows without segment ids: one document each
    assert TrainModule.model_flops(module, batch) == pytest.approx(2 * SEQ * size.flops_per_token)
