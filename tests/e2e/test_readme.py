"""README.md, run as written, so that it cannot drift from the code.

Rules (README.md points here):

- A command is a line of a ```bash block (backslash continuations joined; an ``&&`` chain is split into its
  commands) or a ``$ `` line of a ```console block; the lines under a console command are its expected output,
  each of which must appear in what it prints.
- Commands run in order, in one scratch directory (a fresh clone's working directory, without the clone: configs
  are named, as the README names them) that holds the input files the README names (``corpus/``,
  ``held_out.txt``, ``sft.jsonl``, ``sft-held-out.jsonl``; see ``inputs``), through bash, so globs and quotes
  work as they would for a reader. ``megatransformer`` is this interpreter's ``python -m megatransformer.cli``.
- Small options are appended to keep the run cheap (``APPENDED``: tiny model, two steps, a few generated
  tokens); nothing is replaced. The configs' batch sizes stay, so the small inputs (a 400-example
  instruction file) meet the batches a reader's run has.
- No command ends in a ``# comment`` (it goes on the line above): an override appended to such a line, by this
  test or by a reader, would be swallowed by the comment.
- A command that CI cannot run is skipped by an explicit rule of ``NOT_RUN`` (how it starts, and why), and a
  whole block is skipped when the line before it is ``<!-- readme-test: skip WHY -->``. Any other command must
  be a ``megatransformer`` command, so a new README section makes this choice explicitly; a ``NOT_RUN`` rule
  that no command matches fails the test too.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from support import REPO
from support.runs import tiny_model

README = REPO / "README.md"
SKIP_MARKER = re.compile(r"<!--\s*readme-test:\s*skip\b(?P<why>.*?)-->")

NOT_RUN = {
    "python -m venv": "creates a virtual environment; the test runs in the one CI installed",
    ". .venv/bin/activate": "activates that virtual environment",
    "pip install": "installs packages; CI has installed the project (tests/e2e/test_install.py installs it anew)",
    "python -m pytest": "the test suite itself, which this test is part of",
    "torchrun": "starts 8 processes; tests/e2e/test_launch_processes.py and tests/e2e/test_training.py run "
    "torchrun on CPU",
    "sbatch": "needs a Slurm cluster; tests/e2e/test_slurm.py submits slurm/train.sbatch to the local one",
}

# the tiny decoder with one layer, at the vocabulary and length of the README's configs
TINY_TRAIN = [
    *tiny_model(n_layers=1, d_ff=128, vocab_size=None, max_seq_len=None),
    "data.seq_len=64",
    "train.max_steps=2",
    "train.global_batch_size=null",
    "train.grad_accum=1",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "precision=fp32",
    "wandb.mode=disabled",
]
APPENDED = {  # by sub-command
    "quickstart": TINY_TRAIN,
    "train": TINY_TRAIN,
    "eval": ["data.seq_len=64", "--max-batches", "2"],  # an override after --data's path, as users write it
    "generate": ["--max-new-tokens", "8"],
    "data inspect": ["data.seq_len=64"],
}


@dataclass
class Command:
    text: str
    line: int  # in README.md
    expected: list[str]  # console blocks: output lines that must appear
    skip: str | None = None  # why it is not run


def commands(readme: str) -> list[Command]:
    """The README's commands, in order, with the skip reason of the ones not run."""
    found: list[Command] = []
    lines = readme.splitlines()
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if fence not in ("```bash", "```console"):
            i += 1
            continue
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP_MARKER.search(previous)
        start, i = i + 1, i + 1
        while lines[i].strip() != "```":
            i += 1
        block = [(n + 1, line) for n, line in enumerate(lines[start:i], start)]
        parsed = _console(block) if fence == "```console" else _bash(block)
        for command in parsed:
            command.skip = f"block marked: {marker['why'].strip()}" if marker else _rule(command.text)
        found += parsed
        i += 1
    return found


def _bash(block: list[tuple[int, str]]) -> list[Command]:
    found, pending, first = [], "", 0
    for number, line in block:
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text and not text.startswith("#"):
            found += [Command(part.strip(), first, []) for part in text.split(" && ")]
    return found


def _console(block: list[tuple[int, str]]) -> list[Command]:
    found: list[Command] = []
    for number, line in block:
        if line.startswith("$ "):
            found.append(Command(line[2:].strip(), number, []))
        elif line.strip() and found:
            found[-1].expected.append(line.strip())
    return found


def _rule(text: str) -> str | None:
    for start, why in NOT_RUN.items():
        if text.startswith(start):
            return why
    return None


def appended(text: str) -> list[str]:
    words = shlex.split(text)
    assert words[0] == "megatransformer", (
        f"README command {text!r} is neither a megatransformer command nor covered by a NOT_RUN rule or a "
        "readme-test: skip marker; decide which, in tests/e2e/test_readme.py or README.md"
    )
    sub = " ".join(words[1:3]) if words[1] == "data" else words[1]
    return APPENDED.get(sub, [])


def inputs(root: Path) -> None:
    """The files the README's commands read: a corpus (.txt and .jsonl.zst), held-out text, instruction data."""
    import zstandard

    from data_pipeline.corpus import write_demo_corpus
    from data_pipeline.documents import read_documents

    corpus = write_demo_corpus(root / "corpus" / "docstrings.txt", max_bytes=300_000)
    docs = [d.text for d in read_documents([str(corpus)])]
    records = "".join(json.dumps({"text": d}) + "\n" for d in docs[-300:])
    (root / "corpus" / "more.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(records.encode()))
    (root / "held_out.txt").write_text("\n\n".join(docs[:20]))

    def examples(texts: list[str]) -> str:
        rows = []
        for text in texts:
            words = text.split()
            rows.append(
                {
                    "prompt": "Question: how does it start? " + " ".join(words[:4]) + "\n",
                    "completion": " " + " ".join(words[4:16]),
                }
            )
        return "".join(json.dumps(r) + "\n" for r in rows)

    (root / "sft.jsonl").write_text(examples(docs[:400]))  # a small fine-tuning set
    (root / "sft-held-out.jsonl").write_text(examples(docs[-30:]))


def test_readme_rules_are_explicit():
    """Every command is run or skipped for a stated reason, and every NOT_RUN rule is still needed."""
    found = commands(README.read_text())
    assert found, "README.md has no command blocks"
    for command in found:
        if command.skip is None:
            appended(command.text)  # asserts it is a megatransformer command
    commented = [
        f"README.md:{c.line}: {c.text}" for c in found if shlex.split(c.text, comments=True) != shlex.split(c.text)
    ]
    assert not commented, (
        "README commands end in a # comment, which swallows any override a reader (or this test) appends; put "
        f"the comment on the line above: {commented}"
    )
    used = {why for command in found for why in [command.skip] if why}
    assert set(NOT_RUN.values()) <= used, f"NOT_RUN rules that match no README command: {set(NOT_RUN.values()) - used}"


def test_readme_commands_work_as_written(tmp_path):
    inputs(tmp_path)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    (bin_dir / "megatransformer").write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m megatransformer.cli "$@"\n'
    )
    (bin_dir / "megatransformer").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    ran = []
    for command in commands(README.read_text()):
        if command.skip:
            continue
        line = command.text + "".join(" " + shlex.quote(a) for a in appended(command.text))
        started = time.perf_counter()
        result = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        print(f"{time.perf_counter() - started:6.1f} s  README.md:{command.line}  {line}")
        output = result.stdout + result.stderr
        expect_error = any("error:" in e for e in command.expected)
        if (result.returncode != 0) != expect_error:
            raise AssertionError(
                f"README.md line {command.line}: `{line}` exited {result.returncode}:\n{output[-4000:]}"
            )
        for expected in command.expected:
            assert expected in output, f"README.md line {command.line}: `{line}` did not print {expected!r}:\n{output}"
        ran.append((command, output))
    texts = [c.text for c, _ in ran]
    assert any(t.startswith("megatransformer quickstart") for t in texts)
    # what the README says about the runs holds: where they land, the summary, the init_from confirmation
    assert (tmp_path / "runs" / "quickstart" / "metrics.png").is_file()
    quickstart = next(out for c, out in ran if c.text.startswith("megatransformer quickstart"))
    assert "next:" in quickstart and "megatransformer eval --checkpoint runs/quickstart" in quickstart
    from_hf = next(out for c, out in ran if "init_from=ckpt" in c.text)
    assert "init_from=ckpt: starting from its weights" in from_hf


def test_the_remote_shards_block_serves_the_shards_the_data_block_wrote():
    """The remote-shards block is not run (a server in the background), so its paths are checked here: the
    directory served plus the URL's path is where a `data shard --out` wrote shards, on the port served."""
    found = [command.text for command in commands(README.read_text())]
    shards = [shlex.split(text) for text in found if text.startswith("megatransformer data shard ")]
    written = {Path(words[words.index("--out") + 1]) for words in shards}
    [server] = [shlex.split(text, comments=True) for text in found if text.startswith("python -m http.server ")]
    [url] = [
        word.removeprefix("data.train=")
        for text in found
        for word in shlex.split(text, comments=True)
        if word.startswith("data.train=http")
    ]
    served = Path(server[server.index("--directory") + 1])
    assert url.startswith(f"http://127.0.0.1:{server[3]}/"), (url, server)
    assert served / url.split("/", 3)[3] in written, (served, url, written)
