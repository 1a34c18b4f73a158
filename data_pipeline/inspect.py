"""``megatransformer data inspect``: what the model will see, as a person wants to read it, plus statistics."""

from __future__ import annotations

import json
import time

import torch

from data_pipeline.loader import LoaderSettings
from data_pipeline.loader.sources import ShardSet
from megatransformer.batch import IGNORE_INDEX


def batch_stats(
    batch: dict[str, torch.Tensor], objective: str, mask_id: int | None, eos_id: int | None, sentinels: set[int]
) -> dict[str, float]:
    """Averages over one batch; fractions are of all positions unless named otherwise."""
    labels = batch["labels"]
    has_loss = labels != IGNORE_INDEX
    stats = {"loss_fraction": has_loss.float().mean().item()}
    stats["padding_fraction"] = (batch["segment_ids"] == 0).float().mean().item()
    if "decoder_segment_ids" in batch:
        stats["decoder_padding_fraction"] = (batch["decoder_segment_ids"] == 0).float().mean().item()
    stats["documents_per_sequence"] = batch["segment_ids"].max(dim=1).values.float().mean().item()
    if objective == "masked_lm":
        inputs, selected = batch["input_ids"][has_loss], labels[has_loss]
        n = max(len(selected), 1)
        stats["selected_fraction"] = has_loss.sum().item() / max((batch["segment_ids"] > 0).sum().item(), 1)
        stats["masked_fraction"] = (inputs == mask_id).sum().item() / n
        stats["kept_fraction"] = ((inputs == selected) & (inputs != mask_id)).sum().item() / n
        stats["random_fraction"] = 1.0 - stats["masked_fraction"] - stats["kept_fraction"]
    if objective == "span_corruption":
        target = labels[has_loss].tolist()
        spans = sum(t in sentinels for t in target)
        noise = sum(t not in sentinels and t != eos_id for t in target)
        examples = int(batch["segment_ids"].max(dim=1).values.sum())  # one sentinel per span, one EOS each
        kept = (batch["segment_ids"] > 0).sum().item() - spans - examples
        stats["noise_fraction"] = noise / max(noise + kept, 1)
        if spans:
            stats["mean_noise_span_length"] = noise / spans
    return stats


def describe(shard_set: ShardSet) -> dict:
    """How a dataset's shards of one split are stored: the manifest's format and compression, bytes per
    token."""
    m = shard_set.manifest
    return {
        "directory": shard_set.directory,
        "format": m.version,
        "compression": m.compression,
        "bytes_per_token": m.bytes_per_token(shard_set.split),
    }


def show_row(batch: dict[str, torch.Tensor], row: int, tok, objective: str) -> str:
    """One row as text: the examples of an encoder-decoder row, the prefix/suffix split, [input->target] at
    masked-LM positions, or the packed documents separated by their EOS."""

    def text(ids) -> str:
        return tok.decode([int(i) for i in ids if int(i) != IGNORE_INDEX])

    ids, labels, segments = batch["input_ids"][row], batch["labels"][row], batch["segment_ids"][row]
    real = segments > 0
    if "decoder_input_ids" in batch:
        dec = batch["decoder_segment_ids"][row]
        return "\n".join(
            f"  example {k}: input  {text(ids[segments == k])!r}\n             target {text(labels[dec == k])!r}"
            for k in range(1, int(segments.max()) + 1)
        )
    if "prefix_len" in batch:  # per position: where the prefix of its document ends
        ends = batch["prefix_len"][row]
        lines = []
        for k in range(1, int(segments.max()) + 1):
            where = torch.nonzero(segments == k).flatten()
            start, stop = int(where[0]), int(where[-1]) + 1
            end = min(int(ends[start]), stop)
            if end > start:
                lines.append(f"  prefix: {text(ids[start:end])!r}")
            lines.append(f"  suffix: {text(ids[max(start, end) : stop])!r}")
        return "\n".join(lines)
    if objective == "masked_lm":
        pieces = []
        for i, lab in zip(ids[real].tolist(), labels[real].tolist()):
            word = tok.decode([i])
            if lab == IGNORE_INDEX:
                pieces.append(word)
            else:
                pieces.append(f"[{word.strip() or '_'}->{tok.decode([lab]).strip() or '_'}]")
        return "  " + repr("".join(pieces))
    return "  " + repr(text(ids[real]))


def inspect_batches(
    settings: LoaderSettings, tokenizer: str, micro: int, n_batches: int, split: str, as_json: bool
) -> int:
    from data_pipeline.loader import build_loader
    from data_pipeline.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    objective = settings.objective
    loader = build_loader(settings, split, micro, 0, 1, tok)
    started, batches = time.perf_counter(), []
    for batch in loader:
        batches.append(batch)
        if len(batches) == n_batches:
            break
    elapsed = time.perf_counter() - started
    tokens = sum(b["input_ids"].numel() + b.get("decoder_input_ids", b["input_ids"][:, :0]).numel() for b in batches)
    per_batch = [batch_stats(b, objective, tok.mask_id, tok.eos_id, set(tok.sentinel_ids)) for b in batches]
    stats = {key: sum(s[key] for s in per_batch) / len(per_batch) for key in per_batch[0]}
    stats["tokens_per_second"] = tokens / max(elapsed, 1e-9)
    datasets = [describe(src) for src in loader.spec.shard_sets]
    if as_json:
        print(json.dumps({"objective": objective, "batches": len(batches), **stats, "datasets": datasets}, indent=2))
        return 0
    for b, batch in enumerate(batches):
        print(f"batch {b}: " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items()))
        for row in range(min(2, batch["input_ids"].shape[0])):
            print(f" row {row}:\n{show_row(batch, row, tok, objective)}")
    for d in datasets:
        size = "" if d["bytes_per_token"] is None else f", {d['bytes_per_token']:.2f} bytes per token"
        print(f"{split} data {d['directory']}: format {d['format']}, {d['compression'] or 'uncompressed'}{size}")
    print(f"objective {objective}, {len(batches)} batches of {micro}")
    for key, value in stats.items():
        print(f"  {key:26s} {value:,.0f}" if value >= 1000 else f"  {key:26s} {value:.4f}")
    return 0


def inspect_rows(settings: LoaderSettings, tokenizer: str, start: int, stop: int) -> int:
    """Print global training rows [start, stop) as text: the rows of the layout-independent order (the same
    on any number of ranks and workers), e.g. the range a loss-spike rollback skipped."""
    from data_pipeline.loader import build_loader
    from data_pipeline.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    loader = build_loader(settings, "train", 1, 0, 1, tok)
    loader.skip_rows(0, start)  # (read, not shown)
    for row, batch in zip(range(start, stop), loader):
        print(f"row {row}:\n{show_row(batch, 0, tok, settings.objective)}")
    return 0
