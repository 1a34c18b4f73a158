"""A whole model that does not fit its device's free memory is refused in one line naming the sizes and the fix
before a weight is read; ``--zero-stage 3`` on one process is refused as ``eval --tasks`` refuses it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from support import assert_one_line
from support.models import run_config

from megatransformer import checkpoint as ckpt
from megatransformer import inference
from megatransformer.cli import main
from megatransformer.config import ConfigError, RunConfig
from megatransformer.model import build_model

MODEL = {"d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 256, "vocab_size": 512}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_data):
    """A weights checkpoint of a random decoder with tiny_data's tokenizer, and a translation pair to read."""
    cfg = run_config(model=MODEL)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("memory")
    path = ckpt.write_weights_checkpoint(root / "w", cfg, build_model(cfg.model).state_dict(), tiny_data.tokenizer)
    pairs = root / "pairs.jsonl"
    pairs.write_text(json.dumps({"src": "Return the", "tgt": "value"}) + "\n")
    return path, pairs


def commands(saved) -> dict[str, list[str]]:
    path, pairs = saved
    bleu = ["--data", str(pairs), "--source-field", "src", "--target-field", "tgt", "--bleu"]
    return {
        "generate": ["generate", "--checkpoint", str(path), "--prompt", "The"],
        "eval --data": ["eval", "--checkpoint", str(path), "--data", str(pairs)],
        "eval --bleu": ["eval", "--checkpoint", str(path), *bleu],
    }


def assert_refused(err: str, *fragments: str) -> None:
    """One line of error (after the line that says what loads), no traceback."""
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if not line.startswith("loading ")]
    assert_one_line("\n".join(lines), *fragments)


@pytest.mark.parametrize("command", ["generate", "eval --data", "eval --bleu"])
def test_a_whole_model_larger_than_the_free_memory_is_refused_before_a_weight_is_read(
    saved, command, monkeypatch, capsys
):
    """MODEL's 361,088 parameters are 1.4 MiB in fp32; the host says it has 0.5 MiB free."""
    cfg = run_config(model=MODEL)
    assert inference.whole_model_bytes(cfg, "fp32") == 4 * sum(p.numel() for p in build_model(cfg.model).parameters())
    monkeypatch.setattr(inference, "available_host_bytes", lambda: 2**19)
    monkeypatch.setattr(inference, "construct", lambda *a: pytest.fail("the model was made"))
    monkeypatch.setattr(ckpt, "load_state", lambda *a: pytest.fail("weights were read"))
    name = command.split()[0]
    assert main(commands(saved)[command]) == 2
    assert_refused(
        capsys.readouterr().err,
        f"megatransformer {name}: error: the model's 1.4 MiB in fp32 do not fit in the 0.5 MiB free on cpu",
    )


@pytest.mark.parametrize("free", [None, 10**9])
def test_a_model_that_fits_or_a_device_that_does_not_say_goes_on(saved, free, monkeypatch, capsys):
    monkeypatch.setattr(inference, "available_host_bytes", lambda: free)
    assert main([*commands(saved)["generate"], "--max-new-tokens", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("The")


def llama_7b_shape() -> RunConfig:
    model = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "d_ff": 11008, "vocab_size": 32000, "max_seq_len": 4096}
    return run_config(model=model)


def test_the_fix_names_enough_ranks_for_the_partitions_and_the_gathered_layers(monkeypatch):
    """A GPU's free memory is CUDA's; a rank of N holds 1/N of the model and the layers it gathers for a forward
    (ZeRO-3's 2 layers of 202M elements live, and the largest parameter, 131M: 2.0 GiB in fp32). 6.6B parameters
    are 24.6 GiB in fp32; 10 GiB free leave 8.0 GiB for a partition: 4 ranks (bf16's 12.3 GiB do not fit either);
    20 GiB: 2 ranks, or bf16; 1.5 GiB: not even the gathered layers."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 80 * 2**30))
    with pytest.raises(ConfigError) as refused:
        inference.refuse_unless_it_fits(llama_7b_shape(), "cuda:0", "fp32", "generate")
    assert str(refused.value) == (
        "the model's 24.6 GiB in fp32 do not fit in the 10.0 GiB free on cuda:0; partition it over 4 or more such "
        "devices: torchrun --nproc-per-node 4 -m megatransformer.cli generate ... --zero-stage 3"
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (20 * 2**30, 80 * 2**30))
    with pytest.raises(
        ConfigError, match=r"over 2 or more .* eval \.\.\. --zero-stage 3; or --dtype bf16 \(12.3 GiB\)"
    ):
        inference.refuse_unless_it_fits(llama_7b_shape(), "cuda:0", "fp32", "eval")
    monkeypatch.setattr(inference, "available_host_bytes", lambda: 3 * 2**29)
    with pytest.raises(ConfigError, match="even partitioned .* a rank's gathered layers would not fit"):
        inference.refuse_unless_it_fits(llama_7b_shape(), "cpu", "fp32", "eval")


@pytest.mark.parametrize("command", ["generate", "eval --data", "eval --bleu"])
def test_zero_stage_3_on_one_process_is_refused_in_one_line(saved, command, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*commands(saved)[command], "--zero-stage", "3"]) == 2
    assert_one_line(
        capsys.readouterr().err,
        f"megatransformer {command.split()[0]}: error: --zero-stage 3 partitions the model over torchrun's ranks: "
        "run it under torchrun, 2 or more",
    )


def test_the_hosts_available_memory_is_read_from_the_kernel():
    assert 0 < inference.available_host_bytes() < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_ranks_loading_together_refuse_together_when_one_device_lacks_the_room(monkeypatch):
    """Each rank's device has its own free memory: one rank's refusal is every rank's, the same line (a rank going
    on alone would wait for the others in its next collective)."""
    from support.thread_ranks import thread_group

    ranks = thread_group(monkeypatch, 3)
    monkeypatch.setattr(inference, "free_bytes", lambda device: 2**19 if ranks.rank() == 1 else 10**12)
    cfg = run_config(model=MODEL)
    outcomes = ranks.run(lambda: inference.refuse_unless_it_fits(cfg, "cpu", "fp32", "generate"))
    lines = {str(err) for _, err in outcomes if isinstance(err, ConfigError)}
    assert len(lines) == 1 and all(isinstance(err, ConfigError) for _, err in outcomes)
    assert lines.pop().startswith("the model's 1.4 MiB in fp32 do not fit in the 0.5 MiB free on cpu")
    monkeypatch.setattr(inference, "free_bytes", lambda device: 10**12)
    assert ranks.run(lambda: inference.refuse_unless_it_fits(cfg, "cpu", "fp32", "generate")) == [(None, None)] * 3
