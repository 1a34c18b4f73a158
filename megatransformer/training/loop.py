"""The training loop: steps, logging, validation, checkpoints, preemption; generic over the train module.

What one optimizer step does on DeepSpeed (micro batches, loss normalisation, skipped updates) lives in
``engine.TrainModule``; this loop only sees ``advance(batches) -> [StepResult]``: the results read in a step,
which for a step that logs, validates or checkpoints is its own, and for the others arrives during the next step
(the device decides their updates; docs/gpu.md, "Host syncs"). Each result is concluded in order.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from megatransformer import checkpoint as ckpt
from megatransformer.config import RunConfig, dump_config, precision_dtype
from megatransformer.flops import model_size
from megatransformer.model.attention import describe_backend
from megatransformer.model.latent_attention import core_head_dim, describe_value_width
from megatransformer.training.checkpointing.resume import decay_start, plan_resume, refusal, rollback_target, skippable
from megatransformer.training.collector import GarbageCollection
from megatransformer.training.data import build_run_loader, small_validation_warning
from megatransformer.training.engine.compiled import CompileWatch, describe_compile
from megatransformer.training.engine.train_module import StepResult, TrainModule
from megatransformer.training.observability import spikes
from megatransformer.training.observability.metrics import Reporter, finite_or_none, peak_tflops
from megatransformer.training.observability.profiling import StepProfiler
from megatransformer.training.observability.trackers import resolved_config, run_facts
from megatransformer.training.observability.watchdog import Watchdog
from megatransformer.training.optimizers.schedules import (
    branch_decay,
    describe_decay,
    schedule_change,
    schedule_phase,
    warmup_warning,
)
from megatransformer.training.runtime import cpu_bf16
from megatransformer.training.runtime.distributed import Dist
from megatransformer.training.runtime.layout import describe_layout, validation_batch, validation_rows, zero_stage_notes

EXIT_PREEMPTED = 124  # checkpoint saved after SIGUSR1/SIGTERM/SIGINT: requeue and resume=auto
EXIT_DIVERGED = 3  # too many non-finite, spiking or dead steps: checkpoint saved, run stopped
EXIT_INTERRUPTED = 128 + signal.SIGINT  # a second Ctrl-C: stopped at once, no checkpoint (as a shell reports it)
ROLLED_BACK, SAVE = "rolled back", "save"  # what a step's result asks of the loop besides going on or stopping


class Window:
    """The steps since the last training record: their tokens and model FLOPs, and the time they took."""

    def __init__(self, peak_flops: float | None) -> None:
        self.peak_flops = peak_flops
        self.start, self.tokens, self.flops = time.perf_counter(), 0, 0.0

    def add(self, result: StepResult) -> None:
        self.tokens += result.tokens
        self.flops += result.model_flops

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (validation, train.evals) is not the steps': throughput and MFU are the training's."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - started

    def take(self) -> dict[str, float | None]:
        """Throughput and MFU over the window (None without a peak), and a new window from now."""
        seconds = time.perf_counter() - self.start
        mfu = self.flops / seconds / self.peak_flops if self.peak_flops else None
        figures = {"tokens_per_s": self.tokens / seconds, "mfu": mfu}
        self.start, self.tokens, self.flops = time.perf_counter(), 0, 0.0
        return figures


class Preemption:
    """Remembers SIGUSR1 / SIGTERM and a first SIGINT (Ctrl-C); the loop checks it between steps (all ranks
    agree before stopping). A second SIGINT ends the process at once, and so does a first one while the run is
    ``starting`` (DeepSpeed starting up, perhaps waiting for another process's build of an op: nothing trained
    to save, and the first step may be minutes away)."""

    def __init__(self) -> None:
        self.requested = self.interrupted = False
        self.starting = True  # until the trainer is built
        self.pid = os.getpid()  # (DataLoader workers inherit the handlers: Ctrl-C there is the main process's)
        self.says = os.environ.get("LOCAL_RANK", "0") == "0"  # (torchrun signals every rank: the first says it)
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            return
        if signum == signal.SIGINT:
            if self.starting:
                if self.says:
                    os.write(2, b"\nCtrl-C while starting (nothing trained yet to checkpoint): exiting now\n")
                os._exit(EXIT_INTERRUPTED)
            if self.interrupted:
                os.write(2, b"\nmegatransformer train: interrupted again: exiting now, without a checkpoint\n")
                os._exit(EXIT_INTERRUPTED)
            self.interrupted = True
            if self.says:
                os.write(2, b"\nCtrl-C: checkpointing after this step, then exiting (Ctrl-C again: exit now)\n")
        self.requested = True

    def reason(self) -> str:
        return "interrupted (Ctrl-C)" if self.interrupted else "preempted"


class Trainer:
    def __init__(
        self, cfg: RunConfig, dist_info: Dist, tokenizer, init_state=None, preemption: Preemption | None = None
    ) -> None:
        self.resume = plan_resume(cfg, dist_info.world_size, torch.device(dist_info.device).type, tokenizer.sha256)
        # (a decay branched from another run's checkpoint: where it began, resolved once and kept in the state)
        self.decay_origin = decay_start(cfg, self.resume)
        if self.decay_origin is not None:
            cfg = branch_decay(cfg, self.decay_origin.step)
        self.cfg, self.dist, self.tokenizer = cfg, dist_info, tokenizer
        self.module = TrainModule(cfg, dist_info, init_state)
        micro = self.module.sizes.micro
        pin = dist_info.device.startswith("cuda")  # batches in page-locked memory: copies that do not wait
        self.train_loader = build_run_loader(
            cfg, "train", micro, self.module.dp_rank, self.module.dp_size, tokenizer, pin_memory=pin
        )
        # (the same validation rows on any layout: read in batches that divide them)
        self.valid_rows = validation_rows(cfg.train)
        self.valid_batch = valid_batch = validation_batch(self.valid_rows, micro)
        self.valid_loader = build_run_loader(cfg, "valid", valid_batch, 0, 1, tokenizer, pin_memory=pin)
        # (read now: an empty split fails before training; said in run(), outside the engine's quiet start-up)
        self.validation_warning = small_validation_warning(self.valid_loader, valid_batch)
        self.state = ckpt.TrainerState(
            step=0,
            tokens=0,
            bad_steps=0,
            tokenizer_sha256=tokenizer.sha256,
            world_size=dist_info.world_size,
            tensor_parallel=cfg.parallel.tensor_parallel,
            sequence_parallel=cfg.parallel.sequence_parallel,
            zero_stage=self.module.zero_stage,
        )
        self.preemption = preemption or Preemption()
        self.downstream = None  # train.evals' tasks, loaded before the first step
        if cfg.train.evals.tasks:
            from megatransformer.training.downstream import Downstream

            self.downstream = Downstream(
                cfg, self.module, dist_info.device, tokenizer, lambda: self.preemption.requested
            )
        self.spikes = spikes.SpikeLadder(cfg.train.spikes)
        # (gradients that vanish, or a uniform output: a dead model, stopped as a diverged run)
        self.dead = spikes.DeadRun(cfg.model.vocab_size, cfg.train.max_dead_steps, cfg.schedule.warmup_steps)
        self.checkpoint: Path | None = None  # the run's state on disk: the one resumed from, then the last saved
        self.compile_watch: CompileWatch | None = None  # (compiled runs, from the first step on)

    # ------------------------------------------------------------------------------------ the run

    def resume_or_start(self) -> None:
        cfg = self.cfg
        if self.resume is not None:
            self.state, loader_state = self.load_resume()
            self.train_loader.load_state_dict(loader_state)
            self.checkpoint = self.resume.path
            if self.dist.is_main:
                print(self.resume.describe(cfg, self.dist.world_size))
                if (change := self.resumed_schedule_line()) is not None:
                    print(change)
        if self.decay_origin is not None and self.dist.is_main:
            print(describe_decay(cfg, self.decay_origin.checkpoint, self.decay_origin.step))
        elif self.resume is None and self.dist.is_main and cfg.resume == "auto":
            print(f"resume=auto: no complete checkpoint in {ckpt.checkpoints_dir(cfg.run_dir)}, starting fresh")
        if self.resume is not None:
            state = spikes.resume_state(self.resume.path, self.state.spikes, cfg.run_dir)
            self.spikes = spikes.SpikeLadder(cfg.train.spikes, state)
            for rows in self.spikes.skip_rows:
                self.train_loader.skip_rows(*rows)
        if self.dist.is_main:
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.run_dir) / "config.yaml").write_text(dump_config(cfg))

    def resumed_schedule_line(self) -> str | None:
        """The line of a resume that trains on at other learning rates than its checkpoint's schedule gave (not
        at a decay branch's start, whose decay is meant and has a line of its own; not past train.max_steps)."""
        branch_start = self.decay_origin is not None and self.resume.saved.schedule.decay_from is None
        if branch_start or self.state.step >= self.cfg.train.max_steps:
            return None
        return schedule_change(self.resume.saved, self.cfg, self.state.step)

    def load_resume(self) -> tuple[ckpt.TrainerState, dict | list[dict]]:
        """Load the checkpoint this run resumes from; with resume=auto, one of the run's own in which a rank finds
        a damaged file is skipped for the next older intact one (nothing of it was loaded)."""
        found: list[ckpt.CheckpointDamaged] = []
        while True:
            try:
                return self.module.load(self.resume)
            except ckpt.CheckpointDamaged as err:
                if not skippable(self.cfg, err):
                    raise refusal(self.cfg, err) from None
                found.append(err)
            device_type = torch.device(self.dist.device).type
            self.resume = plan_resume(self.cfg, self.dist.world_size, device_type, self.tokenizer.sha256, found=found)
            if self.resume is None:  # (never a fresh start after a damaged checkpoint)
                raise refusal(self.cfg, found[-1])

    def run(self) -> int:
        cfg = self.cfg
        self.resume_or_start()
        if self.state.step >= cfg.train.max_steps:
            if self.dist.is_main:
                print(f"nothing to do: the run is at step {self.state.step} of train.max_steps={cfg.train.max_steps}")
            return 0
        if self.dist.is_main:
            p = cfg.parallel
            print(
                f"layout: {describe_layout(self.module.dp_size, p.tensor_parallel, p.sequence_parallel)} "
                f"on {self.dist.world_size} rank{'s' if self.dist.world_size > 1 else ''}"
            )
            dtype = precision_dtype(cfg.precision)
            print(
                describe_backend(
                    cfg.model.attention_backend,
                    torch.device(self.dist.device).type,
                    dtype,
                    cfg.model.attention_dropout,
                    core_head_dim(cfg.model),
                    cfg.model.position == "alibi",
                )
            )
            if cfg.model.attention == "mla":
                print(describe_value_width(cfg.model))
            print(describe_compile(cfg, torch.device(self.dist.device).type))
            matmuls = cpu_bf16.describe(cfg.train.cpu_bf16_matmul, self.dist.device, dtype, self.module.compiled)
            if matmuls is not None:
                print(matmuls)
            muon_bf16 = cfg.optim.name == "muon" and cfg.optim.muon_ns_dtype == "bf16"
            if muon_bf16 and (dtype != torch.bfloat16 or self.module.compiled):  # (else the line above says it)
                ns = cpu_bf16.describe(
                    cfg.train.cpu_bf16_matmul, self.dist.device, torch.bfloat16, what="Muon's bf16 Newton-Schulz"
                )
                if ns is not None:
                    print(ns)
            for line in zero_stage_notes(cfg, self.module.zero_stage, torch.device(self.dist.device).type):
                print(line)
            if self.module.optimizer_line:
                print(self.module.optimizer_line)
            if self.module.muon_owner_line:
                print(self.module.muon_owner_line)
            for warning in (warmup_warning(cfg), self.validation_warning):
                if warning:
                    print(warning)
            for line in self.downstream.tasks.code() if self.downstream is not None else ():
                print(f"train.evals: {line}")  # (a task folder is code: lm-eval imports it)
        size = model_size(cfg.model, cfg.data.seq_len)
        report = Reporter(
            cfg,
            self.dist.is_main,
            self.state.step,
            self.tracker_config(size.params) if self.dist.is_main else None,
            self.spikes.rollbacks,
        )
        watchdog = Watchdog(cfg, self.dist.rank)  # (a hang ends the run with the stacks on file)
        peak = peak_tflops(cfg, self.dist.device)  # None on a CPU without train.peak_tflops: no MFU
        peak_flops = peak * 1e12 * self.dist.world_size if peak else None
        report.message(first_step_note(cfg, self.state.step, self.module.compiled))
        batches = iter(self.train_loader)
        collector = GarbageCollection(cfg.train.gc_every)
        self.compile_watch = CompileWatch() if self.module.compiled else None
        self.last_save = time.monotonic()
        window = Window(peak_flops)
        profiler = StepProfiler(cfg.train.profile, cfg.run_dir, self.dist.rank, torch.device(self.dist.device))
        exit_code = 0
        while self.state.step < cfg.train.max_steps:
            step = self.state.step + 1
            report.message(profiler.step_starts(step))
            started = time.perf_counter()
            watchdog.arm()
            results = self.module.advance(
                batches, lambda: self.preemption.requested, self.spikes, self.save_due, step, self.reads_at(step)
            )
            step_seconds = time.perf_counter() - started
            watchdog.disarm(step_seconds)
            self.state.step = step
            collector.step(step)
            for line in self.compile_watch.after_step(step) if self.compile_watch is not None else ():
                report.message(line)
            report.progress(step)
            self.report_saves(report)
            outcome = self.conclude_all(results, report, watchdog, window)
            if profiler.recording:
                with window.paused():  # (writing the profile after the window's last step is not the steps' time)
                    report.message(profiler.step_ended(step))
            if outcome == ROLLED_BACK:
                batches.close()
                batches = iter(self.train_loader)
            elif outcome is not None:
                exit_code = outcome
                break
        report.message(profiler.close())  # (a run that stopped inside the window)
        validated_last = self.downstream is not None or (
            cfg.train.eval_every and self.state.step % cfg.train.eval_every == 0
        )
        if exit_code == 0 and not validated_last:
            report.log({"step": self.state.step, **self.evaluations(watchdog, downstream=False)})
        with watchdog.watching("a checkpoint"):
            if exit_code != 0 or cfg.checkpoint.final:
                self.save()
            self.module.checkpointer.wait()  # (the run ends with its last checkpoint complete)
        self.report_saves(report)
        watchdog.close()
        collector.close()
        report.close()
        return exit_code

    def reads_at(self, step: int) -> bool:
        """Whether step ``step``'s result is read in the step (a step that logs, validates or checkpoints, and
        the last); the others' results are read during the next step (``TrainModule.advance``)."""
        cfg = self.cfg
        return (
            step % cfg.train.log_every == 0
            or step == cfg.train.max_steps
            or step % cfg.checkpoint.every == 0
            or bool(cfg.train.eval_every and step % cfg.train.eval_every == 0)
            or (self.downstream is not None and self.downstream.due(step))
        )

    def conclude_all(
        self, results: list[StepResult], report: Reporter, watchdog: Watchdog, window: Window
    ) -> int | str | None:
        """Conclude ``results`` in order (:meth:`conclude`). A stop or a checkpoint asked for by a result read a
        step late first reads and concludes the step run since (the checkpoint holds it: a spike there was
        skipped, and is answered no further when the run stops); a rollback forgets it. Returns ROLLED_BACK, the
        exit code to stop with, or None."""
        queue, exit_code, save = list(results), None, False
        while queue:
            outcome = self.conclude(queue.pop(0), report, watchdog, window, stopping=exit_code is not None)
            if outcome == ROLLED_BACK:
                self.module.discard()
                return ROLLED_BACK
            if outcome == SAVE:
                save = True
            elif outcome is not None and exit_code is None:
                exit_code = outcome
            if not queue and (save or exit_code is not None):
                queue = self.module.settle(self.spikes)
        if save and exit_code is None:
            with watchdog.watching("a checkpoint"):
                self.save()
        return exit_code

    def conclude(
        self, result: StepResult, report: Reporter, watchdog: Watchdog, window: Window, stopping: bool = False
    ) -> int | str | None:
        """What the run does with the result of step ``result.step`` (the run may be a step further: a result
        read late): count it, log it, answer a spike, validate, stop (``stopping``: the run stops already; the
        step is counted and logged, a spike only skipped). Returns ROLLED_BACK, an exit code to stop with, SAVE (a
        checkpoint is due), or None."""
        cfg, step = self.cfg, result.step
        self.state.tokens += result.tokens
        window.add(result)
        self.state.bad_steps = 0 if result.finite else self.state.bad_steps + 1
        if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
            report.log(
                {
                    "step": step,
                    "loss": finite_or_none(result.loss),
                    **({"z_loss": finite_or_none(result.z_loss)} if cfg.train.z_loss else {}),
                    "lr": result.lr,
                    "grad_norm": finite_or_none(result.grad_norm),
                    "tokens": self.state.tokens,
                    **window.take(),
                    "bad_steps": self.state.bad_steps,
                    "skipped_shards": len(self.train_loader.skipped_shards),
                    **device_memory(self.dist.device),
                }
            )
        if not result.finite:
            report.message(
                f"step {step}: non-finite loss or gradients, update skipped ({self.state.bad_steps} in a row)"
            )
        if result.rejected or (not result.finite and cfg.train.spikes.enabled):
            action = self.answer_spike(result, report, stopping)
            if action == spikes.STOP:
                return EXIT_DIVERGED
            if action == spikes.ROLLBACK:
                return ROLLED_BACK
        if stopping:
            return None
        last = step == cfg.train.max_steps
        downstream = self.downstream is not None and (last or self.downstream.due(step))
        if downstream and result.stop:  # (the tasks may take longer than a preemption's warning leaves: save first)
            report.message(
                f"step {step}: train.evals skipped: {self.preemption.reason()}; evaluate the checkpoint saved now "
                "with `megatransformer eval --tasks`"
            )
            downstream = False
        if downstream or (cfg.train.eval_every and step % cfg.train.eval_every == 0):
            with window.paused():  # (the tasks' numbers beside a validation loss)
                report.log({"step": step, **self.evaluations(watchdog, downstream)})
            for line in self.compile_watch.after_evaluation(step) if self.compile_watch is not None else ():
                report.message(line)
            if downstream and self.downstream.interrupted:  # (the next step agrees to stop and saves; the last saves)
                report.message(
                    f"step {step}: train.evals interrupted: {self.preemption.reason()}; evaluate the checkpoint the "
                    "run saves next with `megatransformer eval --tasks`"
                )
        if (dead := self.dead.see(step, result.loss, result.grad_norm)) is not None:
            report.message(dead)
            return EXIT_DIVERGED
        if self.state.bad_steps >= cfg.train.max_bad_steps:
            report.message(
                f"stopping: {self.state.bad_steps} consecutive non-finite steps "
                f"(train.max_bad_steps); lower optim.lr or check the data"
            )
            return EXIT_DIVERGED
        if result.stop:
            report.message(
                f"{self.preemption.reason()} at step {self.state.step}: checkpointing, exit {EXIT_PREEMPTED}"
            )
            return EXIT_PREEMPTED
        if (step % cfg.checkpoint.every == 0 or result.save_due) and self.state.step < cfg.train.max_steps:
            return SAVE
        return None

    def tracker_config(self, parameters: int) -> dict:
        """The config W&B records: the resolved config, and the run's facts under ``run``."""
        sizes = self.module.sizes
        facts = run_facts(
            sizes, self.dist.world_size, self.cfg.parallel.tensor_parallel, self.module.zero_stage, parameters
        )
        return {**resolved_config(self.cfg, sizes), "run": facts}

    def save_due(self) -> bool:
        """checkpoint.every_minutes have passed since the last save (rank 0's clock decides: the step's
        reduction tells the others)."""
        minutes = self.cfg.checkpoint.every_minutes
        return minutes is not None and self.dist.is_main and time.monotonic() - self.last_save >= 60 * minutes

    def report_saves(self, report: Reporter) -> None:
        """A metrics record and a log line for each save whose background write has finished."""
        for done in self.module.checkpointer.finished():
            if done.error is None:
                report.log_save(done.step, done.stall_s, done.setup_s, done.write_s, done.bytes)

    def save(self) -> Path:
        self.last_save = time.monotonic()
        self.state.spikes = ckpt.SpikeState.model_validate(self.spikes.state_dict())
        self.state.schedule_phase = schedule_phase(self.cfg, self.state.step)
        self.state.decay_from = self.decay_origin
        began = self.spikes.protect_before()  # (a rollback in the making needs the checkpoint before it)
        # (listed once the write in flight is done: its rotation may remove a checkpoint, or complete the one needed)
        self.module.checkpointer.wait()
        needed = ckpt.complete_before(ckpt.checkpoints_dir(self.cfg.run_dir), began) if began is not None else []
        keep = tuple(p.name for p in needed[:1])
        self.checkpoint = self.module.save(self.state, self.train_loader.state_dict(), keep)
        return self.checkpoint

    def restore(self, path: Path | None) -> Path | None:
        """Load checkpoint ``path`` (rollback_target's) into the running engine, trainer state and loader (on
        another layout than the one that wrote it too). One in which a rank finds a damaged file is skipped for the
        next older intact one; returns the one loaded (None: none was left, nothing was loaded)."""
        device_type = torch.device(self.dist.device).type
        while path is not None:
            plan = plan_resume(self.cfg, self.dist.world_size, device_type, self.tokenizer.sha256, verified=path)
            try:
                self.state, loader_state = self.module.load(plan)
            except ckpt.CheckpointDamaged as err:
                if isinstance(err, ckpt.CheckpointUnsafe):
                    raise
                ckpt.warn(f"{err}: skipped, looking for an older checkpoint to roll back to")
                path = rollback_target(self.cfg, ckpt.step_of(path))
                continue
            self.train_loader.load_state_dict(loader_state)
            return path
        return None

    # ------------------------------------------------------------------------------- loss spikes

    def answer_spike(self, result: StepResult, report: Reporter, stopping: bool = False) -> str:
        """Log the spike of ``result`` and take the ladder's answer: skip (done: the update was not applied),
        roll back (done here), or stop; only skip when the run is ``stopping`` already."""
        event = self.spikes.respond(result.step, result.loss, result.grad_norm)
        if stopping:
            event.action = spikes.SKIP
        record = event.record(self.spikes.rollbacks)
        if event.action == spikes.ROLLBACK:
            self.module.checkpointer.wait()  # (the checkpoint to roll back to may be the one being written)
        rolled = self.roll_back(event.began, self.state.step - result.step) if event.action == spikes.ROLLBACK else None
        if event.action == spikes.ROLLBACK and rolled is None:
            event.action = record["event"] = spikes.STOP
        if rolled is None:
            report.event(record, spikes.describe(event))
        else:
            target, rows = rolled
            report.rewind(self.state.step, self.spikes.rollbacks)
            record.update(checkpoint=target.name, skipped_rows=list(rows))
            report.event(
                record,
                spikes.describe(event, rows, target.name, self.spikes.rollbacks, self.cfg.train.spikes.max_rollbacks),
            )
            if self.dist.is_main:  # (last: a run killed before this resumes to the same answer)
                ckpt.rewind_to(target)
                spikes.write_log(self.cfg.run_dir, self.state.spikes.ladder_state(), target)
        if event.action == spikes.STOP:
            limit = self.cfg.train.spikes.max_rollbacks
            why = (
                f"{limit} rollbacks (train.spikes.max_rollbacks)"
                if self.spikes.rollbacks >= limit
                else f"finding no intact checkpoint before step {event.began} to roll back to"
            )
            report.message(
                f"stopping: loss spikes since step {event.began} after {why}; lower optim.lr, raise "
                "train.spikes.max_rollbacks, or look at the data (megatransformer data inspect --rows)"
            )
        return event.action

    def roll_back(self, before_step: int, steps_since: int = 0) -> tuple[Path, tuple[int, int]] | None:
        """Back to the newest intact checkpoint older than ``before_step``: that checkpoint, and the global rows
        read up to the spike (``steps_since`` steps ago) and a margin, skipped from now on (as [start, stop));
        None when there is none."""
        sizes = self.module.sizes
        rows = self.train_loader.rows + (self.cfg.train.spikes.margin_steps - steps_since) * sizes.micro * sizes.accum
        stop = rows * sizes.dp
        path = self.restore(rollback_target(self.cfg, before_step))
        if path is None:
            return None
        rows = (self.train_loader.rows * sizes.dp, stop)
        self.spikes.rolled_back(rows, self.state.spikes.ladder_state())
        for skipped in self.spikes.skip_rows:
            self.train_loader.skip_rows(*skipped)
        self.state.spikes = ckpt.SpikeState.model_validate(self.spikes.state_dict())
        return path, rows

    def evaluations(self, watchdog: Watchdog, downstream: bool) -> dict[str, float | None]:
        """The validation loss and, with ``downstream``, the harness's tasks (train.evals): one record (without
        the tasks where a preemption ended them: ``Downstream.interrupted``), each part watched for a hang."""
        with watchdog.watching("validation"):
            record = self.evaluate()
        if downstream:
            # (the tasks' answers are gathered on a group with a timeout of its own: the tasks may take hours)
            with watchdog.watching("train.evals", self.downstream.gather_timeout_minutes):
                record.update(self.downstream.run())
        return record

    def close(self) -> None:
        """Let the train module go (before the process group ends: training.distributed.teardown)."""
        self.module.close()

    def evaluate(self) -> dict[str, float]:
        """Validation loss over the first rows of the validation split (layout.validation_rows: every rank
        reads the same batches; the train module deals them across data-parallel ranks)."""
        batches = self.valid_rows // self.valid_batch
        return self.module.evaluate([batch for _, batch in zip(range(batches), self.valid_loader)])


def first_step_note(cfg: RunConfig, step: int, compiled: bool) -> str:
    """What the seconds before the first step line are spent on."""
    work = ["the data loader starts", "the first batches are read", "memory is allocated"]
    if compiled:
        work.append("torch.compile compiles the model")
    return (
        f"step {step + 1}: first step of this process ({', '.join(work)}): slower than the rest; "
        f"a line every {cfg.train.log_every} step{'s' * (cfg.train.log_every != 1)}"
    )


def device_memory(device: str) -> dict[str, float]:
    """Peak memory of this process on a GPU so far (the allocator's count: no wait for the device)."""
    if not device.startswith("cuda"):
        return {}
    return {"max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}
