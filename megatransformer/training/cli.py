"""``megatransformer train --config FILE [key.path=value ...]``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatransformer.config import RunConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train a model (one process, torchrun, or Slurm via launch)",
                                   description="Train the model a config describes; key.path=value overrides "
                                               "change any field (megatransformer/config.py documents them).")
    parser.add_argument("--config", required=True, help="YAML run description, or a shipped config's name (llama-style)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. train.max_steps=100")
    parser.add_argument("--verbose", action="store_true", help="also show DeepSpeed's start-up messages")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return train(args.config, args.overrides, args.verbose)


def train(config: str, overrides: list[str], verbose: bool = False) -> int:
    """Train; returns the exit code (0 done, 124 preempted and checkpointed, 3 diverged, 4 a collective
    timed out or lost a peer: another rank stalled or died)."""
    from megatransformer.config import load_config

    started = time.perf_counter()
    cfg = load_config(config, overrides)  # config errors surface before any process group exists
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.training import checkpoint as ckpt
    from megatransformer.training.distributed import EXIT_COLLECTIVE_FAILED, collective_failure, setup, teardown
    from megatransformer.training.host_memory import apply_host_memory_policy
    from megatransformer.training.loop import Preemption, Trainer, print_sample
    from megatransformer.training.metrics import quiet_engine
    from megatransformer.training.preflight import check_before_start, stale_build_locks
    from megatransformer.training.watchdog import hang_dir, stack_dumps, switch_on_flight_recorder

    preemption = Preemption()  # before the seconds of DeepSpeed start-up, so an early signal is not lost

    if cfg.data.tokenizer is None:
        from megatransformer.config import ConfigError

        raise ConfigError("data.tokenizer is not set; point it at the tokenizer.json the shards were made with")
    existing = ckpt.latest_checkpoint(ckpt.checkpoint_root(cfg))
    if cfg.resume not in (None, "auto"):
        ckpt.locate_resume(cfg)  # a missing or incomplete resume=PATH fails now (its files are verified later)
    if cfg.resume is None and existing is not None:  # never overwrite a run by starting it afresh
        from megatransformer.config import ConfigError

        raise ConfigError(f"run_dir={cfg.run_dir} already holds checkpoints (latest: {existing.name}); pass "
                          "resume=auto to continue that run, or choose a new run_dir")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_before_start(cfg, tokenizer)  # device and files: seconds, not after DeepSpeed's start-up
    if os.environ.get("LOCAL_RANK", "0") == "0":  # (one line per node: the build directory is per node)
        for line in stale_build_locks():
            print(line, file=sys.stderr, flush=True)
    host_memory = apply_host_memory_policy(cfg.train.host_memory)  # before the first large tensor
    init_state = ckpt.load_weights(cfg.init_from, cfg.model)[1] if cfg.init_from else None
    import torch

    if torch.cuda.is_available():
        switch_on_flight_recorder(cfg.run_dir)  # (before the process group starts)
    try:
        with quiet_engine(verbose):
            dist_info = setup(cfg.parallel.timeout_minutes)
            trainer = Trainer(cfg, dist_info, tokenizer, init_state, preemption)
        if dist_info.is_main:
            print(host_memory)
        if init_state is not None and dist_info.is_main:
            print(f"init_from={cfg.init_from}: starting from its weights ({len(init_state)} tensors); optimizer, "
                  "learning-rate schedule and data order start fresh")
        code = trainer.run()
        teardown()  # (every collective of the run is behind it)
    except RuntimeError as err:  # a stalled or dead rank: one line per rank, not a traceback from each
        line = collective_failure(err, cfg.parallel.timeout_minutes)
        if line is None:
            raise
        rank = os.environ.get("RANK", "0")
        dumps = stack_dumps(cfg.run_dir)
        if dumps:
            line += f"; Python stacks of the stalled step: {hang_dir(cfg.run_dir)}/ ({', '.join(p.name for p in dumps)})"
        print(f"megatransformer train: error: rank {rank}: {line}", file=sys.stderr, flush=True)
        return EXIT_COLLECTIVE_FAILED
    if dist_info.is_main:
        if code == 0:
            print_sample(cfg, ckpt.checkpoint_root(cfg), tokenizer)
        print_summary(cfg, code, time.perf_counter() - started)
    sys.stdout.flush()
    if dist_info.world_size > 1:
        # A finished multi-rank run skips the interpreter's shutdown. There, now and then, a rank aborted
        # ("terminate called without an active exception": a C++ thread of the communication stack still
        # joinable, SIGABRT; twice in ~40 two-rank gloo runs here, once after destroying the process group),
        # which turned a finished, checkpointed run into a failed job. Everything the run writes is closed.
        sys.stderr.flush()
        os._exit(code)
    return code


def print_summary(cfg: RunConfig, code: int, wall_seconds: float) -> None:
    """The run's closing summary, after drawing its curves next to metrics.jsonl."""
    from pathlib import Path

    from megatransformer.commands.plot import default_out, draw
    from megatransformer.training import checkpoint as ckpt
    from megatransformer.training.metrics import summary

    has_metrics = (Path(cfg.run_dir) / "metrics.jsonl").is_file()
    plot = draw([cfg.run_dir], default_out([cfg.run_dir])) if has_metrics else None
    checkpoint = ckpt.latest_checkpoint(ckpt.checkpoint_root(cfg))
    print(summary(cfg, code, wall_seconds, checkpoint, plot))
