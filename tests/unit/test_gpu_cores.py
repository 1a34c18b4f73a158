"""flash-attn 4 / 3 through PyTorch's flash registry, checked on a CPU: a fake FA4 (and FA3) registered with
``torch.nn.attention.register_flash_attention_impl``, its kernel module a stand-in in ``sys.modules``; ``auto``'s
choice per GPU generation and mask kind (``gpu_cores.SPEED_TABLE``), the run-log line, the one-line refusals,
and the registry core's routes (SDPA's flash backend, ``varlen_attn``) against ``eager``."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.attention
import torch.nn.attention.varlen
from support import flash_reference
from support.attention import SELF_MASKS, assert_close_in_bf16, assert_same, qkv, values_and_grads
from support.flash_registry import MODULES, register_fake, restore_torch_impls

from megatransformer.config import ConfigError, ModelConfig, RunConfig
from megatransformer.model import attention, gpu_cores
from megatransformer.model.masks import AttentionMask, self_attention_mask
from megatransformer.model.positions import Alibi
from megatransformer.training.preflight import check_device

BF16 = torch.bfloat16


@pytest.fixture
def fake_impls(monkeypatch):
    """``install("FA4", ...)`` registers fakes through PyTorch's registry API, installed (their kernel modules
    import); ``log`` lists their activations."""
    log: list[str] = []
    gpu_cores.registry_impl_installed.cache_clear()
    yield (lambda *names: [register_fake(monkeypatch, name, log) for name in names]), log
    restore_torch_impls()


def on_gpu(monkeypatch, generation: str | None, flash: bool = False, varlen: bool = True) -> None:
    monkeypatch.setattr(gpu_cores, "gpu_generation", lambda: generation)
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: flash)
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: varlen)


MASKS = {
    "causal": AttentionMask(True),
    "packed documents": self_attention_mask(True, torch.tensor([[1, 1, 2, 2]])),
    "prefix-LM": self_attention_mask(True, prefix_len=torch.tensor([2])),
    "cross-attention": AttentionMask(False, torch.tensor([[1, 1]]), torch.tensor([[1, 1, 1]])),
    "window": AttentionMask(True).with_window(4),
}


def test_the_speed_table_ranks_every_generation_and_mask_kind_ending_in_sdpa():
    generations = set(gpu_cores.GENERATIONS.values())
    assert set(gpu_cores.SPEED_TABLE) == {(g, kind) for g in generations for kind in gpu_cores.MASK_KINDS}
    for (generation, kind), cores in gpu_cores.SPEED_TABLE.items():
        assert cores[-1] == "sdpa" and len(set(cores)) == len(cores)
        assert set(cores) <= set(attention.BACKENDS)
        # a registry core is listed only where its kernels run, never for ALiBi (they have none)
        registry = [core for core in cores if core in gpu_cores.REGISTRY_IMPLS]
        assert all(generation in gpu_cores.REGISTRY_IMPLS[core].generations for core in registry)
        assert not registry if kind == "alibi" else True
        # flash-attn 3 leads every row it is in; flash-attn 4 leads the plain rows and ranks below PyTorch's
        # varlen kernel for packed batches (its varlen backward gets no max_seqlen), so auto never activates it
        causal = [c for c in gpu_cores.SPEED_TABLE[(generation, "causal")] if c in gpu_cores.REGISTRY_IMPLS]
        assert registry == ([] if kind == "alibi" else causal)
        if "fa4" in cores and kind not in ("causal", "alibi"):
            assert cores.index("varlen") < cores.index("fa4")
    assert gpu_cores.SPEED_TABLE[("hopper", "causal")][:2] == ("fa3", "fa4")
    assert gpu_cores.SPEED_TABLE[("hopper", "packed documents")][0] == "fa3"
    assert gpu_cores.SPEED_TABLE[("blackwell", "causal")][0] == "fa4"
    assert "fa4" not in gpu_cores.SPEED_TABLE[("ampere", "causal")]


def test_mask_kinds_are_named_as_the_table_names_them():
    assert {kind: gpu_cores.mask_kind(mask) for kind, mask in MASKS.items()} == {kind: kind for kind in MASKS}
    assert gpu_cores.mask_kind(None) == "causal" and gpu_cores.mask_kind(MASKS["window"], alibi=True) == "alibi"


@pytest.mark.parametrize(
    "generation, installed, expected",
    [
        ("blackwell", ("FA4",), None),  # (ranked below varlen for packed batches: never activated by auto)
        ("hopper", ("FA4",), None),
        ("hopper", ("FA3", "FA4"), "fa3"),
        ("blackwell", ("FA3", "FA4"), None),  # FA3 does not run on Blackwell
        ("ampere", ("FA3", "FA4"), None),  # neither runs on Ampere
    ],
)
def test_auto_takes_the_fastest_registry_core_per_generation_and_mask(
    fake_impls, monkeypatch, generation, installed, expected
):
    install, _ = fake_impls
    install(*installed)
    on_gpu(monkeypatch, generation, flash=True)
    choose = attention.auto_backend
    for kind, mask in MASKS.items():
        assert choose("cuda", BF16, mask) == (expected or "flash"), kind
    # ALiBi and attention dropout go to flash-attn 2; fp32 and heads too wide for the kernel to SDPA / the next
    assert choose("cuda", BF16, MASKS["causal"], alibi=True) == "flash"
    assert choose("cuda", BF16, MASKS["packed documents"], dropout=0.1) == "flash"
    assert choose("cuda", torch.float32, MASKS["causal"]) == "sdpa"
    wide = "fa3" if expected == "fa3" else "flash"  # FA4 takes heads up to 128, FA3 up to 256
    assert choose("cuda", BF16, MASKS["causal"], head_dim=256) == wide
    on_gpu(monkeypatch, generation, flash=False)  # without flash-attn 2: PyTorch's own kernels
    assert choose("cuda", BF16, MASKS["packed documents"], alibi=True) == "sdpa"
    assert choose("cuda", BF16, MASKS["packed documents"], dropout=0.1) == "sdpa"
    assert choose("cuda", BF16, MASKS["packed documents"]) == (expected or "varlen")
    assert choose("cpu", BF16, MASKS["packed documents"]) == "chunked"  # the CPU's choice is not the table's


def test_activation_goes_through_torchs_registry_and_the_run_log_says_which_core_and_why(fake_impls, monkeypatch):
    install, log = fake_impls
    install("FA3", "FA4")
    on_gpu(monkeypatch, "hopper")
    assert "FA3" in torch.nn.attention.list_flash_attention_impls()
    assert gpu_cores.activate_for("auto", "cpu") is None and log == []
    assert gpu_cores.activate_for("auto", "cuda") == "fa3"
    assert log == ["FA3"] and torch.nn.attention.current_flash_attention_impl() == "FA3"
    gpu_cores.activate("fa3")  # already active: not activated again
    assert log == ["FA3"]
    line = attention.describe_backend("auto", "cuda", BF16, 0.0)
    assert line.startswith("attention: auto -> fa3 for every mask on cuda in bfloat16 (hopper GPU; ")
    assert "flash-attn 3 through PyTorch's flash registry; active: FA3" in line
    assert attention.describe_backend("fa3", "cuda", BF16, 0.0) == (
        "attention: fa3 (flash-attn 3 through PyTorch's flash registry; active: FA3)"
    )
    # with ALiBi the line says why the registry cores do not run
    alibi_line = attention.describe_backend("auto", "cuda", BF16, 0.0, alibi=True)
    assert alibi_line.startswith("attention: auto -> sdpa for every mask") and "fa3, fa4 have no ALiBi" in alibi_line
    # on Blackwell flash-attn 4 is installed but not taken: the line says why and how to run it anyway
    on_gpu(monkeypatch, "blackwell")
    line = attention.describe_backend("auto", "cuda", BF16, 0.0)
    assert line.startswith("attention: auto -> sdpa for causal/bidirectional, varlen for packed documents")
    assert "fa4 not taken: fa4 ranks below PyTorch's varlen kernel for packed batches until measured" in line
    assert "without max_seqlen); model.attention_backend=fa4 runs it" in line
    # a Blackwell without FA4: the line names the install command
    gpu_cores.registry_impl_installed.cache_clear()
    monkeypatch.delitem(sys.modules, MODULES["FA4"])
    monkeypatch.setitem(sys.modules, MODULES["FA4"], None)  # its import fails
    assert "not installed: fa4: pip install --pre flash-attn-4" in attention.describe_backend("auto", "cuda", BF16, 0.0)


@pytest.mark.parametrize(
    "version, runs", [("2.11.0+cu128", False), ("2.12.1", False), ("2.13.0+cpu", True), ("2.14.0a0+git1", True)]
)
def test_registry_cores_run_only_on_a_torch_that_passes_their_windows_right(fake_impls, monkeypatch, version, runs):
    """torch 2.11's varlen_attn passes flash-attn 4 the window (-1, 0): its registry rejects it in the backward
    and flash-attn 4 reads -1 as no keys in the forward. One table (``REGISTRY_TORCH``), one resolver."""
    install, log = fake_impls
    install("FA3", "FA4")
    on_gpu(monkeypatch, "hopper")
    monkeypatch.setattr(torch, "__version__", version)
    assert gpu_cores.torch_version() == tuple(int(part) for part in version.split(".")[:2])
    assert (gpu_cores.torch_refusal("fa4") is None) == runs and (gpu_cores.torch_refusal("fa3") is None) == runs
    assert gpu_cores.registry_core("hopper") == ("fa3" if runs else None)
    line = attention.describe_backend("auto", "cuda", BF16, 0.0)
    if runs:
        assert line.startswith("attention: auto -> fa3 for every mask")
        check_device(run_config("fa4"), "cuda")  # a named core: the user's choice
        return
    assert line.startswith("attention: auto -> sdpa for causal/bidirectional, varlen for packed documents")
    assert f"fa4 not taken: torch {version[:4]}'s varlen_attn passes flash-attn 4 the window (-1, 0)" in line
    assert "it needs torch >= 2.13" in line and "fa3 not taken: torch" in line
    assert gpu_cores.activate_for("auto", "cuda") is None and log == []  # nothing activated: varlen_attn stays torch's
    for core in ("fa4", "fa3"):
        with pytest.raises(
            ConfigError,
            match=rf"^model.attention_backend={core} .* cannot run on this PyTorch: .*"
            r"needs torch >= 2.13; upgrade torch or use auto$",
        ) as refused:
            check_device(run_config(core), "cuda")
        assert "\n" not in str(refused.value)


def run_config(backend: str, **model) -> RunConfig:
    fields = dict(d_model=32, n_layers=1, n_heads=4, d_ff=64, vocab_size=64, attention_backend=backend, **model)
    return RunConfig(model=ModelConfig(**fields), precision="bf16")


def test_a_named_registry_core_that_cannot_run_is_refused_in_one_line(fake_impls, monkeypatch):
    install, _ = fake_impls
    on_gpu(monkeypatch, "hopper")
    with pytest.raises(ConfigError, match=r"fa4 .* not installed here .*: pip install --pre flash-attn-4, or"):
        check_device(run_config("fa4"), "cuda")
    with pytest.raises(ConfigError, match="fa3 .* is not installed here .* hopper/"):
        check_device(run_config("fa3"), "cuda")
    with pytest.raises(ConfigError, match="fa4 .* needs a CUDA GPU"):
        check_device(run_config("fa4"), "cpu")
    with pytest.raises(ConfigError, match="varlen needs a CUDA GPU"):
        check_device(run_config("varlen"), "cpu")
    install("FA4", "FA3")
    check_device(run_config("fa4"), "cuda")  # installed, on Hopper: accepted
    check_device(run_config("fa3"), "cuda")
    with pytest.raises(ConfigError, match="fa4 .* has no ALiBi; use model.attention_backend=flash"):
        check_device(run_config("fa4", position="alibi"), "cuda")
    with pytest.raises(ConfigError, match="fa4 .* has no attention dropout"):
        check_device(run_config("fa4", attention_dropout=0.1), "cuda")
    with pytest.raises(ConfigError, match="bf16 or fp16 only"):
        check_device(run_config("fa4").model_copy(update={"precision": "fp32"}), "cuda")
    on_gpu(monkeypatch, "blackwell")
    with pytest.raises(ConfigError, match="fa3 .* runs on hopper GPUs, this one is blackwell"):
        check_device(run_config("fa3"), "cuda")
    on_gpu(monkeypatch, "ampere")
    with pytest.raises(ConfigError, match="fa4 .* runs on blackwell or hopper GPUs, this one is ampere"):
        check_device(run_config("fa4"), "cuda")
    with pytest.raises(ValueError, match="no attention dropout or ALiBi"):
        q, k, v = qkv()
        attention.BACKENDS["fa4"](q, k, v, MASKS["causal"], 0.1)


@pytest.fixture
def varlen_calls(monkeypatch):
    """``varlen_attn`` (CUDA only) replaced by its documented contract (``flash_reference``); its windows."""
    windows = []

    def varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **gqa):
        windows.append(window_size)
        assert type(max_q) is int and cu_q.dtype == torch.int32
        return flash_reference.flash_attn_varlen_func(
            query, key, value, cu_q, cu_k, max_q, max_k, causal=window_size[1] == 0, window_size=window_size
        )

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_attn)
    return windows


@pytest.mark.parametrize("name", ["causal", "bidirectional", "packed_causal", "packed_prefix_per_document"])
@pytest.mark.parametrize("window", [None, 5])
def test_the_registry_core_matches_eager_through_sdpas_flash_backend_and_varlen_attn(
    fake_impls, varlen_calls, name, window
):
    """On CPU tensors the activated implementation (CUDA kernels) is not reached: PyTorch's own CPU flash kernel
    and the varlen contract compute, which checks the routes and their arguments."""
    install, log = fake_impls
    install("FA4")
    mask = SELF_MASKS[name]()
    if window is not None:
        if mask.prefix_len is not None:
            return  # windows do not combine with a prefix
        mask = mask.with_window(window)
    q, k, v = qkv()
    got = values_and_grads(attention.BACKENDS["fa4"], q, k, v, mask)
    want = values_and_grads(attention.eager_core, q, k, v, mask)
    assert_same(got, want)
    assert log == ["FA4"]  # activated on first use, in eager mode
    takes_varlen = not mask.is_simple or window is not None
    assert bool(varlen_calls) == takes_varlen
    if window is not None:
        assert {w[0] for w in varlen_calls} == {window - 1}


def test_the_registry_core_refuses_alibi(fake_impls):
    q, k, v = qkv()
    alibi = Alibi(torch.ones(4), torch.zeros(2, q.shape[2]), torch.zeros(2, q.shape[2]))
    with pytest.raises(ValueError, match="fa4 has no attention dropout or ALiBi"):
        attention.BACKENDS["fa4"](q, k, v, MASKS["causal"], 0.0, alibi)


def test_named_cores_build_their_varlen_metadata():
    assert {"fa3", "fa4", "flash", "varlen", "auto"} == gpu_cores.VARLEN_BACKENDS
    assert ModelConfig(attention_backend="fa4").attention_backend == "fa4"


def test_the_registry_core_compiles_without_graph_breaks_once_activated(fake_impls):
    """Activated before compiling (as the trainer does), the core's check is a guard, not a graph break."""
    from torch._dynamo.utils import counters

    install, log = fake_impls
    install("FA4")
    gpu_cores.activate_for("fa4", "cuda")
    torch._dynamo.reset()
    counters.clear()
    q, k, v = (t.detach() for t in qkv())
    core = torch.compile(attention.BACKENDS["fa4"], backend="eager", fullgraph=True)
    assert_same(core(q, k, v, MASKS["causal"], 0.0), attention.eager_core(q, k, v, MASKS["causal"], 0.0))
    assert log == ["FA4"] and not counters["graph_break"]


def fa4_runs_here() -> bool:
    return gpu_cores.registry_impl_installed("fa4") and gpu_cores.gpu_generation() in ("hopper", "blackwell")


FA4_CASES = [  # (windows do not combine with a prefix)
    (name, window)
    for name in ("causal", "bidirectional", "packed_causal", "packed_prefix_per_document")
    for window in (None, 5)
    if not (window and name == "packed_prefix_per_document")
]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not fa4_runs_here(),
    reason="needs a Hopper or Blackwell GPU and flash-attn 4 (pip install --pre flash-attn-4)",
)
@pytest.mark.skipif(
    gpu_cores.torch_refusal("fa4") is not None, reason=f"flash-attn 4 on torch {torch.__version__}: needs torch >= 2.13"
)
@pytest.mark.parametrize("name, window", FA4_CASES)
def test_real_flash_attn_4_through_torchs_registry_equals_eager(name, window):
    mask = SELF_MASKS[name]()
    mask = mask.with_window(window).to("cuda")
    gpu_cores.activate("fa4")
    assert torch.nn.attention.current_flash_attention_impl() == "FA4"
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_() for t in qkv(dim=64))  # (a head width FA4 takes)
    got = values_and_grads(attention.BACKENDS["fa4"], q, k, v, mask)
    want = values_and_grads(attention.eager_core, *(t.detach().float().requires_grad_() for t in (q, k, v)), mask)
    assert_close_in_bf16(got, want)


@pytest.mark.parametrize("kind", ["causal", "packed documents"])
def test_autos_choice_on_a_gpu_traces_as_constants_in_a_compiled_graph(kind):
    """What auto asks of the machine (GPU generation, installed cores) is a constant of the process: compiled
    code reads it without a graph break (the lookups import modules and query CUDA)."""
    mask = MASKS[kind]
    torch._dynamo.reset()

    def choose(x):
        return x * len(attention.auto_backend("cuda", BF16, mask))

    x = torch.ones(2)
    compiled = torch.compile(choose, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), choose(x))
