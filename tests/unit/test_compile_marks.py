"""A start without torch.compile's machinery: the marks set without importing dynamo (model/compile_marks.py) do
what torch's own decorators do, building and running a model imports no dynamo, and DeepSpeed's own Muon loads
uncompiled."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatransformer.model.compile_marks import constant_result, never_compiled


def test_constant_result_marks_a_function_as_torch_compiler_assume_constant_result_does():
    def ours():
        return 3

    def torchs():
        return 3

    assert constant_result(ours) is ours
    assert vars(ours) == vars(torch.compiler.assume_constant_result(torchs)) != {}


def test_compiled_code_calls_a_constant_result_once_while_tracing_without_a_graph_break():
    calls = []

    @constant_result
    def width() -> int:
        calls.append(1)
        return 4

    compiled = torch.compile(lambda x: x * width(), backend="eager", fullgraph=True)
    for _ in range(3):
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 4.0))
    assert len(calls) == 1


def test_never_compiled_breaks_the_graph_as_torch_compiler_disable_does():
    def double(x):
        return x * 2

    for mark in (never_compiled, torch.compiler.disable):
        inner = mark(double)
        eager = torch.compile(lambda x: inner(x) + 1, backend="eager")
        assert torch.equal(eager(torch.ones(2)), torch.full((2,), 3.0))
        with pytest.raises(torch._dynamo.exc.Unsupported):
            torch.compile(lambda x: inner(x) + 1, backend="eager", fullgraph=True)(torch.ones(2))
        torch._dynamo.reset()


BUILD_AND_RUN = """
import sys
import torch
from megatransformer.config import load_config
from megatransformer.model import build_model
from megatransformer.flops import model_size
cfg = load_config("quickstart", ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64"])
model_size(cfg.model)
model = build_model(cfg.model, seed=0)
model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
print("torch._dynamo" in sys.modules)
"""


def test_building_sizing_and_running_a_model_imports_no_dynamo():
    """(~1.5 s of the start of eval, generate and export, which never compile)"""
    done = subprocess.run([sys.executable, "-c", BUILD_AND_RUN], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "False", done.stderr[-3000:]


OWN_MUON = """
import sys
import deepspeed.runtime.compiler as compiler
from megatransformer.training.deepspeed.internals import import_own_muon_uncompiled
eager = compiler.compile
import_own_muon_uncompiled()
from deepspeed.runtime.zero.muon import original_muon
print("torch._inductor.compile_fx" in sys.modules, compiler.compile is eager,
      original_muon.muon_update.__wrapped__.__name__)
"""


def test_deepspeed_s_own_muon_is_imported_without_compiling_it():
    """(every ZeRO engine's start imports it; as it loads, it would compile three functions with Inductor)"""
    done = subprocess.run([sys.executable, "-c", OWN_MUON], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines()[-1].split() == ["False", "True", "muon_update"], done.stderr[-3000:]
