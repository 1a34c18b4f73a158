"""A parquet corpus tokenized as parts by `megatransformer data shard --part K/N` processes, joined by
`data merge`: the same documents in the same splits as one run, whatever N and the worker count, in the same
shards, so that training on either takes the same losses; a part killed mid-run is refused by merge until it is
re-made; slurm/shard.sbatch + slurm/merge.sbatch on the local Slurm
cluster (marked slurm)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import REPO
from support.data import shard_documents
from support.runs import CLI, clean_env, cli, losses, tiny_run, train
from support.slurm import Job, cluster_problem

from data_pipeline.documents import read_documents
from data_pipeline.shard import Manifest

FILES = 4


@pytest.fixture(scope="module")
def corpus(tiny_data, tmp_path_factory):
    """The demo corpus as parquet files of several row groups, the text in column "content"."""
    root = tmp_path_factory.mktemp("parquet")
    docs = [d.text for d in read_documents([str(tiny_data.corpus)])]
    for i in range(FILES):
        chunk = docs[i::FILES]
        table = pa.table({"id": list(range(len(chunk))), "content": chunk})
        pq.write_table(table, root / f"train-{i:05d}.parquet", row_group_size=25)
    return root


def shard_args(corpus, tiny_data, out, *more) -> list[str]:
    return [
        "data", "shard", "--input", str(corpus), "--text-field", "content", "--tokenizer", str(tiny_data.tokenizer),
        "--out", str(out), "--shard-mb", "0.05", *more,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one_run(corpus, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "shards"
    cli(*shard_args(corpus, tiny_data, out, "--workers", "1"))
    return out


def assert_same_dataset(merged, one_run):
    for split in ("train", "valid"):
        expected = shard_documents(one_run, split)
        assert len(expected) > 20
        assert shard_documents(merged, split) == expected, split


def test_parquet_parts_merged_equal_one_run(corpus, tiny_data, one_run, tmp_path):
    out = tmp_path / "shards"
    for k in (1, 2):
        result = cli(*shard_args(corpus, tiny_data, out, "--part", f"{k}/2", "--workers", "2"))
        assert f"part {k}/2 is finished" in result.stdout
    result = cli("data", "merge", "--out", out)
    assert result.stdout.startswith("train: ") and "valid: " in result.stdout, result.stdout
    assert_same_dataset(out, one_run)


def test_parts_merged_train_the_losses_of_one_run(corpus, tiny_data, tmp_path):
    """Three parts of many segments each (--shard-mb 0.004: segments of ~32 KiB of text), merged: the shards of
    one run, and five training steps on each take the same losses."""
    one, parts = tmp_path / "one", tmp_path / "parts"
    cli(*shard_args(corpus, tiny_data, one, "--shard-mb", "0.004", "--workers", "1"))
    for k in (1, 2, 3):
        cli(*shard_args(corpus, tiny_data, parts, "--shard-mb", "0.004", "--part", f"{k}/3", "--workers", "1"))
    cli("data", "merge", "--out", parts)
    shards = [Manifest.load(d).splits["train"] for d in (one, parts)]
    assert len(shards[0]) > 12 and {s.file.partition("/")[0] for s in shards[1]} == {
        f"part-0000{k}-of-00003" for k in (1, 2, 3)
    }
    assert [s.sha256 for s in shards[1]] == [s.sha256 for s in shards[0]]
    for data, run in ((one, tmp_path / "run-one"), (parts, tmp_path / "run-parts")):
        train(
            tiny_run(tiny_data, run, steps=5, changes={"checkpoint.every": "5"})
            + [f"data.train={data}", "data.streams=4"]
        )
    assert len(losses(tmp_path / "run-one")) == 5
    assert losses(tmp_path / "run-parts") == losses(tmp_path / "run-one")


def test_part_killed_mid_run_is_refused_until_re_made(corpus, tiny_data, one_run, tmp_path):
    out = tmp_path / "shards"
    cli(*shard_args(corpus, tiny_data, out, "--part", "2/2", "--workers", "1"))
    part = out / "part-00001-of-00002"
    large = tmp_path / "large"  # (an input that takes seconds, so the part is surely killed before it ends)
    large.mkdir()
    table = pq.read_table(corpus / "train-00000.parquet")
    pq.write_table(pa.concat_tables([table] * 200), large / "train-00000.parquet", row_group_size=25)
    process = subprocess.Popen(
        [*CLI, *shard_args(large, tiny_data, out, "--part", "1/2", "--workers", "1", "--shard-mb", "0.005")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while not list(part.glob("*.tar")):  # killed once its first shard is written
            assert process.poll() is None, f"part 1/2 ended (exit {process.returncode}) before it could be killed"
            time.sleep(0.01)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    refused = cli("data", "merge", "--out", out, check=False)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"megatransformer data merge: error: {part} has no part.json: an unfinished part (interrupted or still "
        "running); run that `data shard --part` again with --overwrite, or move the directory away, and merge again"
    ]
    assert not (out / "manifest.json").exists()
    again = cli(*shard_args(corpus, tiny_data, out, "--part", "1/2"), check=False)
    assert again.returncode == 2 and "already holds a dataset (" in again.stderr  # nothing replaced unasked
    cli(*shard_args(corpus, tiny_data, out, "--part", "1/2", "--workers", "1", "--overwrite"))
    cli("data", "merge", "--out", out)
    assert_same_dataset(out, one_run)


@pytest.mark.slurm
def test_slurm_array_of_parts_then_merge(corpus, tiny_data, one_run, tmp_path):
    problem = cluster_problem()
    if problem:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI needs the Slurm cluster: {problem}")
        pytest.skip(problem)
    out, logs = tmp_path / "shards", tmp_path / "logs"
    logs.mkdir()
    options = ["--parsable", f"--chdir={REPO}", "--time=10:00"]

    def sbatch(*args: str) -> int:
        result = subprocess.run(
            ["sbatch", *args], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"sbatch failed: {result.stderr}"
        return int(result.stdout.strip().split(";")[0])

    shard = shard_args(corpus, tiny_data, out)[2:]
    parts = sbatch(*options, f"--output={logs}/%x-%A_%a.out", "--array=1-3", "slurm/shard.sbatch", *shard)
    merge = sbatch(
        *options, f"--output={logs}/%x-%j.out", f"--dependency=afterany:{parts}", "slurm/merge.sbatch", str(out)
    )
    job = Job(merge, logs / f"merge-{merge}.out")
    try:
        info = job.wait_finished()
    finally:
        subprocess.run(["scancel", str(parts), str(merge)], timeout=30)
    logs_text = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(logs.iterdir()))
    assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), logs_text
    assert sorted(p.name for p in out.glob("part-*")) == [f"part-0000{k}-of-00003" for k in (1, 2, 3)], logs_text
    assert_same_dataset(out, one_run)
