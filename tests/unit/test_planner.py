"""The planner's memory estimate against the measured peak of live tensor bytes of real one-rank steps (the bare
model step: fused loss, backward, fused AdamW), and its choices."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import plan_memory  # noqa: E402
from plan_memory import bare_peak, planned, run_config  # noqa: E402
from support.memory import peak_host_bytes  # noqa: E402

from megatransformer.planner import GIB, GPUS, Layout, find_gpu, memory_parts, plan  # noqa: E402

SMALL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=512, attention_backend="chunked")
POINTS = {
    "decoder-gqa": ({}, 256, "fp32"),
    "decoder-mha-gelu": ({"n_kv_heads": None, "ffn": "gelu"}, 512, "fp32"),
    "encoder": ({"arch": "encoder", "ffn": "gelu"}, 256, "fp32"),
    "encoder-decoder": ({"arch": "encoder_decoder", "ffn": "relu"}, 256, "fp32"),
    "t5-style": (  # span corruption: the decoder's rows hold the targets only (58 positions at 256)
        {"arch": "encoder_decoder", "d_model": 128, "n_layers": 4, "n_kv_heads": None, "d_ff": 512, "ffn": "gelu"},
        256,
        "fp32",
    ),
    "checkpointing": ({"activation_checkpointing": True}, 512, "fp32"),
    "selective-checkpointing": ({"activation_checkpointing": "selective"}, 512, "fp32"),
    "mlp-tiles": ({"mlp_tiles": 4}, 512, "fp32"),
    "bf16": ({}, 256, "bf16"),
    "two-loss-chunks": ({"vocab_size": 8192}, 1024, "fp32"),  # 2 x 1024 targets: two chunks of 2^23 logits on CPU
    "latent-attention": ({"attention": "mla", "n_kv_heads": None, "kv_lora_rank": 32, "q_lora_rank": 48}, 512, "fp32"),
    "qk-norm": ({"qk_norm": True}, 512, "fp32"),
    "window": ({"attention_window": 64}, 512, "fp32"),
    "prefix-lm": ({}, 512, "fp32"),
}


@pytest.mark.parametrize("name", list(POINTS))
def test_plan_total_is_the_measured_peak_within_ten_percent(name: str) -> None:
    fields, seq_len, precision = POINTS[name]
    point = {
        "model": SMALL | fields | {"max_seq_len": seq_len},
        "seq_len": seq_len,
        "micro_batch": 2,
        "precision": precision,
        "runner": "bare",
    }
    if name == "prefix-lm":
        point["objective"] = "prefix_lm"
    measured = bare_peak(run_config(point))
    total = planned(point)["total"]
    assert 0.9 < total / measured < 1.1, f"{name}: plan {total / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB"


def llama(**model) -> object:
    from megatransformer.config import load_config

    return load_config("llama-style", [f"model.{k}={v}" for k, v in model.items()])


def layout(**fields) -> Layout:
    base = dict(dp=8, tp=1, sp=1, zero=1, activation_checkpointing=False, mlp_tiles=1, offload=False)
    return Layout(**(base | {"micro_batch": 1, "accum": 32} | fields))


def test_zero_stages_partition_states_over_the_data_parallel_ranks() -> None:
    cfg, h100 = llama(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336), find_gpu("H100")
    parts = {z: memory_parts(cfg, layout(zero=z), h100) for z in range(4)}
    assert parts[1]["optimizer_states"] * 8 == pytest.approx(parts[0]["optimizer_states"], rel=1e-3)
    assert parts[3]["weights"] * 8 == pytest.approx(parts[0]["weights"], rel=1e-3)
    assert parts[0]["total"] > parts[1]["total"] > parts[3]["total"]
    offloaded = memory_parts(cfg, layout(zero=2, offload=True), h100)
    assert offloaded["optimizer_states"] == 0 and offloaded["total"] < parts[2]["total"]


def test_an_offloaded_optimizer_leaves_a_gpu_but_not_a_cpu() -> None:
    """DeepSpeedCPUAdam keeps the fp32 masters, their gradient partitions and Adam's moments in the host's
    memory: off a GPU, still in a CPU's; ZeRO-2's staging buffers of the largest parameter on both sides."""
    from megatransformer.planner import largest_parameter, parameter_counts, state_parts

    cfg = llama(d_model=512, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=1024)
    offloaded = layout(zero=2, offload=True)
    part = -(-sum(parameter_counts(cfg.model)) // 8)
    largest = largest_parameter(cfg.model, 1)
    on_gpu, _, _ = state_parts(cfg, offloaded, engine=True, host=False)
    on_cpu, _, _ = state_parts(cfg, offloaded, engine=True, host=True)
    assert on_gpu["master_weights"] == on_gpu["gradients"] == on_gpu["optimizer_states"] == 0
    assert (on_cpu["master_weights"], on_cpu["gradients"], on_cpu["optimizer_states"]) == (4 * part, 4 * part, 8 * part)
    assert on_gpu["communication_buffers"] == 2 * largest  # (bf16)
    assert on_cpu["communication_buffers"] == 2 * largest + 2 * part + 2 * largest


def test_the_first_layout_fits_and_is_the_fastest_that_does() -> None:
    cfg = llama(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192)
    result = plan(cfg, find_gpu("H100"), 8, 8, None, 256)
    fitting = [p for p in result.layouts if p.fits]
    assert fitting and result.layouts[0] is fitting[0]
    assert result.layouts[0].step_seconds == min(p.step_seconds for p in fitting)
    assert all(p.memory["total"] <= 80 * GIB and p.need <= 80 * GIB for p in fitting)
    assert result.why().startswith(result.layouts[0].layout.describe() + " wins")


def test_layouts_that_cannot_exist_are_skipped_with_their_reason() -> None:
    cfg = llama(n_heads=12, n_kv_heads=4)  # 12 heads: tp 8 does not divide them
    result = plan(cfg, GPUS[0], 8, 8, None, 256)
    reasons = dict(result.skipped)
    assert reasons["dp1 x tp8, tiles 1"] == "parallel.tensor_parallel=8 does not divide model.n_heads=12"
    assert all(p.layout.tp != 8 for p in result.layouts)


def test_nothing_fits_says_the_smallest_memory_that_would() -> None:
    cfg = llama(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672)
    result = plan(cfg, find_gpu("A100-40"), 1, 1, None, 8)
    assert not any(p.fits for p in result.layouts)
    assert result.why().startswith(
        "nothing fits in 40.0 GiB per device and 240 GiB of host memory per rank: the smallest need is "
    )


def test_plan_json_has_the_layouts_and_the_config_own_index(capsys: pytest.CaptureFixture) -> None:
    import json

    from megatransformer.cli import main

    assert main(["plan", "--config", "llama-style", "--gpu", "H100", "--gpus-per-node", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    first, current = out["layouts"][0], out["layouts"][out["current"]]
    keys = {"dp", "tp", "sp", "zero", "activation_checkpointing", "mlp_tiles", "offload", "micro_batch"}
    assert keys | {"memory_bytes", "peak_bytes", "need_bytes", "step_seconds", "fits"} <= first.keys()
    assert set(first["peak_bytes"]) == {"construction", "engine_start", "loading", "step"}
    assert first["fits"] and first["memory_bytes"]["total"] == sum(
        v for k, v in first["memory_bytes"].items() if k != "total"
    )
    # llama-style: ZeRO-1, 8 rows per rank of a 256-row global batch
    assert (current["dp"], current["zero"], current["micro_batch"], current["accum"]) == (8, 1, 8, 4)


def test_the_plan_says_the_model_s_size_in_a_unit_that_shows_it(capsys: pytest.CaptureFixture) -> None:
    from megatransformer.cli import main
    from megatransformer.commands.plan import parameters_text

    assert main(["plan", "--config", "quickstart", "--gpu", "H100", "--top", "1"]) == 0
    assert capsys.readouterr().out.startswith("plan: 1.26 M parameters, ")
    assert parameters_text(6_738_415_616) == "6.74 B"


def test_an_unknown_gpu_asks_for_its_memory_and_peak(capsys: pytest.CaptureFixture) -> None:
    from megatransformer.cli import main

    assert main(["plan", "--config", "llama-style", "--gpu", "MI300X"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatransformer plan: error: --gpu MI300X is not one the planner knows")
    assert err.endswith("give its --gpu-memory GiB and --peak-tflops (dense bf16 TFLOP/s per device)")
    assert (
        main(["plan", "--config", "llama-style", "--gpu", "MI300X", "--gpu-memory", "192", "--peak-tflops", "1307"])
        == 0
    )


def test_train_check_names_the_overflow_and_the_best_layout_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatransformer.commands import plan as command
    from megatransformer.config import ConfigError, load_config

    small = command.local_device(load_config("llama-style"), 1, need_peak=False)[0]
    monkeypatch.setattr("megatransformer.planner.cpu_device", lambda ranks: replace(small, memory_gib=5.0))
    monkeypatch.setattr(command, "cpu_tflops", lambda precision: 0.1)
    cfg = load_config("llama-style", ["train.micro_batch_size=16", "train.global_batch_size=64"])
    with pytest.raises(ConfigError) as err:
        command.check_layout_fits(cfg, 1, 1)
    line = str(err.value)
    assert line.startswith("this run's layout (dp1, ZeRO-1, mb 16 x 4) needs ")
    assert "GiB more than the 5.0 GiB of its CPU (largest part: activations" in line
    assert "the best layout that fits: dp1" in line and line.endswith("train.check_memory=false skips this check")
    command.check_layout_fits(load_config("llama-style", ["train.micro_batch_size=1", "train.grad_accum=1"]), 1, 1)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"arch": "encoder", "ffn": "gelu", "position": "learned", "norm": "layernorm", "bias": True},
        {"arch": "encoder_decoder", "ffn": "relu", "tie_embeddings": False, "share_embeddings": False},
        {"norm_position": "post", "position": "sinusoidal"},
    ],
)
def test_parameter_counts_are_the_model_s(fields: dict) -> None:
    from megatransformer.config import ModelConfig
    from megatransformer.flops import model_size
    from megatransformer.model import build_model
    from megatransformer.planner import parameter_counts

    cfg = ModelConfig(**(SMALL | fields | {"n_layers": 3}))
    built = sum(p.numel() for p in build_model(cfg).parameters())
    assert sum(parameter_counts(cfg)) == model_size(cfg).params == built


@pytest.mark.parametrize("fields", [{}, {"arch": "encoder_decoder", "ffn": "relu", "n_decoder_layers": 1000}])
def test_a_deep_model_is_counted_from_one_block_per_stack(monkeypatch, fields: dict) -> None:
    from megatransformer.config import ModelConfig
    from megatransformer.flops import attention_costs, model_size
    from megatransformer.model.transformer import Block
    from megatransformer.planner import parameter_counts

    one, two, deep = (ModelConfig(**(SMALL | fields | {"n_layers": n})) for n in (1, 2, 4096))
    per_block = sum(parameter_counts(two)) - sum(parameter_counts(one))
    blocks, build = [], Block.__init__
    monkeypatch.setattr(Block, "__init__", lambda block, *args, **kw: blocks.append(1) or build(block, *args, **kw))
    assert sum(parameter_counts(deep)) == model_size(deep).params == sum(parameter_counts(one)) + 4095 * per_block
    assert attention_costs(deep)[0].layers == 4096 + (deep.decoder_layers if deep.arch == "encoder_decoder" else 0)
    assert len(blocks) <= 3 * 2  # (one per stack, for each of the three counts)


def test_a_point_whose_rank_aborts_is_measured_once_more_and_any_other_failure_is_raised(monkeypatch):
    def exited(signal_name: str | None) -> mp.ProcessExitedException:
        return mp.ProcessExitedException("process 0 exited", 0, 1, -6 if signal_name else 1, signal_name)

    outcomes = [exited("SIGABRT"), 7]

    def spawn_ranks(point):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(plan_memory, "spawn_ranks", spawn_ranks)
    assert plan_memory.engine_peak({}) == 7 and not outcomes
    for first, second in ((exited("SIGABRT"), exited("SIGABRT")), (exited(None), 7), (exited("SIGSEGV"), 7)):
        outcomes = [first, second]
        with pytest.raises(mp.ProcessExitedException):
            plan_memory.engine_peak({})


LLAMA_70B = dict(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=128256)


def test_no_rank_holds_the_whole_model_at_the_start_of_a_zero_3_run() -> None:
    from megatransformer.planner import largest_layer, parameter_counts, start_peaks

    cfg = llama(**LLAMA_70B)
    whole = 2 * sum(parameter_counts(cfg.model))  # (bf16)
    h100 = find_gpu("H100")
    moments = start_peaks(cfg, layout(dp=512, zero=3), h100)
    reserved = int(h100.reserved_gib * GIB)
    block = 4 * largest_layer(cfg.model, 1)  # (one block of the 70B in fp32: 3.2 GiB)
    assert moments["construction"].device - reserved == whole // 512 + block < whole / 20
    assert all(peak.host < whole / 20 for peak in moments.values())
    below = start_peaks(cfg, layout(dp=512, zero=2), h100)["construction"]  # the whole model, in bf16
    assert below.device - reserved == whole + block


def test_an_offloaded_optimizer_s_states_count_against_the_host() -> None:
    from megatransformer.planner import overflow, parameter_counts, peaks

    cfg = llama(**LLAMA_70B)
    split, whole = parameter_counts(cfg.model)
    h100 = find_gpu("H100")
    offloaded = layout(dp=8, tp=8, zero=3, offload=True, activation_checkpointing=True)
    moments = peaks(cfg, offloaded, h100, memory_parts(cfg, offloaded, h100))
    # fp32 masters, their two gradient copies and Adam's moments of a data-parallel rank's partition of the
    # tensor-parallel shard: 20 bytes a parameter; the checkpointer's copies of its masters and moments: 12 more
    assert moments["step"].host == pytest.approx(32 * (split / 8 + whole) / 8, rel=1e-3)
    assert overflow(moments, h100) is None
    small_host = replace(h100, host_gib=16.0)
    moment, where, needed, limit = overflow(moments, small_host)
    assert (where, limit) == ("host", 16.0) and needed == moments[moment].host > 16 * GIB


def test_train_refuses_a_layout_whose_host_cannot_hold_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatransformer.commands import plan as command
    from megatransformer.config import ConfigError, load_config

    small_host = replace(find_gpu("H100"), host_gib=8.0)
    monkeypatch.setattr(command, "local_device", lambda cfg, ranks, need_peak=True: (small_host, 8))
    overrides = [f"model.{k}={v}" for k, v in LLAMA_70B.items()] + [
        "parallel.zero_stage=3",
        "parallel.offload_optimizer=true",
        "parallel.tensor_parallel=8",
        "model.activation_checkpointing=true",
        "train.micro_batch_size=1",
        "train.global_batch_size=64",
    ]
    with pytest.raises(ConfigError) as err:
        command.check_layout_fits(load_config("llama-style", overrides), 64, 8)
    line = str(err.value)
    assert line.startswith("this run's layout (dp8 x tp8, ZeRO-3, mb 1 x 8, ckpt, offload) needs ")
    assert "GiB per rank when DeepSpeed's engine starts, " in line
    assert "GiB more than the 8.0 GiB of its host (per rank); " in line


def test_selective_checkpointing_is_ranked_between_none_and_full() -> None:
    cfg = llama(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336)
    h100 = find_gpu("H100")
    need = {
        ckpt: memory_parts(cfg, layout(zero=3, micro_batch=2, accum=16, activation_checkpointing=ckpt), h100)
        for ckpt in (False, "selective", True)
    }
    assert need[True]["activations"] < need["selective"]["activations"] < need[False]["activations"]
    result = plan(cfg, h100, 8, 8, None, 256)
    assert any(p.layout.activation_checkpointing == "selective" for p in result.layouts)
    assert "sel-ckpt" in layout(activation_checkpointing="selective").describe()


def test_muon_s_owners_and_their_buffers_are_counted() -> None:
    from megatransformer.flops import model_size, newton_schulz_flops, one_block_per_stack
    from megatransformer.model.matrices import hidden_matrix_names
    from megatransformer.planner import muon_owner_work, muon_step_bytes, step_seconds

    adamw, muon = (llama(**LLAMA_70B) for _ in range(2))
    muon = muon.model_copy(update={"optim": muon.optim.model_copy(update={"name": "muon"})})
    model, copies = one_block_per_stack(muon.model)
    named = dict(model.named_parameters())
    total = sum(newton_schulz_flops(tuple(named[n].shape)) * copies(n) for n in hidden_matrix_names(model))
    assert muon_owner_work(muon.model, 1)[0] == total
    busiest = muon_owner_work(muon.model, 8)[0]
    assert total / 8 <= busiest < 1.1 * total / 8  # (560 matrices over 8 owners, balanced by their FLOPs)
    h100 = find_gpu("H100")
    big = layout(dp=64, tp=8, zero=3, micro_batch=2, accum=4, activation_checkpointing="selective")
    flops = model_size(muon.model, muon.data.seq_len).flops_per_token
    extra = step_seconds(muon, big, h100, 8, flops) - step_seconds(adamw, big, h100, 8, flops)
    assert extra > 5 * muon_owner_work(muon.model, 512)[0] / (h100.peak_tflops * 1e12 * 0.4)
    work, block, side = muon_owner_work(muon.model, 512)
    assert work <= 1.1 * total / 512  # (560 matrices over 512 ranks: some split across teams)
    assert side == 8192 and block < 28672 * 8192  # (no rank holds the largest matrix whole)
    assert muon_step_bytes(muon, big, "cuda") > 4 * block + 2 * side * side  # (the block in fp32, A and B whole)


@pytest.mark.parametrize(("choice", "upcast"), [("fp32", True), ("native", False)])
def test_bf16_newton_schulz_as_fp32_gemms_on_a_cpu_counts_its_upcasts(choice: str, upcast: bool) -> None:
    from megatransformer.planner import muon_owner_work, muon_step_bytes

    cfg = llama(**LLAMA_70B)
    cfg = cfg.model_copy(
        update={
            "optim": cfg.optim.model_copy(update={"name": "muon", "muon_ns_dtype": "bf16"}),
            "train": cfg.train.model_copy(update={"cpu_bf16_matmul": choice}),
        }
    )
    ranks = layout(dp=8, zero=3)
    _, block, side = muon_owner_work(cfg.model, 8)
    added = muon_step_bytes(cfg, ranks, "cpu") - muon_step_bytes(cfg, ranks, "cuda")
    assert added == (8 * block + 2 * side * side if upcast else 0)


def test_newton_schulz_as_fp32_gemms_holds_what_the_planner_counts() -> None:
    """The allocator's peak over one bf16 Newton-Schulz under cpu_bf16.Fp32Gemms: more than the working set
    without the upcasts, no more than with them."""
    from megatransformer.planner import newton_schulz_bytes
    from megatransformer.training.optimizers.muon import newton_schulz_steps
    from megatransformer.training.runtime.cpu_bf16 import Fp32Gemms

    update = torch.randn(64, 256)

    def orthogonalize() -> torch.Tensor:
        with Fp32Gemms():
            *_, result = newton_schulz_results(newton_schulz_steps(update, 3, "bf16"))
        return result

    peak = peak_host_bytes(orthogonalize, python=False)
    block, side = update.numel(), 64
    assert newton_schulz_bytes(block, side, 2, upcast=False) < peak <= newton_schulz_bytes(block, side, 2, upcast=True)


def newton_schulz_results(steps):
    """Every pause of a :func:`muon.newton_schulz_steps` iteration (None), then its result."""
    try:
        while True:
            yield next(steps)
    except StopIteration as done:
        yield done.value


@pytest.mark.parametrize("policy, zero, noted", [("keep", 3, True), ("release", 3, False), ("keep", 1, False)])
def test_train_check_says_when_keeps_heap_growth_at_zero3_could_outgrow_the_memory(
    monkeypatch: pytest.MonkeyPatch, policy: str, zero: int, noted: bool
) -> None:
    from megatransformer.commands import plan as command
    from megatransformer.config import load_config
    from megatransformer.planner import GIB, KEEP_HEAP_GROWTH_ZERO3, memory_parts, peaks

    overrides = ["train.micro_batch_size=1", "train.grad_accum=1", "precision=bf16"]
    cfg = load_config("llama-style", [*overrides, f"parallel.zero_stage={zero}", f"train.host_memory={policy}"])
    device = command.local_device(cfg, 2, need_peak=False)[0]
    layout, _ = command.config_layout(cfg, 2, "cpu")
    step = peaks(cfg, layout, device, memory_parts(cfg, layout, device))["step"].on(device)
    # the plan fits, with room for less than keep's growth
    between = replace(device, memory_gib=(1 + KEEP_HEAP_GROWTH_ZERO3) / 2 * step / GIB)
    monkeypatch.setattr("megatransformer.planner.cpu_device", lambda ranks: between)
    note = command.check_layout_fits(cfg, 2, 2)
    if noted:
        assert note.startswith(f"memory: this layout's step needs {step / GIB:.1f} GiB per rank")
        assert note.endswith("train.host_memory=release holds it to the plan, at a slower step")
    else:
        assert note is None
    monkeypatch.setattr("megatransformer.planner.cpu_device", lambda ranks: replace(device, memory_gib=1e4))
    assert command.check_layout_fits(cfg, 2, 2) is None
