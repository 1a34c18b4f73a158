"""Every file a resume reads is verified: the loss-spike record of trainer.json is typed and strict; the rollback
log RUN_DIR/spikes.json is read by schema and applied only to the checkpoint it was written for (never one of
another run), a damaged one ignored in one line. A failed metrics write is one line (a full disk while
checkpointing or sharding: tests/e2e/test_full_disk.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.runs import trainer_state_record

from data_pipeline import WriteFailed
from megatransformer import checkpoint as ckpt
from megatransformer.training.observability.metrics import append_record
from megatransformer.training.observability.spikes import LOG, resume_state, write_log

BEFORE = {"losses": [3.0, 3.1], "recent": [5], "rollbacks": 0, "skip_rows": []}
AFTER = {"losses": [3.0], "recent": [], "rollbacks": 1, "skip_rows": [[8, 96]]}


def trainer_state(**changes) -> dict:
    return trainer_state_record(spikes=BEFORE) | changes


def checkpoint_of(run_dir, step: int, manifest: bytes = b'{"format": 1}') -> ckpt.TrainerState:
    path = run_dir / "checkpoints" / ckpt.step_name(step)
    path.mkdir(parents=True)
    (path / ckpt.COMPLETE).write_bytes(manifest)
    return path


@pytest.mark.parametrize(
    "spikes,where",
    [
        ({**BEFORE, "losses": ["3.0"]}, "spikes.losses.0"),  # a string loss
        ({**BEFORE, "losses": [True]}, "spikes.losses.0"),
        ({**BEFORE, "rollbacks": "1"}, "spikes.rollbacks"),
        ({**AFTER, "skip_rows": [[8]]}, "spikes.skip_rows.0"),
        ({**AFTER, "skip_rows": [[96, 8]]}, "start >= stop"),
        ({**AFTER, "skip_rows": []}, "1 rollbacks but 0 skipped row ranges"),  # plausible, but not this state
        ({**BEFORE, "recent": [41]}, "spikes.recent names steps after step 40"),
        ({**BEFORE, "threshold": 3.0}, "spikes.threshold"),  # a field no version writes
    ],
)
def test_a_malformed_spike_record_in_trainer_json_is_damage_named_in_one_line(tmp_path, spikes, where):
    path = tmp_path / ckpt.step_name(40)
    path.mkdir()
    (path / ckpt.TRAINER_STATE).write_text(json.dumps(trainer_state(spikes=spikes)))
    with pytest.raises(ckpt.CheckpointDamaged, match=r"trainer\.json") as err:
        ckpt.read_trainer_state(path)
    assert where in str(err.value) and "\n" not in str(err.value)


def test_the_spike_record_round_trips_and_records_of_earlier_versions_still_read(tmp_path):
    path = tmp_path / ckpt.step_name(40)
    path.mkdir()
    state = ckpt.TrainerState.model_validate(trainer_state(spikes={**AFTER, "grad_norms": [1.5]}))
    ckpt.write_trainer_state(path, state)
    assert ckpt.read_trainer_state(path) == state
    (path / ckpt.TRAINER_STATE).write_text(json.dumps(trainer_state(spikes={})))  # before the ladder kept state
    assert ckpt.read_trainer_state(path).spikes.ladder_state() == {
        "losses": [],
        "recent": [],
        "rollbacks": 0,
        "skip_rows": [],
    }


def test_the_rollback_log_applies_to_the_checkpoint_it_was_written_for(tmp_path, capsys):
    target = checkpoint_of(tmp_path, 20)
    saved = ckpt.SpikeState.model_validate(BEFORE)
    assert resume_state(target, saved, tmp_path) == BEFORE  # no log
    write_log(tmp_path, AFTER, target)
    assert resume_state(target, saved, tmp_path) == AFTER
    newer = checkpoint_of(tmp_path, 30)  # saved after the rollback: its own state holds it
    assert resume_state(newer, ckpt.SpikeState.model_validate(AFTER), tmp_path) == AFTER
    assert capsys.readouterr().err == ""


def test_a_rollback_log_of_another_run_is_never_applied(tmp_path, capsys):
    """A reused run_dir: the log names a checkpoint of the same name, written by another run (another manifest)."""
    other = checkpoint_of(tmp_path / "other", 20, b'{"format": 1, "files": {"a": 1}}')
    write_log(tmp_path, AFTER, other)
    mine = checkpoint_of(tmp_path, 20)
    assert resume_state(mine, ckpt.SpikeState.model_validate(BEFORE), tmp_path) == BEFORE
    (line,) = capsys.readouterr().err.splitlines()
    assert f"{tmp_path / LOG} records a rollback to step_000020, not to this run's step_000020" in line
    assert "ignored" in line


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "\x00\x01",
        json.dumps({"rollbacks": 1, "skip_rows": [[8, 96]]}),  # the format of earlier versions: unbound
        json.dumps({"checkpoint": "step_000020", "manifest_sha256": "x", "state": {**AFTER, "rollbacks": "1"}}),
    ],
)
def test_a_damaged_rollback_log_is_ignored_in_one_line(tmp_path, capsys, text):
    target = checkpoint_of(tmp_path, 20)
    (tmp_path / LOG).write_text(text)
    assert resume_state(target, ckpt.SpikeState.model_validate(BEFORE), tmp_path) == BEFORE
    (line,) = capsys.readouterr().err.splitlines()
    assert f"{tmp_path / LOG} is damaged" in line and "resuming with the loss-spike state of step_000020" in line


def test_a_failed_metrics_write_is_one_line_naming_the_file_and_the_free_space():
    full = Path("/dev/full")  # every write to it fails with ENOSPC, as on a full disk
    with pytest.raises(WriteFailed) as err:
        append_record(full, {"step": 1, "loss": 3.0})
    (line,) = str(err.value).splitlines()
    assert line.startswith("writing /dev/full failed: No space left on device (") and "MiB free on /dev" in line
    assert "the checkpoints are intact (resume=auto)" in line
