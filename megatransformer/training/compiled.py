"""torch.compile in training: whether a run compiles (:func:`compile_enabled`), each Transformer block compiled on
its own (:func:`compile_blocks`), and the compiler's work after warm-up watched (:class:`CompileWatch`).

Blocks are compiled one by one, as torchtitan does: one graph serves every block of a stack, and activation
checkpointing and DeepSpeed's hooks stay outside the graphs. The design: docs/gpu.md.
"""

from __future__ import annotations

from torch import nn

from megatransformer.config import RunConfig
from megatransformer.model.layers import Block

WARMUP_STEPS = 2  # steps in which the compiler may still work: the first traces, the second marks shapes dynamic


def compile_enabled(cfg: RunConfig, device_type: str) -> bool:
    """``train.compile``, or where it is left unset, on for CUDA (the compiled step is far faster there) and off on
    CPUs (compiling takes minutes there and gains little)."""
    return cfg.train.compile if cfg.train.compile is not None else device_type == "cuda"


def describe_compile(cfg: RunConfig, device_type: str) -> str:
    """The run log's line on compilation."""
    on = compile_enabled(cfg, device_type)
    why = "train.compile" if cfg.train.compile is not None else f"the default on {device_type.upper()}"
    if not on:
        return f"torch.compile: off ({why}{'' if cfg.train.compile is not None else '; train.compile=true compiles'})"
    return f"torch.compile: each Transformer block ({why})"


def compile_blocks(model: nn.Module) -> int:
    """Compile every Transformer block of ``model`` in place (``nn.Module.compile``: parameter names unchanged);
    returns how many."""
    blocks = [module for module in model.modules() if isinstance(module, Block)]
    for block in blocks:
        block.compile()
    return len(blocks)


class CompileWatch:
    """Dynamo's counters of compiled frames and graph breaks, read after each step: once warm-up is over, any
    further compilation (a recompile) or graph break is reported in one line, never left to run silently slower
    (past the recompile limit dynamo falls back to eager)."""

    def __init__(self, warmup_steps: int = WARMUP_STEPS) -> None:
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.baseline: tuple[int, int] | None = None

    @staticmethod
    def counts() -> tuple[int, int]:
        """(frames compiled, graph breaks) in this process so far."""
        from torch._dynamo.utils import counters

        return counters["frames"]["total"], sum(counters["graph_break"].values())

    def after_step(self) -> str | None:
        """A line when the compiler worked during this step, past warm-up; None otherwise."""
        self.steps += 1
        if self.steps < self.warmup_steps:
            return None
        now = self.counts()
        if self.baseline is None:
            self.baseline = now
            return None
        (frames, breaks), (frames_before, breaks_before) = now, self.baseline
        self.baseline = now
        if frames == frames_before and breaks == breaks_before:
            return None
        return (
            f"torch.compile after warm-up: {frames - frames_before} recompile(s), {breaks - breaks_before} graph "
            f"break(s) in step {self.steps} (each costs time; TORCH_LOGS=recompiles,graph_breaks says why)"
        )

    @staticmethod
    def graph_break_reasons() -> list[str]:
        """The first line of each distinct graph break seen so far."""
        from torch._dynamo.utils import counters

        return [reason.splitlines()[0] for reason in counters["graph_break"]]
