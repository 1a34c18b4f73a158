"""lm-evaluation-harness on our decoders: an ``LM`` that runs in the caller's process on its device and
precision, task loading that fails in one line, and the harness's results as flat numbers.

Loglikelihood requests are packed, longest first, several to a row (one forward per batch of packed requests,
the output head only where a token is scored); generation left-pads a batch of prompts (padding is a segment
of its own) and decodes with the KV cache. Data-parallel ranks follow the harness's protocol (``rank`` /
``world_size``: each builds its share of every task's requests; the evaluator gathers the per-item metrics
once). Design: docs/evaluation.md.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatransformer.config import ConfigError

EVAL_EXTRA = "pip install -e '.[eval]'"

try:
    from lm_eval.api.model import TemplateLM
except ImportError:
    raise ConfigError(f"downstream evaluation needs lm-evaluation-harness (not installed): {EVAL_EXTRA}") from None

from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text  # noqa: E402

from megatransformer.batch import PAD_SEGMENT  # noqa: E402
from megatransformer.model.generate import sample_next  # noqa: E402
from megatransformer.model.masks import batch_masks  # noqa: E402

DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for tasks that name no max_gen_toks


@dataclass(frozen=True)
class Placement:
    """Where the harness's LM runs: ``rank`` of ``world_size`` data-parallel ranks (each with the whole model),
    on ``device``; ``forwards``: the context every forward runs in (autocast, a run's matmul precision)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    forwards: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def unsupported(arch: str) -> str | None:
    """Why a model of ``arch`` cannot be evaluated by the harness here, or None."""
    if arch == "decoder":
        return None
    return (
        f"lm-eval tasks score decoder models (model.arch=decoder); this is model.arch={arch}, which the harness "
        "would need as a seq2seq model of its own"
    )


def runs_varlen(cfg, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed documents run through flash-attn's or PyTorch's varlen kernels here, which skip what the
    segment masks forbid (the core ``attention_backend=auto`` picks for such a mask, or the one named)."""
    from megatransformer.model.attention import auto_backend
    from megatransformer.model.latent_attention import core_head_dim
    from megatransformer.model.masks import AttentionMask

    backend = cfg.model.attention_backend
    if backend == "auto":
        packed = AttentionMask(True, prefix_len=torch.zeros(1))  # (any mask that is not plain causal)
        alibi = cfg.model.position == "alibi"
        backend = auto_backend(device.type, dtype, packed, 0.0, core_head_dim(cfg.model), alibi)
    return device.type == "cuda" and backend in ("flash", "varlen")


def pack(lengths: list[int], capacity: int | None, max_rows: int) -> list[list[list[int]]]:
    """Batches of at most ``max_rows`` rows of request indices (``lengths``: longest first). A batch's first
    request opens its first row; each later one goes into the row with the least room that holds it, else into
    a new row while the batch has fewer than ``max_rows``, else into a later batch.

    ``capacity``: tokens a row, in every batch (where attention skips what the masks forbid: flash-attn's
    varlen kernels); None: rows as long as their batch's first request (where attention computes every pair of
    a row: no wider than that request padded)."""
    import bisect

    batches: list[list[list[int]]] = []
    remaining = list(range(len(lengths)))
    while remaining:
        width = capacity or lengths[remaining[0]]
        smallest = lengths[remaining[-1]]
        rows: list[list[int]] = []
        open_rows: list[tuple[int, int]] = []  # (room, row), sorted
        later: list[int] = []
        position = 0
        while position < len(remaining):
            index = remaining[position]
            length = lengths[index]
            at = bisect.bisect_left(open_rows, (length, -1))
            if at < len(open_rows):
                room, row = open_rows.pop(at)
            elif len(rows) < max_rows:
                room, row = width, len(rows)
                rows.append([])
            else:  # on to the first request short enough for the most room left (none: the batch is done)
                most = open_rows[-1][0] if open_rows else 0
                skip = bisect.bisect_left(remaining, -most, lo=position, key=lambda i: -lengths[i])
                later.extend(remaining[position:skip])
                position = skip
                continue
            rows[row].append(index)
            if room - length >= smallest:
                bisect.insort(open_rows, (room - length, row))
            position += 1
        batches.append(rows)
        remaining = later
    return batches


class HarnessLM(TemplateLM):
    """lm-eval's ``LM`` for a decoder of ours (``model``: the plain module, weights in the run's precision)."""

    def __init__(self, model, cfg, tokenizer, placement: Placement, batch_size: int = 8) -> None:
        super().__init__()
        reason = unsupported(cfg.model.arch)
        if reason:
            raise ConfigError(reason)
        if tokenizer.eos_id is None:
            raise ConfigError(f"lm-eval needs an end-of-text token; tokenizer {tokenizer.path} has none")
        from megatransformer.hf.rope import max_position_embeddings

        self.model, self.cfg, self.tok, self.placement = model, cfg, tokenizer, placement
        self.batch_size = batch_size
        self.max_length = max_position_embeddings(cfg.model)  # what transformers reports for the export
        self._rank, self._world_size, self._device = placement.rank, placement.world_size, placement.device
        self.varlen = runs_varlen(cfg, placement.device, next(model.parameters()).dtype)

    # ---------------------------------------------------------------------------- the harness's terms

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a rolling document start from: BOS where the tokenizer has one, else EOS
        (the harness's rule for Hugging Face models)."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def max_gen_toks(self) -> int:
        return min(DEFAULT_MAX_GEN_TOKS, self.max_length // 2)

    @property
    def tokenizer_name(self) -> str:
        return Path(self.tok.path).stem

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)  # (our tokenizers add no special tokens: documents are plain text)

    # ------------------------------------------------------------------------------ data-parallel ranks

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor.reshape(-1)) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor.reshape(-1))
        return torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    # ----------------------------------------------------------------------------------- scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation) of every
        ``(strings, context tokens, continuation tokens)``: each scored on its last max_length + 1 tokens, as
        the harness's Hugging Face model does."""
        too_long = next((len(cont) for _, _, cont in requests if len(cont) > self.max_length), None)
        if too_long is not None:
            raise ConfigError(f"a continuation of {too_long} tokens is longer than model.max_seq_len={self.max_length}")
        windows = [(ctx + cont)[-(self.max_length + 1) :] for _, ctx, cont in requests]
        continuations = [cont for _, _, cont in requests]
        order = sorted(range(len(requests)), key=lambda i: (-len(windows[i]), tuple(windows[i])))
        sums, misses = [0.0] * len(requests), [0] * len(requests)
        capacity = self.max_length if self.varlen else None
        for rows in pack([len(windows[i]) - 1 for i in order], capacity, self.batch_size):
            rows = [[order[i] for i in row] for row in rows]
            hidden = self._packed_hidden([[windows[i][:-1] for i in row] for row in rows])
            # the continuation's positions of every request, flattened, and which request of the batch they are
            width, where, owners, targets, in_batch = hidden.shape[1], [], [], [], []
            for r, row in enumerate(rows):
                end = r * width
                for i in row:
                    end += len(windows[i]) - 1
                    where.extend(range(end - len(continuations[i]), end))
                    owners.extend([len(in_batch)] * len(continuations[i]))
                    targets.extend(continuations[i])
                    in_batch.append(i)
            device = hidden.device
            where, owners = torch.tensor(where, device=device), torch.tensor(owners, device=device)
            targets = torch.tensor(targets, device=device)
            with torch.no_grad(), self.placement.forwards():
                logits = self.model.lm_head(hidden.flatten(0, 1)[where])
            logprobs = logits.float().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
            wrong = (logits.argmax(-1) != targets).double()
            totals = torch.zeros(len(in_batch), dtype=torch.float64, device=device).index_add_(
                0, owners, logprobs.double()
            )
            missed = torch.zeros_like(totals).index_add_(0, owners, wrong)
            for i, total, miss in zip(in_batch, *torch.stack([totals, missed]).tolist()):
                sums[i], misses[i] = total, miss
        return [(total, miss == 0) for total, miss in zip(sums, misses)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text scored whole in disjoint windows of max_length tokens, every token once, the first after
        ``prefix_token_id`` (the harness's rule)."""
        windows, owners = [], []
        for owner, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(owner)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        return totals

    def _packed_hidden(self, rows: list[list[list[int]]]) -> torch.Tensor:
        """The decoder's last hidden states [rows, width, d_model] of rows of token sequences, each sequence a
        document of its own (the output head runs only where a token is scored)."""
        width = max(sum(map(len, row)) for row in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros_like(ids)
        segments = torch.full_like(ids, PAD_SEGMENT)
        for r, row in enumerate(rows):
            start = 0
            for s, tokens in enumerate(row, 1):
                end = start + len(tokens)
                ids[r, start:end] = torch.tensor(tokens)
                positions[r, start:end] = torch.arange(len(tokens))
                segments[r, start:end] = s
                start = end
        batch = {"input_ids": ids, "position_ids": positions, "segment_ids": segments}
        masks = batch_masks("decoder", batch, varlen=self.varlen).to(self.device)
        model, device = self.model, self.device
        with torch.no_grad(), self.placement.forwards():
            return model.decoder(model.embed_tokens(ids.to(device)), positions.to(device), masks.decoder)

    # -------------------------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued (greedy unless the task samples) until one of its stop strings, the
        end-of-text token or max_gen_toks; batches of contexts with the same generation settings, longest
        first, left-padded."""
        args = [req.args for req in requests]
        encoded = [self.tok_encode(context) for context, _ in args]
        groups: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(repr(sorted(gen_kwargs.items())), []).append(i)
        results: list[str | None] = [None] * len(requests)
        eos_text = self.tok.decode([self.eot_token_id])
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(args[indices[0]][1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = kwargs.pop("max_gen_toks")
            room = self.max_length - max_new
            if room < 1:
                raise ConfigError(
                    f"a task asks for {max_new} new tokens, which leave no room for its context in "
                    f"model.max_seq_len={self.max_length}"
                )
            indices.sort(key=lambda i: (-len(encoded[i]), args[i][0]))
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start : start + self.batch_size]
                prompts = [encoded[i][-room:] for i in batch]
                for i, tokens in zip(batch, self._generate(prompts, max_new, until, kwargs)):
                    text = self.tok.decode(tokens, skip_special=True)
                    results[i] = postprocess_generated_text(text, until, None)
        return results

    def _generate(self, prompts: list[list[int]], max_new: int, until: list[str], kwargs: dict) -> list[list[int]]:
        """The new tokens of each prompt, up to its end-of-text token or first stop string."""
        if self.cfg.model.attention_window is not None and len({len(p) for p in prompts}) > 1:
            # a sliding-window cache drops keys, and with them the padding's place: prompts of one length at a time
            by_length: dict[int, list[int]] = {}
            for i, prompt in enumerate(prompts):
                by_length.setdefault(len(prompt), []).append(i)
            out: list[list[int]] = [[] for _ in prompts]
            for same in by_length.values():
                for i, tokens in zip(same, self._generate([prompts[i] for i in same], max_new, until, kwargs)):
                    out[i] = tokens
            return out
        device, eos = self.device, self.eot_token_id
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        positions = torch.zeros_like(ids)
        segments = torch.zeros_like(ids)
        for r, prompt in enumerate(prompts):
            ids[r, width - len(prompt) :] = torch.tensor(prompt)
            positions[r, width - len(prompt) :] = torch.arange(len(prompt))
            segments[r, width - len(prompt) :] = 1
        ids, positions, segments = ids.to(device), positions.to(device), segments.to(device)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        sampling = dict(
            temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
            top_k=kwargs.get("top_k"),
            top_p=kwargs.get("top_p"),
        )
        stops = [s for s in until if s]
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        with torch.no_grad(), self.placement.forwards():
            caches = self.model.new_caches(len(prompts), width + max_new)
            logits = self.model(ids, position_ids=positions, segment_ids=segments, caches=caches)
            for step in range(max_new):
                tokens = sample_next(logits[:, -1].float(), **sampling).tolist()
                for r, token in enumerate(tokens):
                    if done[r]:
                        continue
                    if token == eos:
                        done[r] = True
                        continue
                    new[r].append(token)
                    done[r] = any(s in self.tok.decode(new[r], skip_special=True) for s in stops)
                if all(done) or step == max_new - 1:
                    break
                segments = torch.cat([segments, segments.new_ones(len(prompts), 1)], dim=1)
                next_ids = torch.tensor(tokens, device=device)[:, None]
                logits = self.model(
                    next_ids, position_ids=(lengths + step)[:, None], segment_ids=segments, caches=caches
                )
        return new


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The harness without its progress bars, prints and notes (shown if it fails): stdout holds the results."""
    import io
    import logging
    import sys

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    notes = io.StringIO()
    try:
        with contextlib.redirect_stderr(notes), contextlib.redirect_stdout(notes):
            yield
    except BaseException:
        sys.stderr.write(notes.getvalue()[-5000:])
        raise
    finally:
        logger.setLevel(level)


# ------------------------------------------------------------------------------------------ tasks


def task_manager(include_paths: list[str], include_defaults: bool = True):
    """The harness's task index: the YAML files and folders of ``include_paths``, and with ``include_defaults`` the
    harness's own tasks (thousands of files: ~10 s to index)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_paths or None, include_defaults=include_defaults)


def split_tasks(tasks: list[str]) -> tuple[list[str], list[str]]:
    """(task names, folders to index): a task given as the path of a YAML file is named by its file, whose folder
    is indexed."""
    names, folders = [], []
    for task in tasks:
        path = Path(task)
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise ConfigError(f"task file {task} does not exist")
            import yaml

            spec = yaml.safe_load(path.read_text()) or {}
            if "task" not in spec:
                raise ConfigError(f"task file {task} names no task (its `task:` key)")
            names.append(str(spec["task"]))
            folders.append(str(path.resolve().parent))
        else:
            names.append(task)
    return names, folders


@dataclass(frozen=True)
class Tasks:
    """Tasks the harness knows by name once ``include_paths`` are indexed (see :func:`load_tasks`)."""

    names: tuple[str, ...]
    include_paths: tuple[str, ...]
    include_defaults: bool = True

    def load(self) -> dict:
        """The harness's task dictionary (its ``TaskManager.load``), data read (from the datasets cache after
        the first time)."""
        return task_manager(list(self.include_paths), self.include_defaults).load(list(self.names))


def load_tasks(tasks: list[str], include_paths: list[str] = ()) -> Tasks:
    """``tasks`` (names the harness knows, names in ``include_paths``, or task YAML paths), loaded once with
    their data: an unknown task or a missing data file fails here, in one line."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # (tasks read local files; nothing is downloaded)
    names, folders = split_tasks(tasks)
    for folder in include_paths:
        if not Path(folder).is_dir():
            raise ConfigError(f"include path {folder} is not a directory")
    found = Tasks(tuple(names), tuple(dict.fromkeys([*map(str, include_paths), *folders])))
    if found.include_paths:  # tasks of the user's own need not wait for the harness's index
        manager = task_manager(list(found.include_paths), include_defaults=False)
        if all(name in manager.all_tasks for name in names):
            found = replace(found, include_defaults=False)
    if found.include_defaults:
        manager = task_manager(list(found.include_paths))
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"lm-eval knows no task {', '.join(unknown)} (a task of your own: its YAML's path, or its folder in "
            "include_path)"
        )
    for name in names:
        try:
            with quiet():
                manager.load([name])
        except Exception as err:  # noqa: BLE001 - datasets and the harness raise many kinds; one line says which
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"lm-eval task {name} cannot load: {reason}") from None
    return found


# The seeds lm-eval's simple_evaluate sets (python random, numpy, torch, few-shot sampling): the same numbers
# as its own command line.
SEEDS = {"random": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}


def evaluate(
    lm: HarnessLM,
    tasks: Tasks,
    limit: int | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 0,
    log_samples: bool = False,
) -> dict | None:
    """The harness's results (its dict; None on ranks other than 0) of ``tasks``, as ``lm_eval.simple_evaluate``
    computes them (few-shot count and seeds alike), without its environment report; the caller's random
    states are left as they were."""
    from lm_eval.evaluator import evaluate as harness_evaluate

    loaded = tasks.load()
    for task in loaded["tasks"].values():
        default = task.get_config("num_fewshot")
        if num_fewshot is not None and default != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=SEEDS["fewshot"])
    with kept_random_states():
        import random

        import numpy as np

        random.seed(SEEDS["random"])
        np.random.seed(SEEDS["numpy"])
        torch.manual_seed(SEEDS["torch"])
        return harness_evaluate(
            lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=log_samples
        )


@contextlib.contextmanager
def kept_random_states() -> Iterator[None]:
    """Python's, NumPy's and torch's random states (CPU and CUDA) as they were before the block."""
    import random

    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def metrics_of(results: dict) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from the harness's results: its ``metric,filter`` keys as ``metric`` for
    the unfiltered responses, ``metric,filter`` otherwise; numbers only (a standard error it did not compute,
    "N/A", is left out)."""
    flat: dict[str, dict[str, float]] = {}
    for task, values in results["results"].items():
        numbers = {}
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, _, filter_name = key.partition(",")
            numbers[metric if filter_name == "none" else key] = value if math.isfinite(value) else None
        flat[task] = numbers
    return flat
