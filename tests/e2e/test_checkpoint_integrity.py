"""Checkpoints you can trust: a damaged checkpoint is never resumed, a pickle in one never runs.

One tiny run (one process, ZeRO-3, 4 steps, a checkpoint every 2) is trained once for the module; each case
copies its run directory, damages the copy and checks what resuming does. Most cases check the resolution
(``resolve_resume``, what the trainer calls before any engine load) directly; a few run the real
``megatransformer train`` end to end.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from pathlib import Path

import pytest
import torch
from support.runs import (
    ONE_THREAD,
    cli,
    losses_by_step,
    spawn_ranks,
    tiny_data_overrides,
    tiny_model,
    train,
    wait_ranks,
)

from megatransformer import checkpoint as ckpt
from megatransformer.config import ConfigError, validate
from megatransformer.training.checkpointing import checkpointer
from megatransformer.training.checkpointing.resume import plan_resume, refusal, resolve_resume, skippable

OLD, NEW = "step_000002", "step_000004"
# The files of a checkpoint of one rank: every kind there is.
SHARD, RANK_STATE = "shard_00000.safetensors", "rank_00000.pt"
FILES = (SHARD, RANK_STATE, "index.json", "trainer.json", "config.yaml", "tokenizer.json")


def overrides(tiny_data, run_dir: Path, *extra: str) -> list[str]:
    return [
        *tiny_model(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32),
        f"run_dir={run_dir}",
        *tiny_data_overrides(tiny_data),
        "data.seq_len=32",
        "train.micro_batch_size=2",
        "train.max_steps=4",
        "train.log_every=1",
        "train.eval_batches=1",
        "optim.lr=1e-2",
        "schedule.warmup_steps=1",
        "checkpoint.every=2",
        "parallel.zero_stage=3",
        "wandb.mode=disabled",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> Path:
    """A finished run directory with two checkpoints, step_000002 and step_000004 (`latest`)."""
    run = tmp_path_factory.mktemp("integrity") / "run"
    result = train(overrides(tiny_data, run), expect=None, env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [OLD, NEW]
    assert sorted(ckpt.read_manifest(run / "checkpoints" / NEW)) == sorted(FILES)
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run directory, to damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def resume_cfg(run: Path, resume: str):
    return validate({"run_dir": str(run), "resume": resume})


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def flip(file: Path) -> None:
    """64 bytes XORed in the middle: the file keeps its size (and may well still load)."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0x5A for b in data[middle : middle + 64])
    file.write_bytes(bytes(data))


DAMAGE = {"truncated": truncate, "deleted": Path.unlink, "flipped": flip}


# ------------------------------------------------------------------ damaged files: fallback or exit 2


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_a_damaged_file_falls_back_or_is_named(run, capsys, name, damage):
    newest = run / "checkpoints" / NEW
    DAMAGE[damage](newest / name)
    if ckpt.is_rank_part(name) and damage == "flipped":
        # (its contents are the reading ranks' to verify, as they load it: test_resume_auto_skips_damaged_newest_...)
        assert resolve_resume(resume_cfg(run, "auto")) == newest
        with pytest.raises(ckpt.CheckpointDamaged, match=f"{NEW}: {name.replace('.', '[.]')}: changed since the save"):
            ckpt.verify_files(newest, [name])
        return

    assert resolve_resume(resume_cfg(run, "auto")) == run / "checkpoints" / OLD
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"{NEW}: {name}: " in warnings[0], warnings
    assert "skipped, resuming from step_000002" in warnings[0]

    with pytest.raises(ConfigError, match=f"{NEW}: {name.replace('.', '[.]')}: ") as err:
        resolve_resume(resume_cfg(run, str(run / "checkpoints" / NEW)))
    assert "\n" not in str(err.value)


def test_a_damaged_manifest_or_an_unlisted_file_falls_back(run, capsys):
    newest = run / "checkpoints" / NEW
    (newest / "shard_00001.safetensors").write_bytes(b"not from this save")
    assert resolve_resume(resume_cfg(run, "auto")) == run / "checkpoints" / OLD
    assert "shard_00001.safetensors: a file the manifest does not list" in capsys.readouterr().err

    (newest / ckpt.COMPLETE).write_bytes(b'{"format": 1, "files": {"config.yaml": {"si')  # cut short
    assert resolve_resume(resume_cfg(run, "auto")) == run / "checkpoints" / OLD
    assert f"{NEW}: COMPLETE: not a readable manifest" in capsys.readouterr().err


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(run):
    for step in (OLD, NEW):
        truncate(run / "checkpoints" / step / SHARD)
    with pytest.raises(ConfigError, match="every complete checkpoint .* is damaged"):
        resolve_resume(resume_cfg(run, "auto"))


@pytest.mark.parametrize("pointer", [b"\xff\xfe\x00garbage", b"step_000099", b"../../etc", b"", b"step_000004\x00"])
def test_a_bad_latest_pointer_is_ignored_for_a_scan(run, capsys, pointer):
    (run / "checkpoints" / "latest").write_bytes(pointer)
    assert resolve_resume(resume_cfg(run, "auto")) == run / "checkpoints" / NEW
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and f"warning: {run / 'checkpoints' / 'latest'} " in warnings[0], warnings
    assert "ignored; taking the newest complete checkpoint" in warnings[0]
    flip(run / "checkpoints" / NEW / "trainer.json")  # and the scan falls back past damage too
    assert resolve_resume(resume_cfg(run, "auto")) == run / "checkpoints" / OLD
    # (unverified, what refuses a fresh start over an existing run)
    assert ckpt.latest_checkpoint(run / "checkpoints") == run / "checkpoints" / NEW


def as_before_manifests(checkpoint: Path) -> None:
    """``checkpoint`` as the versions before manifests wrote it (as far as a resolution reads it): an empty
    COMPLETE, none of the sharded state's files, and a trainer.json of their fields only."""
    (checkpoint / ckpt.COMPLETE).write_bytes(b"")
    unshard(checkpoint)
    state = json.loads((checkpoint / ckpt.TRAINER_STATE).read_text())
    earlier = ("step", "tokens", "bad_steps", "tokenizer_sha256", "world_size", "tensor_parallel", "zero_stage")
    (checkpoint / ckpt.TRAINER_STATE).write_text(json.dumps({key: state[key] for key in earlier}))


def unshard(checkpoint: Path) -> None:
    for file in (checkpoint / "index.json", checkpoint / SHARD):
        file.unlink()


def test_a_checkpoint_without_manifest_is_accepted_with_a_warning(run, capsys):
    as_before_manifests(run / "checkpoints" / NEW)
    assert resolve_resume(resume_cfg(run, "auto")) == run / "checkpoints" / NEW
    assert "has no manifest" in capsys.readouterr().err


@pytest.mark.parametrize(
    "damage,why",
    [
        (lambda path: None, "it holds index.json"),
        (lambda path: (path / "index.json").unlink(), f"it holds {SHARD}"),
        (unshard, "its trainer.json has fields of later versions"),
        (
            lambda path: (unshard(path), (path / ckpt.TRAINER_STATE).write_text("{")),
            "its trainer.json is unreadable",
        ),
    ],
    ids=["emptied", "emptied-and-index-deleted", "emptied-and-shards-deleted", "emptied-and-trainer-state-damaged"],
)
def test_an_emptied_manifest_of_a_new_checkpoint_is_damage(run, capsys, damage, why):
    """Only a checkpoint that holds what the versions before manifests wrote, and nothing they never wrote,
    is read unverified: deleting the files a manifest-writing version adds does not make it one."""
    newest = run / "checkpoints" / NEW
    (newest / ckpt.COMPLETE).write_bytes(b"")
    damage(newest)
    assert resolve_resume(resume_cfg(run, "auto")) == run / "checkpoints" / OLD
    said = capsys.readouterr().err
    assert f"{NEW}: COMPLETE: empty, but {why}" in said and "written by a version that writes a manifest" in said


def test_weights_readers_verify_what_they_read(run):
    """init_from, eval, generate and export read the shards, the index, config.yaml and tokenizer.json: damage
    there is an error naming the file; damage in the per-rank loader states does not concern them."""
    newest = run / "checkpoints" / NEW
    truncate(newest / RANK_STATE)
    cfg, weights = ckpt.load_weights(run / "checkpoints")
    assert cfg.model.d_model == 32 and "embed_tokens.weight" in weights and "lm_head.weight" in weights
    flip(newest / SHARD)
    with pytest.raises(ckpt.CheckpointDamaged, match=f"{SHARD}: changed since the save"):
        ckpt.load_weights(newest)
    result = cli("export", "--checkpoint", run, "--out", run / "exported", check=False, env=ONE_THREAD)
    assert result.returncode == 2, result.stderr
    assert SHARD in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_export_carries_a_manifest(trained, tmp_path):
    out = tmp_path / "exported"
    result = cli("export", "--checkpoint", trained, "--out", out, check=False, env=ONE_THREAD)
    assert result.returncode == 0, result.stderr
    assert sorted(ckpt.read_manifest(out)) == ["config.yaml", "model.safetensors", "tokenizer.json"]
    ckpt.verify_checkpoint(out)


# ------------------------------------------------------------------------------------- end to end


def test_resume_auto_skips_damaged_newest_and_continues_exactly(tiny_data, trained, run):
    """Bytes flipped in the shard (what would otherwise resume silently wrong) and a torn last metrics line:
    one warning for each, a resume from step 2, and steps 3-4 as the uninterrupted run had them."""
    flip(run / "checkpoints" / NEW / SHARD)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 6.2')  # a write cut short
    result = train(overrides(tiny_data, run, "resume=auto"), expect=None, env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-4000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, warnings
    assert f"{SHARD}: changed since the save" in warnings[0]
    assert "metrics.jsonl: the last line" in warnings[1]
    assert f"resumed from {run / 'checkpoints' / OLD} at step 2" in result.stdout
    assert losses_by_step(run) == losses_by_step(trained)


def test_every_checkpoint_damaged_where_only_the_ranks_look_is_an_error(tiny_data, run):
    """Bytes flipped in the shard of both checkpoints: each passes the resolution (sizes, manifest) and is refused
    by the rank that reads it, as it loads; resume=auto tries the older one, then fails in one line."""
    for step in (OLD, NEW):
        flip(run / "checkpoints" / step / SHARD)
    before = (run / "metrics.jsonl").read_bytes()
    result = train(overrides(tiny_data, run, "resume=auto"), expect=None, env=ONE_THREAD)
    assert result.returncode == 2, result.stderr[-4000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("megatransformer train: error:")]
    assert len(errors) == 1 and "every complete checkpoint" in errors[0], result.stderr[-2000:]
    assert f"{NEW}: {SHARD}: changed since the save" in errors[0]
    assert (run / "metrics.jsonl").read_bytes() == before  # (no step was trained)


def test_nothing_left_to_train_is_summed_up_from_the_checkpoint_resumed(tiny_data, run):
    """The newest checkpoint's trainer.json damaged, the run already at train.max_steps once resumed from the older
    one: the summary counts that one's steps and names it in the commands it suggests (the damaged one is still
    `latest`), and the suggested eval runs."""
    (run / "checkpoints" / NEW / "trainer.json").write_text('{"step": 4, "tok')
    result = train(overrides(tiny_data, run, "resume=auto", "train.max_steps=2"), expect=None, env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "nothing to do: the run is at step 2 of train.max_steps=2" in result.stdout
    summary = result.stdout[result.stdout.index("done: ") :]
    assert summary.startswith("done: 2 of 2 steps"), summary
    assert f"checkpoint:            {run / 'checkpoints' / OLD}\n" in summary
    eval_line = next(line.strip() for line in summary.splitlines() if "megatransformer eval" in line)
    assert eval_line.startswith(f"megatransformer eval --checkpoint {run / 'checkpoints' / OLD} --data ")
    assert "final train loss" in summary and f"{losses_by_step(run)[2]:.4f}" in summary
    evaluated = cli(*eval_line.split()[1:], env=ONE_THREAD)
    assert "loss" in evaluated.stdout


def test_resume_path_of_a_damaged_checkpoint_exits_2_naming_the_file(tiny_data, run):
    truncate(run / "checkpoints" / NEW / SHARD)
    result = train(overrides(tiny_data, run, f"resume={run / 'checkpoints' / NEW}"), expect=None, env=ONE_THREAD)
    assert result.returncode == 2, result.stderr[-4000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("megatransformer train: error:")]
    assert len(errors) == 1 and SHARD in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------- no code from checkpoints


class Payload:
    """Unpickled without weights_only, this touches ``marker``: code run by loading a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def plant(file: Path, marker: Path, protocol: int = 2) -> None:
    """The payload inside a state file's dictionary, the manifest rewritten to match (integrity passes);
    first proven live on a copy. (Pickle protocol 4 hides it from the static scan of the verification.)"""
    state = torch.load(file, weights_only=False)  # (our own file, from the fixture's run)
    state["extra"] = Payload(marker)
    torch.save(state, file, pickle_protocol=protocol)
    probe = file.with_name("probe.tmp")
    shutil.copyfile(file, probe)
    torch.load(probe, weights_only=False)
    assert marker.is_file(), "the payload does not run: the test would prove nothing"
    marker.unlink()
    probe.unlink()
    ckpt.write_manifest(file.parent)


def test_a_pickle_payload_is_refused_naming_the_file(run, tmp_path):
    """Found by the static scan of the rank that reads the file, and never skipped as damage (resume=auto refuses
    too): the manifest matches, the file is planted."""
    marker = tmp_path / "payload-ran"
    plant(run / "checkpoints" / NEW / RANK_STATE, marker)
    with pytest.raises(ckpt.CheckpointUnsafe, match=f"{RANK_STATE}: holds Python objects beyond tensors") as err:
        ckpt.verify_files(run / "checkpoints" / NEW, [RANK_STATE])
    assert "\n" not in str(err.value)
    assert not skippable(resume_cfg(run, "auto"), err.value)
    assert refusal(resume_cfg(run, "auto"), err.value) is err.value
    assert not marker.exists(), "the payload ran"


def test_a_pickle_payload_in_a_rank_state_never_runs(tiny_data, run, tmp_path):
    """A planted pickle, end to end: `megatransformer train resume=auto` exits 2 with one line naming the
    file, and the payload never runs. Written with pickle protocol 4, which the verification's static scan
    cannot read: what refuses it is the weights_only load itself."""
    marker = tmp_path / "payload-ran"
    plant(run / "checkpoints" / NEW / RANK_STATE, marker, protocol=4)
    ckpt.verify_checkpoint(run / "checkpoints" / NEW)  # (passes: the scan does not see it)
    result = train(overrides(tiny_data, run, "resume=auto"), expect=None, env=ONE_THREAD)
    assert not marker.exists(), "the payload ran"
    assert result.returncode == 2, result.stderr[-4000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("megatransformer train: error:")]
    assert len(errors) == 1 and f"{RANK_STATE}: holds Python objects beyond tensors" in errors[0]
    assert "Traceback" not in result.stderr


def test_a_shard_of_another_save_is_refused(run):
    """A shard copied from the older checkpoint, with a manifest made to match: refused by its save id."""
    newest = run / "checkpoints" / NEW
    shutil.copyfile(run / "checkpoints" / OLD / SHARD, newest / SHARD)
    ckpt.write_manifest(newest)
    ckpt.verify_checkpoint(newest)  # (the files are intact)
    with pytest.raises(ckpt.CheckpointDamaged, match=f"{SHARD}: a shard of another save [(]step 2, ") as err:
        ckpt.load_weights(newest)
    assert "\n" not in str(err.value)


def test_safe_load_names_an_unreadable_file(run):
    file = run / "checkpoints" / NEW / RANK_STATE
    truncate(file)
    with pytest.raises(ckpt.CheckpointDamaged, match="rank_00000.pt: unreadable"):
        ckpt.safe_load(file, allowed=checkpointer.deepspeed_safe_globals())


# ------------------------------------------------------------------------------------------ file modes


def test_files_are_written_with_the_umask(trained, tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    for file in (trained / "checkpoints" / NEW).iterdir():
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file
    old = os.umask(0o027)
    try:
        ckpt.directory.default_file_mode.cache_clear()
        ckpt.save_safetensors({"w": torch.zeros(2)}, tmp_path / "w.safetensors")
    finally:
        os.umask(old)
        ckpt.directory.default_file_mode.cache_clear()
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == 0o640


def saved_run_config(run: Path, resume: str):
    """The run's own config (its model shape), resuming from ``resume``."""
    return ckpt.saved_config(run / "checkpoints" / NEW).model_copy(update={"run_dir": str(run), "resume": resume})


def test_a_resume_is_decided_reading_each_file_once(run, monkeypatch):
    cfg = saved_run_config(run, "auto")
    reads: list[str] = []
    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self.name) or read_text(self, *a, **k))
    plan = plan_resume(cfg, world_size=1, device_type="cpu", tokenizer_sha256=None)
    assert plan.path == run / "checkpoints" / NEW and plan.state.step == 4 and plan.elastic is None
    assert reads.count("trainer.json") == 1 and reads.count("config.yaml") == 1, reads


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("step", 3, "trainer.json: says step 3, its directory step 4"),
        ("step", -4, "trainer.json: step: Input should be greater than or equal to 0"),
        ("step", "4", "trainer.json: step: Input should be a valid integer"),
        ("zero_stage", 7, "trainer.json: zero_stage: Input should be 0, 1, 2 or 3"),
    ],
)
def test_trainer_state_values_are_checked(run, field, value, error):
    state = run / "checkpoints" / NEW / "trainer.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), field: value}))
    ckpt.write_manifest(state.parent)  # (a consistent manifest: what is refused is the value)
    cfg = saved_run_config(run, str(state.parent))
    assert resolve_resume(cfg) == state.parent  # (the files are intact)
    with pytest.raises(ConfigError, match=re.escape(error)):
        plan_resume(cfg, world_size=1, device_type="cpu", tokenizer_sha256=None)


def test_another_optimizer_than_the_checkpoints_is_refused_at_resume(run):
    cfg = saved_run_config(run, "auto")
    other = "muon" if cfg.optim.name != "muon" else "adamw"
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"name": other})})
    message = f"was trained with optim.name={saved_run_config(run, 'auto').optim.name}, this run says {other}"
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_resume(cfg, world_size=1, device_type="cpu", tokenizer_sha256=None)


def test_a_checkpoint_without_a_tokenizer_hash_is_warned_about_at_resume(run, capsys):
    state = run / "checkpoints" / NEW / "trainer.json"
    tokenizer = json.loads(state.read_text())["tokenizer_sha256"]
    assert plan_resume(saved_run_config(run, "auto"), 1, "cpu", tokenizer).path == state.parent
    assert "tokenizer hash" not in capsys.readouterr().err
    state.write_text(json.dumps({**json.loads(state.read_text()), "tokenizer_sha256": None}))
    ckpt.write_manifest(state.parent)
    assert plan_resume(saved_run_config(run, "auto"), 1, "cpu", tokenizer).path == state.parent
    (line,) = capsys.readouterr().err.splitlines()
    assert f"checkpoint {state.parent} records no tokenizer hash" in line and "cannot be checked" in line


def as_consolidated(checkpoint: Path) -> None:
    """``checkpoint`` as the format before shards held its state: the whole weights in model.safetensors, the
    whole Adam state in optimizer.safetensors (step count and schedule in its metadata), no index or shard."""
    from megatransformer.checkpoint.sharded import ShardedState

    state = ShardedState(checkpoint)
    optimizer = json.loads((checkpoint / "index.json").read_text())["optimizer"]
    ckpt.save_safetensors(dict(state.weights()), checkpoint / ckpt.WEIGHTS)
    moments = {
        f"{kind}/{name}": state.tensor(name, kind)
        for name in state.params
        for kind in state.kinds_of(name)
        if kind != "fp32"
    }
    meta = {"adam_step": str(optimizer["step"]), "lr_scheduler": json.dumps(optimizer["lr_scheduler"])}
    ckpt.save_safetensors(moments, checkpoint / ckpt.OPTIMIZER, meta)
    unshard(checkpoint)
    ckpt.write_manifest(checkpoint)


def test_a_checkpoint_of_the_format_before_shards_is_refused_then_converted_and_resumed(tiny_data, trained, run):
    old = run / "checkpoints" / OLD
    as_consolidated(old)
    (run / "checkpoints" / "latest").write_text(OLD)
    shutil.rmtree(run / "checkpoints" / NEW)
    refused = train(overrides(tiny_data, run, "resume=auto"), expect=2, env=ONE_THREAD)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("megatransformer train: error:")]
    assert len(errors) == 1 and f"megatransformer checkpoint convert {old}" in errors[0], refused.stderr[-2000:]
    assert "converted" in cli("checkpoint", "convert", old, env=ONE_THREAD).stdout
    assert sorted(ckpt.read_manifest(old)) == sorted(FILES)
    resumed = train(overrides(tiny_data, run, "resume=auto"), env=ONE_THREAD)
    assert f"resumed from {old} at step 2" in resumed.stdout
    assert losses_by_step(run) == losses_by_step(trained)


def test_two_ranks_agree_on_a_shard_of_another_save_and_fall_back_together(tiny_data, tmp_path):
    """Rank 1's shard of the newest checkpoint taken from the older one, the manifest made to match: only rank 1
    reads it, yet no rank loads the checkpoint; both fall back to the older one, the warning naming the file."""
    run = tmp_path / "run"
    train(overrides(tiny_data, run), nproc=2, env=ONE_THREAD)
    root = run / "checkpoints"
    shard = "shard_00001.safetensors"
    shutil.copyfile(root / OLD / shard, root / NEW / shard)
    ckpt.write_manifest(root / NEW)
    resumed = train(overrides(tiny_data, run, "resume=auto", "train.max_steps=3"), nproc=2, env=ONE_THREAD)
    assert f"resumed from {root / OLD} at step 2" in resumed.stdout, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    warning = [line for line in resumed.stderr.splitlines() if f"{shard}: a shard of another save" in line]
    assert len(warning) == 1 and f"skipped, resuming from {OLD}" in warning[0], resumed.stderr[-3000:]


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_init_from_stops_both_zero_3_ranks_naming_the_file(tiny_data, run, tmp_path, damage):
    """init_from on 2 ranks (ZeRO-3): a shard changed in place is hashed by one rank once the process group runs,
    and stops both ranks with the same line; one cut short is found by every rank before the group starts, and
    said once for the node (by local rank 0)."""
    DAMAGE[damage](run / "checkpoints" / NEW / SHARD)
    fine = tmp_path / "fine"
    log = tmp_path / "init_from"
    codes = wait_ranks(spawn_ranks(overrides(tiny_data, fine, f"init_from={run}/checkpoints"), log), log)
    logs = [Path(f"{log}.rank{rank}.log").read_text() for rank in range(2)]
    assert codes == [2, 2], logs
    errors = [[line for line in text.splitlines() if line.startswith("megatransformer train: error:")] for text in logs]
    reason = "changed since the save" if damage == "flipped" else "cut short or grown"
    assert len(errors[0]) == 1 and f"{NEW}: {SHARD}: {reason}" in errors[0][0], logs
    assert errors[1] == (errors[0] if damage == "flipped" else []), logs
    assert not (fine / "checkpoints").exists() and "Traceback" not in logs[0] + logs[1]


def test_a_converted_muon_checkpoint_resumes_at_zero_3(tiny_data, tmp_path):
    """Muon's matrices have a momentum and no Adam moments: the converted index says so per parameter, so a ZeRO-3
    resume copies no state into a view the optimizer does not have (and ZeRO-0 makes no Adam state for them)."""
    run = tmp_path / "run"
    muon = ["optim.name=muon", "optim.muon_lr=0.02", "train.max_steps=2", "parallel.zero_stage=0"]
    train(overrides(tiny_data, run, *muon), env=ONE_THREAD)
    step = run / "checkpoints" / OLD
    as_consolidated(step)
    cli("checkpoint", "convert", step, env=ONE_THREAD)
    kinds = json.loads((step / "index.json").read_text())["params"]
    adam = ("fp32", "exp_avg", "exp_avg_sq")
    assert {tuple(p["kinds"]) for p in kinds.values()} == {("fp32", "momentum_buffer"), adam}
    zero_3 = ["resume=auto", "train.max_steps=3", "parallel.zero_stage=3"]
    resumed = train(overrides(tiny_data, run, *muon, *zero_3), env=ONE_THREAD)
    assert "resuming step 2 written by 1 rank" in resumed.stdout and "Traceback" not in resumed.stderr
