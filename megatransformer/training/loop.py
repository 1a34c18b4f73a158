"""The training loop: one step is grad-accum micro batches through DeepSpeed, then an optimizer step.

The loss is the mean over every loss token of the global batch (all micro batches, all data-parallel
ranks), not a mean of per-batch means, so padding and variable loss counts (masked-LM) weigh correctly.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatransformer.batch import IGNORE_INDEX
from megatransformer.config import RunConfig, dump_config
from megatransformer.flops import model_size
from megatransformer.model.attention import describe_backend
from megatransformer.training import checkpoint as ckpt
from megatransformer.training.distributed import Dist
from megatransformer.training.engine import Engine, build_engine
from megatransformer.training.metrics import Reporter, peak_tflops

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


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           label_smoothing=label_smoothing, reduction="sum")


def to_device(batch: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def all_reduce_sum(values: list[float], device: str) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


@dataclass
class StepResult:
    loss: float
    tokens: int  # input positions processed, all ranks
    finite: bool
    stop: bool  # a rank was asked to stop (preemption)
    lr: float = 0.0  # the learning rate this step's update used


class Trainer:
    def __init__(self, cfg: RunConfig, dist_info: Dist, tokenizer, init_state=None,
                 preemption: Preemption | None = None) -> None:
        from megatransformer.training.data import build_loader

        self.cfg, self.dist, self.tokenizer = cfg, dist_info, tokenizer
        self.e: Engine = build_engine(cfg, dist_info, init_state)
        self.engine = self.e.engine
        micro = self.e.sizes.micro
        self.train_loader = build_loader(cfg, "train", micro, self.e.dp_rank, self.e.dp_size, tokenizer)
        self.valid_loader = build_loader(cfg, "valid", micro, 0, 1, tokenizer)
        next(iter(self.valid_loader))  # a validation split smaller than one batch fails now, not after training
        self.state = ckpt.TrainerState(0, 0, 0, tokenizer.sha256, dist_info.world_size,
                                       cfg.parallel.tensor_parallel, cfg.parallel.zero_stage)
        self.preemption = preemption or Preemption()
        self.grad_norm: float | None = None

    # ---------------------------------------------------------------------------------- one step

    def train_step(self, batches) -> StepResult:
        """Forward/backward every micro batch of one optimizer step, then step (or skip a bad step)."""
        micro = [to_device(next(batches), self.dist.device) for _ in range(self.e.sizes.accum)]
        local_targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro)
        local_tokens = sum(b["input_ids"].numel() + b.get("decoder_input_ids", b["labels"][:, :0]).numel()
                           for b in micro)
        targets, tokens, stop = all_reduce_sum(
            [local_targets, local_tokens, float(self.preemption.requested)], self.dist.device)
        tp = self.cfg.parallel.tensor_parallel  # the ranks of a tensor-parallel group share their batches
        targets, tokens = targets / tp, tokens / tp
        # DeepSpeed averages gradients over micro batches and data-parallel ranks; undo that so the
        # gradient is that of (sum of token losses) / (loss tokens in the global batch).
        scale = self.e.sizes.accum * self.e.dp_size / max(targets, 1.0)
        loss_sum, finite, lr = 0.0, True, self.engine.get_lr()[0]  # (the schedule moves on in step())
        for batch in micro:
            labels = batch.pop("labels")
            loss = token_loss_sum(self.engine(**batch), labels, self.cfg.train.label_smoothing)
            # every rank must take the same decision, or the replicas would drift apart
            finite = finite and all_reduce_sum([float(not torch.isfinite(loss))], self.dist.device)[0] == 0
            # after a non-finite loss the remaining micro batches only keep DeepSpeed's hooks in step
            self.engine.backward(loss * scale if finite else _zero_loss(self.engine.module))
            loss_sum += loss.item() if finite else math.nan
            boundary = self.engine.is_gradient_accumulation_boundary()
            if boundary and self.cfg.parallel.zero_stage == 0:  # (ZeRO checks its gradients itself)
                self.grad_norm = unclipped_grad_norm(self.engine.module, self.cfg.parallel.tensor_parallel)
                finite = finite and (math.isfinite(self.grad_norm) or self.cfg.precision == "fp16")
            skipped_before = self.engine.skipped_steps
            with skipped_update(self.engine, skip=boundary and not finite):
                self.engine.step()
        # ZeRO skips a step with non-finite gradients on its own (and counts it); with fp16 that is the loss
        # scaler finding its scale, which is routine, not divergence
        if self.cfg.precision != "fp16":
            finite = finite and self.engine.skipped_steps == skipped_before
        (loss_sum,) = all_reduce_sum([loss_sum], self.dist.device)
        loss_sum /= tp
        return StepResult(loss_sum / max(targets, 1.0), int(tokens), finite, stop > 0, lr)

    def last_grad_norm(self) -> float | None:
        norm = self.grad_norm if self.cfg.parallel.zero_stage == 0 else self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    # ------------------------------------------------------------------------------------ the run

    def resume_or_start(self) -> None:
        cfg = self.cfg
        path = ckpt.resolve_resume(cfg)
        if path is not None:
            self.state, loader_state = ckpt.load_checkpoint(self.engine, cfg, path, self.tokenizer.sha256)
            self.train_loader.load_state_dict(loader_state)
            if self.dist.is_main:
                print(f"resumed from {path} at step {self.state.step} ({self.state.tokens:,} tokens seen)")
        elif self.dist.is_main and cfg.resume == "auto":
            print(f"resume=auto: no complete checkpoint in {ckpt.checkpoint_root(cfg)}, starting fresh")
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
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
            print(describe_backend(cfg.model.attention_backend, torch.device(self.dist.device).type, dtype,
                                   cfg.model.attention_dropout))
        report = Reporter(cfg, self.dist.is_main, self.state.step)
        flops = model_size(cfg.model, cfg.data.seq_len).flops_per_token
        peak = peak_tflops(cfg, self.dist.device) * 1e12 * self.dist.world_size
        batches = iter(self.train_loader)
        exit_code, window_start, window_tokens, step_seconds = 0, time.perf_counter(), 0, 0.0
        while self.state.step < cfg.train.max_steps:
            started = time.perf_counter()
            result = self.train_step(batches)
            step_seconds = time.perf_counter() - started
            self.state.step += 1
            self.state.tokens += result.tokens
            window_tokens += result.tokens
            self.state.bad_steps = 0 if result.finite else self.state.bad_steps + 1
            report.progress(self.state.step, result.loss, result.tokens / step_seconds, step_seconds)
            if self.state.step % cfg.train.log_every == 0 or self.state.step == cfg.train.max_steps:
                tokens_per_s = window_tokens / (time.perf_counter() - window_start)
                report.log({"step": self.state.step, "loss": result.loss if math.isfinite(result.loss) else None,
                            "lr": result.lr, "grad_norm": self.last_grad_norm(),
                            "tokens": self.state.tokens, "tokens_per_s": tokens_per_s,
                            "mfu": tokens_per_s * flops / peak, "bad_steps": self.state.bad_steps,
                            "skipped_shards": len(self.train_loader.skipped_shards)})
                window_start, window_tokens = time.perf_counter(), 0
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
        return ckpt.save_checkpoint(self.engine, self.cfg, self.state, self.train_loader.state_dict(),
                                    self.cfg.data.tokenizer)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-weighted validation loss over the first train.eval_batches batches of the validation split.

        Every rank reads the same batches; data-parallel rank r evaluates batches r, r + dp, ... (its
        tensor-parallel peers the same ones) and the sums are all-reduced: the numbers of one rank evaluating
        them all, in 1/dp of the time. A rank with a batch fewer runs one more forward and drops its result,
        so all ranks run the same forwards (ZeRO-3 gathers parameters in each).
        """
        batches = [batch for _, batch in zip(range(self.cfg.train.eval_batches), self.valid_loader)]
        self.engine.eval()
        loss_sum, targets = 0.0, 0
        for index in eval_schedule(len(batches), self.e.dp_size, self.e.dp_rank):
            batch = to_device(batches[index or 0], self.dist.device)
            labels = batch.pop("labels")
            loss = token_loss_sum(self.engine(**batch), labels, 0.0).item()
            if index is not None:
                loss_sum, targets = loss_sum + loss, targets + int((labels != IGNORE_INDEX).sum())
        self.engine.train()
        tp = self.cfg.parallel.tensor_parallel  # tensor-parallel peers counted the same batches
        loss_sum, targets = (x / tp for x in all_reduce_sum([loss_sum, targets], self.dist.device))
        loss = loss_sum / max(targets, 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": int(targets)}


def eval_schedule(n_batches: int, dp_size: int, dp_rank: int) -> list[int | None]:
    """The validation batches data-parallel rank ``dp_rank`` evaluates, round by round: ``dp_rank``,
    ``dp_rank + dp_size``, ...; None marks a round whose forward only keeps this rank in step with the others."""
    rounds = -(-n_batches // dp_size)
    return [i if i < n_batches else None for i in range(dp_rank, rounds * dp_size, dp_size)]


@contextmanager
def skipped_update(engine, skip: bool):
    """When ``skip``, the step inside this block changes nothing: weights, Adam moments, the optimizer's
    step count and the learning-rate schedule stay as they were (DeepSpeed still zeroes the gradients).
    This is what DeepSpeed's ZeRO optimizers do on their own for non-finite gradients.

    DeepSpeed wraps the torch optimizer (ZeRO and bf16 wrappers keep it in ``.optimizer``); the innermost
    one is the one whose ``step`` would change state.
    """
    if not skip:
        yield
        return
    inner = engine.optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    # (torch's LR scheduler may already have wrapped the optimizer's step on the instance: put it back)
    patched = [(obj, vars(obj).get("step")) for obj in (inner, engine.lr_scheduler) if obj is not None]
    for obj, _ in patched:
        obj.step = _no_op
    try:
        yield
    finally:
        for obj, own in patched:
            if own is None:
                del obj.step
            else:
                obj.step = own


def _no_op(*args, **kwargs) -> None:
    return None


def _zero_loss(module: torch.nn.Module) -> torch.Tensor:
    """A finite loss with zero gradient for every parameter (keeps ZeRO's gradient hooks in step)."""
    return sum(p.sum() * 0.0 for p in module.parameters() if p.requires_grad)


def unclipped_grad_norm(module: torch.nn.Module, tensor_parallel: int) -> float:
    """Global gradient norm without ZeRO (whose optimizer computes it for us): tensor-parallel shards'
    squares are summed over the tensor-parallel group, replicated parameters counted once."""
    from megatransformer.training.checkpoint import _partition_dim

    sharded, replicated = 0.0, 0.0
    for name, param in module.named_parameters():
        if param.grad is None:
            continue
        square = float(param.grad.detach().float().pow(2).sum())
        if tensor_parallel > 1 and _partition_dim(name) is not None:
            sharded += square
        else:
            replicated += square
    if tensor_parallel > 1:
        from deepspeed.utils import groups

        total = torch.tensor([sharded], dtype=torch.float64)
        dist.all_reduce(total, group=groups.get_tensor_model_parallel_group())
        sharded = float(total)
    return math.sqrt(sharded + replicated)


def print_sample(cfg: RunConfig, weights_dir: Path, tokenizer, max_new_tokens: int = 40) -> None:
    """Greedy continuation of train.sample_prompt with the final weights (decoder models)."""
    from megatransformer.model import build_model, generate
    from megatransformer.training.checkpoint import load_weights

    if not cfg.train.sample_prompt or cfg.model.arch != "decoder":
        return
    _, weights = load_weights(weights_dir)
    model = build_model(cfg.model).eval()
    model.load_state_dict(weights)
    prompt = torch.tensor([tokenizer.encode(cfg.train.sample_prompt)])
    new = generate(model, prompt, max_new_tokens, temperature=0.0, eos_id=tokenizer.eos_id)
    print(f"sample: {cfg.train.sample_prompt}{tokenizer.decode(new[0].tolist(), skip_special=True)}")
    sys.stdout.flush()
