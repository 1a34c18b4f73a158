"""Task files as the harness reads them: bad YAML, refused tags and tasks that cannot load are one line naming the
file and the fix; a task file with `!function` loads (its Python named); the file named is the one evaluated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")

from support import assert_one_line  # noqa: E402

from megatransformer import harness  # noqa: E402
from megatransformer.config import ConfigError  # noqa: E402


def items(path: Path, n: int, word: str = "a") -> Path:
    path.write_text(
        "".join(json.dumps({"context": f"{word} {i}", "choices": [" x", " y"], "gold": i % 2}) + "\n" for i in range(n))
    )
    return path


def task_yaml(path: Path, name: str, data: Path, extra: str = "", metrics: str = "[{metric: acc}]") -> Path:
    path.write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data.resolve()}}}}}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        f'doc_to_text: "{{{{context}}}}"\ndoc_to_choice: "{{{{choices}}}}"\ndoc_to_target: gold\n'
        f"metric_list: {metrics}\n{extra}"
    )
    return path


def refused(tasks: list[str], *fragments: str) -> None:
    with pytest.raises(ConfigError) as err:
        harness.load_tasks(tasks)
    assert_one_line(str(err.value), *fragments)


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("task: [unclosed\n", ["is not valid YAML, line 2", "fix its syntax"]),
        ("task: t\n  bad: indent\n", ["is not valid YAML, line 2"]),
        ("task: t\nprocess_docs: !!python/name:os.system\n", ["line 2: the tag !!python/name:os.system is refused"]),
        (
            "task: t\nx: !!python/object/apply:os.system [echo]\n",
            ["the tag !!python/object/apply:os.system is refused"],
        ),
        ("- just\n- a list\n", ["holds no mapping of task settings"]),
    ],
)
def test_a_task_file_of_bad_yaml_or_a_python_tag_is_one_line_naming_it(tmp_path, text, fragments):
    (tmp_path / "t.yaml").write_text(text)
    refused([str(tmp_path / "t.yaml")], f"task file {tmp_path / 't.yaml'}", *fragments)


def test_a_task_file_with_a_function_tag_is_named_by_path_and_its_python_is_named(tmp_path):
    task_yaml(
        tmp_path / "fn.yaml", "mt_fn", items(tmp_path / "items.jsonl", 9), "process_docs: !function utils.first_five\n"
    )
    (tmp_path / "utils.py").write_text("def first_five(dataset):\n    return dataset.select(range(5))\n")
    tasks = harness.load_tasks([str(tmp_path / "fn.yaml")])
    assert len(tasks.load()["tasks"]["mt_fn"].eval_docs) == 5  # (lm-eval ran the folder's utils.py)
    [line] = tasks.code()
    assert f"task mt_fn ({tmp_path / 'fn.yaml'}) imports Python: {tmp_path / 'utils.py'}" in line


def test_tasks_that_cannot_load_say_why_naming_the_file_and_the_fix(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    task_yaml(tmp_path / "empty.yaml", "mt_empty", tmp_path / "empty.jsonl")
    refused([str(tmp_path / "empty.yaml")], "lm-eval task mt_empty", str(tmp_path / "empty.yaml"), "holds no items")
    task_yaml(tmp_path / "m.yaml", "mt_m", items(tmp_path / "i.jsonl", 3), metrics="[{metric: acc}, {metric: no_such}]")
    refused([str(tmp_path / "m.yaml")], "lm-eval task mt_m", "lm-eval knows no metric no_such (its metric_list)")


def test_the_task_file_named_wins_over_a_task_of_the_same_name_in_an_indexed_folder(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "lmtasks").mkdir()
    task_yaml(tmp_path / "tasks" / "facts.yaml", "facts", items(tmp_path / "three.jsonl", 3))
    task_yaml(tmp_path / "lmtasks" / "facts.yaml", "facts", items(tmp_path / "seven.jsonl", 7))
    task_yaml(tmp_path / "lmtasks" / "heldppl.yaml", "heldppl", items(tmp_path / "two.jsonl", 2))
    # (train.evals with tasks/facts.yaml and lmtasks/heldppl.yaml ran lmtasks/facts.yaml)
    tasks = harness.load_tasks([str(tmp_path / "tasks" / "facts.yaml"), str(tmp_path / "lmtasks" / "heldppl.yaml")])
    loaded = tasks.load()["tasks"]
    assert len(loaded["facts"].eval_docs) == 3 and len(loaded["heldppl"].eval_docs) == 2
    # (eval --tasks u.yaml evaluated its sibling t.yaml)
    task_yaml(tmp_path / "lmtasks" / "u.yaml", "facts", items(tmp_path / "five.jsonl", 5))
    assert len(harness.load_tasks([str(tmp_path / "lmtasks" / "u.yaml")]).load()["tasks"]["facts"].eval_docs) == 5
    refused(
        [str(tmp_path / "tasks" / "facts.yaml"), str(tmp_path / "lmtasks" / "facts.yaml")],
        "both define task facts",
        "rename one",
    )


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--limit", "0"], ["--limit 0: give at least 1 item a task"]),
        (["--samples", "/proc/no/such/samples.jsonl"], ["--samples /proc/no/such/samples.jsonl cannot be written"]),
        (["--zero-stage", "3"], ["--zero-stage 3 partitions the model over torchrun's ranks: run it under torchrun"]),
    ],
)
def test_arguments_that_would_fail_inside_the_harness_are_one_line_before_evaluating(tmp_path, capsys, args, fragments):
    from megatransformer.cli import main

    task = task_yaml(tmp_path / "t.yaml", "mt_t", items(tmp_path / "i.jsonl", 3))
    assert main(["eval", "--checkpoint", str(tmp_path / "none"), "--tasks", str(task), *args]) == 2
    assert_one_line(capsys.readouterr().err, "megatransformer eval: error:", *fragments)


def test_a_few_shot_count_beyond_a_tasks_examples_is_refused_and_a_perplexity_task_keeps_none(tmp_path):
    task = task_yaml(tmp_path / "t.yaml", "mt_t", items(tmp_path / "i.jsonl", 4))
    rolling = tmp_path / "r.yaml"
    rolling.write_text(
        f"task: mt_r\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {tmp_path / 'i.jsonl'}}}}}\n"
        'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{context}}"\n'
        "metric_list: [{metric: word_perplexity}]\n"
    )
    tasks = harness.load_tasks([str(task), str(rolling)])
    with pytest.raises(ConfigError) as err:
        harness.check_fewshot(tasks, 9, "--num-fewshot")
    assert_one_line(str(err.value), "--num-fewshot 9: task mt_t", "has 4 examples to draw shots from", "at most")
    harness.check_fewshot(tasks, 3, "--num-fewshot")
    assert harness.configured(tasks, 3)["tasks"]["mt_r"].get_config("num_fewshot") == 0


def test_a_task_in_an_include_path_file_that_cannot_be_read_is_named_with_the_file(tmp_path, monkeypatch):
    own = harness.task_manager
    monkeypatch.setattr(harness, "task_manager", lambda paths, shipped=True: own(paths, shipped=False))  # (fast)
    (tmp_path / "t.yaml").write_text("task: mt_t\ndataset_path: json\nx: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        harness.load_tasks(["mt_t"], [str(tmp_path)])
    assert_one_line(str(err.value), "lm-eval knows no task mt_t", f"task file {tmp_path / 't.yaml'} is not valid YAML")
