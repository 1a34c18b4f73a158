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


def test_pack_fills_rows_longest_first_within_capacity():
    batches = harness.pack([9, 7, 5, 4, 3, 2, 2, 1], capacity=10, max_rows=2)
    assert batches == [[[0, 7], [1, 4]], [[2, 3], [5, 6]]]
    assert harness.pack([10, 10, 10], capacity=10, max_rows=2) == [[[0], [1]], [[2]]]
    # rows as wide as each batch's longest request: the shorter ones fill their room
    batches = harness.pack([9, 7, 5, 4, 3, 2, 2, 1], capacity=None, max_rows=2)
    assert batches == [[[0], [1, 5]], [[2], [3, 7]], [[4], [6]]]


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


def test_left_padded_generation_is_each_prompts_own(model, tok):
    cfg, module = model
    until = {"until": ["."], "max_gen_toks": 10, "do_sample": False}
    batched = lm_of(model, tok, 8).generate_until(requests("generate_until", [(t, until) for t in TEXTS]))
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
    with pytest.raises(ConfigError, match="lm-eval task lost cannot load: .*none.jsonl"):
        harness.load_tasks([str(task)])


def test_tasks_of_ones_own_load_without_the_harness_index(tmp_path):
    (tmp_path / "items.jsonl").write_text('{"x": "a b", "y": " c"}\n{"x": "d", "y": " e f"}\n')
    task = tmp_path / "own.yaml"
    task.write_text(
        f"task: own\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {tmp_path / 'items.jsonl'}}}}}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{x}}'\ndoc_to_target: '{{y}}'\n"
    )
    tasks = harness.load_tasks([str(task)])
    assert (tasks.names, tasks.include_defaults) == (("own",), False)
    assert list(tasks.load()["tasks"]) == ["own"]
