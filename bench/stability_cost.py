"""What QK-norm (``model.qk_norm``) and the z-loss (``train.z_loss``) cost on the training step: our decoder
stepped side by side plain, with QK-norm, with the z-loss and with both (same initial weights, batch and AdamW
as ``bench/train_step.py``'s runners), in alternating rounds; the cost is the median over rounds of the
per-round ratio of step times against the plain model (``+2.0%``: 2% slower). The z-loss at 0 is the plain
model itself: the head computes nothing of it (tests/unit/test_z_loss.py counts the operations).

    python bench/stability_cost.py --modes fp32,bf16 --rounds 7 --steps 3 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_step  # noqa: E402

from megatransformer.model import build_model  # noqa: E402

VARIANTS = {  # name: (model.qk_norm, train.z_loss)
    "plain": (False, 0.0),
    "qk_norm": (True, 0.0),
    "z_loss": (False, None),
    "qk_norm + z_loss": (True, None),
}


def runners(args: argparse.Namespace, mode: str) -> dict[str, train_step.Runner]:
    cfg = train_step.model_config(args).model_copy(update={"attention_backend": args.backend})
    torch.manual_seed(0)
    state = build_model(cfg).state_dict()
    made = {}
    for name, (qk_norm, z_loss) in VARIANTS.items():
        model = build_model(cfg.model_copy(update={"qk_norm": qk_norm}))
        model.load_state_dict(state, strict=False)  # (QK-norm's own weights start at 1)
        z_loss = args.z_loss if z_loss is None else z_loss
        made[name] = train_step.Runner(
            "ours", model, mode, args.device, args.compile, cpu_bf16_matmul=args.cpu_bf16_matmul, z_loss=z_loss
        )
    return made


def main() -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--backend", default="chunked", help="model.attention_backend of every variant")
    own.add_argument("--z-loss", type=float, default=1e-4, help="train.z_loss of the z-loss variants (PaLM's)")
    args = train_step.parse_args(sys.argv[1:], parents=(own,))
    if args.threads:
        torch.set_num_threads(args.threads)
    batch = train_step.make_batch(train_step.model_config(args), args)
    print(
        f"# QK-norm and z-loss cost: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"d{args.d_model} L{args.layers} H{args.heads} KV{args.kv_heads} V{args.vocab}, batch {args.batch} x "
        f"{args.seq}, {args.backend} attention, z_loss {args.z_loss}, {args.clock} clock, {args.rounds} rounds x "
        f"{args.steps} steps\n# command: python {' '.join(sys.argv)}"
    )
    print("| mode | variant | s/step (median) | tokens/s | cost vs plain (median; per round) |")
    print("|---|---|---|---|---|")
    tokens = args.batch * args.seq
    for mode in args.modes.split(","):
        made = runners(args, mode)
        for runner in made.values():
            for _ in range(args.warmup):
                runner.step(*batch)
        seconds: dict[str, list[float]] = {name: [] for name in made}
        for rnd in range(args.rounds):
            for name in made if rnd % 2 == 0 else reversed(made):
                seconds[name].append(train_step.timed_steps(made[name], batch, args.steps, args.clock))
        for name, times in seconds.items():
            costs = [t / p - 1 for t, p in zip(times, seconds["plain"])]
            cost = (
                "-"
                if name == "plain"
                else f"**{statistics.median(costs):+.1%}**; " + ", ".join(f"{c:+.1%}" for c in costs)
            )
            step_s = statistics.median(times)
            print(f"| {mode} | {name} | {step_s:.3f} | {tokens / step_s:,.0f} | {cost} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
