"""Translation pairs as data: tab-separated files with and without a header, refused by line when malformed."""

from __future__ import annotations

import pytest


def test_tsv_pairs_with_and_without_header(tmp_path):
    from data_pipeline.documents import read_documents

    (tmp_path / "plain.tsv").write_text("ka lo\tolive ember\n\nmi\tcoral\n")
    (tmp_path / "header.tsv").write_text("id\ttgt\tsrc\n1\tolive ember\tka lo\n2\tcoral\tmi\n")
    for name in ("plain.tsv", "header.tsv"):
        pairs = [(d.prompt, d.text) for d in read_documents([tmp_path / name], "tgt", prompt_field="src")]
        assert pairs == [("ka lo", "olive ember"), ("mi", "coral")], name


def test_tsv_with_a_wrong_number_of_columns_is_refused_by_line(tmp_path):
    from data_pipeline import DataError
    from data_pipeline.documents import read_documents

    (tmp_path / "bad.tsv").write_text("ka\tolive\nlo olive\n")
    with pytest.raises(DataError, match=r"bad.tsv:2: 1 tab-separated columns, expected 2"):
        list(read_documents([tmp_path / "bad.tsv"], "tgt", prompt_field="src"))
