"""A compiled training step against the eager one, on packed documents (the masks the trainer builds).

Both runners hold the same weights and see the same batch: rows packed with documents of varied lengths
(``--prefix``: each document a prefix-LM example, its first third bidirectional), fp32, torch's AdamW. Each
step builds its masks on the host with ``masks.batch_masks``, as the trainer does for every batch (a mask
reused across steps would carry what its first step cached, which a trainer's fresh mask does not). Rounds
alternate the order of the two; the speed-up is the median of the per-round ratios ``eager s / compiled s``,
printed with the graph breaks ``torch.compile`` met and the frames it traced over all steps.

    python bench/compile_step.py
    python bench/compile_step.py --prefix --rounds 5
    python bench/compile_step.py --threads 1 --clock cpu   # immune to other processes' load
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_step import Runner, timed_steps  # noqa: E402

from megatransformer.config import ModelConfig  # noqa: E402
from megatransformer.model import build_model  # noqa: E402
from megatransformer.model.masks import batch_masks  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--backend", default="auto", help="model.attention_backend")
    p.add_argument("--prefix", action="store_true", help="prefix-LM documents")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per runner and round")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: process CPU time, immune to other processes' load (use with --threads 1)",
    )
    return p.parse_args(argv)


def packed_batch(args: argparse.Namespace, vocab: int) -> dict[str, torch.Tensor]:
    """Rows of documents 20-120 tokens long (the last one cut at the row's end)."""
    g = torch.Generator().manual_seed(1)
    segments = torch.zeros(args.batch, args.seq, dtype=torch.long)
    prefix = torch.zeros_like(segments)
    for row in range(args.batch):
        start, doc = 0, 1
        while start < args.seq:
            end = min(args.seq, start + int(torch.randint(20, 121, (1,), generator=g)))
            segments[row, start:end], prefix[row, start:end] = doc, start + (end - start) // 3
            start, doc = end, doc + 1
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "segment_ids": segments}
    return batch | ({"prefix_len": prefix} if args.prefix else {})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=4,
        d_ff=args.d_model * 3,
        vocab_size=8192,
        max_seq_len=args.seq,
        norm="rmsnorm",
        position="rope",
        ffn="swiglu",
        attention_backend=args.backend,
    )
    batch = packed_batch(args, cfg.vocab_size)
    step_inputs = (batch["input_ids"], batch["labels"])
    torch.manual_seed(0)
    state = build_model(cfg).state_dict()
    runners = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        model = build_model(cfg)
        model.load_state_dict(state)
        runners[name] = Runner("ours", model, "fp32", "cpu", compiled)
        runners[name].step(*step_inputs, masks=batch_masks("decoder", batch))  # warm-up (the compilation)
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    for rnd in range(args.rounds):
        for name in runners if rnd % 2 == 0 else reversed(runners):
            with_masks = SimpleNamespace(
                step=lambda *step, run=runners[name]: run.step(*step, masks=batch_masks("decoder", batch))
            )
            seconds[name].append(timed_steps(with_masks, step_inputs, args.steps, args.clock))
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    frames = sum(torch._dynamo.utils.counters["frames"].values())
    ratios = [e / c for e, c in zip(seconds["eager"], seconds["compiled"])]
    print(
        f"# torch={torch.__version__} threads={torch.get_num_threads()} d{args.d_model} L{args.layers} "
        f"batch {args.batch} x {args.seq} backend={args.backend} prefix={args.prefix} clock={args.clock}; command: "
        f"python {' '.join(sys.argv)}"
    )
    print(f"graph breaks while compiling: {breaks} (in all steps, {frames} frames traced)")
    print(
        f"eager {statistics.median(seconds['eager']):.3f} s/step, compiled "
        f"{statistics.median(seconds['compiled']):.3f} s/step; speed-up (median) {statistics.median(ratios):.2f}x;"
        f" per round {', '.join(f'{r:.2f}' for r in ratios)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
