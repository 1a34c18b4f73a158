"""Local lm-evaluation-harness tasks of every output type, made from a corpus (no download): one JSONL of items
and a task YAML per output type, read by the harness through `dataset_path: json`."""

from __future__ import annotations

import json
from pathlib import Path

# task name -> (output type, the YAML lines particular to it)
TASKS = {
    "mt_choice": (
        "multiple_choice",
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: gold\n'
        "metric_list: [{metric: acc}, {metric: acc_norm}]\n",
    ),
    "mt_loglikelihood": (
        "loglikelihood",
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{choices[gold]}}"\n'
        "metric_list: [{metric: perplexity}, {metric: acc}]\n",
    ),
    "mt_rolling": (
        "loglikelihood_rolling",
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]\n",
    ),
    "mt_generate": (
        "generate_until",
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs: {until: ["\\n", "."], max_gen_toks: 12, do_sample: false}\n'
        "metric_list: [{metric: exact_match}]\n",
    ),
}


def write_items(corpus: Path, out: Path, n: int = 20, max_chars: int = 700) -> Path:
    """``n`` items from the corpus's blank-line-separated documents: a document's first words as the context,
    its next three words and those of two other documents as the choices (gold: a different one each time),
    the document itself (at most ``max_chars``) as the text, its next word as the answer."""
    docs = [d for d in (p.strip() for p in corpus.read_text().split("\n\n")) if len(d.split()) >= 12]
    docs = docs[: n + 2]
    with out.open("w") as f:
        for i in range(n):
            words = docs[i].split()
            cut = 4 + i % 6
            gold = i % 3
            others = [docs[(i + k) % len(docs)].split()[cut : cut + 3] for k in (1, 2)]
            choices = others[:gold] + [words[cut : cut + 3]] + others[gold:]
            record = {
                "context": " ".join(words[:cut]),
                "choices": [" " + " ".join(c) for c in choices],
                "gold": gold,
                "text": docs[i][:max_chars],
                "answer": words[cut],
            }
            f.write(json.dumps(record) + "\n")
    return out


def write_tasks(corpus: Path, folder: Path, n: int = 20) -> dict[str, Path]:
    """The items and one YAML per task of TASKS in ``folder``: {task name: its YAML}."""
    folder.mkdir(parents=True, exist_ok=True)
    items = write_items(corpus, folder / "items.jsonl", n).resolve()
    yamls = {}
    for name, (output_type, lines) in TASKS.items():
        yamls[name] = folder / f"{name}.yaml"
        yamls[name].write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {items}}}}}\n"
            f"test_split: test\noutput_type: {output_type}\n{lines}"
        )
    return yamls
