"""``bench/gpu_suite.py``'s own bookkeeping on CPU: its ``--dry`` run end to end (tiny model, the real trainer and
bare step, every figure of the report present), and how it reads dynamo's log, the run's metrics and the
checkpoint's stall."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from support import REPO


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", REPO / "bench" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_dry_run_reports_every_figure_of_both_workloads(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_suite.py"), "--dry", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert report["ok"] and report["missing"] == []
    assert report["gpu_check"]["exit"] == 2  # gpu_check's answer on a machine without CUDA
    for mode in ("rows", "packed"):
        trainer, bare = report[mode]["trainer"], report[mode]["bare"]
        assert trainer["step_s"] > 0 and bare["step_s"] > 0 and 0 < trainer["mfu"] < 1 and 0 < bare["mfu"] < 1
        assert report[mode]["trainer_over_bare"] == pytest.approx(bare["step_s"] / trainer["step_s"])
        assert trainer["compile"]["recompiles"] == 0  # (uncompiled when dry)
        assert trainer["attention"] and trainer["attention"][0].startswith("attention: auto -> chunked")
    # short documents packed, long ones one to a row
    assert report["packed"]["bare"]["documents_per_row"] > 1.5 > report["rows"]["bare"]["documents_per_row"]
    e2e = report["packed"]["trainer"]
    assert e2e["steps"] == 6 and e2e["checkpoint_step"] == 5 and e2e["checkpoint_gib"] > 0
    assert isinstance(e2e["checkpoint_stall_s"], float)
    assert set(report["phases_s"]) == {
        "gpu_check",
        "data",
        "trainer-rows",
        "bare-rows",
        "trainer-packed",
        "bare-packed",
    }
    assert "| packed | trainer |" in done.stdout and "checkpoint at step 5" in done.stdout
    assert not (tmp_path / "run-packed" / "checkpoints").exists()  # (removed once measured: 15 GB at 1.1B)


def test_without_cuda_the_real_suite_refuses_to_start(suite, capsys):
    assert suite.main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


def test_recompiles_and_graph_breaks_are_counted_from_dynamos_log(suite):
    output = "\n".join(
        [
            "V1128 guards.py:5389] [0/1] [__recompiles] Recompiling function forward in model.py:10",
            "V1128 guards.py:5389] [0/1] [__recompiles]     triggered by the following guard failure(s):",
            "V1128 symbolic_convert.py:5077] [0/0] [__graph_breaks] Graph break in user code at varlen.py:40",
            "V1128 symbolic_convert.py:5077] [0/0] [__graph_breaks] Graph Break Reason: data-dependent branch",
            "V1128 symbolic_convert.py:5131] [0/1] [__graph_breaks] Graph break (user stack suppressed due to "
            "duplicate graph break) in user code at varlen.py:40",
            "compile: 1 recompile after warm-up (forward)",  # the run log's own line
        ]
    )
    events = suite.compile_events(output)
    assert events["recompiles"] == 1 and events["graph_breaks"] == 2
    assert events["run_log_lines"] == ["compile: 1 recompile after warm-up (forward)"]


def test_step_times_and_the_checkpoint_stall_come_from_the_metrics(suite):
    records = [
        {"step": 1, "tokens": 100, "tokens_per_s": 50.0, "time": 10.0},
        {"step": 2, "tokens": 200, "tokens_per_s": 100.0, "time": 11.0},
        {"step": 3, "tokens": 300, "tokens_per_s": 100.0, "time": 15.0},  # a checkpoint after step 2
    ]
    assert suite.step_times(records) == [(1, 2.0), (2, 1.0), (3, 1.0)]
    assert suite.checkpoint_stall(records, 2, 1.0) == pytest.approx(3.0)
    assert suite.checkpoint_stall(records, 3, 1.0) is None  # no step after it


def test_a_missing_figure_is_named(suite):
    report = {
        mode: {
            "trainer": {"step_s": 1.0, "mfu": 0.4, "compile": {"recompiles": 0}},
            "bare": {"step_s": 1.0, "mfu": 0.5, "compile": {"recompiles": 0}, "documents_per_row": 1.0},
            "trainer_over_bare": 1.0,
        }
        for mode in ("rows", "packed")
    }
    report["packed"]["trainer"] |= {"checkpoint_stall_s": 2.0, "checkpoint_gib": 15.0}
    assert suite.missing_figures(report) == []
    report["packed"]["trainer"]["mfu"] = None
    del report["rows"]["bare"]["compile"]
    assert suite.missing_figures(report) == ["packed.trainer.mfu", "rows.bare.compile.recompiles"]


def test_the_phases_fit_in_eight_minutes_and_their_limits_are_given_on_the_command_line(suite, monkeypatch):
    assert sum(suite.LIMITS_S.values()) <= 8 * 60
    monkeypatch.setattr(suite, "LIMITS_S", dict(suite.LIMITS_S))
    suite.parse_args(["--limit", "gpu_check=200"])
    assert suite.LIMITS_S["gpu_check"] == 200
    with pytest.raises(SystemExit):
        suite.parse_args(["--limit", "nothing=3"])
