"""Weights files in save_pretrained's layout (checkpoint/weights_files.py) and the commands that write or read them
a tensor at a time: a weights checkpoint in shards, `export --format safetensors`, `import`, `average`, and the
model eval and generate load."""

from __future__ import annotations

import json
import re

import pytest
import torch
from support.memory import peak_host_bytes
from support.models import ReadOnLookup, llama_style, run_config

from megatransformer import checkpoint as ckpt
from megatransformer.checkpoint import WEIGHTS, WEIGHTS_INDEX, WeightsFiles, write_weights_files
from megatransformer.checkpoint.weights_files import weights_file_names
from megatransformer.commands.average import average_checkpoints
from megatransformer.config import ConfigError
from megatransformer.hf import load_hf_dir, save_hf_dir
from megatransformer.model import build_model


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    embedding = torch.randn(40, 6)
    return {
        "embedding": embedding,
        "head": embedding,  # (tied: one storage)
        "rows": torch.randn(12, 8),
        "view": torch.randn(10, 8)[2:6],
        "cube": torch.randn(4, 6, 2).bfloat16(),
        "big": torch.randn(64, 8),
        "scalar": torch.tensor(3.0),
    }


def test_weights_larger_than_a_file_are_written_in_files_of_at_most_its_bytes_and_an_index(tmp_path):
    state = tensors()
    write_weights_files(tmp_path, state.items(), shard_bytes=1024)
    index = json.loads((tmp_path / WEIGHTS_INDEX).read_text())
    files = weights_file_names(tmp_path)
    assert len(files) >= 4 and sorted(p.name for p in tmp_path.glob("*.safetensors")) == files
    assert not (tmp_path / WEIGHTS).exists()
    read = WeightsFiles(tmp_path, files)
    assert sorted(read) == sorted(state)
    for file in files:
        held = [name for name, where in index["weight_map"].items() if where == file]
        assert sum(state[name].nbytes for name in held) <= 1024 or held == ["big"], (file, held)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    for name, tensor in state.items():
        assert torch.equal(read[name], tensor) and read[name].dtype == tensor.dtype, name
        assert read.meta(name).shape == tensor.shape and read.meta(name).dtype == tensor.dtype
        assert read.meta(name).is_meta


def test_weights_that_fit_a_file_are_one_model_safetensors(tmp_path):
    state = tensors()
    write_weights_files(tmp_path, iter(state.items()))
    assert sorted(p.name for p in tmp_path.iterdir()) == [WEIGHTS] and weights_file_names(tmp_path) == [WEIGHTS]
    read = WeightsFiles(tmp_path, [WEIGHTS])
    assert {name: read[name] for name in read}.keys() == state.keys()
    assert torch.equal(read["head"], state["embedding"])


@pytest.mark.parametrize("shard_bytes", [1024, 10**9])
def test_a_slice_reads_the_same_elements_from_one_file_or_from_shards(tmp_path, shard_bytes):
    state = tensors()
    write_weights_files(tmp_path, state.items(), shard_bytes)
    read = WeightsFiles(tmp_path, weights_file_names(tmp_path))
    rows = state["rows"]
    for dim, parts in ((None, 1), (0, 3), (1, 2), (1, 4)):
        for index in range(parts):
            part = rows if dim is None else rows.chunk(parts, dim)[index]
            for start, stop in ((0, part.numel()), (3, 17), (5, 6)):
                got = read.flat("rows", start, stop, dim, index, parts)
                assert torch.equal(got, part.reshape(-1)[start:stop]), (dim, parts, index, start, stop)
    assert torch.equal(read.flat("scalar", 0, 1), state["scalar"].reshape(1))


def test_a_name_in_two_files_or_an_unreadable_file_or_index_is_refused_by_name(tmp_path):
    ckpt.save_safetensors({"a": torch.zeros(2)}, tmp_path / "one.safetensors")
    ckpt.save_safetensors({"a": torch.ones(2)}, tmp_path / "two.safetensors")
    with pytest.raises(ValueError, match="a is in both one.safetensors and two.safetensors"):
        WeightsFiles(tmp_path, ["one.safetensors", "two.safetensors"])
    (tmp_path / "torn.safetensors").write_bytes((tmp_path / "one.safetensors").read_bytes()[:-3])
    with pytest.raises(ValueError, match="torn.safetensors is not a readable safetensors file"):
        WeightsFiles(tmp_path, ["torn.safetensors"])
    (tmp_path / WEIGHTS_INDEX).write_text(json.dumps({"weight_map": {"a": "../one.safetensors"}}))
    with pytest.raises(ValueError, match=r"names '../one.safetensors', not a file beside it"):
        weights_file_names(tmp_path)
    (tmp_path / WEIGHTS_INDEX).write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not an index of safetensors files"):
        weights_file_names(tmp_path)


# ------------------------------------------------------------------------------------ weights checkpoints

CFG = llama_style(n_layers=12, d_model=128, d_ff=256, vocab_size=64, tie_embeddings=False)


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return build_model(CFG).state_dict()


def whole(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in state.values())


def test_a_weights_checkpoint_in_shards_loads_like_one_file_and_its_shards_are_verified(tmp_path, state):
    cfg = run_config(model=CFG.model_dump())
    path = ckpt.write_weights_checkpoint(tmp_path / "w", cfg, state, shard_bytes=whole(state) // 6)
    assert len(weights_file_names(path)) >= 6 and json.loads((path / ckpt.COMPLETE).read_text())
    _, read = ckpt.load_weights(path)
    _, lazy = ckpt.load_weights(path, lazy=True)
    for name, tensor in state.items():
        assert torch.equal(read[name], tensor) and torch.equal(lazy[name], tensor), name
        assert torch.equal(lazy.flat(name, 0, 7, dim=0, index=1, parts=2), tensor.chunk(2)[1].reshape(-1)[:7])
    shard = path / weights_file_names(path)[2]
    shard.write_bytes(shard.read_bytes()[:-8] + bytes(8))
    with pytest.raises(ckpt.CheckpointDamaged, match=f"{shard.name}: changed since the save"):
        ckpt.load_weights(path, lazy=True)
    shard.unlink()
    with pytest.raises(ckpt.CheckpointDamaged, match=f"{shard.name}: missing"):
        ckpt.load_weights(path)


def test_a_weights_checkpoint_is_written_a_tensor_at_a_time_holding_a_file_never_the_model(tmp_path, state):
    """As `export --format safetensors` writes one from weights read on lookup: torch's host allocator holds a
    tensor and a file's tensors at most, never the model (1.0), and converts each to the dtype asked for."""
    cfg = run_config(model=CFG.model_dump())
    out = tmp_path / "w"
    lazy = ReadOnLookup(state)
    peak = peak_host_bytes(  # (torch's alone: the manifest hashes 16 MiB pieces, more than this model)
        lambda: ckpt.write_weights_checkpoint(out, cfg, lazy, None, torch.bfloat16, whole(state) // 12), python=False
    )
    assert peak < 0.3 * whole(state), (peak, whole(state))
    _, read = ckpt.load_weights(out)
    assert all(torch.equal(read[name], tensor.bfloat16()) for name, tensor in state.items())


def test_eval_and_generate_make_the_model_and_read_the_checkpoint_into_it_a_tensor_at_a_time(
    tmp_path, state, monkeypatch
):
    """load_for_inference (eval, generate) holds the model and one tensor of the checkpoint at a time, not the
    model twice (it read the weights whole, then loaded them: 2.0), and the model is the checkpoint's. (The
    checkpoint's reads are ReadOnLookup's: torch's profiler counts each file safetensors maps as allocated.)"""
    from megatransformer.inference import load_for_inference

    cfg = run_config(model=CFG.model_dump())
    path = ckpt.write_weights_checkpoint(tmp_path / "w", cfg, state)
    read = ReadOnLookup(state)
    monkeypatch.setattr(ckpt, "load_weights", lambda _, lazy=False: (cfg, read if lazy else dict(read.items())))
    loaded: list = []
    peak = peak_host_bytes(lambda: loaded.append(load_for_inference(path).model), python=False)
    assert peak < 1.25 * whole(state), (peak, whole(state))
    assert all(torch.equal(loaded[0].state_dict()[name], tensor) for name, tensor in state.items())


def test_a_failed_write_leaves_neither_the_checkpoint_nor_its_temporary_directory(tmp_path, state):
    def failing():
        yield "a", torch.zeros(2)
        raise ValueError("the conversion refused")

    with pytest.raises(ValueError, match="refused"):
        ckpt.write_weights_checkpoint(tmp_path / "w", run_config(model=CFG.model_dump()), failing())
    assert list(tmp_path.iterdir()) == []


def test_import_reads_a_layer_at_a_time_from_a_sharded_directory(tmp_path, state, monkeypatch):
    """The tensors a sharded transformers directory holds are read as the conversion reaches their layer, each
    once, and the checkpoint written from them is the model's; a consolidated file of another format beside the
    index's files is not read (Mistral's repositories hold one)."""
    save_hf_dir(tmp_path / "hf", CFG, state, shard_bytes=whole(state) // 6)
    consolidated = {"layers.0.attention.wq.weight": torch.zeros(2)}
    ckpt.save_safetensors(consolidated, tmp_path / "hf" / "consolidated.safetensors")
    reads: list[str] = []
    read = WeightsFiles.__getitem__
    monkeypatch.setattr(WeightsFiles, "__getitem__", lambda self, name: reads.append(name) or read(self, name))
    cfg, weights = load_hf_dir(tmp_path / "hf")
    assert reads == []  # (the config, the names and the shapes are checked from the files' headers)
    written: list[str] = []
    for name, tensor in weights:
        written.append(name)
        assert torch.equal(tensor, state[name]), name
        ahead = [read for read in reads if layer_of(read) > layer_of(name)]
        assert not ahead, (name, ahead)
    assert sorted(written) == sorted(state) and sorted(reads) == sorted(set(reads))


def layer_of(name: str) -> int:
    found = re.search(r"\.layers\.(\d+)\.", name)
    return -1 if found is None else int(found.group(1))


def test_average_takes_each_tensors_mean_holding_one_tensor_of_each_not_the_models(tmp_path, state):
    cfg = run_config(model=CFG.model_dump())
    paths = []
    for k in range(3):
        scaled = {name: tensor * (k + 1) for name, tensor in state.items()}
        # (in files of a twelfth: safetensors maps a file whole, and torch counts a mapping as allocated)
        paths.append(ckpt.write_weights_checkpoint(tmp_path / f"c{k}", cfg, scaled, shard_bytes=whole(state) // 12))
    _, means, _ = average_checkpoints(paths)
    out = tmp_path / "mean"
    peak = peak_host_bytes(
        lambda: ckpt.write_weights_checkpoint(out, cfg, means, shard_bytes=whole(state) // 12), python=False
    )
    _, read = ckpt.load_weights(out)
    for name, tensor in state.items():
        assert torch.allclose(read[name], tensor * 2, rtol=1e-6, atol=0), name
    assert peak < 0.5 * whole(state), (peak, whole(state))


@pytest.mark.parametrize("command", ["export safetensors", "export hf", "average", "import"])
def test_an_out_directory_holding_other_files_is_refused_and_kept_one_written_before_is_replaced(
    tmp_path, capsys, command
):
    """Each command writes its directory beside --out and renames it over, so --out may hold only what such a
    command wrote there before: a run directory or a parent given by mistake is refused in one line, untouched."""
    from support import assert_one_line

    from megatransformer.cli import main

    cfg = run_config(model=llama_style().model_dump())
    source = ckpt.write_weights_checkpoint(tmp_path / "source", cfg, build_model(cfg.model).state_dict())
    save_hf_dir(tmp_path / "hf", cfg.model, build_model(cfg.model).state_dict())
    out = tmp_path / "out"
    argv = {
        "export safetensors": ["export", "--checkpoint", str(source), "--out", str(out)],
        "export hf": ["export", "--checkpoint", str(source), "--out", str(out), "--format", "hf"],
        "average": ["average", "--checkpoints", str(source), str(source), "--out", str(out)],
        "import": ["import", "--hf", str(tmp_path / "hf"), "--out", str(out)],
    }[command]
    assert main(argv) == 0 and main(argv) == 0  # (the second replaces the first's files)
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(argv) == 2
    assert_one_line(capsys.readouterr().err, f"{out} holds notes.txt, which this command does not write")
    assert (out / "notes.txt").read_text() == "mine" and not out.with_name("out.tmp").exists()


def test_a_transformers_directory_given_as_a_checkpoint_names_the_import_that_converts_it(tmp_path):
    cfg = run_config(model=llama_style().model_dump())
    save_hf_dir(tmp_path / "hf", cfg.model, build_model(cfg.model).state_dict())
    with pytest.raises(ConfigError) as err:
        ckpt.load_weights(tmp_path / "hf", what=f"init_from={tmp_path / 'hf'}")
    message = str(err.value)
    assert "is a Hugging Face model directory" in message and f"import --hf {tmp_path / 'hf'}" in message
