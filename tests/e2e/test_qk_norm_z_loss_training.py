"""QK-norm and z-loss trained: tensor parallelism 2 and sequence parallelism 2 equal one rank (losses, z-losses,
gradient norms), the z-loss is logged as its own metric, and the checkpoint exports to transformers as
Qwen3ForCausalLM with the same logits and imports back unchanged. Real `megatransformer train` runs."""

from __future__ import annotations

import math

import pytest
import torch
from support.runs import cli, losses, metrics, tiny_run, train

transformers = pytest.importorskip("transformers")

Z_LOSS = 0.01
OPTIONS = ["model.qk_norm=true", f"train.z_loss={Z_LOSS}", "train.grad_accum=1", "parallel.zero_stage=1"]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """The same tiny QK-norm decoder with a z-loss, four steps on one rank, tensor_parallel=2 and
    sequence_parallel=2 (two ranks each, one global batch of 4 rows)."""
    root = tmp_path_factory.mktemp("qk_norm_z_loss")
    done = {"tp1": root / "tp1", "tp2": root / "tp2", "sp2": root / "sp2"}
    stdout = {"tp1": train(tiny_run(tiny_data, done["tp1"], steps=4) + OPTIONS).stdout}
    for name, option in (("tp2", "parallel.tensor_parallel=2"), ("sp2", "parallel.sequence_parallel=2")):
        train(tiny_run(tiny_data, done[name], steps=4) + OPTIONS + [option], nproc=2)
    return done, stdout


def z_losses(run_dir) -> list[float]:
    return [r["z_loss"] for r in metrics(run_dir) if r["kind"] == "train"]


def grad_norms(run_dir) -> list[float]:
    return [r["grad_norm"] for r in metrics(run_dir) if r["kind"] == "train"]


def test_the_z_loss_is_logged_beside_the_cross_entropy(runs):
    done, stdout = runs
    z = z_losses(done["tp1"])
    assert len(z) == 4 and all(value > 0 for value in z)
    # at initialisation the logits are near 0, so log Z is about log(vocabulary) for every token
    assert z[0] == pytest.approx(Z_LOSS * math.log(512) ** 2, rel=0.02)
    assert losses(done["tp1"])[0] == pytest.approx(math.log(512), rel=0.02)  # the cross-entropy alone
    assert "z-loss " in next(line for line in stdout["tp1"].splitlines() if line.startswith("step 4/4"))
    assert "val_loss" in metrics(done["tp1"])[-1] and "z_loss" not in metrics(done["tp1"])[-1]


@pytest.mark.parametrize("layout", ["tp2", "sp2"])
def test_two_ranks_train_like_one_rank(runs, layout):
    done, _ = runs
    assert losses(done[layout]) == pytest.approx(losses(done["tp1"]), abs=1e-5, rel=0)
    assert z_losses(done[layout]) == pytest.approx(z_losses(done["tp1"]), rel=1e-5)
    assert grad_norms(done[layout]) == pytest.approx(grad_norms(done["tp1"]), rel=1e-4)


def test_the_checkpoint_exports_as_qwen3_and_imports_back(runs, tmp_path):
    from megatransformer.inference import load_for_inference

    done, _ = runs
    result = cli("export", "--checkpoint", done["tp2"], "--format", "hf", "--out", tmp_path / "hf")
    assert "Qwen3ForCausalLM" in result.stdout + result.stderr
    ours = load_for_inference(done["tp2"]).model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 512, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)).abs().max().item() < 1e-4
    cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "back")
    again = load_for_inference(tmp_path / "back").model.state_dict()
    original = ours.state_dict()
    assert original.keys() == again.keys() and any("q_norm" in name for name in again)
    assert all(torch.equal(original[name], again[name]) for name in original)
