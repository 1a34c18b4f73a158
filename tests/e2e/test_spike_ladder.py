"""Loss spikes end to end: a tiny model trained on data with a poisoned region (documents of random CJK
characters, which the tokenizer's corpus never holds) spikes there; the default ladder skips, rolls back
and steps over the region, and ends where the same run on clean data ends; without it the spike shows.
Real `megatransformer train` processes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from support.runs import metrics, tiny_model, train, train_command

MICRO = 4
# streams=1, shuffle_buffer=1: rows follow the documents' order, so the poison is one contiguous row range
RUN = [
    *tiny_model(),
    "data.seq_len=64",
    f"train.micro_batch_size={MICRO}",
    "train.grad_accum=1",
    "train.log_every=1",
    "train.eval_batches=4",
    "train.max_steps=170",
    "optim.lr=3e-3",
    "schedule.warmup_steps=20",
    "checkpoint.every=25",
    "wandb.mode=disabled",
    "data.streams=1",
    "data.shuffle_buffer=1",
]


class Poisoned(NamedTuple):
    poisoned: Path  # train shards with the poisoned documents
    clean: Path  # the same documents without them
    rows: tuple[int, int]  # the global rows holding poison: [first, last + 1)


def poison_documents(n: int, chars: int) -> list[str]:
    rng = random.Random(0)
    return ["".join(chr(rng.randrange(0x4E00, 0x9FA5)) for _ in range(chars)) for _ in range(n)]


@pytest.fixture(scope="module")
def poisoned(tiny_data, tmp_path_factory) -> Poisoned:
    from data_pipeline.shard import write_shards
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.config import validate
    from megatransformer.training.data import build_run_loader

    root = tmp_path_factory.mktemp("poisoned")
    docs = tiny_data.corpus.read_text().split("\n\n")
    at = len(docs) // 6  # a third of the way into the run
    for name, kept in (("poisoned", docs[:at] + poison_documents(6, 200) + docs[at:]), ("clean", docs)):
        (root / f"{name}.txt").write_text("\n\n".join(kept))
        write_shards(
            [str(root / f"{name}.txt")],
            str(tiny_data.tokenizer),
            root / name,
            shard_mb=100,
            valid_every=0,
            workers=1,
            progress=False,
        )
    tok = load_tokenizer(tiny_data.tokenizer)
    cfg = validate(
        {
            "model": {"vocab_size": 512, "max_seq_len": 128},
            "data": {
                "train": str(root / "poisoned"),
                "tokenizer": str(tiny_data.tokenizer),
                "seq_len": 64,
                "streams": 1,
                "shuffle_buffer": 1,
            },
        }
    )
    bad = []
    for index, batch in zip(range(400), build_run_loader(cfg, "train", MICRO, 0, 1, tok)):
        for r, row in enumerate(batch["input_ids"]):
            if any("\u4e00" <= ch <= "\u9fa5" for ch in tok.decode(row.tolist())):
                bad.append(index * MICRO + r)
    assert bad and bad[-1] - bad[0] < 80, bad
    return Poisoned(root / "poisoned", root / "clean", (bad[0], bad[-1] + 1))


def overrides(tiny_data, train_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"data.train={train_dir}",
        f"data.valid={tiny_data.shards}",
        f"data.tokenizer={tiny_data.tokenizer}",
        *RUN,
        f"run_dir={run_dir}",
        *extra,
    ]


def final_val_loss(run_dir: Path) -> float:
    return [r for r in metrics(run_dir) if "val_loss" in r][-1]["val_loss"]


@pytest.fixture(scope="module")
def guarded(tiny_data, poisoned, tmp_path_factory) -> tuple[Path, str]:
    """A run on the poisoned data with the default ladder: its directory and its console output."""
    run = tmp_path_factory.mktemp("guarded") / "run"
    return run, train(overrides(tiny_data, poisoned.poisoned, run)).stdout


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics(run_dir) if "loss" in r]


def test_the_default_ladder_rolls_back_over_the_poison_and_ends_like_the_clean_run(
    tiny_data, poisoned, guarded, tmp_path
):
    clean = tmp_path / "clean"
    train(overrides(tiny_data, poisoned.clean, clean))
    guarded, said = guarded
    events = [r for r in metrics(guarded) if "event" in r]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert len(rollbacks) == 1, events
    start, stop = rollbacks[0]["skipped_rows"]
    assert start <= poisoned.rows[0] and poisoned.rows[1] <= stop, (rollbacks, poisoned.rows)
    assert start == int(rollbacks[0]["checkpoint"].split("_")[1]) * MICRO  # from the checkpoint it went back to
    assert sum(e["event"] == "skip" for e in events) == 2  # the two spikes before the third rolled back
    assert "rolled back to step_" in said and "1 rollbacks" in said
    latest = guarded / "checkpoints" / (guarded / "checkpoints" / "latest").read_text()
    state = json.loads((latest / "trainer.json").read_text())
    assert state["spikes"]["rollbacks"] == 1 and state["spikes"]["skip_rows"] == [[start, stop]]
    assert [step for step, _ in losses(guarded)] == list(range(1, 171))  # steps run again are logged once
    assert abs(final_val_loss(guarded) - final_val_loss(clean)) < 0.05 * final_val_loss(clean)


def test_without_the_ladder_the_spike_shows_in_the_curve(tiny_data, poisoned, tmp_path):
    run = tmp_path / "unguarded"
    train(overrides(tiny_data, poisoned.poisoned, run, "train.spikes.enabled=false"))
    losses = {r["step"]: r["loss"] for r in metrics(run) if "loss" in r}
    before = sorted(losses[s] for s in range(poisoned.rows[0] // MICRO - 30, poisoned.rows[0] // MICRO))
    in_poison = max(losses[s] for s in range(poisoned.rows[0] // MICRO + 1, poisoned.rows[1] // MICRO + 1))
    assert in_poison > 1.3 * before[len(before) // 2]
    assert not any("event" in r for r in metrics(run))


def test_kill_9_after_a_rollback_and_resume_give_the_same_curve(tiny_data, poisoned, guarded):
    run = guarded[0].parent / "killed"
    process = subprocess.Popen(
        train_command() + overrides(tiny_data, poisoned.poisoned, run),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    while not (run / "spikes.json").is_file():  # the rollback happened: killed before the next checkpoint
        assert process.poll() is None, "the run ended before rolling back"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    train(overrides(tiny_data, poisoned.poisoned, run, "resume=auto"))
    assert losses(run) == losses(guarded[0])
    rollbacks = [r for r in metrics(run) if r.get("event") == "rollback"]
    assert (
        len(rollbacks) == 1
        and rollbacks[0]["skipped_rows"]
        == next(r for r in metrics(guarded[0]) if r.get("event") == "rollback")["skipped_rows"]
    )
