"""Instruction data: (prompt, completion) .jsonl -> shards -> samples with loss on the completion only."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from support.data import INSTRUCTION_VALID_EVERY, loader_config

from data_pipeline import DataError
from data_pipeline.documents import read_documents
from data_pipeline.shard import INSTRUCTIONS, Manifest, write_shards
from megatransformer.batch import IGNORE_INDEX
from megatransformer.training.data import build_run_loader as build_loader


def make_cfg(tiny_data, shards, *args, **data):
    """loader_config of ``shards`` (``train=``: others), with tiny_data's tokenizer."""
    return loader_config(tiny_data, *args, seed=7, **{"train": str(shards), **data})


def valid_examples(tiny_instructions, tok) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + EOS) of the validation split, in order."""
    pairs = tiny_instructions.examples()
    held_out = [pair for i, pair in enumerate(pairs) if i % INSTRUCTION_VALID_EVERY == INSTRUCTION_VALID_EVERY - 1]
    return [(tok.encode(p), tok.encode(c) + [tok.eos_id]) for p, c in held_out]


def validation_batches(cfg, tok) -> list[dict[str, torch.Tensor]]:
    return list(build_loader(cfg, "valid", 2, 0, 1, tok))


# ------------------------------------------------------------------------------------ reading and sharding


def test_reads_prompt_and_completion_unstripped(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"q": "Q: 2+2?\nA:", "a": " 4"}) + "\n\n" + json.dumps({"q": "", "a": ""}) + "\n")
    docs = list(read_documents([str(path)], text_field="a", prompt_field="q"))
    assert [(d.prompt, d.text, d.line) for d in docs] == [("Q: 2+2?\nA:", " 4", 1)]


@pytest.mark.parametrize(
    "line,message",
    [
        ({"prompt": "p"}, "no string field 'completion'; choose the field with --completion-field"),
        ({"completion": "c"}, "no string field 'prompt'; choose the field with --prompt-field"),
        ({"prompt": 3, "completion": "c"}, "no string field 'prompt'"),
        (["prompt", "completion"], "expected a JSON object, got list"),
    ],
)
def test_bad_records_name_the_line_and_the_fix(tmp_path, line, message):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DataError, match=f"sft.jsonl:2: {message}"):
        list(read_documents([str(path)], text_field="completion", prompt_field="prompt"))


def test_prompt_field_on_plain_text_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    with pytest.raises(DataError, match="from .jsonl, .tsv, .parquet and .arrow files only"):
        list(read_documents([str(path)], prompt_field="prompt"))


def test_shards_hold_prompt_then_completion_tokens_and_the_prompt_length(tiny_instructions, tok):
    import webdataset as wds

    manifest = Manifest.load(tiny_instructions.shards)
    assert manifest.kind == INSTRUCTIONS and manifest.documents == len(tiny_instructions.examples())
    first = manifest.splits["train"][0]
    block = next(iter(wds.WebDataset(str(tiny_instructions.shards / first.file), shardshuffle=False).decode()))
    prompt, completion = tiny_instructions.examples()[0]
    ids = block["ids.npy"][block["offsets.npy"][0] : block["offsets.npy"][1]].tolist()
    assert block["prompt_lens.npy"][0] == len(tok.encode(prompt))
    assert ids == tok.encode(prompt) + tok.encode(completion)


def test_shard_cli_takes_the_fields(tmp_path, tiny_data):
    from megatransformer.cli import main

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f" {i}"}) + "\n" for i in range(4)))
    code = main(
        [
            "data",
            "shard",
            "--input",
            str(path),
            "--tokenizer",
            str(tiny_data.tokenizer),
            "--out",
            str(tmp_path / "shards"),
            "--prompt-field",
            "instruction",
            "--completion-field",
            "output",
            "--valid-every",
            "0",
            "--workers",
            "1",
        ]
    )
    assert code == 0 and Manifest.load(tmp_path / "shards").kind == INSTRUCTIONS
    code = main(
        [
            "data",
            "shard",
            "--input",
            str(path),
            "--tokenizer",
            str(tiny_data.tokenizer),
            "--out",
            str(tmp_path / "other"),
            "--prompt-field",
            "prompt",
            "--workers",
            "1",
        ]
    )
    assert code == 2


# ------------------------------------------------------------------------------------ objectives


def test_autoregressive_packs_examples_and_scores_only_completions(tiny_data, tiny_instructions, tok):
    """The packed stream is prompt + completion + EOS per example; exactly the completion tokens and EOS are
    labels, each once, at the position before them."""
    cfg = make_cfg(tiny_data, tiny_instructions.shards)
    batches = validation_batches(cfg, tok)
    inputs = [t for b in batches for t in b["input_ids"].flatten().tolist()]
    labels = [t for b in batches for t in b["labels"].flatten().tolist()]
    stream, expected = [], []
    for prompt, completion in valid_examples(tiny_instructions, tok):
        stream += prompt + completion
        expected += [IGNORE_INDEX] * (len(prompt) - 1) + completion + [IGNORE_INDEX]
    assert len(inputs) > 1000 and inputs == stream[: len(inputs)]
    assert labels == expected[: len(labels)]
    assert any(bool((b["segment_ids"] > 1).any()) for b in batches), "examples were not packed"


def test_decoder_prefix_lm_makes_the_prompt_the_prefix(tiny_data, tiny_instructions, tok):
    cfg = make_cfg(tiny_data, tiny_instructions.shards, "prefix_lm", seq_len=256, pack=False)
    rows = [{k: v[i] for k, v in b.items()} for b in validation_batches(cfg, tok) for i in range(len(b["labels"]))]
    examples = valid_examples(tiny_instructions, tok)
    assert max(len(p) + len(c) for p, c in examples) <= 256, "the fixture's examples should fit a row whole"
    assert len(rows) == len(examples) // 2 * 2
    for row, (prompt, completion) in zip(rows, examples):
        n = len(prompt) + len(completion) - 1
        assert (row["prefix_len"][:n] == len(prompt)).all()
        assert row["input_ids"][:n].tolist() == (prompt + completion)[:-1]
        assert row["labels"].tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + completion + [IGNORE_INDEX] * (256 - n)
        assert row["segment_ids"].tolist() == [1] * n + [0] * (256 - n)


def test_decoder_prefix_lm_packs_examples_each_with_its_prompt_as_prefix(tiny_data, tiny_instructions, tok):
    """Packed rows: the labels of autoregressive fine-tuning, and per position the end of its own example's
    prompt (the part of it in this row) as the prefix end."""
    cfg = make_cfg(tiny_data, tiny_instructions.shards, "prefix_lm")
    batches = validation_batches(cfg, tok)
    stream, is_prompt, expected = [], [], []
    for prompt, completion in valid_examples(tiny_instructions, tok):
        stream += prompt + completion
        is_prompt += [True] * len(prompt) + [False] * len(completion)
        expected += [IGNORE_INDEX] * (len(prompt) - 1) + completion + [IGNORE_INDEX]
    rows = [
        (b["input_ids"][i], b["labels"][i], b["segment_ids"][i], b["prefix_len"][i])
        for b in batches
        for i in range(len(b["labels"]))
    ]
    assert len(rows) * 64 > 1000 and any(int(seg.max()) > 1 for _, _, seg, _ in rows), "examples were not packed"
    for j, (ids, labels, segments, ends) in enumerate(rows):
        assert ids.tolist() == stream[64 * j : 64 * (j + 1)] and labels.tolist() == expected[64 * j : 64 * (j + 1)]
        for k in range(1, int(segments.max()) + 1):
            where = torch.nonzero(segments == k).flatten().tolist()
            prompt_here = sum(is_prompt[64 * j + i] for i in where)
            assert (ends[where] == where[0] + prompt_here).all()


def test_encoder_decoder_prefix_lm_reads_the_prompt_and_learns_the_completion(tiny_data, tiny_instructions, tok):
    cfg = make_cfg(tiny_data, tiny_instructions.shards, "prefix_lm", "encoder_decoder", seq_len=256)
    batches = validation_batches(cfg, tok)
    sources, targets = [], []
    for b in batches:
        for row in range(len(b["input_ids"])):
            for seg in range(1, int(b["segment_ids"][row].max()) + 1):
                sources.append(b["input_ids"][row][b["segment_ids"][row] == seg].tolist())
                targets.append(b["labels"][row][b["decoder_segment_ids"][row] == seg].tolist())
    examples = valid_examples(tiny_instructions, tok)[: len(sources)]
    assert len(sources) > 20 and max(len(s) + len(t) for s, t in examples) < 256
    assert sources == [p for p, _ in examples] and targets == [c for _, c in examples]
    assert any(int(b["segment_ids"].max()) > 1 for b in batches), "examples were not packed"


@pytest.mark.parametrize(
    "objective,arch,data,message",
    [
        ("masked_lm", "encoder", {}, "objective=masked_lm cannot use"),
        ("span_corruption", "encoder_decoder", {}, "objective=span_corruption cannot use"),
    ],
)
def test_objectives_that_cannot_use_instructions_are_refused(
    tiny_data, tiny_instructions, tok, objective, arch, data, message
):
    cfg = make_cfg(tiny_data, tiny_instructions.shards, objective, arch, **data)
    with pytest.raises(DataError, match=message):
        build_loader(cfg, "train", 2, 0, 1, tok)


def test_mixing_text_and_instructions(tiny_data, tiny_instructions, tok):
    """Text documents keep their random prefix split, instruction rows their prompt, in one batch."""
    sources = [{"path": str(tiny_data.shards), "weight": 1.0}, {"path": str(tiny_instructions.shards), "weight": 1.0}]
    cfg = make_cfg(tiny_data, tiny_instructions.shards, "prefix_lm", seq_len=256, pack=False, train=sources)
    batch = next(iter(build_loader(cfg, "train", 16, 0, 1, tok)))
    prompt_word = tok.encode("Continue:")
    starts_with_prompt = [row[: len(prompt_word)].tolist() == prompt_word for row in batch["input_ids"]]
    assert any(starts_with_prompt) and not all(starts_with_prompt)


def test_long_examples_are_truncated_and_unlearnable_ones_skipped_with_a_warning(tmp_path, tiny_data, tok):
    path = tmp_path / "sft.jsonl"
    records = [("short", " answer"), ("a very long prompt " * 20, " never learned"), ("ok", " word " * 40)]
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in records))
    write_shards(
        [str(path)],
        str(tiny_data.tokenizer),
        tmp_path / "shards",
        valid_every=0,
        workers=1,
        progress=False,
        prompt_field="prompt",
        text_field="completion",
    )
    cfg = make_cfg(tiny_data, tmp_path / "shards", "prefix_lm", seq_len=32, pack=False, streams=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = build_loader(cfg, "train", 1, 0, 1, tok)
        rows = [b for _, b in zip(range(3), loader)][:2]  # one epoch (shuffled): the examples left, once each
    messages = " | ".join(str(w.message) for w in caught)
    assert "they are skipped" in messages and "their end is cut off" in messages
    truncated, short = sorted(rows, key=lambda r: int((r["segment_ids"] == 0).sum()))
    assert int(short["prefix_len"][0, 0]) == len(tok.encode("short"))
    assert int(truncated["prefix_len"][0, 0]) == len(tok.encode("ok")) and bool((truncated["segment_ids"] == 1).all())
    assert int((truncated["labels"] != IGNORE_INDEX).sum()) == 33 - len(tok.encode("ok"))  # a 33-token window


@pytest.mark.parametrize(
    "objective,arch,pack",
    [
        ("autoregressive", "decoder", True),
        ("prefix_lm", "decoder", False),
        ("prefix_lm", "decoder", True),
        ("prefix_lm", "encoder_decoder", True),
    ],
)
def test_exact_resume(tiny_data, tiny_instructions, tok, objective, arch, pack):
    cfg = make_cfg(tiny_data, tiny_instructions.shards, objective, arch, pack=pack, num_workers=2)
    reference = [b for _, b in zip(range(9), build_loader(cfg, "train", 3, 1, 2, tok))]
    first = build_loader(cfg, "train", 3, 1, 2, tok)
    assert all(torch.equal(b["input_ids"], r["input_ids"]) for (_, b), r in zip(zip(range(4), first), reference))
    resumed = build_loader(cfg, "train", 3, 1, 2, tok)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for (_, b), r in zip(zip(range(5), resumed), reference[4:]):
        assert b.keys() == r.keys() and all(torch.equal(b[k], r[k]) for k in b)
