"""The trainer's pure parts, in-process and fast: batch arithmetic, parameter groups, learning-rate schedules,
the DeepSpeed config, the loss, skipped updates, checkpoint bookkeeping and metrics truncation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from support.models import run_config

from megatransformer.config import ConfigError, TrainConfig

# ------------------------------------------------------------------------------------------- batch sizes


@pytest.mark.parametrize(
    "overrides, global_batch, dp, advice",
    [
        ([], 32, 1, ["train.grad_accum=2", "train.global_batch_size=32"]),  # quickstart: micro 16 x accum 1
        ([], 32, 4, ["train.micro_batch_size=8", "train.global_batch_size=32"]),
        ([], 12, 1, ["train.micro_batch_size=12", "train.global_batch_size=12"]),
        (
            ["train.grad_accum=null", "train.global_batch_size=64"],
            32,
            2,
            ["train.grad_accum=1", "train.global_batch_size=32"],
        ),
        ([], 30, 4, None),
    ],
)
def test_the_advice_for_a_resume_with_another_global_batch_gives_the_saved_one(overrides, global_batch, dp, advice):
    from megatransformer.config import load_config
    from megatransformer.training.runtime.layout import exact_batch_overrides, resolve_batch_sizes

    cfg = load_config("quickstart", overrides)
    assert exact_batch_overrides(cfg.train, global_batch, dp) == advice
    if advice is not None:
        assert resolve_batch_sizes(load_config("quickstart", overrides + advice).train, dp).global_batch == global_batch


@pytest.mark.parametrize(
    "given,dp,expected",
    [
        (dict(micro_batch_size=4, grad_accum=2), 2, (4, 2, 2, 16)),
        (dict(micro_batch_size=4, global_batch_size=32), 2, (4, 4, 2, 32)),
        (dict(grad_accum=2, global_batch_size=32), 4, (4, 2, 4, 32)),
        (dict(micro_batch_size=4, grad_accum=2, global_batch_size=8), 1, (4, 2, 1, 8)),
        (dict(micro_batch_size=4), 3, (4, 1, 3, 12)),
    ],
)
def test_batch_sizes_derive_the_third(given, dp, expected):
    from megatransformer.training.runtime.layout import resolve_batch_sizes

    sizes = resolve_batch_sizes(TrainConfig(**given), dp)
    assert (sizes.micro, sizes.accum, sizes.dp, sizes.global_batch) == expected


@pytest.mark.parametrize(
    "given,dp,message",
    [
        (dict(micro_batch_size=4, grad_accum=2, global_batch_size=12), 1, "train.global_batch_size=12 != micro"),
        (
            dict(micro_batch_size=4, global_batch_size=30),
            2,
            "not divisible by train.micro_batch_size=4 x data-parallel",
        ),
        (dict(grad_accum=3, global_batch_size=32), 2, "not divisible by train.grad_accum=3 x data-parallel size 2"),
        (dict(global_batch_size=32), 1, "set two of train.micro_batch_size"),
        (dict(), 1, "set two of train.micro_batch_size"),
    ],
)
def test_inconsistent_batch_sizes_are_config_errors(given, dp, message):
    from megatransformer.training.runtime.layout import resolve_batch_sizes

    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        resolve_batch_sizes(TrainConfig(**given), dp)


# ------------------------------------------------------------------------------------- optimizer and LR


def test_no_weight_decay_on_norms_biases_and_embeddings():
    from megatransformer.model import build_model
    from megatransformer.training.optimizers.schedules import param_groups

    cfg = run_config(
        model=dict(
            d_model=32,
            n_layers=1,
            n_heads=4,
            d_ff=64,
            vocab_size=128,
            bias=True,
            norm="layernorm",
            position="learned",
            tie_embeddings=True,
        )
    )
    model = build_model(cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = param_groups(model, 0.1, decay_everything=False)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed and all(n.endswith("_proj.weight") for n in decayed)
    assert any("norm" in names[id(p)] for p in no_decay["params"])
    assert any(names[id(p)].endswith(".bias") for p in no_decay["params"])
    assert any("embed" in names[id(p)] for p in no_decay["params"])
    everything = decay["params"] + no_decay["params"]
    assert len(everything) == len({id(p) for p in everything}) == len(list(model.parameters()))
    (all_decay,) = param_groups(model, 0.1, decay_everything=True)
    assert len(all_decay["params"]) == len(everything) and all_decay["weight_decay"] == 0.1


def schedule(name: str, warmup: int = 10, steps: int = 100, **extra):
    from megatransformer.training.optimizers.schedules import lr_multiplier

    cfg = run_config(
        schedule=dict(name=name, warmup_steps=warmup, min_lr_ratio=0.1), train=dict(max_steps=steps), **extra
    )
    return lr_multiplier(cfg)


def test_warmup_then_cosine_linear_constant():
    for name in ("cosine", "linear", "constant"):
        f = schedule(name)
        assert [f(i) for i in range(3)] == pytest.approx([0.1, 0.2, 0.3])  # step i is the (i+1)-th update
        assert f(9) == pytest.approx(1.0)
    cosine, linear, constant = schedule("cosine"), schedule("linear"), schedule("constant")
    assert cosine(54) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert linear(54) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cosine(99) == pytest.approx(0.1) and linear(99) == pytest.approx(0.1)
    assert cosine(500) == pytest.approx(0.1)  # past max_steps: the floor
    assert constant(99) == 1.0


def test_inverse_sqrt_is_the_papers_schedule():
    f = schedule("inverse_sqrt", warmup=4000, steps=100_000)
    d = 32
    paper = [d**-0.5 * min(s**-0.5, s * 4000**-1.5) for s in (1, 100, 4000, 10_000, 100_000)]
    assert [f(s - 1) for s in (1, 100, 4000, 10_000, 100_000)] == pytest.approx(paper)
    assert max(f(s) for s in range(0, 20_000, 7)) == pytest.approx(d**-0.5 * 4000**-0.5, rel=1e-3)


# --------------------------------------------------------------------------------------- DeepSpeed config


def test_deepspeed_config_from_run_config():
    from megatransformer.model import TP_PLAN
    from megatransformer.training.engine.train_module import deepspeed_config
    from megatransformer.training.runtime.layout import BatchSizes

    cfg = run_config(
        optim=dict(name="adam", betas=[0.9, 0.98], eps=1e-9, weight_decay=0.0),
        parallel=dict(zero_stage=2, tensor_parallel=2, offload_optimizer=True),
        precision="bf16",
    )
    ds = deepspeed_config(cfg, BatchSizes(micro=4, accum=3, dp=2), "cpu")
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 3)
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    params = ds["optimizer"]["params"]  # offloaded: DeepSpeedCPUAdam (no torch_adam) steps on the host
    assert ds["optimizer"]["type"] == "Adam" and params["adam_w_mode"] is False and "torch_adam" not in params
    assert params["betas"] == [0.9, 0.98] and params["eps"] == 1e-9
    on_device = deepspeed_config(run_config(), BatchSizes(4, 1, 1), "cpu")["optimizer"]["params"]
    assert on_device["torch_adam"] is True and on_device["fused"] is True  # one fused AdamW kernel
    tp = ds["tensor_parallel"]
    assert tp["autotp_size"] == 2 and not tp["partition_config"]["use_default_specs"]
    patterns = {p: spec["partition_type"] for spec in tp["partition_config"]["layer_specs"] for p in spec["patterns"]}
    assert patterns == TP_PLAN
    with pytest.raises(ConfigError, match="offload_optimizer needs parallel.zero_stage >= 1"):
        deepspeed_config(run_config(parallel=dict(zero_stage=0, offload_optimizer=True)), BatchSizes(4, 1, 1), "cpu")


def test_zero_reduces_through_a_bucket_of_the_ranks_gradients_at_most_deepspeeds_default():
    """What the engine gives DeepSpeed is the bucket the planner counts: every gradient a tensor-parallel rank
    holds, and DeepSpeed's default 5e8 elements for models above that; no bucket without ZeRO."""
    from megatransformer.planner import REDUCE_BUCKET, Layout, parameter_counts, reduce_bucket_elements, state_parts
    from megatransformer.training.engine.train_module import deepspeed_config
    from megatransformer.training.runtime.layout import BatchSizes

    cfg = run_config(parallel=dict(zero_stage=2, tensor_parallel=2))
    split, whole = parameter_counts(cfg.model)
    zero = deepspeed_config(cfg, BatchSizes(4, 1, 2), "cpu")["zero_optimization"]
    assert zero["reduce_bucket_size"] == reduce_bucket_elements(cfg.model, 2) == split // 2 + whole
    _, in_backward, _ = state_parts(cfg, Layout(2, 2, 1, 2, False, 1, False, 4, 1), engine=True)
    assert in_backward["communication_buffers"] == 4 * zero["reduce_bucket_size"]  # (fp32)
    assert "reduce_bucket_size" not in deepspeed_config(cfg, BatchSizes(4, 1, 2), "cpu", 0)["zero_optimization"]
    large = run_config(model=dict(d_model=4096, n_layers=32, n_heads=32, d_ff=16384, vocab_size=32000))
    assert sum(parameter_counts(large.model)) > REDUCE_BUCKET == reduce_bucket_elements(large.model, 1)


def test_zero_3_buckets_and_gathers_a_layer_never_the_whole_model_nor_above_deepspeeds_defaults():
    """ZeRO-3's sizes come from the model's largest layer: DeepSpeed's defaults (a 5e8 bucket, 1e9 elements gathered
    and kept for reuse) would gather a model below 1e9 parameters whole. The engine's config and the planner read
    the same sizes; ZeRO-1/2 keep their own bucket."""
    from megatransformer.planner import (
        REDUCE_BUCKET,
        ZERO3_MAX_LIVE,
        ZERO3_PERSISTENCE,
        ZERO3_PREFETCH,
        Layout,
        largest_layer,
        parameter_counts,
        persistent_elements,
        state_parts,
        zero3_sizes,
    )
    from megatransformer.training.engine.train_module import deepspeed_config
    from megatransformer.training.runtime.layout import BatchSizes

    model = dict(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=32)
    cfg = run_config(model=model, parallel=dict(zero_stage=3))
    layer, sizes = largest_layer(cfg.model, 1), zero3_sizes(cfg.model, 1, shards=2)
    assert (sizes.reduce_bucket, sizes.prefetch_bucket, sizes.max_reuse_distance, sizes.max_live) == (
        layer,
        layer,
        layer,
        2 * layer,
    )
    assert sizes.max_live < sum(parameter_counts(cfg.model))
    assert sizes.sub_group == -(-layer // 2)  # (a layer's share of the partition per optimizer sub-group)
    assert sizes.persistence_threshold == 10 * cfg.model.d_model  # (norms: every rank keeps them whole)
    assert persistent_elements(cfg.model, 1, sizes.persistence_threshold) == 9 * cfg.model.d_model
    zero = deepspeed_config(cfg, BatchSizes(4, 1, 2), "cpu")["zero_optimization"]
    assert zero == {"stage": 3, **sizes.deepspeed()}
    held, in_backward, _ = state_parts(cfg, Layout(2, 1, 1, 3, False, 1, False, 4, 1), engine=True, host=True)
    assert held["communication_buffers"] >= 4 * zero["reduce_bucket_size"]
    assert in_backward["communication_buffers"] == 2 * 4 * zero["reduce_bucket_size"]  # (the copy, gloo's clone)
    stage_2 = deepspeed_config(run_config(parallel=dict(zero_stage=2)), BatchSizes(4, 1, 2), "cpu")
    assert stage_2["zero_optimization"].keys() == {"stage", "reduce_bucket_size", "overlap_comm"}
    large = zero3_sizes(
        run_config(model=dict(d_model=8192, n_layers=2, n_heads=64, d_ff=28672, vocab_size=128256)).model, 1
    )
    assert (large.reduce_bucket, large.prefetch_bucket, large.max_live) == (
        REDUCE_BUCKET,
        ZERO3_PREFETCH,
        ZERO3_MAX_LIVE,
    )
    assert large.persistence_threshold == 10 * 8192 < ZERO3_PERSISTENCE


@pytest.mark.parametrize(
    "stage,dp,precision,device,offload,runs",
    [
        (0, 1, "fp32", "cuda", False, 0),
        (1, 1, "fp32", "cuda", False, 0),  # one rank: nothing to partition
        (2, 1, "fp32", "cuda", False, 0),
        (3, 1, "fp32", "cuda", False, 3),
        (1, 2, "fp32", "cuda", False, 1),
        (2, 8, "fp32", "cpu", False, 2),
        (3, 2, "fp32", "cpu", False, 3),
        (1, 1, "fp32", "cpu", True, 1),
        (2, 1, "fp32", "cuda", True, 2),  # offloading needs ZeRO, on one rank too
        (1, 1, "bf16", "cuda", False, 1),
        (2, 1, "fp16", "cuda", False, 2),  # (a GPU wait per parameter at ZeRO-0)
        (1, 1, "fp16", "cpu", False, 0),
        (2, 1, "fp16", "cpu", False, 0),  # (the same reads cost a CPU nothing)
        (1, 1, "bf16", "cpu", False, 1),
        (2, 1, "bf16", "cpu", False, 2),  # (bf16 accumulates in fp32 only in ZeRO)
    ],
)
def test_zero_1_and_2_on_one_data_parallel_rank_run_as_stage_0(stage, dp, precision, device, offload, runs):
    from megatransformer.training.engine.train_module import deepspeed_config
    from megatransformer.training.runtime.layout import BatchSizes, engine_zero_stage

    cfg = run_config(parallel=dict(zero_stage=stage, offload_optimizer=offload), precision=precision)
    assert engine_zero_stage(cfg, dp, device) == runs
    assert (
        deepspeed_config(cfg, BatchSizes(4, 1, dp), f"{device}:0" if device == "cuda" else device)["zero_optimization"][
            "stage"
        ]
        == runs
    )
    assert deepspeed_config(cfg, BatchSizes(4, 1, dp), device, zero_stage=stage)["zero_optimization"]["stage"] == stage


def test_the_run_log_says_which_zero_stage_runs_and_warns_of_per_parameter_waits():
    from megatransformer.training.runtime.layout import zero_stage_notes

    one_rank = run_config(parallel=dict(zero_stage=2))
    assert zero_stage_notes(one_rank, 2, "cpu") == []
    [line] = zero_stage_notes(one_rank, 0, "cpu")
    assert line.startswith("parallel.zero_stage=2 on one data-parallel rank: nothing to partition")
    bf16_zero0 = run_config(parallel=dict(zero_stage=0), precision="bf16", train=dict(grad_accum=1))
    assert zero_stage_notes(bf16_zero0, 0, "cpu") == []  # (a CPU does not wait)
    [warning] = zero_stage_notes(bf16_zero0, 0, "cuda")
    assert warning.startswith("warning: precision=bf16 with parallel.zero_stage=0") and "zero_stage=1" in warning
    assert zero_stage_notes(run_config(parallel=dict(zero_stage=0)), 0, "cuda") == []  # fp32: the torch optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fused_loss_equals_cross_entropy_of_the_logits(dtype, smoothing):
    """linear_cross_entropy (the head's loss, chunk by chunk, gradients computed in the forward pass) against
    the plain head: F.linear, fp32 logits, F.cross_entropy summed; padding ignored; several chunks."""
    from megatransformer.model.head import linear_cross_entropy

    torch.manual_seed(0)
    hidden, weight = torch.randn(13, 8, dtype=dtype), torch.randn(11, 8, dtype=dtype)
    labels = torch.randint(0, 11, (13,))
    labels[3:6] = -100

    def grads(loss_fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = loss_fn(h, w)
        (loss * 0.37).backward()  # a scaled loss, as the trainer's
        return loss.detach(), h.grad, w.grad

    def plain_loss(h, w):
        return F.cross_entropy(F.linear(h, w).float(), labels, label_smoothing=smoothing, reduction="sum")

    plain = grads(plain_loss)
    fused = grads(lambda h, w: linear_cross_entropy(h, w, labels, smoothing, chunk_logits=4 * 11))  # 4 rows
    assert fused[0].dtype == torch.float32
    if dtype == torch.float32:
        for a, b in zip(plain, fused):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    else:  # both round: against float64, each is within two bf16 roundings (2^-8 each) of the largest value
        hidden, weight = hidden.double(), weight.double()
        exact = grads(plain_loss)
        for a, b, x in zip(plain, fused, exact):
            bound = 2**-7 * x.abs().max()
            assert (a.double() - x).abs().max() <= bound and (b.double() - x).abs().max() <= bound, (a, b, x)
    none = torch.full_like(labels, -100)
    assert linear_cross_entropy(hidden, weight, none, smoothing) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the CPU tests above check the same arithmetic")
def test_fused_loss_on_cuda_equals_the_plain_head_in_less_memory():
    """bf16 on a GPU at a real vocabulary, several chunks: the loss and gradients of the plain head (within
    bf16 rounding), and a peak below the plain head's fp32 logits."""
    from megatransformer.model.head import linear_cross_entropy

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 512, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(32000, 512, device="cuda", generator=gen) * 0.02).bfloat16()
    labels = torch.randint(0, 32000, (4096,), device="cuda", generator=gen)
    labels[::5] = -100

    def run(loss_fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = loss_fn(h, w)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), h.grad, w.grad, torch.cuda.max_memory_allocated() - base

    *plain, plain_peak = run(lambda h, w: F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum"))
    *fused, fused_peak = run(lambda h, w: linear_cross_entropy(h, w, labels, chunk_logits=1 << 23))  # 16 chunks
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-4, atol=1e-2)
    for a, b in zip(plain[1:], fused[1:]):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2**-7 * a.float().abs().max().item())
    assert fused_peak < plain_peak / 2, (fused_peak, plain_peak)


def test_the_fused_loss_chunks_by_the_device_it_runs_on(monkeypatch):
    """Without chunk_logits, the chunk size is the device's: 128M logits on CUDA (GEMMs of a few hundred rows
    are slow there), 8M elsewhere; traced on a fake CUDA tensor."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from megatransformer.model import head

    asked = []
    monkeypatch.setattr(head, "chunked_loss_and_grads", lambda *args: asked.append(args[4]) or (None, None))
    fake = FakeTensorMode()
    cuda = [FakeTensor(fake, torch.empty(shape, device="meta"), torch.device("cuda")) for shape in ((4, 8), (16, 8))]
    with torch.no_grad():
        head.linear_cross_entropy(torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(4, dtype=torch.long))
        head.linear_cross_entropy(*cuda, torch.zeros(4, dtype=torch.long))
        head.linear_cross_entropy(torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(4, dtype=torch.long), 0.0, 40)
    assert asked == [1 << 23, 1 << 27, 40]


def test_fused_loss_computes_only_the_gradients_autograd_needs():
    """Evaluation (no_grad) does one matmul per chunk, training three (logits, then both gradients), with a
    frozen head two."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatransformer.model.head import linear_cross_entropy

    class CountMatmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
            return func(*args, **(kwargs or {}))

    hidden, weight = torch.randn(12, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    labels = torch.randint(0, 10, (12,))
    for grad_enabled, matmuls in ((False, 3), (True, 9)):  # 3 chunks of 4 rows
        with torch.set_grad_enabled(grad_enabled), CountMatmuls() as counter:
            loss = linear_cross_entropy(hidden, weight, labels, chunk_logits=40)
        assert counter.count == matmuls and loss.requires_grad == grad_enabled
    # a frozen head: the hidden states' gradient only (two matmuls per chunk), the same as with both
    expected = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, chunk_logits=40), hidden)[0]
    with CountMatmuls() as counter:
        loss = linear_cross_entropy(hidden, weight.detach(), labels, chunk_logits=40)
    assert counter.count == 6
    loss.backward()
    assert torch.equal(hidden.grad, expected)


def gated_engine():
    """A parameter with a gradient, its AdamW and schedule, wrapped as ZeRO wraps them."""
    from types import SimpleNamespace

    param = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.AdamW([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0 / (step + 1))
    param.grad = torch.ones(3)
    return param, inner, scheduler, SimpleNamespace(optimizer=SimpleNamespace(optimizer=inner), lr_scheduler=scheduler)


def test_a_refused_update_leaves_optimizer_and_schedule_untouched(recwarn):
    """What the trainer does with a non-finite or spiking step: the wrapped optimizer's step and the
    schedule's step are no-ops for that one step, and work again afterwards."""
    from megatransformer.training.engine.train_module import gated_update

    param, inner, scheduler, engine = gated_engine()
    with gated_update(engine, lambda: False):
        engine.optimizer.optimizer.step()
        engine.lr_scheduler.step()
    assert torch.equal(param.detach(), torch.ones(3)) and inner.state_dict()["state"] == {}
    assert scheduler.last_epoch == 0 and inner.param_groups[0]["lr"] == 0.1
    with gated_update(engine, lambda: True):
        inner.step()
        scheduler.step()
    assert not torch.equal(param.detach(), torch.ones(3)) and scheduler.last_epoch == 1
    assert not recwarn.list  # (torch's scheduler warns when the optimizer's step lost its mark)


def test_the_gate_is_asked_once_when_the_optimizer_steps_and_not_when_zero_skips_first():
    """ZeRO steps its inner optimizer once per parameter group, after computing the gradient norm: the
    decision is taken at the first of those steps and holds for the rest; a step ZeRO skips itself (non-finite
    gradients) never reaches the inner optimizer and asks nothing."""
    from megatransformer.training.engine.train_module import gated_update

    param, inner, scheduler, engine = gated_engine()
    asked = []
    with gated_update(engine, lambda: asked.append(len(asked)) or False):
        assert not asked  # (not before the optimizer is about to update)
        inner.step()
        inner.step()
        scheduler.step()
    assert asked == [0] and torch.equal(param.detach(), torch.ones(3)) and scheduler.last_epoch == 0
    with gated_update(engine, lambda: asked.append(len(asked)) or True):
        pass
    assert asked == [0]
    with gated_update(engine, lambda: asked.append(len(asked)) or True):
        inner.step()
        scheduler.step()
    assert asked == [0, 1] and scheduler.last_epoch == 1 and not torch.equal(param.detach(), torch.ones(3))


# ------------------------------------------------------------------------------------------ checkpoints


def test_shape_mismatch_lists_every_field():
    from megatransformer.checkpoint import check_same_shapes

    saved = run_config().model
    current = run_config(
        model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=32)
    ).model
    with pytest.raises(ConfigError) as err:
        check_same_shapes(saved, current, "checkpoint X")
    message = str(err.value)
    assert "\n" not in message
    assert "model.d_model: 32 in the checkpoint, 64 now" in message
    assert "model.n_layers: 1 in the checkpoint, 2 now" in message
    check_same_shapes(
        saved,
        run_config(
            model=dict(
                d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=64, dropout=0.1
            )
        ).model,
        "ok",
    )


def test_resume_resolution(tmp_path):
    from megatransformer.checkpoint import COMPLETE
    from megatransformer.training.checkpointing.resume import resolve_resume

    root = tmp_path / "checkpoints"
    cfg = run_config(run_dir=str(tmp_path), resume="auto")
    assert resolve_resume(cfg) is None  # auto with nothing saved: a fresh start
    for step, complete in ((10, True), (20, False)):
        (root / f"step_{step:06d}").mkdir(parents=True)
        if complete:
            (root / f"step_{step:06d}" / COMPLETE).touch()
    (root / "latest").write_text("step_000010")
    assert resolve_resume(cfg) == root / "step_000010"
    assert resolve_resume(cfg.model_copy(update={"resume": str(root)})) == root / "step_000010"
    with pytest.raises(ConfigError, match="nowhere does not exist"):
        resolve_resume(cfg.model_copy(update={"resume": str(tmp_path / "nowhere")}))
    with pytest.raises(ConfigError, match="is not a complete checkpoint directory"):  # cut short while saving
        resolve_resume(cfg.model_copy(update={"resume": str(root / "step_000020")}))
    (root / "latest").write_text("step_000020")  # never written before COMPLETE, and never trusted without it
    assert resolve_resume(cfg) == root / "step_000010"
    (root / "latest").unlink()
    assert resolve_resume(cfg) == root / "step_000010"


def test_only_the_last_k_complete_checkpoints_are_kept(tmp_path):
    from megatransformer.checkpoint import COMPLETE
    from megatransformer.checkpoint import prune as _prune

    for step in (1, 2, 3, 4):
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / COMPLETE).touch()
    (tmp_path / "step_000005").mkdir()  # incomplete: not counted, not deleted here
    _prune(tmp_path, 2, keep={"step_000004"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004", "step_000005"]


def test_tensor_parallel_split_dimensions():
    from megatransformer.model.tp_plan import partition_dim

    assert partition_dim("decoder.layers.0.self_attn.q_proj.weight") == 0
    assert partition_dim("decoder.layers.0.self_attn.q_proj.bias") == 0
    assert partition_dim("decoder.layers.0.cross_attn.k_proj.weight") == 0
    assert partition_dim("decoder.layers.0.ffn.down_proj.weight") == 1
    assert partition_dim("decoder.layers.0.self_attn.o_proj.bias") is None  # added after the all-reduce
    assert partition_dim("embed_tokens.weight") is None and partition_dim("decoder.norm.weight") is None


def test_rng_state_round_trip():
    import random

    import numpy as np

    from megatransformer.training.checkpointing.rng import rng_state, set_rng_state

    state = rng_state()
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first


def test_metrics_after_the_checkpoint_are_dropped_on_resume(tmp_path):
    from megatransformer.training.observability.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "val_loss": 2.5}, {"step": 3, "loss": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    truncate_metrics(path, after_step=2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == lines[:3]


def test_wandb_defaults_to_offline_without_a_key(monkeypatch):
    from megatransformer.training.observability.metrics import wandb_mode

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode(run_config()) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(run_config()) == "online"
    assert wandb_mode(run_config(wandb=dict(mode="disabled"))) == "disabled"


@pytest.mark.parametrize(
    "n,dp,expected",
    [
        (3, 2, [[0, 2], [1, None]]),  # the second rank keeps in step with a dropped forward
        (4, 2, [[0, 2], [1, 3]]),
        (1, 3, [[0], [None], [None]]),
        (5, 1, [[0, 1, 2, 3, 4]]),
    ],
)
def test_validation_batches_are_dealt_to_data_parallel_ranks(n, dp, expected):
    from megatransformer.training.engine.train_module import eval_schedule

    schedules = [eval_schedule(n, dp, rank) for rank in range(dp)]
    assert schedules == expected
    assert sorted(i for s in schedules for i in s if i is not None) == list(range(n))


# ------------------------------------------------------------------------------------------------- MFU


@pytest.mark.parametrize(
    "name,dtype,peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
        ("NVIDIA H100 NVL", torch.float16, 835.0),
        ("NVIDIA H200", torch.bfloat16, 989.0),
        ("NVIDIA GH200 480GB", torch.bfloat16, 989.0),
        ("NVIDIA A100-SXM4-40GB", torch.bfloat16, 312.0),
        ("NVIDIA A100 80GB PCIe", torch.float32, 156.0),
        ("NVIDIA B200", torch.bfloat16, 2250.0),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, None),
    ],
)
def test_gpu_peaks_by_device_name(name, dtype, peak):
    from megatransformer.training.observability.metrics import gpu_peak_tflops

    assert gpu_peak_tflops(name, dtype) == peak


def test_tensor_parallel_shards_are_checked_after_set_up():
    """A DeepSpeed that leaves a planned layer whole (old versions ignore custom patterns) is refused by name."""
    from megatransformer.training.engine.train_module import check_tensor_parallel_shards

    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.q_proj = torch.nn.Linear(8, 8, bias=False)
    model.norm = torch.nn.LayerNorm(8)
    full = {"attn.q_proj.weight": torch.Size([8, 8]), "norm.weight": torch.Size([8]), "norm.bias": torch.Size([8])}
    with pytest.raises(ConfigError, match=r"did not split attn\.q_proj\.weight: it holds \(8, 8\) of \(8, 8\)"):
        check_tensor_parallel_shards(model, full, 2)
    model.attn.q_proj = torch.nn.Linear(8, 4, bias=False)  # the column shard of rank r: 4 of 8 output rows
    check_tensor_parallel_shards(model, full, 2)


def test_rope_frequencies_stay_fp32_when_the_engine_casts_the_model():
    from megatransformer.model.positions import Rotary

    rotary = Rotary(64, 10000.0).to(torch.bfloat16)  # what DeepSpeed's bf16 mode does to every module
    positions = torch.tensor([[4000]])
    cos, _ = rotary(positions, torch.float32)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    expected = torch.cos(4000 * inv_freq).float()
    assert torch.allclose(cos[0, 0, 0, :32], expected, atol=1e-3)  # bf16 frequencies are off by up to ~1 here


@pytest.mark.parametrize(
    "prompt", ["The", "it's", "### Instruction:\nSay hi.\n\n### Response:\n", "a\tb\\c 'q' \x01 é"]
)
def test_the_suggested_generate_command_is_one_line_that_gives_back_the_prompt(prompt):
    """An instruction prompt's newlines would break the suggested command over lines (shlex keeps them)."""
    import subprocess

    from megatransformer.commands.train import shell_quote

    quoted = shell_quote(prompt)
    assert "\n" not in quoted
    assert subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True, text=True).stdout == prompt


def test_eval_says_how_its_rows_are_made(tiny_data):
    from megatransformer.commands.eval import expected_rows, scored
    from megatransformer.config import load_config

    data = [f"data.train={tiny_data.shards}", f"data.valid={tiny_data.shards}", "data.seq_len=32"]
    packed, unpacked = load_config("quickstart", data), load_config("quickstart", [*data, "data.pack=false"])
    assert "packed in order" in scored(packed) and "data.pack=false" not in scored(packed)
    assert "packed" not in scored(unpacked) and "each document in rows of its own" in scored(unpacked)
    assert expected_rows(packed, "valid") > 0 and expected_rows(unpacked, "valid") > 0
