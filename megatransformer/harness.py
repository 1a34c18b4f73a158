"""lm-evaluation-harness on our decoders: an ``LM`` that runs in the caller's process on its device and
precision, task loading that fails in one line, and the harness's results as flat numbers.

Loglikelihood requests scored after the same context (the choices of a multiple-choice item) run that context
once, each continuation after it seeing the context and itself only (``masks.shared_context_mask``); requests
and such groups are packed, longest first, several to a row (one forward per batch of packed requests, the
output head only where a token is scored); generation left-pads a batch of prompts (padding is a segment of its
own) and decodes with the KV cache. Data-parallel ranks: every rank builds every request (the harness sees one
rank), runs a share of them dealt by cost (:func:`deal`: tokens, not items) and gathers the others' answers on a
group of the evaluation's own (``lockstep.Placement.group``: its own timeout, not the training collectives').
Design: docs/evaluation.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from megatransformer.config import ConfigError

EVAL_EXTRA = "pip install -e '.[eval]'"

try:
    from lm_eval.api.model import TemplateLM
except ImportError:
    raise ConfigError(f"downstream evaluation needs lm-evaluation-harness (not installed): {EVAL_EXTRA}") from None

from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text  # noqa: E402

from megatransformer.batch import PAD_SEGMENT  # noqa: E402
from megatransformer.lockstep import Interrupted, Placement  # noqa: E402
from megatransformer.model.generate import sample_next  # noqa: E402
from megatransformer.model.gpu_cores import VARLEN_BACKENDS  # noqa: E402
from megatransformer.model.masks import shared_context_mask  # noqa: E402

DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for tasks that name no max_gen_toks


ROLLING_CHUNK = 1024
"""Rolling windows scored at a time: the memory of a long text's scoring is bounded by it, not by the text."""


PROGRESS_AFTER = 4096
"""Windows of a text from which its scoring shows progress."""


class Progress:
    """A line on stderr (outside :func:`quiet`) every 10 % of a long piece of work, on rank 0."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.shown = what, total, total < PROGRESS_AFTER
        self.next, self.started = 0.1, time.monotonic()

    def at(self, done: int, show: bool = True) -> None:
        if self.shown or not show or done < self.next * self.total:
            return
        import sys

        seconds = time.monotonic() - self.started
        sys.__stderr__.write(f"{self.what}: {done:,} of {self.total:,} windows ({seconds:.0f} s)\n")
        sys.__stderr__.flush()
        self.next = math.floor(10 * done / self.total + 1) / 10


def deal(costs: list[int], ranks: int) -> list[list[int]]:
    """Indices of ``costs`` dealt to ``ranks`` shares of about equal total cost: each, costliest first, to the
    share with the least so far (the lowest rank of equals). Every rank deals the same."""
    import heapq

    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [(0, rank) for rank in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        shares[rank].append(index)
        heapq.heappush(loads, (load + costs[index], rank))
    return [sorted(share) for share in shares]


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
    return device.type == "cuda" and backend in VARLEN_BACKENDS


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


@dataclass(frozen=True)
class Group:
    """Loglikelihood requests scored after one copy of a shared ``context``: each member, ``(request, own)``,
    is scored on the context's last positions and its ``own`` tokens after it (which see the context and
    themselves only); a member without own tokens is scored on the context's last positions alone."""

    context: list[int]
    members: list[tuple[int, list[int]]]

    @property
    def length(self) -> int:
        return len(self.context) + sum(len(own) for _, own in self.members)


def group_requests(windows: list[list[int]], continuations: list[list[int]], limit: int | None) -> list[Group]:
    """The requests whose ``windows`` (the tokens scored, continuation last) share the tokens up to the one
    that predicts their continuation's first token, grouped, as many as fit in ``limit`` tokens a group (a row
    no longer than a lone request's), longest first. A request alone (every request where ``limit`` is None, and
    those after a one-token context, such as rolling windows: sharing a token saves nothing worth a group) is a
    group of its window without its last token."""
    alone: list[int] = []
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, (window, continuation) in enumerate(zip(windows, continuations)):
        context = window[: len(window) - len(continuation)]
        if limit is None or len(context) < 2:
            alone.append(i)
        else:
            by_context.setdefault(tuple(context), []).append(i)
    groups = [Group(windows[i][:-1], [(i, [])]) for i in alone]
    for context, requests in by_context.items():
        parts, length = [[]], len(context)
        for i in requests:
            own = len(windows[i]) - 1 - len(context)
            if parts[-1] and length + own > limit:
                parts, length = [*parts, []], len(context)
            parts[-1].append(i)
            length += own
        for members in parts:
            if len(members) == 1:
                groups.append(Group(windows[members[0]][:-1], [(members[0], [])]))
            else:
                groups.append(Group(list(context), [(i, windows[i][len(context) : -1]) for i in members]))
    return sorted(groups, key=lambda g: (-g.length, g.context))


@dataclass(frozen=True)
class Layout:
    """Rows of groups as the decoder's inputs (host tensors [rows, width]: a segment for each context and
    each member's own tokens, ``contexts`` as ``AttentionMask.contexts``) and each request's scored positions
    in the flattened rows."""

    ids: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    contexts: torch.Tensor
    scored: list[tuple[int, list[int]]]


def lay_out(rows: list[list[Group]], continuation_lengths: list[int]) -> Layout:
    """``rows`` of groups, each row as wide as the widest (padding: a segment of its own)."""
    width = max(sum(group.length for group in row) for row in rows)
    columns: dict[str, list[list[int]]] = {"ids": [], "positions": [], "segments": [], "contexts": []}
    scored = []
    for r, row in enumerate(rows):
        ids, positions, segments, contexts = [], [], [], []
        segment = PAD_SEGMENT
        for group in row:
            segment += 1
            context_segment, context_end = segment, r * width + len(ids) + len(group.context)
            ids += group.context
            positions += range(len(group.context))
            segments += [segment] * len(group.context)
            contexts += [segment] * len(group.context)
            for request, own in group.members:
                where = list(range(context_end - (continuation_lengths[request] - len(own)), context_end))
                if own:
                    segment += 1
                    where += range(r * width + len(ids), r * width + len(ids) + len(own))
                    ids += own
                    positions += range(len(group.context), len(group.context) + len(own))
                    segments += [segment] * len(own)
                    contexts += [context_segment] * len(own)
                scored.append((request, where))
        pad = width - len(ids)
        for name, values in zip(columns, (ids, positions, segments, contexts)):
            columns[name].append(values + [PAD_SEGMENT if name in ("segments", "contexts") else 0] * pad)
    return Layout(*(torch.tensor(values, dtype=torch.long) for values in columns.values()), scored)


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
        # (the harness sees one rank and builds every request on each: the ranks share the work here, by cost)
        self._rank, self._world_size, self._device = 0, 1, placement.device
        self.varlen = runs_varlen(cfg, placement.device, next(model.parameters()).dtype)
        self.shares_contexts = cfg.model.attention_window is None  # (a window counts row places, not positions)
        # the harness encodes an item's context alone once per continuation, the item's requests one after the
        # other: the last few texts' tokens are kept
        self._encoded = functools.lru_cache(maxsize=16)(lambda text: tuple(tokenizer.encode(text)))

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
        return list(self._encoded(string))  # (our tokenizers add no special tokens: documents are plain text)

    # ------------------------------------------------------------------------------ data-parallel ranks

    def shared(
        self, costs: list[int], run: Callable[[list[int]], dict[int, object]], stand_in: Callable[[], object]
    ) -> dict[int, object]:
        """``run`` on this rank's share of the items of ``costs`` (:func:`deal`: their indices), its answers
        ({request: answer}) merged with the other ranks': the answers of every request, on every rank. In
        lockstep, ``stand_in`` (a forward of one token, through the modules ``run``'s forwards call) runs while
        another rank's share is not done."""
        ranks = self.placement.world_size
        if ranks == 1:
            return run(list(range(len(costs))))
        try:
            mine: dict[int, object] | None = run(deal(costs, ranks)[self.placement.rank])
            self.placement.wait_for_others(stand_in)
        except Interrupted:
            mine = None  # (told to the others in the gather: none is left waiting for this rank's answers)
        every = self.placement.gather_all(mine)
        if any(answers is None for answers in every):
            raise Interrupted
        merged: dict[int, object] = {}
        for answers in every:
            merged.update(answers)
        return merged

    # ----------------------------------------------------------------------------------- scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation) of every
        ``(strings, context tokens, continuation tokens)``: each scored on its last max_length + 1 tokens, as
        the harness's Hugging Face model does; requests with the same context in one group (see
        :func:`group_requests`)."""
        too_long = next((len(cont) for _, _, cont in requests if len(cont) > self.max_length), None)
        if too_long is not None:
            raise ConfigError(f"a continuation of {too_long} tokens is longer than model.max_seq_len={self.max_length}")
        windows = [(ctx + cont)[-(self.max_length + 1) :] for _, ctx, cont in requests]
        continuations = [cont for _, _, cont in requests]
        groups = group_requests(windows, continuations, self.max_length if self.shares_contexts else None)
        answers = self.shared(
            [group.length for group in groups],
            lambda share: self._scored(groups, share, continuations),
            lambda: self._scored_batch(lay_out([[Group([0], [(0, [])])]], [1]), [[0]]),
        )
        return [answers[i] for i in range(len(requests))]

    def _scored(self, groups: list[Group], share: list[int], continuations: list[list[int]]) -> dict[int, tuple]:
        """{request: (log p, greedy)} of the requests of ``groups[share]`` (longest first, as :func:`pack` takes
        them)."""
        groups = [groups[g] for g in share]
        capacity = self.max_length if self.varlen else None
        answers = {}
        for rows in pack([group.length for group in groups], capacity, self.batch_size):
            layout = lay_out([[groups[g] for g in row] for row in rows], list(map(len, continuations)))
            self.placement.any_working(True)
            answers.update(self._scored_batch(layout, continuations))
        return answers

    def _scored_batch(self, layout: Layout, continuations: list[list[int]]) -> dict[int, tuple]:
        """{request: (log p, greedy)} of the requests ``layout`` scores, from one forward."""
        hidden = self._packed_hidden(layout)
        in_batch = [request for request, _ in layout.scored]
        device = hidden.device
        where = torch.tensor([p for _, places in layout.scored for p in places], device=device)
        owners = torch.tensor([k for k, (_, places) in enumerate(layout.scored) for _ in places], device=device)
        targets = torch.tensor([t for request in in_batch for t in continuations[request]], device=device)
        with torch.no_grad(), self.placement.forwards():
            logits = self.model.lm_head(hidden.flatten(0, 1)[where])
        logprobs = logits.float().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
        wrong = (logits.argmax(-1) != targets).double()
        totals = torch.zeros(len(in_batch), dtype=torch.float64, device=device).index_add_(0, owners, logprobs.double())
        missed = torch.zeros_like(totals).index_add_(0, owners, wrong)
        return {i: (total, miss == 0) for i, total, miss in zip(in_batch, *torch.stack([totals, missed]).tolist())}

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text scored whole in disjoint windows of max_length tokens, every token once, the first after
        ``prefix_token_id`` (the harness's rule). The windows are made as they are scored, :data:`ROLLING_CHUNK`
        at a time (a 20 MB document's windows at once held gigabytes), with a progress line on stderr for
        a long text."""
        totals = [0.0] * len(requests)
        chunk: list[tuple] = []
        owners: list[int] = []

        def score() -> None:
            for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(chunk)):
                totals[owner] += logprob
            chunk.clear()
            owners.clear()

        for owner, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            windows = -(-len(tokens) // self.max_length)
            progress = Progress(f"rolling loglikelihood of text {owner + 1} of {len(requests)}", windows)
            made = lm_utils.get_rolling_token_windows(
                token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
            )
            for done, (context, continuation) in enumerate(map(lm_utils.make_disjoint_window, made), start=1):
                chunk.append((None, context, continuation))
                owners.append(owner)
                if len(chunk) == ROLLING_CHUNK:
                    score()
                    progress.at(done, self.placement.rank == 0)
        if chunk:
            score()
        return totals

    def _packed_hidden(self, layout: Layout) -> torch.Tensor:
        """The decoder's last hidden states [rows, width, d_model] of a layout (the output head runs only where
        a token is scored)."""
        mask = shared_context_mask(layout.segments, layout.contexts, varlen=self.varlen).to(self.device)
        model, device = self.model, self.device
        with torch.no_grad(), self.placement.forwards():
            return model.decoder(model.embed_tokens(layout.ids.to(device)), layout.positions.to(device), mask)

    # -------------------------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued (greedy unless the task samples) until one of its stop strings, the
        end-of-text token or max_gen_toks; batches of contexts with the same generation settings, longest
        first, left-padded."""
        args = [req.args for req in requests]
        encoded = [self.tok_encode(context) for context, _ in args]
        lengths = [
            len(tokens) + normalize_gen_kwargs(kwargs, self.max_gen_toks)["max_gen_toks"]
            for tokens, (_, kwargs) in zip(encoded, args)
        ]
        answers = self.shared(
            lengths,
            lambda share: self._generated(args, encoded, share),
            lambda: self._logits(torch.zeros(1, 1, dtype=torch.long, device=self.device)),
        )
        return [answers[i] for i in range(len(requests))]

    def _generated(self, args: list[tuple], encoded: list[list[int]], share: list[int]) -> dict[int, str]:
        """{request: its generated text} of the requests in ``share``."""
        groups: dict[str, list[int]] = {}
        for i in share:
            groups.setdefault(repr(sorted(args[i][1].items())), []).append(i)
        results: dict[int, str] = {}
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
            logits = self._forward(ids, position_ids=positions, segment_ids=segments, caches=caches, logits_to_keep=1)
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
                logits = self._forward(
                    next_ids, position_ids=(lengths + step)[:, None], segment_ids=segments, caches=caches
                )
        return new

    def _forward(self, ids: torch.Tensor, **inputs) -> torch.Tensor:
        """The model's logits of ``ids``, in lockstep with the other ranks (:meth:`Placement.any_working`)."""
        self.placement.any_working(True)
        return self._logits(ids, **inputs)

    def _logits(self, ids: torch.Tensor, **inputs) -> torch.Tensor:
        with torch.no_grad(), self.placement.forwards():
            return self.model(ids, **inputs)


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
    except Interrupted:
        raise
    except BaseException:
        sys.stderr.write(notes.getvalue()[-5000:])
        raise
    finally:
        logger.setLevel(level)


# ------------------------------------------------------------------------------------------ tasks


def task_manager(include_paths: list[str], shipped: bool = True):
    """The harness's task index of the YAML files and folders of ``include_paths`` and, with ``shipped``, of the
    tasks the harness ships (some 14,000 YAML files: tens of seconds to index)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_paths or None, include_defaults=shipped)


class FunctionRef(str):
    """A task YAML's ``!function module.name`` (code lm-eval imports from the file's folder), as its text."""


class TaskYamlLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, with lm-eval's ``!function`` read as a :class:`FunctionRef` (nothing is imported):
    any other tag that is not plain data (``!!python/...``) is refused."""


TaskYamlLoader.add_constructor("!function", lambda loader, node: FunctionRef(loader.construct_scalar(node)))


def read_task_file(path: Path, what: str = "task file") -> dict:
    """A task YAML as data (its ``!function`` tags as :class:`FunctionRef`); bad YAML is one line naming it."""
    try:
        spec = yaml.load(path.read_text(), Loader=TaskYamlLoader)  # noqa: S506 - a SafeLoader
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{what} {path} cannot be read ({err.__class__.__name__}: {err})") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = err.problem or err.context or "invalid YAML"
        if "python/" in problem:
            tag = problem.split("tag ", 1)[-1].strip().strip("'").replace("tag:yaml.org,2002:", "!!")
            raise ConfigError(
                f"{what} {path}{where}: the tag {tag} is refused (a task file is read as data, as yaml.safe_load "
                "reads it); code goes in a Python file beside it, named by `!function module.function`"
            ) from None
        raise ConfigError(f"{what} {path} is not valid YAML{where}: {problem}; fix its syntax") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {path} is not valid YAML: {str(err).splitlines()[0]}; fix its syntax") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{what} {path} holds no mapping of task settings (a YAML {type(spec).__name__})")
    return spec


def task_code(path: Path, spec: dict | None = None, seen: frozenset[Path] = frozenset()) -> list[str]:
    """The Python a task file makes lm-eval import (its ``!function`` tags and those of the files it includes),
    each as ``FILE (!function module.name)`` where the module is a file of the task's folder, else as the
    module's name."""
    path = path.resolve()
    if path in seen:
        return []
    spec = read_task_file(path) if spec is None else spec
    found: list[str] = []

    def walk(value) -> None:
        if isinstance(value, FunctionRef):
            module = value.rpartition(".")[0]
            local = path.parent / f"{module.replace('.', '/')}.py"
            found.append(f"{local} (!function {value})" if local.is_file() else f"module {module} (!function {value})")
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(spec)
    includes = spec.get("include") or []
    for include in includes if isinstance(includes, list) else [includes]:
        included = Path(include) if Path(str(include)).is_absolute() else path.parent / str(include)
        if included.is_file():
            found += task_code(included, None, seen | {path})
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class TaskFile:
    """A task named by the path of its YAML file."""

    name: str
    path: Path  # resolved
    given: str  # as the user wrote it


def split_tasks(tasks: list[str]) -> tuple[list[str], list[str], dict[str, TaskFile]]:
    """(task names, folders to index, {name: its file} of the tasks given as YAML paths): a task file is loaded
    from that very file (a task of the same name elsewhere in the indexed folders does not replace it); its
    folder is indexed (for the files it includes and the groups it names)."""
    names, folders, files = [], [], {}
    for task in tasks:
        path = Path(task)
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise ConfigError(f"task file {task} does not exist")
            spec = read_task_file(path)
            if not isinstance(spec.get("task"), str) or not spec["task"]:
                raise ConfigError(f"task file {task} names no task (its `task:` key)")
            name = spec["task"]
            if name in files:
                raise ConfigError(
                    f"task files {files[name].given} and {task} both define task {name}; rename one (its `task:` key)"
                )
            names.append(name)
            files[name] = TaskFile(name, path.resolve(), task)
            folders.append(str(path.resolve().parent))
        else:
            names.append(task)
    clash = next((name for name in names if name in files and names.count(name) > 1), None)
    if clash is not None:
        raise ConfigError(
            f"task {clash} is named both by its file {files[clash].given} and by its name; give one of them"
        )
    return names, folders, files


@dataclass(frozen=True)
class Tasks:
    """Tasks the harness knows by name in ``manager``'s index, or by their file, built once (see
    :func:`load_tasks`)."""

    names: tuple[str, ...]
    manager: object  # lm_eval.tasks.TaskManager
    files: tuple[tuple[str, str], ...] = ()  # (name, resolved path) of the tasks named by their file

    def spec(self, name: str) -> str:
        """What the harness loads ``name`` by: its file's path where the task was named by its file."""
        return dict(self.files).get(name, name)

    def load(self) -> dict:
        """The harness's task dictionary (its ``TaskManager.load``: new task objects), data read (from the
        datasets cache after the first time)."""
        return self.manager.load([self.spec(name) for name in self.names])

    def source(self, name: str) -> Path | None:
        """The YAML file task ``name`` is read from (None: a group, a tag, or a task of no file)."""
        if name in dict(self.files):
            return Path(dict(self.files)[name])
        entry = self.manager.task_index.get(name)
        return Path(entry.yaml_path) if entry is not None and entry.yaml_path is not None else None

    def code(self) -> list[str]:
        """One line per task that makes lm-eval import Python (``!function``): a task folder is code."""
        lines = []
        for name in self.names:
            path = self.source(name)
            imports = task_code(path) if path is not None and not _shipped(path) else []
            if imports:
                lines.append(f"task {name} ({path}) imports Python: {', '.join(imports)}")
        return lines


def _shipped(path: Path) -> bool:
    """Whether ``path`` is one of the task files the harness ships (its code is the harness's own)."""
    import lm_eval.tasks

    return path.resolve().is_relative_to(Path(lm_eval.tasks.__file__).resolve().parent)


def load_tasks(tasks: list[str], include_paths: list[str] = ()) -> Tasks:
    """``tasks`` (names the harness knows, names in ``include_paths``, or task YAML paths), loaded once with
    their data: an unknown task or a missing data file fails here, in one line. Tasks that are all in the include
    paths (tasks of one's own, no groups) are indexed without the harness's shipped ones."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # (tasks read local files; nothing is downloaded)
    names, folders, files = split_tasks(tasks)
    for folder in include_paths:
        if not Path(folder).is_dir():
            raise ConfigError(f"include path {folder} is not a directory")
    paths = list(dict.fromkeys([*map(str, include_paths), *folders]))
    by_file = tuple((name, str(file.path)) for name, file in files.items())
    named = [name for name in names if name not in files]
    if paths:
        own = task_manager(paths, shipped=False)
        if all(name in own.all_subtasks for name in named):  # (no group or tag, which may name shipped tasks)
            return loaded(Tasks(tuple(names), own, by_file))
    found = Tasks(tuple(names), task_manager(paths), by_file)
    unknown = [name for name in named if name not in found.manager.all_tasks]
    if unknown:
        unread = unreadable(paths)  # (the harness's index skips a file it cannot read, without a word)
        raise ConfigError(
            f"lm-eval knows no task {', '.join(unknown)} (a task of your own: its YAML's path, or its folder in "
            "include_path)" + (f"; of the indexed files, {unread}" if unread else "")
        )
    return loaded(found)


def unreadable(folders: list[str]) -> str | None:
    """Why the first task file of ``folders`` that cannot be read as a task is not one (None: all can)."""
    for folder in folders:
        for path in sorted(Path(folder).glob("**/*.yaml")):
            try:
                read_task_file(path)
            except ConfigError as err:
                return str(err)
    return None


def loaded(tasks: Tasks) -> Tasks:
    """``tasks``, each of which loads with its data, else a one-line error naming the first that does not."""
    for name in tasks.names:
        try:
            with quiet():
                tasks.manager.load([tasks.spec(name)])
        except Exception as err:  # noqa: BLE001 - datasets and the harness raise many kinds; one line says which
            raise ConfigError(f"lm-eval task {name} {why_not_loaded(err, tasks, name)}") from None
    return tasks


def why_not_loaded(err: Exception, tasks: Tasks, name: str) -> str:
    """What the harness's ``err`` loading task ``name`` means, with what to do (its own words where they say
    something)."""
    path = tasks.source(name)
    where = f"({path}) " if path is not None else ""
    spec: dict = {}
    if path is not None:
        with contextlib.suppress(ConfigError):
            spec = read_task_file(path)
    if isinstance(err, StopIteration) or (isinstance(err, RuntimeError) and "StopIteration" in str(err)):
        files = (spec.get("dataset_kwargs") or {}).get("data_files")
        files = ", ".join(map(str, files.values())) if isinstance(files, dict) else files
        return (
            f"{where}cannot load: its data ({files or spec.get('dataset_path', 'the data set')}) holds no items "
            "(an empty file?); put the items in it, one JSON object a line"
        )
    if isinstance(err, KeyError) and err.args == (None,):
        from lm_eval.api.registry import get_metric_aggregation

        metrics = [m for m in spec.get("metric_list") or [] if isinstance(m, dict)]
        named = [m["metric"] for m in metrics if isinstance(m.get("metric"), str) and "aggregation" not in m]
        unknown = [metric for metric in named if get_metric_aggregation(metric) is None]
        if unknown:
            return (
                f"{where}cannot load: lm-eval knows no metric {', '.join(unknown)} (its metric_list); name one it "
                "knows (acc, acc_norm, perplexity, exact_match, word_perplexity, ...), or give the metric's "
                "aggregation"
            )
    reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if not reason or reason in ("None", repr(None)):
        reason = f"{type(err).__name__}{f' {reason}' if reason else ''}"
    return f"{where}cannot load: {reason}"


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

    if limit is not None and limit < 1:
        raise ConfigError(f"limit {limit}: give at least 1 item a task (0 evaluates nothing)")
    loaded = configured(tasks, num_fewshot)
    with kept_random_states():
        import random

        import numpy as np

        random.seed(SEEDS["random"])
        np.random.seed(SEEDS["numpy"])
        torch.manual_seed(SEEDS["torch"])
        results = harness_evaluate(
            lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=log_samples
        )
    return results if lm.placement.rank == 0 else None  # (every rank holds every answer: rank 0 reports)


def configured(tasks: Tasks, num_fewshot: int | None) -> dict:
    """The harness's task dictionary with the few-shot counts and seed ``lm_eval.simple_evaluate`` would set:
    ``num_fewshot`` where the task's YAML does not say 0 (nor scores perplexity, loglikelihood_rolling, which
    takes no shots), else the task's own (0 where it names none)."""
    loaded = tasks.load()
    for task in loaded["tasks"].values():
        default = task.get_config("num_fewshot")
        rolling = task.get_config("output_type") == "loglikelihood_rolling"
        if num_fewshot is not None and default != 0 and not rolling:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=SEEDS["fewshot"])
    return loaded


def check_fewshot(tasks: Tasks, num_fewshot: int | None, option: str) -> None:
    """Refuse a few-shot count (``option``'s ``num_fewshot``) that a task has too few examples to draw, before
    anything is evaluated (the harness fails in the middle, with a traceback)."""
    if not num_fewshot:
        return
    with quiet():
        loaded = configured(tasks, num_fewshot)
        pools = {name: _fewshot_pool(task) for name, task in loaded["tasks"].items()}
    for name, task in loaded["tasks"].items():
        shots, pool = task.get_config("num_fewshot") or 0, pools[name]
        if shots == 0:
            continue
        itself = task.fewshot_cfg.split is not None and task.fewshot_cfg.split == task.config.test_split
        most = pool - 1 if itself else pool
        if shots > most:
            source = tasks.source(name)
            raise ConfigError(
                f"{option} {shots}: task {name}{f' ({source})' if source else ''} has {pool} example"
                f"{'s' * (pool != 1)} to draw shots from{' (the item itself left out)' if itself else ''}: at most "
                f"{max(most, 0)}; lower {option}"
            )


def _fewshot_pool(task) -> int:
    """How many documents the harness draws ``task``'s few-shot examples from."""
    if not task.get_config("num_fewshot"):
        return 0
    docs = task.fewshot_docs()
    return 0 if docs is None else len(docs) if hasattr(docs, "__len__") else len(list(docs))


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
