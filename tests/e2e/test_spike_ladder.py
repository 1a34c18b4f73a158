"""Loss spikes end to end: a tiny model trained on data with a poisoned region (documents of random CJK
characters, which the tokenizer's corpus never holds) spikes there; the default ladder skips, rolls back and
steps over the region, and ends where the same run on clean data ends; without it the spike shows. The same
on two ranks (ZeRO-1, the same global batch, the gradient norm judged too); a run killed after its rollback
resumes to the same curve on one rank and on two, and from two ranks on one (elastic). A spike that cannot roll
back stops the run; checkpoint.keep spares the checkpoint a rollback needs. Random tokens mixed into the data
while the loss still falls from its start are seen too. Real `megatransformer train` processes."""

from __future__ import annotations

import bisect
import itertools
import json
import random
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from support.runs import kill_when, losses_by_step, metrics, tiny_model, train

MICRO = 4
STEPS = 170
# streams=1, shuffle_buffer=1: rows follow the documents' order, so the poison is one contiguous row range
RUN = [
    *tiny_model(),
    "data.seq_len=64",
    f"train.micro_batch_size={MICRO}",
    "train.grad_accum=1",
    "train.log_every=1",
    "train.eval_batches=4",
    f"train.max_steps={STEPS}",
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
    streams: Path  # train shards for data.streams=2 with poisoned documents in each stream's part
    rows_two_streams: tuple[int, int]  # the global rows holding poison in ``streams``, read with data.streams=2


def poison_documents(n: int, chars: int) -> list[str]:
    rng = random.Random(0)
    return ["".join(chr(rng.randrange(0x4E00, 0x9FA5)) for _ in range(chars)) for _ in range(n)]


def shard_texts(root: Path, datasets: dict[str, list[str]], tokenizer: Path) -> None:
    """Each dataset's documents into train shards ``root / name`` (one shard, no validation split)."""
    from data_pipeline.shard import write_shards

    for name, docs in datasets.items():
        text = root / f"{name}.txt"
        text.write_text("\n\n".join(docs))
        write_shards([str(text)], str(tokenizer), root / name, shard_mb=100, valid_every=0, workers=1, progress=False)


@pytest.fixture(scope="module")
def poisoned(tiny_data, tmp_path_factory) -> Poisoned:
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.config import validate
    from megatransformer.training.data import build_run_loader

    root = tmp_path_factory.mktemp("poisoned")
    docs = tiny_data.corpus.read_text().split("\n\n")
    tok = load_tokenizer(tiny_data.tokenizer)
    poison = poison_documents(6, 200)
    at = len(docs) // 6  # a third of the way into the run
    # two streams read the two halves of the documents, each at half the rows per step: half of the poison after
    # an eighth of the first half and half after as many tokens of the second come at about the steps where the
    # single stream reads its poison, in every row of those batches
    half = len(docs) // 2
    first, second = docs[:half], docs[half : 2 * half]
    at_first = half // 8
    before = sum(len(tok.encode(doc)) + 1 for doc in first[:at_first])  # (+1: the end-of-document token)
    at_second = bisect.bisect(list(itertools.accumulate(len(tok.encode(doc)) + 1 for doc in second)), before)
    datasets = {
        "poisoned": docs[:at] + poison + docs[at:],
        "streams": first[:at_first]
        + poison[:3]
        + first[at_first:]
        + second[:at_second]
        + poison[3:]
        + second[at_second:],
        "clean": docs,
    }
    shard_texts(root, datasets, tiny_data.tokenizer)

    def poisoned_rows(name: str, streams: int) -> tuple[int, int]:
        data = {"train": str(root / name), "tokenizer": str(tiny_data.tokenizer), "seq_len": 64}
        cfg = validate(
            {"model": {"vocab_size": 512, "max_seq_len": 128}, "data": data | {"streams": streams, "shuffle_buffer": 1}}
        )
        bad = []
        for index, batch in zip(range(400), build_run_loader(cfg, "train", MICRO, 0, 1, tok)):
            for r, row in enumerate(batch["input_ids"]):
                if any("\u4e00" <= ch <= "\u9fa5" for ch in tok.decode(row.tolist())):
                    bad.append(index * MICRO + r)
        assert bad and bad[-1] - bad[0] < 80, bad
        return bad[0], bad[-1] + 1

    return Poisoned(
        root / "poisoned", root / "clean", poisoned_rows("poisoned", 1), root / "streams", poisoned_rows("streams", 2)
    )


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


# The same global batch on two data-parallel ranks, which need two streams (each rank reads one); the gradient
# norm judged too (ZeRO-1: inside DeepSpeed's step)
TWO_RANKS = [f"train.micro_batch_size={MICRO // 2}", "data.streams=2", "train.spikes.grad_norm=true"]


@pytest.fixture(scope="module")
def guarded(tiny_data, poisoned, tmp_path_factory) -> tuple[Path, str]:
    """A run on the poisoned data with the default ladder: its directory and its console output."""
    run = tmp_path_factory.mktemp("guarded") / "run"
    return run, train(overrides(tiny_data, poisoned.poisoned, run)).stdout


@pytest.fixture(scope="module")
def guarded_two_ranks(tiny_data, poisoned, tmp_path_factory) -> Path:
    """The guarded run on two data-parallel ranks."""
    run = tmp_path_factory.mktemp("guarded_two_ranks") / "run"
    train(overrides(tiny_data, poisoned.streams, run, *TWO_RANKS), nproc=2)
    return run


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training record, a repeated step as often as it was logged."""
    return [(r["step"], r["loss"]) for r in metrics(run_dir) if "loss" in r]


def assert_rolled_back_over_the_poison(run: Path, poison: tuple[int, int], grad_norm: bool = False) -> None:
    """One rollback, from the checkpoint it went back to over all poisoned rows, after two skipped spikes;
    every step logged once; with ``grad_norm``, gradient norms judged (spiked ones above their threshold)."""
    events = [r for r in metrics(run) if "event" in r]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert len(rollbacks) == 1, events
    start, stop = rollbacks[0]["skipped_rows"]
    assert start <= poison[0] and poison[1] <= stop, (rollbacks, poison)
    assert start == int(rollbacks[0]["checkpoint"].split("_")[1]) * MICRO  # from the checkpoint it went back to
    before = [e for e in events if e["step"] < rollbacks[0]["step"]]
    assert [e["event"] for e in before] == ["skip", "skip"]  # the two spikes before the third rolled back
    for event in events:
        assert event["spiked"] and event["spike_grad_norm"] is not None
        assert (event["grad_norm_threshold"] is not None) == grad_norm
        if "grad_norm" in event["spiked"]:
            assert event["spike_grad_norm"] > event["grad_norm_threshold"], event
    assert any("grad_norm" in e["spiked"] for e in events) == grad_norm, events
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    state = json.loads((latest / "trainer.json").read_text())
    assert state["spikes"]["rollbacks"] == 1 and state["spikes"]["skip_rows"] == [[start, stop]]
    assert len(state["spikes"].get("grad_norms", [])) == (len(state["spikes"]["losses"]) if grad_norm else 0)
    assert [step for step, _ in logged_losses(run)] == list(range(1, STEPS + 1))  # steps run again are logged once


def test_the_default_ladder_rolls_back_over_the_poison_and_ends_like_the_clean_run(
    tiny_data, poisoned, guarded, tmp_path
):
    clean = tmp_path / "clean"
    train(overrides(tiny_data, poisoned.clean, clean))
    guarded, said = guarded
    assert_rolled_back_over_the_poison(guarded, poisoned.rows)
    assert "rolled back to step_" in said and "1 rollbacks" in said
    assert not any("event" in r for r in metrics(clean))  # neither quantity spikes on clean data
    assert abs(final_val_loss(guarded) - final_val_loss(clean)) < 0.05 * final_val_loss(clean)


def test_two_ranks_roll_back_over_the_poisoned_rows(poisoned, guarded_two_ranks):
    assert_rolled_back_over_the_poison(guarded_two_ranks, poisoned.rows_two_streams, grad_norm=True)


def test_without_the_ladder_the_spike_shows_in_the_curve(tiny_data, poisoned, tmp_path):
    run = tmp_path / "unguarded"
    train(overrides(tiny_data, poisoned.poisoned, run, "train.spikes.enabled=false"))
    losses = losses_by_step(run)
    before = sorted(losses[s] for s in range(poisoned.rows[0] // MICRO - 30, poisoned.rows[0] // MICRO))
    in_poison = max(losses[s] for s in range(poisoned.rows[0] // MICRO + 1, poisoned.rows[1] // MICRO + 1))
    assert in_poison > 1.3 * before[len(before) // 2]
    assert not any("event" in r for r in metrics(run))


def test_the_checkpoint_a_rollback_needs_outlives_checkpoint_keep(tiny_data, poisoned, tmp_path):
    # checkpoints every 45 steps, one kept: the one written inside the spikes (at 90) would rotate away the
    # one before them (45), which the rollback needs
    run = tmp_path / "keep_one"
    train(overrides(tiny_data, poisoned.poisoned, run, "checkpoint.every=45", "checkpoint.keep=1"))
    assert_rolled_back_over_the_poison(run, poisoned.rows)
    [rollback] = [r for r in metrics(run) if r.get("event") == "rollback"]
    assert rollback["checkpoint"] == "step_000045" and rollback["spike_began"] < 90 < rollback["step"] + 1


@pytest.mark.parametrize(
    "setting, why",
    [
        ("train.spikes.max_rollbacks=0", "after 0 rollbacks (train.spikes.max_rollbacks)"),
        ("checkpoint.every=1000", "after finding no intact checkpoint before step"),
    ],
)
def test_a_spike_that_cannot_roll_back_stops_the_run_with_exit_3(tiny_data, poisoned, tmp_path, setting, why):
    run = tmp_path / "stopped"
    done = train(overrides(tiny_data, poisoned.poisoned, run, setting), expect=3)
    said = done.stdout + done.stderr
    assert "stopping: loss spikes since step " in said and why in said and "Traceback" not in said, said[-2000:]
    events = [r["event"] for r in metrics(run) if "event" in r]
    assert events == ["skip", "skip", "stop"]
    assert max(r["step"] for r in metrics(run) if "loss" in r) < poisoned.rows[1] // MICRO  # it stopped in the poison


def assert_resumes_to_the_same_curve(run: Path, reference: Path) -> None:
    assert logged_losses(run) == logged_losses(reference)
    rollbacks = [[r for r in metrics(each) if r.get("event") == "rollback"] for each in (run, reference)]
    assert len(rollbacks[0]) == 1 and rollbacks[0][0]["skipped_rows"] == rollbacks[1][0]["skipped_rows"]


def test_kill_9_after_a_rollback_and_resume_give_the_same_curve(tiny_data, poisoned, guarded):
    run = guarded[0].parent / "killed"
    kill_when(run / "spikes.json", overrides(tiny_data, poisoned.poisoned, run))  # after the rollback
    train(overrides(tiny_data, poisoned.poisoned, run, "resume=auto"))
    assert_resumes_to_the_same_curve(run, guarded[0])


def test_kill_9_of_two_ranks_after_a_rollback_and_resume_give_the_same_curve(tiny_data, poisoned, guarded_two_ranks):
    run = guarded_two_ranks.parent / "killed"
    kill_when(run / "spikes.json", overrides(tiny_data, poisoned.streams, run, *TWO_RANKS), nproc=2)
    train(overrides(tiny_data, poisoned.streams, run, *TWO_RANKS, "resume=auto"), nproc=2)
    assert_resumes_to_the_same_curve(run, guarded_two_ranks)


def test_an_elastic_resume_after_a_rollback_continues_the_curve(tiny_data, poisoned, guarded_two_ranks):
    """Killed after its rollback on two ranks, resumed on one (micro 2 x accum 2, the same global batch): the
    same rows skipped, the same spikes judged, the curve continued."""
    run = guarded_two_ranks.parent / "elastic"
    kill_when(run / "spikes.json", overrides(tiny_data, poisoned.streams, run, *TWO_RANKS), nproc=2)
    said = train(overrides(tiny_data, poisoned.streams, run, *TWO_RANKS, "train.grad_accum=2", "resume=auto")).stdout
    assert "on 1 rank" in said  # (an elastic resume: the run log names both layouts)
    resumed, reference = losses_by_step(run), losses_by_step(guarded_two_ranks)
    assert sorted(resumed) == sorted(reference)
    assert [resumed[s] for s in sorted(resumed)] == pytest.approx([reference[s] for s in sorted(reference)], rel=1e-4)
    events = [
        [(r["step"], r["event"], r.get("skipped_rows")) for r in metrics(d) if "event" in r]
        for d in (run, guarded_two_ranks)
    ]
    assert events[0] == events[1]


EARLY_STEPS = 120
EARLY_FROM = 52  # the first step reading the random tokens, while the loss still falls from its start


class EarlyPoison(NamedTuple):
    mixed: Path  # train shards with random tokens mixed in
    clean: Path  # the same documents without them
    rows: tuple[int, int]  # global rows that hold random tokens, or a little more: [first, last + 1)


@pytest.fixture(scope="module")
def early_poison(tiny_data, tmp_path_factory) -> EarlyPoison:
    """Train shards of tiny_data's corpus (read in order: RUN) with random tokens mixed into it from step
    EARLY_FROM, a third of the tokens of about 11 steps; and the same documents without them."""
    from data_pipeline.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("early_poison")
    docs = tiny_data.corpus.read_text().split("\n\n")
    tok = load_tokenizer(tiny_data.tokenizer)
    ends = list(itertools.accumulate(len(tok.encode(doc)) + 1 for doc in docs))  # (+1: the end-of-document token)
    at = next(i for i, end in enumerate(ends) if end >= (EARLY_FROM - 1) * MICRO * 64)
    rng = random.Random(0)
    noise = [tok.decode([rng.randrange(3, 512) for _ in range(80)]) for _ in range(8)]
    mixed = [part for pair in zip(docs[at : at + 8], noise) for part in pair]
    end = ends[at - 1] + sum(len(tok.encode(part)) + 1 for part in mixed)
    rows = (ends[at - 1] // 65, -(-end // 64))  # (rows of 64 tokens, or of 65 with the next one's label)
    shard_texts(root, {"mixed": docs[:at] + mixed + docs[at + 8 :], "clean": docs}, tiny_data.tokenizer)
    return EarlyPoison(root / "mixed", root / "clean", rows)


def test_random_tokens_early_in_the_descent_are_rolled_back_and_the_run_ends_like_the_clean_one(
    tiny_data, early_poison, tmp_path
):
    """The loss of the mixed steps rises less than the descent before them spreads the losses (a median + 6 x
    1.4826 x MAD of them misses it), but far above the noise around the trend: skipped, then rolled back over;
    the clean run has no spike, and the final validation losses agree within 3 %."""
    mixed, clean = tmp_path / "mixed", tmp_path / "clean"
    train(overrides(tiny_data, early_poison.mixed, mixed, f"train.max_steps={EARLY_STEPS}"))
    train(overrides(tiny_data, early_poison.clean, clean, f"train.max_steps={EARLY_STEPS}"))
    events = [r for r in metrics(mixed) if "event" in r]
    [rollback] = [e for e in events if e["event"] == "rollback"]
    assert [e["event"] for e in events[: events.index(rollback)]] == ["skip", "skip"], events
    start, stop = rollback["skipped_rows"]
    assert start <= early_poison.rows[0] and early_poison.rows[1] <= stop, (rollback, early_poison.rows)
    first = events[0]["step"]
    assert EARLY_FROM <= first < EARLY_FROM + 4
    before = np.array([loss for step, loss in logged_losses(clean) if step < first])  # (the same steps as mixed's)
    median = np.median(before)
    assert events[0]["spike_loss"] < median + 6 * 1.4826 * np.median(np.abs(before - median))
    assert not any("event" in r for r in metrics(clean))
    assert [step for step, _ in logged_losses(mixed)] == list(range(1, EARLY_STEPS + 1))
    assert abs(final_val_loss(mixed) - final_val_loss(clean)) < 0.03 * final_val_loss(clean)
