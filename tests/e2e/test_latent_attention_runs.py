"""Multi-head latent attention in real runs: tensor parallelism (heads split after the up-projections, latents
whole) and Ulysses sequence parallelism (causal and prefix-LM) train like one rank; a trained model exports as
DeepseekV3ForCausalLM (same logits, same 64 greedy tokens) and imports back bit for bit; an HF directory with
mixture-of-experts layers is refused with one line (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch
from support import assert_one_line
from support.runs import cli, losses, metrics, tiny_model, tiny_run, train

MLA = [
    "model.n_kv_heads=null",
    "model.attention=mla",
    "model.kv_lora_rank=32",
    "model.q_lora_rank=24",
    "model.qk_rope_head_dim=8",
    "model.qk_nope_head_dim=16",
    "model.v_head_dim=12",
]


def mla_run(tiny_data, run_dir, *extra: str, steps: int = 6) -> list[str]:
    return [*tiny_run(tiny_data, run_dir, steps), *MLA, *extra]


def grad_norms(run_dir) -> list[float]:
    return [r["grad_norm"] for r in metrics(run_dir) if "grad_norm" in r]


CASES = {  # the objective, and the run's other options
    "decoder": ["parallel.zero_stage=1"],
    "prefix_lm": ["parallel.zero_stage=1", "objective=prefix_lm"],  # bidirectional prefixes, packed documents
}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """The one-rank run of a case (made once per case)."""
    made = {}

    def run(case: str):
        if case not in made:
            made[case] = tmp_path_factory.mktemp("mla") / case
            said = train(mla_run(tiny_data, made[case], *CASES[case])).stdout
            assert "attention: mla, values 12 wide beside queries/keys 24: values zero-padded to 24 for auto" in said
        return made[case]

    return run


@pytest.fixture(scope="module")
def one_rank(runs):
    return runs("decoder")


def test_tensor_parallel_equals_one_rank(one_rank, tiny_data, tmp_path):
    run = tmp_path / "tp2"
    train(mla_run(tiny_data, run, *CASES["decoder"], "parallel.tensor_parallel=2"), nproc=2)
    assert losses(run) == pytest.approx(losses(one_rank), rel=1e-5)
    assert grad_norms(run) == pytest.approx(grad_norms(one_rank), rel=1e-4)


# values padded (chunked) or exchanged at their own width (sdpa); prefix-LM masks over the whole sequence
@pytest.mark.parametrize("case, backend", [("decoder", "auto"), ("decoder", "sdpa"), ("prefix_lm", "auto")])
def test_sequence_parallel_equals_one_rank(runs, tiny_data, tmp_path, case, backend):
    run = tmp_path / "sp2"
    extra = [*CASES[case], "parallel.sequence_parallel=2", f"model.attention_backend={backend}"]
    train(mla_run(tiny_data, run, *extra), nproc=2)
    assert losses(run) == pytest.approx(losses(runs(case)), abs=1e-5, rel=0)
    assert grad_norms(run) == pytest.approx(grad_norms(runs(case)), rel=1e-4)


def test_export_to_transformers_and_import_back(one_rank, tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatransformer.inference import load_for_inference
    from megatransformer.model import generate

    out = tmp_path / "hf"
    said = cli("export", "--checkpoint", one_rank, "--format", "hf", "--out", out).stdout
    assert "wrote a DeepseekV3ForCausalLM directory" in said
    ours = load_for_inference(one_rank).model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(5, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-4
    prompt = ids[:1, :8]
    options = dict(max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = theirs.generate(prompt, **options)[:, 8:]
    assert torch.equal(theirs.generate(prompt, use_cache=False, **options)[:, 8:], expected)
    assert torch.equal(generate(ours, prompt, 64), expected)
    assert torch.equal(generate(ours, prompt, 64, use_cache=False), expected)

    back = tmp_path / "imported"
    cli("import", "--hf", out, "--out", back)
    again = load_for_inference(back).model.state_dict()
    assert again.keys() == ours.state_dict().keys()
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())

    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "first_k_dense_replace": 1}))
    result = cli("import", "--hf", out, "--out", tmp_path / "moe", check=False)
    assert result.returncode == 2
    assert_one_line(result.stderr, "layers 1-1 are mixture-of-experts layers")


def test_bad_latent_dimensions_exit_2_with_one_line(tmp_path):
    result = cli(
        "info", "--config", "/dev/null", *tiny_model(n_kv_heads=None), *MLA, "model.qk_rope_head_dim=7", check=False
    )
    assert result.returncode == 2
    assert_one_line(result.stderr, "model.qk_rope_head_dim=7 must be even")
