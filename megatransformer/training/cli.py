"""``megatransformer train --config FILE [key.path=value ...]``."""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train a model (one process, torchrun, or Slurm via launch)")
    parser.add_argument("--config", required=True, help="YAML run description")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return train(args.config, args.overrides)


def train(config: str, overrides: list[str]) -> int:
    """Train; returns the exit code (0 done, 124 preempted and checkpointed, 3 diverged, 4 a collective
    timed out or lost a peer: another rank stalled or died)."""
    from megatransformer.config import load_config

    cfg = load_config(config, overrides)  # config errors surface before any process group exists
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.training import checkpoint as ckpt
    from megatransformer.training.distributed import EXIT_COLLECTIVE_FAILED, collective_failure, setup
    from megatransformer.training.loop import Preemption, Trainer, print_sample
    from megatransformer.training.preflight import check_before_start

    preemption = Preemption()  # before the seconds of DeepSpeed start-up, so an early signal is not lost

    if cfg.data.tokenizer is None:
        from megatransformer.config import ConfigError

        raise ConfigError("data.tokenizer is not set; point it at the tokenizer.json the shards were made with")
    existing = ckpt.latest_checkpoint(ckpt.checkpoint_root(cfg))
    if cfg.resume is None and existing is not None:  # never overwrite a run by starting it afresh
        from megatransformer.config import ConfigError

        raise ConfigError(f"run_dir={cfg.run_dir} already holds checkpoints (latest: {existing.name}); pass "
                          "resume=auto to continue that run, or choose a new run_dir")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_before_start(cfg, tokenizer)  # device and files: seconds, not after DeepSpeed's start-up
    init_state = ckpt.load_weights(cfg.init_from, cfg.model)[1] if cfg.init_from else None
    try:
        dist_info = setup(cfg.parallel.timeout_minutes)
        trainer = Trainer(cfg, dist_info, tokenizer, init_state, preemption)
        code = trainer.run()
    except RuntimeError as err:  # a stalled or dead rank: one line per rank, not a traceback from each
        line = collective_failure(err, cfg.parallel.timeout_minutes)
        if line is None:
            raise
        rank = os.environ.get("RANK", "0")
        print(f"megatransformer train: error: rank {rank}: {line}", file=sys.stderr, flush=True)
        return EXIT_COLLECTIVE_FAILED
    if code == 0 and dist_info.is_main:
        print_sample(cfg, ckpt.checkpoint_root(cfg), tokenizer)
    sys.stdout.flush()
    return code
