"""Eval, generate, export/import: pretrain -> checkpoint -> eval -> export -> transformers, and back."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.runs import cli  # noqa: E402

from megatransformer.inference import load_for_inference  # noqa: E402
from megatransformer.model import generate  # noqa: E402


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama-style decoder trained for a few steps on stdlib docstrings (through the real CLI)."""
    from data_pipeline.corpus import write_demo_corpus

    root = tmp_path_factory.mktemp("pretrain")
    corpus = write_demo_corpus(root / "corpus.txt", max_bytes=300_000)
    held_out = root / "held_out.txt"
    held_out.write_text("\n\n".join(corpus.read_text().split("\n\n")[-20:]))
    cli("data", "tokenizer", "--input", str(corpus), "--vocab-size", "512", "--out", str(root / "tok.json"))
    cli(
        "data",
        "shard",
        "--input",
        str(corpus),
        "--tokenizer",
        str(root / "tok.json"),
        "--out",
        str(root / "shards"),
        "--shard-mb",
        "0.05",
        "--valid-every",
        "10",
        "--workers",
        "1",
    )
    config = root / "run.yaml"
    config.write_text(f"""
run_dir: {root / "run"}
model: {{d_model: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, d_ff: 96, vocab_size: 512, max_seq_len: 128,
         tie_embeddings: false}}
data: {{train: {root / "shards"}, tokenizer: {root / "tok.json"}, seq_len: 64}}
train: {{micro_batch_size: 8, grad_accum: 1, max_steps: 20, log_every: 5, eval_batches: 2}}
optim: {{lr: 3.0e-3}}
schedule: {{warmup_steps: 2}}
checkpoint: {{every: 10}}
wandb: {{mode: disabled}}
""")
    cli("train", "--config", str(config))
    return {
        "root": root,
        "config": config,
        "run": root / "run",
        "shards": root / "shards",
        "held_out": held_out,
        "tokenizer": root / "tok.json",
    }


@pytest.fixture(scope="module")
def exported(pretrained) -> Path:
    out = pretrained["root"] / "hf"
    cli("export", "--checkpoint", str(pretrained["run"]), "--format", "hf", "--out", str(out))
    return out


def test_transformers_loads_the_export_and_computes_the_same_logits(pretrained, exported):
    ours = load_for_inference(pretrained["run"]).model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, 512, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)).abs().max().item() < 1e-4


def test_transformers_perplexity_equals_megatransformer_eval(pretrained, exported):
    """One document per row (data.pack=false), so transformers sees the same rows with a padding mask."""
    from data_pipeline.shard import write_shards
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.config import load_config
    from megatransformer.training.data import build_run_loader as build_loader

    ours = json.loads(
        cli(
            "eval",
            "--checkpoint",
            str(pretrained["run"]),
            "--data",
            str(pretrained["held_out"]),
            "--json",
            "data.pack=false",
        ).stdout
    )
    shards = pretrained["root"] / "held_out_shards"
    write_shards(
        [str(pretrained["held_out"])],
        str(pretrained["tokenizer"]),
        shards,
        valid_every=0,
        workers=1,
        progress=False,
        overwrite=True,
    )
    cfg = load_config(pretrained["config"], [f"data.train={shards}", "data.pack=false", "data.streams=1"])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    loss_sum, count = 0.0, 0
    for batch in build_loader(cfg, "train", 1, 0, 1, load_tokenizer(pretrained["tokenizer"]), epochs=1):
        with torch.no_grad():
            logits = theirs(batch["input_ids"], attention_mask=(batch["segment_ids"] > 0).long()).logits
        mask = batch["labels"] != -100
        loss_sum += torch.nn.functional.cross_entropy(logits[mask], batch["labels"][mask], reduction="sum").item()
        count += int(mask.sum())
    assert count == ours["tokens"] > 0
    assert math.exp(loss_sum / count) == pytest.approx(ours["perplexity"], rel=1e-4)


def test_greedy_generation_matches_transformers(pretrained, exported):
    ours = load_for_inference(pretrained["run"]).model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    prompt = torch.randint(5, 512, (1, 8), generator=torch.Generator().manual_seed(1))
    expected = theirs.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)[:, 8:]
    assert torch.equal(generate(ours, prompt, 20, temperature=0.0), expected)


def test_import_of_export_is_bit_identical(pretrained, exported):
    back = pretrained["root"] / "imported"
    cli("import", "--hf", str(exported), "--out", str(back))
    original = load_for_inference(pretrained["run"]).model.state_dict()
    again = load_for_inference(back).model.state_dict()
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original)


def test_eval_does_not_depend_on_batch_size(pretrained):
    runs = [
        cli("eval", "--checkpoint", pretrained["run"], "--data", pretrained["shards"], "--batch-size", b, "--json")
        for b in (1, 3)
    ]
    results = [json.loads(run.stdout) for run in runs]
    loading, evaluating = runs[1].stderr.splitlines()[:2]
    assert loading == f"loading {pretrained['run']}"
    assert evaluating.startswith(f"evaluating {results[1]['checkpoint']} on {pretrained['shards']} (")
    assert results[0]["tokens"] == results[1]["tokens"] > 0
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-5)
    assert "(autoregressive, fp32 on cpu, batches of 3)" in evaluating


def test_eval_in_bf16_is_the_fp32_numbers_to_bf16s_precision(pretrained):
    """--dtype bf16: the model's weights and activations in bf16 (its GEMMs in fp32 where this CPU has no bf16
    kernels): near the fp32 loss, not equal to it."""
    source = ("--checkpoint", pretrained["run"], "--data", pretrained["shards"])
    runs = {dtype: cli("eval", *source, "--dtype", dtype, "--json") for dtype in ("fp32", "bf16")}
    results = {dtype: json.loads(run.stdout) for dtype, run in runs.items()}
    assert "(autoregressive, bf16 on cpu, batches of 8)" in runs["bf16"].stderr
    assert results["bf16"]["tokens"] == results["fp32"]["tokens"]
    assert results["bf16"]["loss"] == pytest.approx(results["fp32"]["loss"], rel=1e-2)
    assert results["bf16"]["loss"] != results["fp32"]["loss"]


def test_generate_streams_a_continuation(pretrained):
    result = cli(
        "generate",
        "--checkpoint",
        str(pretrained["run"]),
        "--prompt",
        "Return the",
        "--max-new-tokens",
        "10",
        "--temperature",
        "0",
    )
    assert result.stdout.startswith("Return the") and len(result.stdout) > len("Return the\n")


def test_generate_refuses_too_many_tokens_with_exit_2(pretrained):
    result = cli(
        "generate", "--checkpoint", str(pretrained["run"]), "--prompt", "x", "--max-new-tokens", "999", check=False
    )
    assert result.returncode == 2 and "max_seq_len" in result.stderr


def test_export_of_a_non_llama_model_is_refused_by_name(pretrained, tmp_path):
    from megatransformer.checkpoint import write_manifest

    ckpt = tmp_path / "ln"
    cli("export", "--checkpoint", str(pretrained["run"]), "--out", str(ckpt))  # consolidated safetensors
    config = ckpt / "config.yaml"
    config.write_text(config.read_text().replace("norm: rmsnorm", "norm: layernorm"))
    write_manifest(ckpt)  # (the edit is ours: list the file as it is now, or the export refuses it as damaged)
    result = cli("export", "--checkpoint", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"), check=False)
    assert result.returncode == 2 and "model.norm=layernorm" in result.stderr


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    result = cli("eval", "--checkpoint", str(tmp_path / "nope"), "--data", str(tmp_path), check=False)
    assert result.returncode == 2 and f"--checkpoint {tmp_path / 'nope'} does not exist" in result.stderr
    result = cli("eval", "--checkpoint", str(tmp_path), "--data", str(tmp_path), check=False)
    assert result.returncode == 2 and "no complete checkpoint there" in result.stderr


def write_instructions(path: Path, documents: list[str]) -> list[tuple[str, str]]:
    """(prompt, completion) examples: continue a document from its first words."""
    examples = []
    for doc in documents:
        words = doc.split()
        if len(words) > 4:
            examples.append(("Continue: " + " ".join(words[:4]) + "\n", (" " + " ".join(words[4:]))[:80]))
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in examples))
    return examples


def test_fine_tune_on_instructions_then_eval_generate_and_export(pretrained, tmp_path):
    """The documented workflow: pretrain -> init_from fine-tune (prefix_lm on prompt/completion data, loss on
    the completion only) -> eval -> generate -> export."""
    from data_pipeline.tokenizer import load_tokenizer

    documents = (pretrained["root"] / "corpus.txt").read_text().split("\n\n")
    write_instructions(tmp_path / "train.jsonl", documents[:-20])
    held_out = write_instructions(tmp_path / "held_out.jsonl", documents[-20:])
    cli(
        "data",
        "shard",
        "--input",
        str(tmp_path / "train.jsonl"),
        "--tokenizer",
        str(pretrained["tokenizer"]),
        "--out",
        str(tmp_path / "sft"),
        "--prompt-field",
        "prompt",
        "--completion-field",
        "completion",
        "--shard-mb",
        "0.02",
        "--valid-every",
        "10",
        "--workers",
        "1",
    )
    run = tmp_path / "finetune"
    trained = cli(
        "train",
        "--config",
        str(pretrained["config"]),
        f"run_dir={run}",
        f"init_from={pretrained['run']}/checkpoints",
        "objective=prefix_lm",
        f"data.train={tmp_path / 'sft'}",
        "data.seq_len=128",
        "train.max_steps=4",
        "parallel.zero_stage=2",
        "model.dropout=0.05",
    )  # packed: several examples per row, each with its prompt as prefix
    assert "this model differs from the checkpoint's: model.dropout=0.05 (0.0 there)" in trained.stdout
    weights_before = load_for_inference(pretrained["run"]).model.state_dict()
    tuned = load_for_inference(run)
    assert tuned.cfg.objective == "prefix_lm"
    changed = [k for k, v in tuned.model.state_dict().items() if not torch.equal(v, weights_before[k])]
    assert changed, "fine-tuning did not update the weights"
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] < 6.0, "started from scratch instead of the pretrained weights (ln 512 = 6.2)"

    # one example per row, so that every completion token is counted (a packed stream drops its last partial row)
    result = json.loads(
        cli(
            "eval",
            "--checkpoint",
            str(run),
            "--data",
            str(tmp_path / "held_out.jsonl"),
            "--prompt-field",
            "prompt",
            "--json",
            "data.pack=false",
            "data.seq_len=128",
        ).stdout
    )
    tok = load_tokenizer(pretrained["tokenizer"])
    assert result["objective"] == "prefix_lm" and result["sequences"] == len(held_out)
    assert result["tokens"] == sum(len(tok.encode(c)) + 1 for _, c in held_out), "loss on completions + EOS only"

    prompt = held_out[0][0]
    out = cli("generate", "--checkpoint", str(run), "--prompt", prompt, "--max-new-tokens", "8").stdout
    assert out.startswith(prompt) and len(out) > len(prompt)
    exported = cli("export", "--checkpoint", str(run), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").is_file() and "objective=prefix_lm" in exported.stderr
