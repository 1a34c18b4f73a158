"""The training loop: steps, logging, validation, checkpoints, preemption; generic over the train module.

What one optimizer step does on DeepSpeed (micro batches, loss normalisation, skipped updates) lives in
``engine.TrainModule``; this loop only sees ``step(batches) -> StepResult``.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import torch

from megatransformer import checkpoint as ckpt
from megatransformer.config import RunConfig, dump_config, precision_dtype
from megatransformer.flops import model_size
from megatransformer.model.attention import describe_backend
from megatransformer.training import cpu_bf16
from megatransformer.training.data import build_run_loader
from megatransformer.training.distributed import Dist
from megatransformer.training.engine import TrainModule
from megatransformer.training.layout import describe_layout, zero_stage_notes
from megatransformer.training.metrics import Reporter, peak_tflops
from megatransformer.training.resume import plan_resume

EXIT_PREEMPTED = 124  # checkpoint saved after SIGUSR1/SIGTERM: requeue and resume=auto
EXIT_DIVERGED = 3  # too many consecutive non-finite losses: checkpoint saved, run stopped


class Preemption:
    """Remembers SIGUSR1 / SIGTERM; the loop checks it between steps (all ranks agree before stopping)."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True


class Trainer:
    def __init__(self, cfg: RunConfig, dist_info: Dist, tokenizer, init_state=None,
                 preemption: Preemption | None = None) -> None:
        self.cfg, self.dist, self.tokenizer = cfg, dist_info, tokenizer
        # decided before the engine: on another layout it is built from the checkpoint's weights
        self.resume = plan_resume(cfg, dist_info.world_size, torch.device(dist_info.device).type, tokenizer.sha256)
        if self.resume is not None and self.resume.elastic is not None:
            init_state = self.resume.elastic.weights
        self.module = TrainModule(cfg, dist_info, init_state)
        micro = self.module.sizes.micro
        pin = dist_info.device.startswith("cuda")  # batches in page-locked memory: copies that do not wait
        self.train_loader = build_run_loader(cfg, "train", micro, self.module.dp_rank, self.module.dp_size,
                                             tokenizer, pin_memory=pin)
        self.valid_loader = build_run_loader(cfg, "valid", micro, 0, 1, tokenizer, pin_memory=pin)
        next(iter(self.valid_loader))  # a validation split smaller than one batch fails now, not after training
        self.state = ckpt.TrainerState(step=0, tokens=0, bad_steps=0, tokenizer_sha256=tokenizer.sha256,
                                       world_size=dist_info.world_size, tensor_parallel=cfg.parallel.tensor_parallel,
                                       sequence_parallel=cfg.parallel.sequence_parallel,
                                       zero_stage=self.module.zero_stage)
        self.preemption = preemption or Preemption()

    # ------------------------------------------------------------------------------------ the run

    def resume_or_start(self) -> None:
        cfg = self.cfg
        if self.resume is not None:
            self.state, loader_state = self.module.load(self.resume)
            self.train_loader.load_state_dict(loader_state)
            if self.dist.is_main:
                print(self.resume.describe(cfg, self.dist.world_size))
        elif self.dist.is_main and cfg.resume == "auto":
            print(f"resume=auto: no complete checkpoint in {ckpt.checkpoints_dir(cfg.run_dir)}, starting fresh")
        if self.dist.is_main:
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.run_dir) / "config.yaml").write_text(dump_config(cfg))

    def run(self) -> int:
        cfg = self.cfg
        self.resume_or_start()
        if self.state.step >= cfg.train.max_steps:
            if self.dist.is_main:
                print(f"nothing to do: the run is at step {self.state.step} of train.max_steps={cfg.train.max_steps}")
            return 0
        if self.dist.is_main:
            p = cfg.parallel
            print(f"layout: {describe_layout(self.module.dp_size, p.tensor_parallel, p.sequence_parallel)} "
                  f"on {self.dist.world_size} rank{'s' if self.dist.world_size > 1 else ''}")
            dtype = precision_dtype(cfg.precision)
            print(describe_backend(cfg.model.attention_backend, torch.device(self.dist.device).type, dtype,
                                   cfg.model.attention_dropout, cfg.model.head_dim))
            matmuls = cpu_bf16.describe(cfg.train.cpu_bf16_matmul, self.dist.device, dtype, cfg.train.compile)
            if matmuls is not None:
                print(matmuls)
            for line in zero_stage_notes(cfg, self.module.zero_stage, torch.device(self.dist.device).type):
                print(line)
        report = Reporter(cfg, self.dist.is_main, self.state.step)
        flops = model_size(cfg.model, cfg.data.seq_len).flops_per_token  # per position that holds a token
        peak = peak_tflops(cfg, self.dist.device) * 1e12 * self.dist.world_size
        batches = iter(self.train_loader)
        exit_code, window_start, window_tokens, window_real, step_seconds = 0, time.perf_counter(), 0, 0, 0.0
        while self.state.step < cfg.train.max_steps:
            started = time.perf_counter()
            result = self.module.step(batches, self.preemption.requested)
            step_seconds = time.perf_counter() - started
            self.state.step += 1
            self.state.tokens += result.tokens
            window_tokens += result.tokens
            window_real += result.real_tokens
            self.state.bad_steps = 0 if result.finite else self.state.bad_steps + 1
            report.progress(self.state.step, result.loss, result.tokens / step_seconds, step_seconds)
            if self.state.step % cfg.train.log_every == 0 or self.state.step == cfg.train.max_steps:
                seconds = time.perf_counter() - window_start
                tokens_per_s = window_tokens / seconds
                report.log({"step": self.state.step, "loss": result.loss if math.isfinite(result.loss) else None,
                            "lr": result.lr, "grad_norm": self.module.last_grad_norm(),
                            "tokens": self.state.tokens, "tokens_per_s": tokens_per_s,
                            "mfu": window_real / seconds * flops / peak, "bad_steps": self.state.bad_steps,
                            "skipped_shards": len(self.train_loader.skipped_shards),
                            **device_memory(self.dist.device)})
                window_start, window_tokens, window_real = time.perf_counter(), 0, 0
            if not result.finite:
                report.message(f"step {self.state.step}: non-finite loss or gradients, update skipped "
                               f"({self.state.bad_steps} in a row)")
            if cfg.train.eval_every and self.state.step % cfg.train.eval_every == 0:
                report.log({"step": self.state.step, **self.evaluate()})
            if self.state.bad_steps >= cfg.train.max_bad_steps:
                report.message(f"stopping: {self.state.bad_steps} consecutive non-finite steps "
                               f"(train.max_bad_steps); lower optim.lr or check the data")
                exit_code = EXIT_DIVERGED
                break
            if result.stop:
                report.message(f"preempted at step {self.state.step}: checkpointing, exit {EXIT_PREEMPTED}")
                exit_code = EXIT_PREEMPTED
                break
            if self.state.step % cfg.checkpoint.every == 0 and self.state.step < cfg.train.max_steps:
                self.save()
        evaluated_last = cfg.train.eval_every and self.state.step % cfg.train.eval_every == 0
        if exit_code == 0 and not evaluated_last:
            report.log({"step": self.state.step, **self.evaluate()})
        self.save()
        report.close()
        return exit_code

    def save(self) -> Path:
        return self.module.save(self.state, self.train_loader.state_dict())

    def evaluate(self) -> dict[str, float]:
        """Validation loss over the first train.eval_batches batches of the validation split (every rank
        reads the same batches; the train module deals them across data-parallel ranks)."""
        return self.module.evaluate([batch for _, batch in zip(range(self.cfg.train.eval_batches),
                                                              self.valid_loader)])


def device_memory(device: str) -> dict[str, float]:
    """Peak memory of this process on a GPU so far (the allocator's count: no wait for the device)."""
    if not device.startswith("cuda"):
        return {}
    return {"max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}

