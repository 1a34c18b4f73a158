"""``megatransformer eval``: token-level loss and perplexity of a checkpoint on shards or text files, or
(``--bleu``) BLEU and chrF of its beam-search translations of a test file, or (``--tasks``) lm-evaluation-harness
tasks (docs/evaluation.md).

Every loss token counts once: the numbers do not depend on the batch size (samples are built one by one
with per-sample seeds, then batched; the last partial batch is kept).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from megatransformer.console import to_stderr


def register(subparsers: argparse._SubParsersAction) -> None:
    from megatransformer.commands.arguments import add_beam_arguments, add_dtype_argument, add_zero_stage_argument
    from megatransformer.commands.data import add_instruction_arguments

    p = subparsers.add_parser(
        "eval",
        help="loss and perplexity of a checkpoint on held-out data, or lm-eval tasks",
        description="Token-level loss and perplexity of a checkpoint on shards or text files, or (--tasks) "
        "lm-evaluation-harness tasks; "
        "key.path=value overrides may follow the options: data.*, objective, objective_args.*, seed, and model.* "
        "fields that keep the weights' shapes (e.g. data.seq_len=4096 model.max_seq_len=4096 "
        "model.rope_scaling='{type: dynamic, factor: 2, original_max_seq_len: 2048}').",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint, checkpoints directory or run directory")
    p.add_argument(
        "--data",
        nargs="+",
        help="a shard directory (its validation split, or --split) or .txt/.jsonl files",
    )
    add_task_arguments(p)
    p.add_argument("--split", choices=["train", "valid"], default="valid", help="which split of a shard directory")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (does not change the numbers)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches (default: all data)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_dtype_argument(p)
    add_zero_stage_argument(p)
    add_instruction_arguments(p)
    p.add_argument(
        "--bleu",
        action="store_true",
        help="translate every --source-field text of --data (.jsonl/.tsv) and score the hypotheses "
        "against --target-field with sacrebleu (BLEU, chrF) instead of computing the loss",
    )
    p.add_argument("--hypotheses", default=None, help="with --bleu: write the hypotheses here, one per line")
    add_beam_arguments(p)
    p.add_argument(
        "overrides", nargs="*", metavar="key.path=value", help="e.g. data.seq_len=256 model.attention_window=64"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    from megatransformer.commands.arguments import zero_stage
    from megatransformer.config import ConfigError

    if args.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    if bool(args.data) == bool(args.tasks):
        raise ConfigError("give --data (loss and perplexity) or --tasks (lm-eval tasks), one of them")
    if args.tasks:
        return run_tasks(args)
    if args.bleu or args.hypotheses:
        _check_bleu_arguments(args)
    model_overrides, run_overrides = _split_overrides(args.overrides)
    stage = zero_stage(args)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    partitioned = stage == 3
    speaks = rank == 0 or not partitioned  # (partitioned, the ranks evaluate together and rank 0 tells)
    say = to_stderr if speaks else lambda line: None
    say(f"loading {args.checkpoint}")  # (PyTorch and the weights: seconds, on a busy machine tens of them)
    import torch

    from megatransformer.inference import inference_device, load_model
    from megatransformer.lockstep import Placement, gather_group, joined, rank_0s
    from megatransformer.training.threads import say_threads

    say_threads(say)  # (as train picks its threads: a busy machine's default threads wait for each other)
    device = inference_device(say)
    with joined(torch.device(device), world if partitioned else 1):
        loaded = load_model(args.checkpoint, device, model_overrides, args.dtype, stage, "eval")
        if loaded.tokenizer is None:
            raise ConfigError(f"{loaded.path} has no tokenizer.json")
        forwards = bf16_matmuls(args.dtype, loaded.device)
        held = f", ZeRO-3 over {world} ranks: 1/{world} of the weights a rank" if partitioned else ""
        if args.bleu:
            # every rank translates every sentence, taking rank 0's choices (generate's way; encoder-decoders call
            # the encoder and the decoder apart, which ranks translating shares of their own would not do in step)
            with forwards():
                result = _bleu(args, loaded, rank_0s if partitioned else None, say if speaks else None)
        else:
            ranks = world if partitioned else 1
            group = gather_group(ranks)
            placement = Placement(loaded.device, rank % ranks, ranks, forwards, group, lockstep=ranks > 1)
            result = _loss(args, loaded, run_overrides, placement, held, say)
    if not speaks:
        return 0
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.bleu:
        print(
            f"{result['bleu_text']}\n{result['chrf_text']}\nBLEU signature: {result['bleu_signature']}\n"
            f"chrF signature: {result['chrf_signature']}\n({result['sentences']:,} sentences, beam "
            f"{args.num_beams}, length penalty {args.length_penalty_form} alpha={args.length_penalty})"
        )
    else:
        print(
            f"{result['objective']}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} "
            f"over {result['tokens']:,} tokens ({result['sequences']:,} sequences); bits per byte "
            f"{result['bits_per_byte']:.4f} over {result['bytes']:,} bytes, word perplexity "
            f"{result['word_perplexity']:.3f} over {result['words']:,} words"
        )
    return 0


def _loss(args: argparse.Namespace, loaded, run_overrides: list[str], placement, held: str, say) -> dict:
    """The loss, perplexity, bits per byte and word perplexity of ``loaded`` on ``--data``."""
    from megatransformer.config import apply_overrides, validate

    raw = apply_overrides(loaded.cfg.model_dump(mode="json"), run_overrides)
    with tempfile.TemporaryDirectory() as tmp:
        shards, split = _as_shards(args, loaded.tokenizer.path, Path(tmp))
        # one stream: every document once, in order, however few there are
        raw["data"] = {**raw["data"], "train": shards, "valid": shards, "num_workers": 0, "streams": 1}
        cfg = validate(raw)
        limit = f", at most {args.max_batches} batches" if args.max_batches else ""
        data = " ".join(args.data)
        say(
            f"evaluating {loaded.path} on {data} ({cfg.objective}, {args.dtype} on {loaded.device}{held}, batches of "
            f"{args.batch_size}{limit})"
        )
        say(scored(cfg))
        result = evaluate(loaded.model, cfg, loaded.tokenizer, split, args.batch_size, args.max_batches, placement)
    return {"checkpoint": str(loaded.path), "objective": cfg.objective, **result}


# What eval reads of a run config besides the model; --data sets the data files and their reading itself.
_EVAL_SECTIONS = ("data", "objective", "objective_args", "seed")
_SET_BY_EVAL = ("data.train", "data.valid", "data.num_workers", "data.streams")


def _split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(model.* overrides, the others eval applies); any other one is refused: it would change nothing."""
    from megatransformer.config import ConfigError

    model, run = [], []
    for item in overrides:
        key = item.partition("=")[0]
        if key.split(".")[0] == "model":
            model.append(item)
        elif key.split(".")[0] in _EVAL_SECTIONS and key not in _SET_BY_EVAL:
            run.append(item)
        else:
            raise ConfigError(
                f"{item} would change nothing in eval (it applies model.*, data.*, objective, objective_args.* and "
                "seed; --data sets the files)"
            )
    return model, run


def _check_bleu_arguments(args: argparse.Namespace) -> None:
    from data_pipeline.shard import MANIFEST
    from megatransformer.config import ConfigError

    if not args.bleu:
        raise ConfigError("--hypotheses goes with --bleu")
    if not args.prompt_field:
        raise ConfigError("--bleu needs --source-field (and --target-field) to read translation pairs from --data")
    if any((Path(d) / MANIFEST).is_file() for d in args.data):
        raise ConfigError("--bleu translates text: give --data .jsonl/.tsv files, not a shard directory")
    if args.num_beams < 1:
        raise ConfigError("--num-beams must be >= 1")
    other = [item for item in args.overrides if not item.startswith("model.")]
    if other:
        raise ConfigError(f"--bleu takes only model.* overrides (got {' '.join(other)})")


def _bleu(args: argparse.Namespace, loaded, agreed, say) -> dict:
    """``bleu_of`` the ``--data`` pairs; ``say`` None: a rank that writes and says nothing (not rank 0)."""
    return {
        "checkpoint": str(loaded.path),
        **bleu_of(
            loaded,
            args.data,
            args.prompt_field,
            args.completion_field,
            args.num_beams,
            args.length_penalty,
            args.length_penalty_form,
            args.hypotheses if say else None,
            args.batch_size,
            agreed,
            say or (lambda line: None),
        ),
    }


def bleu_of(
    loaded,
    files: list[str],
    source_field: str,
    target_field: str,
    num_beams: int,
    alpha: float,
    form: str,
    hypotheses: str | None = None,
    batch_size: int = 8,
    agreed: Callable | None = None,
    say: Callable[[str], None] = to_stderr,
) -> dict:
    """Beam-search translations of the pairs in ``files`` (sources of equal length ``batch_size`` at a time)
    scored by sacrebleu: BLEU, chrF and their signatures (the settings that make scores comparable); ``agreed``:
    as ``beam_search`` takes it."""
    from sacrebleu.metrics import BLEU, CHRF

    from data_pipeline.documents import read_documents
    from megatransformer.config import ConfigError
    from megatransformer.inference import beam_decode

    tok = loaded.tokenizer
    sources, references = [], []
    for pair in read_documents(files, target_field, prompt_field=source_field):
        sources.append(tok.encode(pair.prompt))
        if not sources[-1]:
            raise ConfigError(f"{pair.file}:{pair.line}: the source encodes to no tokens")
        references.append(pair.text)
    if not sources:
        raise ConfigError(f"no translation pairs in {', '.join(files)}")
    say(
        f"translating {len(sources):,} sentences of {', '.join(files)} with {loaded.path}: beam {num_beams}, "
        f"batches of {batch_size}"
    )
    outputs = [
        tok.decode(tokens, skip_special=True).strip()
        for tokens in beam_decode(loaded, sources, num_beams, alpha, form, batch_size=batch_size, agreed=agreed)
    ]
    if hypotheses:
        Path(hypotheses).write_text("".join(line.replace("\n", " ") + "\n" for line in outputs))
    warning = empty_hypotheses_warning(outputs)
    if warning:
        say(warning)
    bleu, chrf = BLEU(), CHRF()
    bleu_score, chrf_score = bleu.corpus_score(outputs, [references]), chrf.corpus_score(outputs, [references])
    return {
        "bleu": bleu_score.score,
        "chrf": chrf_score.score,
        "bleu_text": str(bleu_score),
        "chrf_text": str(chrf_score),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "sentences": len(outputs),
    }


def empty_hypotheses_warning(outputs: list[str]) -> str | None:
    """A warning when a tenth or more of the translations are empty: BLEU then scores mostly silence."""
    empty = sum(not text for text in outputs)
    if not outputs or empty * 10 < len(outputs):
        return None
    return (
        f"warning: {empty:,} of {len(outputs):,} hypotheses are empty (the model ends them at once: trained "
        "too little, or not a translation model?); the scores count them as empty translations"
    )


def add_task_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        metavar="TASK",
        help="lm-evaluation-harness tasks: names it knows, names under --include-path, or task YAML files",
    )
    p.add_argument("--include-path", action="append", default=[], help="a folder of task YAMLs (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="with --tasks: at most this many examples a task")
    p.add_argument("--num-fewshot", type=int, default=None, help="with --tasks: few-shot examples a prompt")
    p.add_argument(
        "--bootstrap-iters",
        type=int,
        default=100_000,
        help="with --tasks: bootstrap resamples for the standard errors that need them (0: none; lm-eval's default)",
    )
    p.add_argument("--samples", default=None, help="with --tasks: every item's responses and metrics, as JSONL here")


def run_tasks(args: argparse.Namespace) -> int:
    """lm-eval tasks on the checkpoint, one process or each torchrun rank a share of every task's items."""
    import os

    from megatransformer.commands.arguments import zero_stage
    from megatransformer.config import ConfigError

    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: give at least 1 item a task (--limit 0 evaluates nothing)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError("--num-fewshot must be >= 0")
    if args.bleu or args.overrides:
        raise ConfigError("--tasks takes no --bleu and no key.path=value overrides")
    stage = zero_stage(args)
    if args.samples:
        writable(Path(args.samples))
    # (PyTorch and lm-eval load for tens of seconds on a busy machine; a terminal only: a task name lm-eval does not
    # know, found once it has loaded, stays a script's one line of stderr)
    if os.environ.get("RANK", "0") == "0" and sys.stderr.isatty():
        to_stderr(f"loading {args.checkpoint}, PyTorch and lm-evaluation-harness for {' '.join(args.tasks)}")
    import torch

    from megatransformer import harness
    from megatransformer.inference import inference_device, load_model
    from megatransformer.lockstep import Placement, gather_group, joined
    from megatransformer.training.threads import say_threads

    tasks = harness.load_tasks(args.tasks, args.include_path)
    harness.check_fewshot(tasks, args.num_fewshot, "--num-fewshot")
    if int(os.environ.get("RANK", 0)) == 0:
        for line in tasks.code():
            to_stderr(line)  # (a task folder is code: lm-eval imports it)
    say_threads(to_stderr)  # (after the tasks: a name lm-eval does not know stays one line)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(inference_device(to_stderr))
    with joined(device, world):
        loaded = load_model(args.checkpoint, str(device), [], args.dtype, stage, "eval")  # (on the device set)
        if loaded.tokenizer is None:
            raise ConfigError(f"{loaded.path} has no tokenizer.json")
        if rank == 0:
            held = f", ZeRO-3: 1/{world} of the weights a rank" if stage == 3 else ""
            to_stderr(
                f"evaluating {loaded.path} on {' '.join(tasks.names)} with lm-eval ({args.dtype} on {device}, "
                f"{world} rank{'s' * (world > 1)}{held}, batches of {args.batch_size})"
            )
        group = gather_group(world)
        forwards = bf16_matmuls(args.dtype, device)
        placement = Placement(device, rank, world, forwards, group, lockstep=stage == 3 and world > 1)
        lm = harness.HarnessLM(loaded.model, loaded.cfg, loaded.tokenizer, placement, args.batch_size)
        bar = task_progress(lm, sys.stderr, enabled=rank == 0 and sys.stderr.isatty())  # (before quiet's redirect)
        with harness.quiet():
            results = harness.evaluate(
                lm, tasks, args.limit, args.num_fewshot, args.bootstrap_iters, log_samples=bool(args.samples)
            )
        bar.close()
    if results is None:  # (ranks other than 0)
        return 0
    if args.samples:
        write_samples(Path(args.samples), results["samples"])
    if args.json:
        print(json.dumps({"tasks": harness.metrics_of(results)}))
    else:
        from lm_eval.utils import make_table

        print(make_table(results))
    return 0


def writable(path: Path) -> None:
    """Refuse a --samples path that cannot be written, before anything is evaluated."""
    from megatransformer.config import ConfigError

    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as err:
        raise ConfigError(
            f"--samples {path} cannot be written ({err.strerror or err.__class__.__name__}); give a writable path"
        ) from None
    if not existed:
        path.unlink()


def task_progress(lm, stream, enabled: bool = True):
    """A bar of the harness's requests this rank scores, on ``stream`` (the harness's own bars are silenced with
    its prints by harness.quiet): each scoring call adds its requests to the total, each packed batch its scored
    requests to the count, a generation call its requests when done."""
    from tqdm import tqdm

    bar = tqdm(total=0, unit="request", desc="lm-eval", file=stream, disable=not enabled, dynamic_ncols=True)
    score, hidden, generate = lm._loglikelihood_tokens, lm._packed_hidden, lm.generate_until

    def scoring(requests, *args, **kwargs):
        bar.total += len(requests)
        bar.refresh()
        return score(requests, *args, **kwargs)

    def packed(layout):
        out = hidden(layout)
        bar.update(len(layout.scored))
        return out

    def generating(requests, *args, **kwargs):
        bar.total += len(requests)
        bar.refresh()
        out = generate(requests, *args, **kwargs)
        bar.update(len(requests))
        return out

    lm._loglikelihood_tokens, lm._packed_hidden, lm.generate_until = scoring, packed, generating
    return bar


def write_samples(path: Path, samples: dict[str, list[dict]]) -> None:
    """One line per item: its task, doc_id, the model's responses (loglikelihoods or text) and its metrics."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for task, items in samples.items():
            for item in sorted(items, key=lambda item: item["doc_id"]):
                metrics = {name: item[name] for name in item["metrics"]}
                record = {"task": task, "doc_id": item["doc_id"], "resps": item["resps"], "metrics": metrics}
                f.write(json.dumps(record, default=str) + "\n")


def _as_shards(args: argparse.Namespace, tokenizer: str, tmp: Path) -> tuple[str, str]:
    """``--data`` as (shard directory, split): given shards as they are, text files tokenized into ``tmp``."""
    from data_pipeline.shard import MANIFEST, write_shards

    data = args.data
    if len(data) == 1 and (Path(data[0]) / MANIFEST).is_file():
        return data[0], args.split
    text_field = args.completion_field if args.prompt_field else "text"
    write_shards(
        data,
        tokenizer,
        tmp / "shards",
        valid_every=0,
        workers=1,
        progress=False,
        text_field=text_field,
        prompt_field=args.prompt_field,
    )
    return str(tmp / "shards"), "train"  # every document went to the (only) split


def bf16_matmuls(dtype: str, device) -> Callable[[], contextlib.AbstractContextManager]:
    """The context the forwards run in: in bf16 on a CPU without bf16 GEMM kernels, fp32 GEMMs of the bf16 operands
    (the same products and sums, many times faster there), as a bf16 run's own forwards (``cpu_bf16.py``)."""
    from megatransformer.config import precision_dtype
    from megatransformer.training.runtime.cpu_bf16 import gemms_as_fp32, matmul_context

    return matmul_context(gemms_as_fp32("auto", device, precision_dtype(dtype)))


def evaluate(
    model, cfg, tokenizer, split: str, batch_size: int, max_batches: int | None = None, placement=None
) -> dict:
    """The summed loss of every batch of ``split`` and what it is over. ``placement`` (``lockstep.Placement``; None:
    one process on the model's device) of several ranks: every rank reads every batch and runs batches rank,
    rank + N, ... of them, in lockstep (a rank whose share is done runs the first row again until every share is);
    the batches' sums are gathered and added in their order, as one process adds them."""
    import torch
    from tqdm import tqdm

    from megatransformer.batch import IGNORE_INDEX
    from megatransformer.lockstep import Placement
    from megatransformer.training.data import build_run_loader

    loader = build_run_loader(cfg, split, 1, 0, 1, tokenizer, epochs=1)
    device = next(model.parameters()).device
    placement = placement or Placement(device)
    ranks, rank = placement.world_size, placement.rank
    total = expected_rows(cfg, split)
    if max_batches:
        total = min(total or max_batches * batch_size, max_batches * batch_size)
    bar = tqdm(
        total=total and -(-total // ranks),
        unit="row",
        desc="evaluating",
        file=sys.stderr,
        disable=rank != 0 or not sys.stderr.isatty(),
    )

    def loss_of(samples: list[dict]) -> tuple[float, torch.Tensor]:
        batch = {k: torch.cat([b[k] for b in samples]).to(device) for k in samples[0]}
        labels = batch.pop("labels")
        with torch.no_grad(), placement.forwards():
            return model(**batch, labels=labels).item(), labels

    sums: dict[int, tuple[float, int, int, int, int]] = {}  # batch: (loss, tokens, bytes, words, sequences)

    def run(index: int, samples: list[dict]) -> None:
        placement.any_working(True)
        loss, labels = loss_of(samples)
        text_bytes, words = 0, 0
        for row in labels:
            text = tokenizer.decode(row[row != IGNORE_INDEX].tolist(), skip_special=True)
            text_bytes += len(text.encode())
            words += len(text.split())
        sums[index] = (loss, int((labels != IGNORE_INDEX).sum()), text_bytes, words, len(samples))
        bar.update(len(samples))

    batches, pending, first = 0, [], None
    for sample in loader:
        first = first or [sample]
        pending.append(sample)
        if len(pending) == batch_size:
            if batches % ranks == rank:
                run(batches, pending)
            batches, pending = batches + 1, []
            if max_batches and batches >= max_batches:
                break
    if pending and not (max_batches and batches >= max_batches) and batches % ranks == rank:
        run(batches, pending)
    placement.wait_for_others(lambda: loss_of(first))
    for share in placement.gather_all(sums):
        sums.update(share)
    bar.total = bar.n  # (the rows expected were an estimate)
    bar.close()
    ordered = [sums[index] for index in sorted(sums)]
    loss_sum = sum(batch[0] for batch in ordered)  # (in the batches' order: the one-process sum, bit for bit)
    tokens, text_bytes, words, sequences = (sum(batch[k] for batch in ordered) for k in range(1, 5))
    loss = loss_sum / max(tokens, 1)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "bits_per_byte": loss_sum / math.log(2) / max(text_bytes, 1),
        "word_perplexity": math.exp(min(loss_sum / max(words, 1), 50.0)),
        "tokens": tokens,
        "bytes": text_bytes,
        "words": words,
        "sequences": sequences,
    }


def expected_rows(cfg, split: str) -> int | None:
    """About how many rows the evaluation reads, for its progress bar: the split's tokens over data.seq_len when
    packed, its documents otherwise (None when the manifest cannot say)."""
    from data_pipeline.shard import Manifest

    try:
        manifest = Manifest.load(cfg.data.valid)
        if cfg.data.pack:
            return max(1, manifest.tokens(split) // cfg.data.seq_len)
        return sum(shard.documents for shard in manifest.splits.get(split, []))
    except Exception:  # (a progress bar without a total: it counts)
        return None


def scored(cfg) -> str:
    """What the loss of :func:`evaluate` is over, in one line."""
    rows = (
        "the documents packed in order and cut where a row ends (a row's first tokens have no context before it)"
        if cfg.data.pack
        else "each document in rows of its own, padded (data.pack=false; one longer than a row goes on in the next, "
        "without the context before it)"
    )
    return (
        f"scored: every {cfg.objective} label token of rows of data.seq_len={cfg.data.seq_len} tokens, {rows}; "
        "bytes and words are those of the labels' decoded text, special tokens left out"
    )
