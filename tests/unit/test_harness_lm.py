"""The lm-eval LM of our decoders: packing, batching and ordering change no number; generation in left-padded
batches gives each prompt's own greedy continuation; a missing harness is one line naming the extra."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")

from lm_eval.api.instance import Instance  # noqa: E402

from megatransformer import harness  # noqa: E402
from megatransformer.config import ConfigError, RunConfig  # noqa: E402
from megatransformer.model import build_model, generate  # noqa: E402

MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 48, "vocab_size": 512, "max_seq_len": 48}
TEXTS = [
    "Return the list of values",
    "a",
    "Open the file and read every line of it, then close it again when done with it.",
    "The module defines functions",
    "Return True if the path exists and is a directory; False otherwise, for broken links too.",
]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({"model": MODEL | {"init_std": 0.2}, "data": {"seq_len": 48}})
    return cfg, build_model(cfg.model).eval()


def lm_of(model, tok, batch_size: int) -> harness.HarnessLM:
    cfg, module = model
    return harness.HarnessLM(module, cfg, tok, harness.Placement(torch.device("cpu")), batch_size)


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def direct_loglikelihood(module, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) from one forward of the last max_seq_len + 1 tokens alone."""
    tokens = (context + continuation)[-(MODEL["max_seq_len"] + 1) :]
    with torch.no_grad():
        logits = module(torch.tensor([tokens[:-1]]))[0].log_softmax(-1)
    scored = logits[-len(continuation) :]
    return float(scored.gather(1, torch.tensor(continuation)[:, None]).sum())


def direct_greedy(module, context: list[int], continuation: list[int]) -> bool:
    """Whether greedy decoding after the context gives the continuation, from the same one forward."""
    tokens = (context + continuation)[-(MODEL["max_seq_len"] + 1) :]
    with torch.no_grad():
        logits = module(torch.tensor([tokens[:-1]]))[0]
    return logits[-len(continuation) :].argmax(-1).tolist() == continuation


@pytest.mark.parametrize(
    "backend, varlen",
    [("fa4", True), ("fa3", True), ("flash", True), ("varlen", True), ("sdpa", False), ("flex", False)],
)
def test_rows_are_packed_to_capacity_for_every_varlen_core(backend, varlen, monkeypatch):
    """(flash-attn 3 and 4 read the varlen problems too: ``attention_backend=auto``'s choice on a Hopper GPU)"""
    from megatransformer.model import attention

    cuda = torch.device("cuda")
    named = RunConfig.model_validate({"model": MODEL | {"attention_backend": backend}, "data": {"seq_len": 48}})
    assert harness.runs_varlen(named, cuda, torch.bfloat16) is varlen
    assert harness.runs_varlen(named, torch.device("cpu"), torch.bfloat16) is False
    monkeypatch.setattr(attention, "auto_backend", lambda *args: backend)
    auto = RunConfig.model_validate({"model": MODEL | {"attention_backend": "auto"}, "data": {"seq_len": 48}})
    assert harness.runs_varlen(auto, cuda, torch.bfloat16) is varlen


def test_pack_fills_rows_longest_first_within_capacity():
    batches = harness.pack([9, 7, 5, 4, 3, 2, 2, 1], capacity=10, max_rows=2)
    assert batches == [[[0, 7], [1, 4]], [[2, 3], [5, 6]]]
    assert harness.pack([10, 10, 10], capacity=10, max_rows=2) == [[[0], [1]], [[2]]]
    # rows as wide as each batch's longest request: the shorter ones fill their room
    batches = harness.pack([9, 7, 5, 4, 3, 2, 2, 1], capacity=None, max_rows=2)
    assert batches == [[[0], [1, 5]], [[2], [3, 7]], [[4], [6]]]


def test_requests_after_the_same_context_are_grouped_within_the_limit():
    windows = [[1, 2, 3, 10, 11], [1, 2, 3, 12], [1, 2, 3, 13, 14, 15], [9, 20, 21], [9, 22]]
    continuations = [[10, 11], [12], [13, 14, 15], [20, 21], [22]]
    shared, short, alone = harness.group_requests(windows, continuations, limit=6)
    assert (shared.context, shared.members, shared.length) == ([1, 2, 3], [(0, [10]), (1, []), (2, [13, 14])], 6)
    assert (short.context, short.members) == ([9, 20], [(3, [])])  # (one token of context: alone)
    assert (alone.context, alone.members) == ([9], [(4, [])])
    split = harness.group_requests(windows, continuations, limit=5)  # the third request no longer fits
    assert [(g.context, g.members) for g in split[:2]] == [
        ([1, 2, 3, 13, 14], [(2, [])]),
        ([1, 2, 3], [(0, [10]), (1, [])]),
    ]  # (longest first)
    assert all(len(g.members) == 1 for g in harness.group_requests(windows, continuations, limit=None))

    layout = harness.lay_out([[shared, short]], list(map(len, continuations)))
    assert layout.ids.tolist() == [[1, 2, 3, 10, 13, 14, 9, 20]]
    assert layout.positions.tolist() == [[0, 1, 2, 3, 3, 4, 0, 1]]  # (each continuation goes on from its context)
    assert layout.segments.tolist() == [[1, 1, 1, 2, 3, 3, 4, 4]]
    assert layout.contexts.tolist() == [[1, 1, 1, 1, 1, 1, 4, 4]]
    assert layout.scored == [(0, [2, 3]), (1, [2]), (2, [2, 4, 5]), (3, [6, 7])]


def test_loglikelihoods_do_not_depend_on_batching(model, tok):
    cfg, module = model
    pairs = [(text, " and more of it") for text in TEXTS] + [("", "Return the value")]
    scores = {size: lm_of(model, tok, size).loglikelihood(requests("loglikelihood", pairs)) for size in (1, 3, 16)}
    lm = lm_of(model, tok, 1)
    for i, (context, continuation) in enumerate(pairs):
        if context:
            ctx, cont = lm._encode_pair(context, continuation)
        else:
            ctx, cont = [lm.prefix_token_id], tok.encode(continuation)
        expected = direct_loglikelihood(module, ctx, cont)
        for size, results in scores.items():
            assert results[i][0] == pytest.approx(expected, rel=1e-5), (size, i)
            assert results[i][1] == scores[1][i][1]


CHOICES = [" and more of it", " or", " then close it again when done with it, and the next file too", " x"]


@pytest.mark.parametrize("window", [None, 8])
def test_choices_of_an_item_run_their_context_once(model, tok, monkeypatch, window):
    """Multiple-choice requests (several continuations of each context) score what each scores alone; the
    context runs once for all of its continuations (not with a sliding window, which counts row places)."""
    cfg, module = model
    if window is not None:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"attention_window": window})})
        module = build_model(cfg.model).eval()
        module.load_state_dict(model[1].state_dict())
    pairs = [(context, choice) for context in (TEXTS[0], TEXTS[2], TEXTS[4]) for choice in CHOICES]
    tokens_run = []
    lay_out = harness.lay_out
    monkeypatch.setattr(
        harness, "lay_out", lambda *a: tokens_run.append(int((lay_out(*a).segments != 0).sum())) or lay_out(*a)
    )
    results = lm_of((cfg, module), tok, 2).loglikelihood(requests("loglikelihood", pairs))
    lm = lm_of((cfg, module), tok, 1)
    encoded = [lm._encode_pair(context, choice) for context, choice in pairs]
    for (ctx, cont), (logprob, greedy) in zip(encoded, results):
        assert logprob == pytest.approx(direct_loglikelihood(module, ctx, cont), rel=1e-5)
        assert greedy == direct_greedy(module, ctx, cont)
    windows = [(ctx + cont)[-(MODEL["max_seq_len"] + 1) :] for ctx, cont in encoded]
    if window is None:  # each context once, each continuation but its last token after it
        contexts = {tuple(w[: len(w) - len(cont)]) for w, (_, cont) in zip(windows, encoded)}
        assert sum(tokens_run) == sum(map(len, contexts)) + sum(len(cont) - 1 for _, cont in encoded)
    else:
        assert sum(tokens_run) == sum(len(w) - 1 for w in windows)
    assert any(len(ctx) + len(cont) > MODEL["max_seq_len"] + 1 for ctx, cont in encoded)  # (one is cut)


def test_rolling_scores_every_token_once_past_the_model_length(model, tok):
    from lm_eval import utils as lm_utils

    cfg, module = model
    texts = [" ".join(TEXTS * 4), TEXTS[0]]  # the first longer than max_seq_len: several windows
    lm = lm_of(model, tok, 4)
    totals = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,) for text in texts]))
    for text, total in zip(texts, totals):
        tokens = tok.encode(text)
        windows = list(
            map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(tokens, lm.prefix_token_id, MODEL["max_seq_len"], 1),
            )
        )
        assert sum(len(cont) for _, cont in windows) == len(tokens)
        expected = sum(direct_loglikelihood(module, ctx, cont) for ctx, cont in windows)
        assert total == pytest.approx(expected, rel=1e-5)
    assert len(tok.encode(texts[0])) > 2 * MODEL["max_seq_len"]


def test_a_long_text_is_scored_in_bounded_chunks_of_windows_with_progress(model, tok, monkeypatch, capsys):
    """(One 20 MB document: every window made and packed at once, 2.8 GB held and no answer in 600 s.)"""
    import io
    import sys

    texts = [" ".join(TEXTS * 12), TEXTS[2]]
    whole = lm_of(model, tok, 4).loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
    monkeypatch.setattr(harness, "ROLLING_CHUNK", 3)
    monkeypatch.setattr(sys, "__stderr__", err := io.StringIO())
    lm, sizes = lm_of(model, tok, 4), []
    scored = lm._loglikelihood_tokens
    monkeypatch.setattr(lm, "_loglikelihood_tokens", lambda reqs: sizes.append(len(reqs)) or scored(reqs))
    monkeypatch.setattr(harness, "PROGRESS_AFTER", 1)
    chunked = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
    assert chunked == pytest.approx(whole, rel=1e-6)
    assert max(sizes) == 3 and sum(sizes) > 6  # (at most ROLLING_CHUNK windows in memory at a time)
    lines = err.getvalue().splitlines()
    assert lines and lines[0].startswith("rolling loglikelihood of text 1 of 2: 3 of ")


def test_left_padded_generation_is_each_prompts_own(model, tok):
    cfg, module = model
    until = {"until": ["."], "max_gen_toks": 10, "do_sample": False}
    head_rows = set()  # (the output head runs on each row's last position alone: [B, T, V] logits are large)
    hook = module.lm_head.register_forward_hook(lambda head, args, out: head_rows.add(out.shape[1]))
    try:
        batched = lm_of(model, tok, 8).generate_until(requests("generate_until", [(t, until) for t in TEXTS]))
    finally:
        hook.remove()
    assert head_rows == {1}
    for text, result in zip(TEXTS, batched):
        ids = tok.encode(text)[-(MODEL["max_seq_len"] - 10) :]  # (room for the new tokens: as the harness cuts)
        alone = generate(module, torch.tensor([ids]), 10, eos_id=tok.eos_id)[0].tolist()
        if tok.eos_id in alone:
            alone = alone[: alone.index(tok.eos_id)]
        expected = tok.decode(alone, skip_special=True).split(".")[0]
        assert result == expected


def test_too_long_a_generation_for_the_model_is_one_line(model, tok):
    request = requests("generate_until", [("a", {"until": ["."], "max_gen_toks": 48})])
    with pytest.raises(ConfigError, match="leave no room for its context in model.max_seq_len=48"):
        lm_of(model, tok, 1).generate_until(request)


def test_encoders_are_refused(tok):
    cfg = RunConfig.model_validate(
        {"model": MODEL | {"arch": "encoder"}, "objective": "masked_lm", "data": {"seq_len": 48}}
    )
    with pytest.raises(ConfigError, match="model.arch=encoder"):
        harness.HarnessLM(build_model(cfg.model), cfg, tok, harness.Placement(torch.device("cpu")))


def test_missing_harness_names_the_extra(monkeypatch):
    for name in [name for name in sys.modules if name == "lm_eval" or name.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)  # (an import of any of them fails as if not installed)
    monkeypatch.delitem(sys.modules, "megatransformer.harness")
    with pytest.raises(ConfigError, match=r"not installed\): pip install -e '\.\[eval\]'"):
        importlib.import_module("megatransformer.harness")


def test_a_missing_data_file_is_one_line(tmp_path):
    """(An unknown task name, which needs the harness's whole index, is tests/e2e/test_lm_eval.py's.)"""
    task = tmp_path / "lost.yaml"
    task.write_text(
        f"task: lost\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {tmp_path / 'none.jsonl'}}}}}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: x\ndoc_to_target: y\n"
    )
    with pytest.raises(ConfigError, match="lm-eval task lost .*lost.yaml.* cannot load: .*none.jsonl"):
        harness.load_tasks([str(task)])


def test_tasks_of_ones_own_are_indexed_without_the_shipped_ones(tiny_data, tmp_path):
    from support.harness_tasks import TASKS, write_tasks

    yamls = write_tasks(tiny_data.corpus, tmp_path / "tasks", n=4)
    tasks = harness.load_tasks([str(yamls["mt_choice"])])
    assert tasks.manager.all_tasks == sorted(TASKS)  # (the folder's tasks: not the harness's thousands)
    first, again = tasks.load()["tasks"]["mt_choice"], tasks.load()["tasks"]["mt_choice"]
    assert first is not again and len(first.eval_docs) == len(again.eval_docs) == 4


def test_shares_are_dealt_by_cost_not_by_count():
    costs = [1000, 10, 10, 10, 10, 10, 10, 10]  # (one long document beside short items)
    shares = harness.deal(costs, 2)
    assert sorted(shares[0] + shares[1]) == list(range(8))
    assert shares == [[0], [1, 2, 3, 4, 5, 6, 7]]  # (round-robin gave rank 0 1,030 tokens, rank 1 40)
    many = list(range(1, 101))
    loads = [sum(many[i] for i in share) for share in harness.deal(many, 4)]
    assert max(loads) - min(loads) <= 100  # (within the costliest item of each other)
    assert harness.deal([5], 2) == [[0], []]  # (a rank may have nothing to do)


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_run_their_shares_and_every_rank_gets_every_answer(model, tok, ranks):
    """(2 ranks on a task of 1 item: the harness's own sharding gave the second rank no item, and a traceback.)"""
    import threading

    cfg, module = model
    ids = [tok.encode(text) for text in TEXTS]
    reqs = [(None, ids[i][:3] or [1], ids[(i + 1) % len(ids)][:20]) for i in range(len(ids))]
    expected = lm_of(model, tok, 2)._loglikelihood_tokens(reqs)
    barrier, posted, ran = threading.Barrier(ranks), {}, {}

    def gather(rank):
        def exchange(obj):
            posted[rank] = obj
            barrier.wait()
            everything = [posted[r] for r in range(ranks)]
            barrier.wait()
            return everything

        return exchange

    def scored(rank, requests, out):
        placement = harness.Placement(torch.device("cpu"), rank, ranks, gather=gather(rank))
        lm = harness.HarnessLM(module, cfg, tok, placement, 2)
        original = lm._scored
        lm._scored = lambda groups, share, conts: (
            ran.setdefault(rank, []).extend(share) or original(groups, share, conts)
        )
        out[rank] = lm._loglikelihood_tokens(requests)

    for requests, want in ((reqs, expected), (reqs[:1], expected[:1])):
        out, ran = {}, {}
        threads = [threading.Thread(target=scored, args=(r, requests, out)) for r in range(ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for r in range(ranks):  # (a request scored alone or in another batch: the same up to rounding)
            assert [ll for ll, _ in out[r]] == pytest.approx([ll for ll, _ in want], rel=1e-6)
            assert [greedy for _, greedy in out[r]] == [greedy for _, greedy in want]
        shares = sum(ran.values(), [])
        assert len(shares) == len(set(shares)) and (len(requests) == 1 or all(ran.get(r) for r in range(ranks)))


def test_the_task_bar_counts_every_request_scored_and_generated(model, tok):
    """eval --tasks' bar (commands/eval.task_progress): the harness's requests this rank scores, batch by batch."""
    import io

    from megatransformer.commands.eval import task_progress

    lm = lm_of(model, tok, 2)
    bar = task_progress(lm, io.StringIO(), enabled=True)
    lm.loglikelihood(requests("loglikelihood", [(text, " and more of it") for text in TEXTS]))
    assert bar.n == bar.total == len(TEXTS)
    lm.generate_until(requests("generate_until", [(TEXTS[0], {"until": ["\n"], "max_gen_toks": 2})]))
    assert bar.n == bar.total == len(TEXTS) + 1
    bar.close()
