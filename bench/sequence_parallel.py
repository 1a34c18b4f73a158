"""Ulysses sequence parallelism on CPU: peak activation memory per rank and tokens/s against sequence length,
at sequence-parallel degrees 1, 2 and 4 (gloo ranks on this machine), and with the MLPs in sequence tiles.

Each degree runs ``sp`` processes that train one micro batch of one packed row (documents of 300-700 tokens)
the way the trainer does: the masks built from the whole row (``masks.batch_masks``), each rank's slice
(``SequenceShard.split``), every attention core run through ``UlyssesCore``, the fused loss on the slice,
backward. No engine: the numbers are the model's. Memory is the peak of live tensor bytes during forward and
backward (``bench/attention.py``'s profiler count), with the weights' gradients allocated beforehand so that
only activations and their transients count; the largest over the ranks is reported. Tokens/s is the row's
length over the time of one forward and backward (median of ``--repeats``), for the whole sequence group.
``--mlp-tiles`` runs each point again with every MLP in that many tiles (``apply_tiled_mlp``, as
``model.mlp_tiles`` does).

    python bench/sequence_parallel.py                                  # lengths 1024 2048 4096, sp 1 2 4
    python bench/sequence_parallel.py --lengths 2048,8192 --degrees 1,2
    python bench/sequence_parallel.py --lengths 4096 --degrees 1,2 --mlp-tiles 1,4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import peak_bytes  # noqa: E402

from megatransformer.config import ModelConfig  # noqa: E402
from megatransformer.model import build_model  # noqa: E402
from megatransformer.model.masks import batch_masks  # noqa: E402
from megatransformer.training.engine.sequence_parallel import SequenceShard, apply_ulysses  # noqa: E402
from megatransformer.training.engine.tiled_mlp import apply_tiled_mlp  # noqa: E402
from megatransformer.training.runtime.distributed import free_port  # noqa: E402

MODEL = dict(
    d_model=256,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    d_ff=704,
    vocab_size=4096,
    position="rope",
    attention_backend="chunked",
)


def packed_row(length: int, vocab: int) -> dict[str, torch.Tensor]:
    """One row of documents of 300-700 tokens, as the loader packs them (positions restart per document)."""
    gen = torch.Generator().manual_seed(length)
    lengths = []
    while sum(lengths) < length:
        lengths.append(int(torch.randint(300, 701, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - length
    segments = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.randint(0, vocab, (1, length + 1), generator=gen)
    return {
        "input_ids": ids[:, :-1],
        "labels": ids[:, 1:],
        "segment_ids": segments[None],
        "position_ids": positions[None],
    }


def run_rank(rank: int, size: int, port: int, length: int, tiles: int, repeats: int, out: str) -> None:
    import torch.distributed as dist
    from gloo_ranks import join

    join(rank, size, port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    cfg = ModelConfig(max_seq_len=length, **MODEL)
    torch.manual_seed(0)
    model = build_model(cfg)
    whole, local = SequenceShard(rank, size).split(packed_row(length, cfg.vocab_size))
    if size > 1:
        apply_ulysses(model, dist.group.WORLD, rank, size)
    if tiles > 1:
        apply_tiled_mlp(model, tiles)
    masks = batch_masks("decoder", whole)
    labels = local.pop("labels")

    def step() -> None:
        model(**local, masks=masks, labels=labels).backward()

    step()  # the weights' gradients exist from here on (not counted as activations)
    dist.barrier()
    peak = peak_bytes(step, "cpu")
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    peaks = [None] * size
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        record = {
            "sp": size,
            "seq_len": length,
            "mlp_tiles": tiles,
            "peak_mib_per_rank": max(peaks) / 2**20,
            "tokens_per_s": length / statistics.median(seconds),
        }
        Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096", help="sequence lengths, comma-separated")
    parser.add_argument("--degrees", default="1,2,4", help="sequence-parallel degrees, comma-separated")
    parser.add_argument("--mlp-tiles", default="1", help="MLP tile counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per point")
    args = parser.parse_args(argv)
    records = []
    result = Path(f"/tmp/bench_sequence_parallel_{os.getpid()}.json")
    for length in map(int, args.lengths.split(",")):
        for size in map(int, args.degrees.split(",")):
            for tiles in map(int, args.mlp_tiles.split(",")):
                run = (size, free_port(), length, tiles, args.repeats, str(result))
                mp.spawn(run_rank, args=run, nprocs=size, join=True)
                records.append(json.loads(result.read_text()))
                print(json.dumps(records[-1]), flush=True)
    result.unlink(missing_ok=True)
    print(f"\nmodel: {MODEL}; one packed row per step; CPU threads {os.cpu_count()} shared by the ranks")
    first = records[0]
    base_name = f"sp={first['sp']} tiles={first['mlp_tiles']}"
    print(
        f"| seq_len | sp | MLP tiles | peak activation MiB per rank | x of {base_name} | "
        f"x of tiles={first['mlp_tiles']} | tokens/s | x of {base_name} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        base = next(
            b
            for b in records
            if b["seq_len"] == r["seq_len"] and b["sp"] == first["sp"] and b["mlp_tiles"] == first["mlp_tiles"]
        )
        untiled = next(
            b
            for b in records
            if b["seq_len"] == r["seq_len"] and b["sp"] == r["sp"] and b["mlp_tiles"] == first["mlp_tiles"]
        )
        print(
            f"| {r['seq_len']} | {r['sp']} | {r['mlp_tiles']} | {r['peak_mib_per_rank']:.1f} | "
            f"{r['peak_mib_per_rank'] / base['peak_mib_per_rank']:.2f} | "
            f"{r['peak_mib_per_rank'] / untiled['peak_mib_per_rank']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
