"""``megatransformer eval``: token-level loss and perplexity of a checkpoint on shards or text files.

Every loss token counts once: the numbers do not depend on the batch size (samples are built one by one
with per-sample seeds, then batched; the last partial batch is kept).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    from data_pipeline.cli import add_instruction_arguments

    p = subparsers.add_parser("eval", help="loss and perplexity of a checkpoint on held-out data",
                              description="Token-level loss and perplexity of a checkpoint on shards or text files; "
                                          "key.path=value overrides (e.g. data.seq_len=256) may follow the options.")
    p.add_argument("--checkpoint", required=True, help="checkpoint, checkpoints directory or run directory")
    p.add_argument("--data", required=True, nargs="+",
                   help="a shard directory (its validation split, or --split) or .txt/.jsonl files")
    p.add_argument("--split", choices=["train", "valid"], default="valid", help="which split of a shard directory")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (does not change the numbers)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches (default: all data)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_instruction_arguments(p)
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="e.g. data.seq_len=256")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatransformer.config import ConfigError, apply_overrides, validate
    from megatransformer.inference import load_for_inference

    if args.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    loaded = load_for_inference(args.checkpoint)
    if loaded.tokenizer is None:
        raise ConfigError(f"{loaded.path} has no tokenizer.json")
    raw = apply_overrides(loaded.cfg.model_dump(mode="json"), args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        shards, split = _as_shards(args, loaded.tokenizer.path, Path(tmp))
        # one stream: every document once, in order, however few there are
        raw["data"] = {**raw["data"], "train": shards, "valid": shards, "num_workers": 0, "streams": 1}
        cfg = validate(raw)
        result = evaluate(loaded.model, cfg, loaded.tokenizer, split, args.batch_size, args.max_batches)
    result = {"checkpoint": str(loaded.path), "objective": cfg.objective, **result}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{cfg.objective}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} "
              f"over {result['tokens']:,} tokens ({result['sequences']:,} sequences)")
    return 0


def _as_shards(args: argparse.Namespace, tokenizer: str, tmp: Path) -> tuple[str, str]:
    """``--data`` as (shard directory, split): given shards as they are, text files tokenized into ``tmp``."""
    from data_pipeline.shard import MANIFEST, write_shards

    data = args.data
    if len(data) == 1 and (Path(data[0]) / MANIFEST).is_file():
        return data[0], args.split
    text_field = args.completion_field if args.prompt_field else "text"
    write_shards(data, tokenizer, tmp / "shards", valid_every=0, workers=1, progress=False, text_field=text_field,
                 prompt_field=args.prompt_field)
    return str(tmp / "shards"), "train"  # every document went to the (only) split


def evaluate(model, cfg, tokenizer, split: str, batch_size: int, max_batches: int | None = None) -> dict:
    import torch

    from megatransformer.training.data import build_loader
    from megatransformer.batch import IGNORE_INDEX
    from megatransformer.training.engine import token_loss_sum

    loader = build_loader(cfg, split, 1, 0, 1, tokenizer, epochs=1)
    loss_sum, tokens, sequences, pending = 0.0, 0, 0, []

    def flush() -> None:
        nonlocal loss_sum, tokens, sequences
        batch = {k: torch.cat([b[k] for b in pending]) for k in pending[0]}
        labels = batch.pop("labels")
        with torch.no_grad():
            loss_sum += token_loss_sum(model(**batch), labels, 0.0).item()
        tokens += int((labels != IGNORE_INDEX).sum())
        sequences += len(pending)
        pending.clear()

    batches = 0
    for sample in loader:
        pending.append(sample)
        if len(pending) == batch_size:
            flush()
            batches += 1
            if max_batches and batches >= max_batches:
                break
    if pending and not (max_batches and batches >= max_batches):
        flush()
    loss = loss_sum / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens, "sequences": sequences}
