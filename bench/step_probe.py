"""Runs engine.TrainModule steps in this process under megatransformer.training.observability.probes and prints JSON.

``python bench/step_probe.py '[{"layers": 1, "accum": 1, "zero": 0, "objective": "prefix_lm"}, ...]'``:
one line per case. A separate process because DeepSpeed's process group is global state.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch


def batches(vocab: int, micro: int, seq: int, prefix: bool):
    """Endless packed decoder batches on the host: 3 documents per row, the last one padding."""
    gen = torch.Generator().manual_seed(0)
    segment_list = [1] * (seq // 2) + [2] * (seq // 4) + [0] * (seq - seq // 2 - seq // 4)
    segments = torch.tensor(segment_list)
    ends = torch.tensor([{1: 3, 2: seq // 2 + 3}.get(s, 0) for s in segment_list])  # 3-token prefixes
    for _ in itertools.count():
        ids = torch.randint(0, vocab, (micro, seq), generator=gen)
        labels = ids.roll(-1, 1).masked_fill(segments.expand(micro, -1) == 0, -100)
        batch = {
            "input_ids": ids,
            "labels": labels,
            "segment_ids": segments.expand(micro, -1).clone(),
            "position_ids": torch.arange(seq).expand(micro, -1).clone(),
        }
        if prefix:
            batch["prefix_len"] = ends.expand(micro, -1).clone()
        yield batch


def page_locked(source):
    """The batches in page-locked memory, as the loader hands them over on a GPU (a copy from pageable memory
    waits for the GPU)."""
    for batch in source:
        yield {key: value.pin_memory() for key, value in batch.items()}


def main(cases: list[dict]) -> None:
    from megatransformer.config import RunConfig
    from megatransformer.training.engine.train_module import TrainModule
    from megatransformer.training.observability.probes import probe_step
    from megatransformer.training.runtime.distributed import setup

    dist_info = setup()
    for case in cases:
        cfg = RunConfig.model_validate(
            {
                "model": dict(
                    d_model=32,
                    n_layers=case["layers"],
                    n_heads=4,
                    n_kv_heads=2,
                    d_ff=64,
                    vocab_size=128,
                    max_seq_len=64,
                ),
                "data": {"seq_len": 32},
                "objective": case.get("objective", "autoregressive"),
                "train": {"micro_batch_size": 2, "grad_accum": case["accum"]},
                "parallel": {"zero_stage": case["zero"]},
                "precision": case.get("precision", "fp32"),
            }
        )
        module = TrainModule(cfg, dist_info, zero_stage=case["zero"])  # (ZeRO's own step, even on one rank)
        source = batches(128, 2, 32, cfg.objective == "prefix_lm")
        report = probe_step(module, page_locked(source) if module.device.type == "cuda" else source)
        print(json.dumps({**case, **report}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
