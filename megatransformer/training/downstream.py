"""train.evals: lm-evaluation-harness tasks run in the training process, every data-parallel rank (and each of
its sequence-parallel peers) on its share of the items, at ZeRO-3 each forward in step with the other ranks
(docs/evaluation.md)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megatransformer.config import ConfigError, RunConfig
from megatransformer.lockstep import EVAL_GATHER_TIMEOUT_MINUTES, Interrupted, Placement, gather_group
from megatransformer.training.engine.train_module import TrainModule


class Downstream:
    """The run's harness tasks, loaded before the first step (a task that cannot load stops the run there)."""

    def __init__(
        self, cfg: RunConfig, module: TrainModule, device: str, tokenizer, stop: Callable[[], bool] | None = None
    ) -> None:
        evals = cfg.train.evals
        from megatransformer import harness

        reason = harness.unsupported(cfg.model.arch)
        if reason:
            raise ConfigError(f"train.evals: {reason}")
        self.harness, self.cfg, self.module, self.tokenizer = harness, cfg, module, tokenizer
        self.interrupted = False  # (the last run's tasks ended early: a rank was asked to stop)
        self.tasks = harness.load_tasks(evals.tasks, evals.include_path)
        harness.check_fewshot(self.tasks, evals.num_fewshot, "train.evals.num_fewshot")
        # (the ranks' answers are gathered on a group of their own, with its own timeout: a task longer than
        # parallel.timeout_minutes does not trip the training collectives' watchdog)
        share, shares = module.item_share()
        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        lockstep = module.forwards_together
        group = gather_group(ranks if shares > 1 or lockstep else 1)
        self.gather_timeout_minutes = EVAL_GATHER_TIMEOUT_MINUTES  # (the longest wait of a rank for the others)
        # (a preemption ends the tasks between two forwards: the checkpoint comes first, see run)
        self.placement = Placement(
            torch.device(device), share, shares, module.matmuls, group, lockstep=lockstep, stop=stop
        )

    def due(self, step: int) -> bool:
        every = self.cfg.train.evals.every
        return bool(every) and step % every == 0

    def run(self) -> dict[str, float | None]:
        """``{"eval/<task>/<metric>": value, "eval_s": seconds the tasks took}`` on rank 0 (empty on the
        others, and on every rank with :attr:`interrupted` set when a rank was asked to stop meanwhile: the
        tasks may take longer than a preemption's warning leaves before the kill)."""
        started = time.perf_counter()
        evals, cfg = self.cfg.train.evals, self.cfg
        batch_size = evals.batch_size or self.module.sizes.micro
        self.interrupted = False
        try:
            with self.module.plain_model() as model, self.harness.quiet():
                lm = self.harness.HarnessLM(model, cfg, self.tokenizer, self.placement, batch_size)
                results = self.harness.evaluate(lm, self.tasks, evals.limit, evals.num_fewshot)
        except Interrupted:
            self.interrupted = True
            return {}
        if results is None:
            return {}
        metrics = {
            f"eval/{task}/{metric}": value
            for task, values in self.harness.metrics_of(results).items()
            for metric, value in values.items()
        }
        return {**metrics, "eval_s": round(time.perf_counter() - started, 3)}
