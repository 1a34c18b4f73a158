"""``megatransformer train --config FILE [key.path=value ...]``, and what a run prints at its end."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from megatransformer.commands.arguments import add_config_argument
from megatransformer.config import ConfigError
from megatransformer.console import held_stdout, to_stderr
from megatransformer.training.observability.metrics import format_duration, read_metrics

if TYPE_CHECKING:
    from megatransformer.checkpoint import TrainerState
    from megatransformer.config import RunConfig
    from megatransformer.training.loop import Trainer
    from megatransformer.training.runtime.failure_board import FailureBoard


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model (one process, torchrun, or Slurm via launch)",
        description="Train the model a config describes; key.path=value overrides "
        "change any field (megatransformer/config/ documents them).",
    )
    add_config_argument(parser)
    parser.add_argument(
        "overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. train.max_steps=100"
    )
    parser.add_argument("--verbose", action="store_true", help="also show DeepSpeed's start-up messages")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return train(args.config, args.overrides, args.verbose)


def train(config: str, overrides: list[str], verbose: bool = False) -> int:
    """Train; returns the exit code (0 done, 124 preempted and checkpointed, 3 diverged, 4 a collective
    timed out or lost a peer: another rank stalled or died); a failed write (a full disk) raises WriteFailed,
    exit 5."""
    from megatransformer.config import load_config

    started, began = time.perf_counter(), time.time()
    cfg = load_config(config, overrides)  # config errors surface before any process group exists
    if os.environ.get("RANK", "0") == "0":  # a first line within seconds: importing PyTorch alone takes some
        print(f"training {cfg.run_dir} to step {cfg.train.max_steps:,}: starting PyTorch and DeepSpeed", flush=True)
    from data_pipeline import DataError, WriteFailed
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer import checkpoint as ckpt
    from megatransformer.training.checkpointing.resume import check_run_dir, keep_saved_batch
    from megatransformer.training.checkpointing.run_lock import lock_run_dir
    from megatransformer.training.loop import Preemption, Trainer
    from megatransformer.training.observability.watchdog import (
        dump_rank,
        hang_dir,
        stack_dumps,
        switch_on_flight_recorder,
    )
    from megatransformer.training.preflight import check_before_start
    from megatransformer.training.runtime.builds import build_notes, build_progress, ops_to_build
    from megatransformer.training.runtime.distributed import (
        EXIT_COLLECTIVE_FAILED,
        collective_failure,
        groups_end_after_failure,
        on_first_rank,
        setup,
    )
    from megatransformer.training.runtime.failure_board import FailureBoard
    from megatransformer.training.runtime.host_memory import apply_host_memory_policy, map_large_blocks
    from megatransformer.training.threads import set_threads_for_machine

    preemption = Preemption()  # before the seconds of DeepSpeed start-up, so an early signal is not lost

    if cfg.data.tokenizer is None:
        raise ConfigError("data.tokenizer is not set; point it at the tokenizer.json the shards were made with")
    check_run_dir(cfg)
    cfg, kept = keep_saved_batch(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # (an elastic resume's batch)
    if kept and os.environ.get("RANK", "0") == "0":
        print(kept, flush=True)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_before_start(cfg, tokenizer)  # device and files: seconds, not after DeepSpeed's start-up
    if cfg.train.check_memory:  # an out-of-memory layout: one line now, not an error minutes in
        from megatransformer.commands.plan import check_layout_fits

        world = int(os.environ.get("WORLD_SIZE", "1"))
        note = check_layout_fits(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
        if note and os.environ.get("RANK", "0") == "0":
            print(note, flush=True)
    ops = []  # the DeepSpeed ops this node builds or waits for, said by one rank (the build directory is per node)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        import torch

        ops = ops_to_build(
            int(os.environ.get("WORLD_SIZE", "1")), torch.cuda.is_available(), cfg.parallel.offload_optimizer
        )
        for line in build_notes(ops):
            print(line, flush=True)
    map_large_blocks()  # (the start's transients go back to the kernel; the policy applies from the first step)
    busy = set_threads_for_machine()
    if busy and os.environ.get("LOCAL_RANK", "0") == "0":
        print(busy, flush=True)
    # (each tensor read when a rank writes it: at ZeRO-3 one rank reads each, never a rank the whole model)
    init, init_from = None, f"init_from={cfg.init_from}"
    if cfg.init_from and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        init = ckpt.load_weights(cfg.init_from, cfg.model, init_from, lazy=True)
    elif cfg.init_from:  # (hashed once the process group runs, each file by one rank)
        ckpt.check_weights(cfg.init_from, cfg.model, init_from)
    import torch

    if torch.cuda.is_available():
        switch_on_flight_recorder(cfg.run_dir)  # (before the process group starts)
    held = []  # the run directory's lock, on the first rank (the job's ranks share it)
    trainer = board = None
    try:
        with build_progress(ops, sys.stdout), held_stdout(verbose):  # (held_stdout holds DeepSpeed's back)
            dist_info = setup(cfg.parallel.timeout_minutes)
            board = FailureBoard.connect(
                dist_info.local_rank
            )  # (another rank's failure ends this one at once, not after the timeout)
            if board is not None:
                board.watch(end_after_peer)
            on_first_rank(lambda: held.append(lock_run_dir(cfg.run_dir)))  # before the run writes anything
            if cfg.init_from and init is None:
                init = ckpt.load_weights(cfg.init_from, cfg.model, init_from, lazy=True, shared=True)
            init_state = init[1] if init else None
            trainer = Trainer(cfg, dist_info, tokenizer, init_state, preemption)
        host_memory = apply_host_memory_policy(cfg.train.host_memory)
        preemption.starting = False
        if dist_info.is_main:
            print(host_memory)
        if init_state is not None and dist_info.is_main:
            print(
                f"init_from={cfg.init_from}: starting from its weights ({len(init_state)} tensors); optimizer, "
                "learning-rate schedule and data order start fresh"
            )
            changed = ckpt.computation_differences(init[0].model, cfg.model)
            if changed:
                print(f"init_from={cfg.init_from}: this model differs from the checkpoint's: {', '.join(changed)}")
        code = trainer.run()
        sample = None
        if code == 0:  # (on every rank: the sample's forwards may need them all; the first rank reads the data)
            cfg = on_first_rank(lambda: with_closing_prompt(cfg, overrides, tokenizer))
            sample = closing_sample(cfg, trainer, tokenizer)
        if board is not None:
            board.close()
        end_groups(trainer)  # (every collective of the run is behind it)
    except (ConfigError, DataError, WriteFailed) as err:  # found once the process group runs: end it first
        stop_watching(board)
        finish_writes(trainer)
        tell_peers(board, str(err))
        end_groups(trainer, err)
        release(held)
        raise
    except RuntimeError as err:  # a stalled or dead rank: one line per rank, not a traceback from each
        stop_watching(board)
        line = collective_failure(err, cfg.parallel.timeout_minutes)
        if line is None:
            finish_writes(trainer)
            tell_peers(board, one_line(err))
            raise
        if board is not None and (first := board.read() or board.gone()) is not None:
            line += f"; {first.replace(':', ' failed first:', 1)}"
        rank = os.environ.get("RANK", "0")
        dumps = [path for path in stack_dumps(cfg.run_dir) if path.stat().st_mtime >= began]  # (this run's)
        if dumps:
            line += (
                f"; Python stacks of the stalled step: {hang_dir(cfg.run_dir)}/ ({', '.join(d.name for d in dumps)})"
            )
        silent = sorted(set(range(int(os.environ.get("WORLD_SIZE", "1")))) - {dump_rank(d) for d in dumps})
        if dumps and silent:
            line += (
                f"; rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} wrote no stacks (stopped or "
                "gone: such a rank cannot answer)"
            )
        to_stderr(f"megatransformer train: error: rank {rank}: {line}")
        finish_writes(trainer)
        tell_peers(board, line)
        if groups_end_after_failure():
            end_groups(trainer, err)
        release(held)
        return EXIT_COLLECTIVE_FAILED
    except BaseException as err:  # (out of memory, a bug: the save in flight is still completed)
        stop_watching(board)
        finish_writes(trainer)
        if isinstance(err, Exception):
            tell_peers(board, one_line(err))
        raise
    if dist_info.is_main:
        if code != 0:  # (the summary's generate command continues the closing prompt)
            cfg = with_closing_prompt(cfg, overrides, tokenizer)
        if sample is not None:
            print(sample, flush=True)
        print_summary(cfg, code, time.perf_counter() - started, trainer.checkpoint, trainer.state)
    release(held)
    return code


def end_after_peer(line: str) -> None:
    """(The failure board's thread.) Another rank failed: this one ends now, naming it, rather than wait for the
    collective timeout in which NCCL would hold it."""
    from megatransformer.training.runtime.distributed import EXIT_COLLECTIVE_FAILED

    rank = os.environ.get("RANK", "0")
    to_stderr(f"megatransformer train: error: rank {rank}: ending: {line.replace(':', ' failed:', 1)}")
    sys.stderr.flush()
    os._exit(EXIT_COLLECTIVE_FAILED)


def stop_watching(board: FailureBoard | None) -> None:
    """This rank fails: it ends by its own path (its checkpoint in flight completed first), not by another's post."""
    if board is not None:
        board.stop()


def tell_peers(board: FailureBoard | None, line: str) -> None:
    """This rank fails with ``line``, its writes finished: posted for the others (:class:`FailureBoard`), then
    the board closed."""
    if board is not None:
        board.post(line)
        board.close(failed=True)


def one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def finish_writes(trainer: Trainer | None) -> None:
    """On every way out of a run that ends with an error: the checkpoint being written in the background is
    completed first (at most checkpoint.timeout_minutes), with a line saying so (``Checkpointer.finish``)."""
    writer = getattr(getattr(trainer, "module", None), "checkpointer", None)
    if writer is not None:
        main = os.environ.get("RANK", "0") == "0"
        writer.finish(lambda line: main and to_stderr(f"megatransformer train: {line}"))


def end_groups(trainer: Trainer | None, err: BaseException | None = None) -> None:
    """End the run's process groups before the interpreter's shutdown (``training.distributed.teardown``), the
    trainer's engine closed first; ``err``: the error the run stops with, whose frames hold the engine until
    cleared."""
    from megatransformer.training.runtime.distributed import teardown

    if err is not None:
        traceback.clear_frames(err.__traceback__)
    if trainer is not None:
        trainer.close()
    teardown()


def release(held: list) -> None:
    """Release the run directory's lock where this process holds it."""
    for lock in held:
        if lock is not None:
            lock.release()


def print_summary(cfg: RunConfig, code: int, wall_seconds: float, checkpoint: Path | None, state: TrainerState) -> None:
    """The run's closing summary, after drawing its curves next to metrics.jsonl (``train.plot``); ``checkpoint``
    and ``state``: where the run stands (the checkpoint it saved last or resumed from, never a damaged one it
    skipped)."""
    from megatransformer.commands.plot import default_out, draw

    has_metrics = (Path(cfg.run_dir) / "metrics.jsonl").is_file()
    plot = draw([cfg.run_dir], default_out([cfg.run_dir])) if has_metrics and cfg.train.plot else None
    print(summary(cfg, code, wall_seconds, checkpoint, plot, state))


def with_closing_prompt(cfg: RunConfig, overrides: list[str], tokenizer) -> RunConfig:
    """``cfg`` with the prompt the closing sample and the suggested ``generate`` continue: on instruction data
    the first training example's prompt (a fine-tuned model answers prompts like it, not the pretraining
    config's ``train.sample_prompt``), unless one was given on the command line."""
    if any(override.startswith("train.sample_prompt=") for override in overrides):
        return cfg
    prompt = first_instruction_prompt(cfg, tokenizer)
    if prompt is None:
        return cfg
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"sample_prompt": prompt})})


def first_instruction_prompt(cfg: RunConfig, tokenizer) -> str | None:
    """The prompt of the first example of the first training dataset when it holds instructions, else None."""
    from data_pipeline import DataError
    from data_pipeline.loader.blocks import ShardOpener, Share
    from data_pipeline.loader.sources import resolve_datasets
    from data_pipeline.remote import Retry
    from data_pipeline.shard import INSTRUCTIONS

    retry = Retry(cfg.data.retries)
    try:
        shard_set = resolve_datasets(cfg.data.train, "train", retry)[0]
        if shard_set.manifest.kind != INSTRUCTIONS:
            return None
        _, block = next(ShardOpener("error", retry).blocks(shard_set, Share(0, 0, 1)))
    except (DataError, OSError, StopIteration):  # (read minutes ago by the run; gone since: the config's prompt)
        return None
    start = int(block.offsets[0])
    return tokenizer.decode(block.ids[start : start + int(block.prompt_lens[0])].tolist(), skip_special=True)


def closing_sample(cfg: RunConfig, trainer: Trainer, tokenizer, max_new_tokens: int = 40) -> str | None:
    """The first rank's line of a greedy continuation of ``train.sample_prompt`` by the final weights (decoder
    models), run in the engine as it stands: where each forward needs every rank (ZeRO-3, tensor parallelism)
    every rank runs it, each step taking the first rank's token, and no rank ever holds more of the model than
    training did."""
    import torch

    from megatransformer.lockstep import rank_0s
    from megatransformer.model import generate

    module = trainer.module
    if not cfg.train.sample_prompt or cfg.model.arch != "decoder":
        return None
    if not (trainer.dist.is_main or module.forwards_together):
        return None
    max_new_tokens = min(max_new_tokens, cfg.model.max_seq_len // 2)
    room = cfg.model.max_seq_len - max_new_tokens  # (a long instruction's prompt: its end)
    prompt = torch.tensor([tokenizer.encode(cfg.train.sample_prompt)[-room:]], device=module.device)
    agreed = rank_0s if module.forwards_together else None  # (every rank takes the first's tokens: as many forwards)
    with torch.no_grad(), module.plain_model() as model, module.matmuls():
        new = generate(model, prompt, max_new_tokens, temperature=0.0, eos_id=tokenizer.eos_id, agreed=agreed)
    tokens = new[0].tolist()
    if tokenizer.eos_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_id)]
    return format_sample(cfg.train.sample_prompt, tokenizer.decode(tokens, skip_special=True))


def format_sample(prompt: str, continuation: str) -> str:
    """The end-of-training sample, cut at its first blank line (an untrained model repeats newlines)."""
    cut = continuation.split("\n\n", 1)[0].rstrip()
    return f"sample: {prompt}{cut}"


def summary(
    cfg: RunConfig,
    exit_code: int,
    wall_seconds: float,
    checkpoint: Path | None,
    plot: Path | None,
    state: TrainerState | None = None,
) -> str:
    """The closing lines of a run: how far it got (``state``, else ``checkpoint``'s: a stop between two logged
    steps is saved at its own step), how it did (metrics.jsonl up to that step), where the results are, what to
    run next."""
    from megatransformer import checkpoint as ckpt

    run_dir = Path(cfg.run_dir)
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    if state is None and checkpoint is not None:
        state = ckpt.read_trainer_state(checkpoint)
    if state is not None:  # (records past it belong to a newer checkpoint this run did not take: a damaged one)
        records = [r for r in records if r["step"] <= state.step]
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "val_loss" in r]
    if state is not None:
        step, tokens = state.step, state.tokens
    else:
        step, tokens = max((r["step"] for r in records), default=0), train[-1]["tokens"] if train else 0
    status = {
        0: "done",
        124: "stopped early (checkpointed; run again with resume=auto to continue)",
        3: "stopped: the loss diverged",
    }.get(exit_code, f"stopped (exit {exit_code})")
    lines = [
        f"{status}: {step:,} of {cfg.train.max_steps:,} steps, {tokens:,} tokens, "
        f"wall time {format_duration(wall_seconds)}"
    ]
    if train:
        loss = train[-1]["loss"]
        lines.append(f"  {_last('train loss', train[-1], step)} {'nan' if loss is None else f'{loss:.4f}'}")
    if valid:
        last = valid[-1]
        lines.append(
            f"  {_last('validation loss', last, step)} {last['val_loss']:.4f} (perplexity {last['val_ppl']:,.2f})"
        )
    events = [r.get("event") for r in records]
    if any(events):
        lines.append(
            f"  loss spikes            {events.count('skip') + events.count('rollback')} updates skipped, "
            f"{events.count('rollback')} rollbacks"
        )
    for name, path in (("checkpoint", checkpoint), ("metrics", run_dir / "metrics.jsonl"), ("plot", plot)):
        if path is not None:
            lines.append(f"  {name + ':':22s} {path}")
    if exit_code == 0:
        latest = ckpt.latest_checkpoint(ckpt.checkpoints_dir(run_dir))
        named = checkpoint if checkpoint is not None and checkpoint != latest else None
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        lines += ["next:", *(f"  {command}" for command in next_commands(cfg, named, ranks))]
    return "\n".join(lines)


def _last(what: str, record: dict, step: int) -> str:
    """The summary's label of the last ``record`` of a metric: "final" where it is of the step the run ended
    at, else the step it is of (a run stopped between two evaluations)."""
    return f"{'final ' + what:22s}" if record["step"] == step else f"{what} at step {record['step']:,}:"


def shell_quote(text: str) -> str:
    """``text`` as one shell word on one line: shlex's quoting, or bash's ``$'...'`` where it holds a newline or
    another control character (an instruction prompt's), which shlex would keep literally, breaking the line."""
    if text.isprintable():
        return shlex.quote(text)
    escaped = "".join(
        {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c)
        or (c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 128 else f"\\u{ord(c):04x}")
        for c in text
    )
    return f"$'{escaped}'"


def next_commands(cfg: RunConfig, checkpoint: Path | None = None, ranks: int = 1) -> list[str]:
    """Evaluate, sample from and export the run just finished, as commands to copy; ``checkpoint``: the one to
    name when the run directory's latest is another (a damaged one the resume skipped); ``ranks``: the ranks of a
    machine the run shared its model among (ZeRO-3, tensor parallelism), which evaluate and sample it partitioned
    too (a model of that size may fit no single device)."""
    from megatransformer.hf import hf_incompatibility

    run = shlex.quote(str(checkpoint or cfg.run_dir))
    data = cfg.data.valid or cfg.data.train
    data = data if isinstance(data, str) or data is None else data[0].path
    shared = ranks > 1 and (cfg.parallel.zero_stage == 3 or cfg.parallel.tensor_parallel > 1)
    launcher = f"torchrun --nproc-per-node {ranks} -m megatransformer.cli" if shared else "megatransformer"
    partitioned = " --zero-stage 3" if shared else ""
    commands = []
    if data is not None:
        commands.append(f"{launcher} eval --checkpoint {run} --data {shlex.quote(data)}{partitioned}")
    if cfg.model.arch != "encoder":
        prompt = cfg.train.sample_prompt or "The"
        commands.append(f"{launcher} generate --checkpoint {run} --prompt {shell_quote(prompt)}{partitioned}")
    hf = hf_incompatibility(cfg.model) is None
    commands.append(
        f"megatransformer export --checkpoint {run} --format {'hf' if hf else 'safetensors'} "
        f"--out {shlex.quote(cfg.run_dir + ('/hf' if hf else '/export'))}"
    )
    return commands
