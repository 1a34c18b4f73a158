"""torch.compile in training: whether a run compiles (:func:`compile_enabled`), each Transformer block compiled on
its own (:func:`compile_blocks`; at ZeRO-3 with DeepSpeed's hooks outside the graph, :func:`gather_whole_blocks`),
and the compiler's work reported from the first step on (:class:`CompileWatch`).

Blocks are compiled one by one, as torchtitan does: one graph serves every block of a stack, and activation
checkpointing and DeepSpeed's hooks stay outside the graphs. The design: docs/gpu.md ("Compiled per block").
"""

from __future__ import annotations

import collections
import contextlib
import os

import torch
from torch import nn

from megatransformer.config import RunConfig
from megatransformer.model.layers import Block

WARMUP_STEPS = 2  # steps in which the compiler may still work: the first traces, the second marks shapes dynamic
BREAK_COUNTERS = ("graph_break", "unimplemented")  # dynamo's counters of breaks (data-dependent branches: the 2nd)


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


def gather_whole_blocks(model: nn.Module) -> int:
    """ZeRO-3, before ``deepspeed.initialize``: every Transformer block a DeepSpeed "leaf" module, whose hooks gather
    all of its parameters before its forward (and backward) and release them after, with no hook on its
    submodules; :func:`compile_blocks` then compiles the block's forward alone, the hooks outside the graph.
    Returns how many blocks."""
    from deepspeed.utils import set_z3_leaf_modules

    return len(set_z3_leaf_modules(model, [Block]))


def compile_blocks(model: nn.Module) -> int:
    """Compile every Transformer block of ``model`` in place (parameter names unchanged); returns how many. A block
    ZeRO-3 gathers whole (:func:`gather_whole_blocks`) has its ``forward`` compiled, DeepSpeed's module hooks
    running around it; any other block is compiled whole (``nn.Module.compile``)."""
    from deepspeed.utils import z3_leaf_module

    blocks = [module for module in model.modules() if isinstance(module, Block)]
    for block in blocks:
        if z3_leaf_module(block):
            block.forward = torch.compile(block.forward)
        else:
            block.compile()
    return len(blocks)


def eager_on_recompile() -> contextlib.AbstractContextManager:
    """Compiled code where a graph already compiled fits, eager code where it would have to compile again
    (forwards of shapes the step never runs: evaluations), so that no recompile counts against dynamo's limit;
    torch before 2.6 has no such stance: nothing changes."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return contextlib.nullcontext() if set_stance is None else set_stance("eager_on_recompile")


class CompileWatch:
    """What the compiler did during each step, read from dynamo's own records after the step (Python state on the
    host: no device sync): every graph break (with its reason, counted per distinct reason) and every recompile
    (with the guard that failed) is one line, from the first step on; the first step also says how many frames it
    compiled. Past the recompile limit dynamo runs a frame eager: a recompile is never left to run silently slower."""

    def __init__(self) -> None:
        self.steps = 0
        self.breaks = self.break_counts()  # (breaks of earlier work in this process are not this run's)
        self.compiles = {self.compile_key(entry) for entry in self.compilation_metrics()}
        self.frames = self.counts()[0]

    @staticmethod
    def counts() -> tuple[int, int]:
        """(frames compiled, graph breaks) in this process so far."""
        from torch._dynamo.utils import counters

        return counters["frames"]["total"], sum(CompileWatch.break_counts().values())

    @staticmethod
    def break_counts() -> collections.Counter[str]:
        """Dynamo's graph breaks so far, by reason (the first line of dynamo's message)."""
        from torch._dynamo.utils import counters

        total: collections.Counter[str] = collections.Counter()
        for name in BREAK_COUNTERS:
            for reason, count in counters[name].items():
                total[reason.strip().splitlines()[0]] += count
        return total

    @staticmethod
    def compilation_metrics() -> list:
        from torch._dynamo.utils import get_compilation_metrics

        return get_compilation_metrics()

    @staticmethod
    def compile_key(entry) -> str:
        return f"{entry.compile_id}/{entry.start_time_us}"

    def after_step(self, step: int | None = None) -> list[str]:
        """The lines on the compiler's work during this step (empty when there was none after the first step);
        ``step``: its number in the run (a resumed run's first step is not 1), by default counted from 1."""
        self.steps += 1
        step = self.steps if step is None else step
        lines, breaks = self.news(f"step {step}")
        frames = self.counts()[0]
        if self.steps == 1:
            done = f"{breaks} graph break(s)" if breaks else "no graph break"
            lines.insert(0, f"torch.compile, step {step}: {frames - self.frames} frame(s) compiled, {done}")
        self.frames = frames
        return lines

    def after_evaluation(self, step: int) -> list[str]:
        """The lines on the compiler's work during step ``step``'s validation and train.evals (a graph for
        forwards without gradients, say), empty when there was none."""
        return self.news(f"step {step}'s evaluation")[0]

    def news(self, where: str) -> tuple[list[str], int]:
        """A line for each graph break and recompile since the last call, saying ``where``; and the breaks' count."""
        lines = []
        breaks = self.break_counts()
        new_breaks, self.breaks = breaks - self.breaks, breaks
        for reason, count in new_breaks.items():
            lines.append(f"torch.compile, {where}: graph break{f' x{count}' if count > 1 else ''}: {reason}")
        for entry in self.compilation_metrics():
            key = self.compile_key(entry)
            if key in self.compiles:
                continue
            self.compiles.add(key)
            if entry.recompile_reason:
                at = f"{entry.co_name} ({os.path.basename(entry.co_filename or '?')}:{entry.co_firstlineno})"
                reason = entry.recompile_reason.strip().splitlines()[0]
                lines.append(f"torch.compile, {where}: recompiled {at}: {reason}")
        return lines, sum(new_breaks.values())

    @staticmethod
    def graph_break_reasons() -> list[str]:
        """The first line of each distinct graph break seen so far."""
        return list(CompileWatch.break_counts())
