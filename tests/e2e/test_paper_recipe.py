"""The 2017 recipe end to end on a toy language pair: translation pairs (.tsv / .jsonl) -> shards -> a tiny
encoder-decoder -> checkpoint averaging -> beam search -> sacrebleu BLEU; plus the parts on their own."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch
from support.runs import ONE_THREAD
from support.runs import cli as megatransformer

# A deterministic toy language pair: every source word has its own target word. Copying the source scores a BLEU
# of 0 (no word in common); the model must learn the vocabulary and align every target word with its source word.
# (Reversing the word order as well makes a harder pair whose training time on a busy 2-core machine varied too
# much for a test.)
SOURCE_WORDS = "ka lo mi nu pe ri so tu va we xi yo".split()
TARGET_WORDS = "ember ivory amber olive coral pearl slate cedar maple frost lilac ocean".split()


def toy_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    translate = dict(zip(SOURCE_WORDS, TARGET_WORDS))
    pairs = []
    for _ in range(n):
        words = [rng.choice(SOURCE_WORDS) for _ in range(rng.randint(2, 6))]
        pairs.append((" ".join(words), " ".join(translate[w] for w in words)))
    return pairs


def cli(*args: object, check: bool = True) -> subprocess.CompletedProcess:
    """The CLI with one intra-op thread: a model this small gains nothing from more, and on a busy machine
    the threads of concurrent processes make every step many times slower."""
    return megatransformer(*args, check=check, env=ONE_THREAD)


# ------------------------------------------------------------------------------------------- parallel data


def test_source_target_fields_are_the_prompt_completion_path(tmp_path, tiny_data):
    """``--source-field/--target-field`` shard exactly what ``--prompt-field/--completion-field`` shard."""
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps({"src": s, "tgt": t}) + "\n" for s, t in toy_pairs(50, seed=0)))
    common = ["data", "shard", "--input", jsonl, "--tokenizer", tiny_data.tokenizer, "--workers", "1"]
    cli(*common, "--out", tmp_path / "a", "--source-field", "src", "--target-field", "tgt")
    cli(*common, "--out", tmp_path / "b", "--prompt-field", "src", "--completion-field", "tgt")
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab")
    assert a == b and a["kind"] == "prompt_completion" and a["documents"] == 50


@pytest.mark.parametrize(
    "args,message",
    [
        (["eval", "--data", "t.jsonl", "--bleu"], "--bleu needs --source-field"),
        (
            ["eval", "--data", "t.jsonl", "--source-field", "s", "--hypotheses", "h.txt"],
            "--hypotheses goes with --bleu",
        ),
        (
            ["eval", "--data", "t.jsonl", "--source-field", "s", "--bleu", "--num-beams", "0"],
            "--num-beams must be >= 1",
        ),
        (
            ["generate", "--prompt", "x", "--num-beams", "4", "--top-p", "0.9"],
            "does not combine with --top-k / --top-p",
        ),
    ],
)
def test_bad_decoding_arguments_are_refused_before_loading(args, message):
    result = cli(*args, "--checkpoint", "no/such/checkpoint", check=False)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1


# ------------------------------------------------------------------------------ training, averaging, BLEU


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory) -> dict[str, Path]:
    """A tiny encoder-decoder trained through the CLI on 3000 toy pairs (.tsv with a header), checkpoints every 200
    steps (it converges after about 200); the test set is a .jsonl file. Embeddings scaled by sqrt(d_model) as in
    the paper: without it the sinusoidal positions drown the token embeddings and the model learns far slower."""
    root = tmp_path_factory.mktemp("toy_translation")
    train, test = toy_pairs(3000, seed=1), toy_pairs(60, seed=2)
    (root / "train.tsv").write_text("src\ttgt\n" + "".join(f"{s}\t{t}\n" for s, t in train))
    (root / "test.jsonl").write_text("".join(json.dumps({"src": s, "tgt": t}) + "\n" for s, t in test))
    (root / "corpus.txt").write_text("\n\n".join(f"{s}\n{t}" for s, t in train))
    cli(
        "data",
        "tokenizer",
        "--input",
        root / "corpus.txt",
        "--vocab-size",
        "400",
        "--sentinels",
        "0",
        "--out",
        root / "tok.json",
    )
    cli(
        "data",
        "shard",
        "--input",
        root / "train.tsv",
        "--source-field",
        "src",
        "--target-field",
        "tgt",
        "--tokenizer",
        root / "tok.json",
        "--out",
        root / "shards",
        "--valid-every",
        "20",
        "--workers",
        "1",
    )
    config = root / "run.yaml"
    config.write_text(f"""
run_dir: {root / "run"}
model: {{arch: encoder_decoder, d_model: 64, n_layers: 2, n_heads: 4, d_ff: 128, vocab_size: 400,
         max_seq_len: 64, position: sinusoidal, ffn: relu, share_embeddings: true, tie_embeddings: true,
         scale_embeddings: true, dropout: 0.0}}
data: {{train: {root / "shards"}, tokenizer: {root / "tok.json"}, seq_len: 32, num_workers: 0}}
objective: prefix_lm
train: {{micro_batch_size: 16, grad_accum: 1, max_steps: 600, log_every: 100, eval_batches: 2,
         label_smoothing: 0.1}}
optim: {{name: adam, lr: 5.0e-3, betas: [0.9, 0.98], eps: 1.0e-9, weight_decay: 0.0}}
schedule: {{name: cosine, warmup_steps: 30}}
checkpoint: {{every: 200, keep: 10}}
wandb: {{mode: disabled}}
""")
    cli("train", "--config", config)
    return {"root": root, "run": root / "run", "test": root / "test.jsonl", "tokenizer": root / "tok.json"}


def bleu(checkpoint: Path, test: Path, beams: int, *extra: str) -> dict:
    out = cli(
        "eval",
        "--checkpoint",
        checkpoint,
        "--data",
        test,
        "--source-field",
        "src",
        "--target-field",
        "tgt",
        "--bleu",
        "--num-beams",
        str(beams),
        "--length-penalty",
        "0.6",
        "--json",
        *extra,
    ).stdout
    return json.loads(out)


def test_trained_translation_model_beats_copying(toy_run):
    """The averaged last checkpoints translate the held-out pairs: BLEU far above the copy baseline, beam 4
    at least as good as greedy; the hypotheses file holds what was scored."""
    from sacrebleu.metrics import BLEU

    averaged = toy_run["root"] / "averaged"
    cli("average", "--last", "2", toy_run["run"], "--out", averaged)
    pairs = [json.loads(line) for line in toy_run["test"].read_text().splitlines()]
    copy = BLEU().corpus_score([p["src"] for p in pairs], [[p["tgt"] for p in pairs]]).score
    greedy = bleu(averaged, toy_run["test"], 1)
    hypotheses = toy_run["root"] / "hyp.txt"
    beam = bleu(averaged, toy_run["test"], 4, "--hypotheses", str(hypotheses))
    assert copy < 5 and beam["bleu"] > copy + 50, (copy, beam)
    assert beam["bleu"] >= greedy["bleu"], (beam, greedy)
    assert beam["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    lines = hypotheses.read_text().splitlines()
    assert len(lines) == len(pairs)
    assert BLEU().corpus_score(lines, [[p["tgt"] for p in pairs]]).score == pytest.approx(beam["bleu"])
    said = cli(
        "eval",
        "--checkpoint",
        averaged,
        "--data",
        toy_run["test"],
        "--source-field",
        "src",
        "--target-field",
        "tgt",
        "--bleu",
        "--num-beams",
        "4",
    )
    text = said.stdout
    assert text.startswith("BLEU = ") and "chrF2 = " in text and "BLEU signature: nrefs:1" in text
    loading, translating = said.stderr.splitlines()[:2]
    assert loading == f"loading {averaged}"
    assert translating.startswith(f"translating {len(pairs)} sentences of {toy_run['test']} with {averaged}: beam 4")


def test_generate_translates_with_beams(toy_run):
    """Encoder-decoder generation defaults to input length + 50 new tokens and stops at EOS."""
    out = cli("generate", "--checkpoint", toy_run["run"], "--prompt", "ka lo mi", "--num-beams", "4").stdout
    assert out.split() == ["ember", "ivory", "amber"]


def checkpoints(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step_*"))


def test_average_is_the_parameter_mean(toy_run, tmp_path):
    from safetensors.torch import load_file

    from megatransformer.checkpoint import load_weights

    sources = checkpoints(toy_run["run"])[-3:]
    cli("average", "--checkpoints", *sources, "--out", tmp_path / "avg")
    weights = [load_weights(p)[1] for p in sources]
    averaged = load_file(tmp_path / "avg" / "model.safetensors")
    assert set(averaged) == set(weights[0])
    for name, tensor in averaged.items():
        assert tensor.dtype == torch.float32
        expected = sum(w[name].double() for w in weights) / len(weights)
        assert (tensor.double() - expected).abs().max().item() < 1e-6, name
        assert not torch.equal(tensor, weights[-1][name]) or torch.equal(weights[0][name], weights[-1][name])
    # what every reader of checkpoints accepts: eval (loss), export, init_from
    loss = json.loads(
        cli(
            "eval",
            "--checkpoint",
            tmp_path / "avg",
            "--data",
            toy_run["test"],
            "--source-field",
            "src",
            "--target-field",
            "tgt",
            "--json",
        ).stdout
    )
    assert loss["tokens"] > 0 and loss["loss"] < 2.0
    cli("export", "--checkpoint", tmp_path / "avg", "--out", tmp_path / "exported")
    from megatransformer.checkpoint import saved_config

    cfg, loaded = load_weights(tmp_path / "avg", saved_config(sources[-1]).model)  # what init_from= does
    assert torch.equal(loaded["lm_head.weight"], averaged["lm_head.weight"])


def test_averaging_one_checkpoint_with_itself_changes_nothing(toy_run, tmp_path):
    from safetensors.torch import load_file

    from megatransformer.checkpoint import load_weights

    source = checkpoints(toy_run["run"])[-1]
    cli("average", "--checkpoints", source, source, source, "--out", tmp_path / "same")
    before, after = load_weights(source)[1], load_file(tmp_path / "same" / "model.safetensors")
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)


def test_average_refuses_other_model_shapes(toy_run, tmp_path):
    from megatransformer.checkpoint import saved_config, write_weights_checkpoint
    from megatransformer.model import build_model

    source = checkpoints(toy_run["run"])[-1]
    cfg = saved_config(source)
    other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"d_ff": 96})})
    write_weights_checkpoint(
        tmp_path / "other", other, build_model(other.model).state_dict(), source / "tokenizer.json"
    )
    result = cli("average", "--checkpoints", source, tmp_path / "other", "--out", tmp_path / "x", check=False)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "model.d_ff=96 (not 128)" in result.stderr
    assert not (tmp_path / "x").exists()
    result = cli("average", "--last", "99", toy_run["run"], "--out", tmp_path / "x", check=False)
    assert result.returncode == 2 and "only" in result.stderr
