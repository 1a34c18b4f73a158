"""``bench/gpu_suite.py`` in one device call: a phase past its limit is killed with every process below it and keeps
what it printed and the metrics it wrote; the data phase's commands share one limit; the report is on disk after
every phase and after an exception; the core wheel list brings every requirement of what it installs."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from support import bench_script


@pytest.fixture(scope="module")
def suite():
    with bench_script("gpu_suite") as module:
        yield module


# A process that writes its pid to the file named (whole, once there) and sleeps.
SLEEPER = (
    "import os, sys, time; open(sys.argv[1] + '~', 'w').write(str(os.getpid())); "
    "os.rename(sys.argv[1] + '~', sys.argv[1]); time.sleep(60)"
)
# A phase's process tree: a child in the phase's process group and a grandchild in a session of its own (as
# torchrun starts its ranks); the phase prints, writes one metrics line and half of another, and waits.
TREE = f"""
import json, os, subprocess, sys, time
folder = sys.argv[1]
subprocess.Popen([sys.executable, "-c", {SLEEPER!r}, folder + "/child"])
subprocess.Popen([sys.executable, "-c", {SLEEPER!r}, folder + "/rank"], start_new_session=True)
with open(folder + "/metrics.jsonl", "w") as f:
    f.write(json.dumps({{"kind": "train", "step": 1, "tokens": 10, "tokens_per_s": 5.0}}) + "\\n" + '{{"kind": "tr')
print("step 1 done", flush=True)
print("[__graph_breaks] Graph break in user code at x.py:1", file=sys.stderr, flush=True)
while not (os.path.exists(folder + "/child") and os.path.exists(folder + "/rank")):
    time.sleep(0.05)
print("waiting", flush=True)
time.sleep(60)
"""
# A phase that leaves a child behind in its process group as it ends.
LEAVES_A_CHILD = f"""
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {SLEEPER!r}, sys.argv[1]])
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


def tree_pids(folder) -> list[int]:
    return [int((folder / name).read_text()) for name in ("child", "rank")]


def test_a_phase_past_its_limit_is_killed_with_its_whole_tree_and_keeps_its_output(suite, tmp_path):
    command = [sys.executable, "-c", TREE, str(tmp_path)]
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        suite.run_process(command, {}, 10, tmp_path / "logs" / "phase")
    assert caught.value.output == "step 1 done\nwaiting\n"  # (text, as far as it was printed)
    assert "Graph break" in caught.value.stderr
    assert (tmp_path / "logs" / "phase.out").read_text() == caught.value.output  # (the whole log stays)
    child, rank = tree_pids(tmp_path)
    assert not suite.running(child) and not suite.running(rank)  # (ended by the time the phase's result is back)


def test_a_trainer_phase_past_its_limit_keeps_its_output_and_the_metrics_written(suite, tmp_path, monkeypatch):
    def fake_trainer(*words):  # (the run's metrics go to its run_dir, as the trainer's)
        run_dir = next(word.partition("=")[2] for word in words if word.startswith("run_dir="))
        return [sys.executable, "-c", f"import os; os.makedirs({run_dir!r}, exist_ok=True)\n{TREE}", run_dir]

    monkeypatch.setattr(suite, "megatransformer", fake_trainer)
    monkeypatch.setattr(suite, "limit", lambda wl, phase: 10)  # (time for three Python starts on a busy machine)
    data = {"train": str(tmp_path / "shards"), "tokenizer": str(tmp_path / "tokenizer.json")}
    result = suite.trainer(suite.DRY, suite.Run("trainer-rows", "rows", 3), data, tmp_path)
    assert result["ok"] is False and result["timed_out"] and result["limit_s"] == suite.LIMITS_S["trainer-rows"]
    assert result["stdout"] == "step 1 done\nwaiting\n" and result["compile"]["graph_breaks"] == 1
    assert result["metrics"] == [{"kind": "train", "step": 1, "tokens": 10, "tokens_per_s": 5.0}]  # (cut line skipped)
    assert not any(map(suite.running, tree_pids(tmp_path / "run-trainer-rows")))


def test_what_a_finished_phase_leaves_in_its_process_group_is_killed(suite, tmp_path):
    command = [sys.executable, "-c", LEAVES_A_CHILD, str(tmp_path / "left")]
    assert suite.run_process(command, {}, 30, tmp_path / "phase").returncode == 0
    left = int((tmp_path / "left").read_text())
    deadline = time.monotonic() + 10
    while suite.running(left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not suite.running(left)


def test_unparsable_metrics_lines_are_skipped(suite, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    good = {"kind": "train", "step": 1}
    metrics.write_text(json.dumps(good) + "\n\n[1, 2]\nnot json\n" + json.dumps(good)[:9])
    assert suite.read_metrics(metrics) == [good]
    assert suite.read_metrics(tmp_path / "absent.jsonl") == []
    assert suite.last_json('{"ns_s": 1.0}\n{cut\nlog line\n') == {"ns_s": 1.0}


def test_the_data_phases_commands_share_its_limit(suite, tmp_path, monkeypatch):
    clock, given = [0.0], []

    def fake_run(command, env, timeout, log):  # (each command takes 6 s of a 15 s limit)
        given.append(timeout)
        clock[0] += 6
        if timeout <= 0:
            raise subprocess.TimeoutExpired(command, timeout, output="", stderr="late")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(suite, "run_process", fake_run)
    monkeypatch.setattr(suite.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(suite, "limit", lambda wl, phase: 15)
    (tmp_path / "corpus.txt").write_text("text " * 100)
    result = suite.data_phase(suite.DRY, tmp_path)
    assert given == [15, 9, 3, 0]  # corpus, tokenizer, rows' shards, then no time left for the packed ones
    assert result["timed_out"] and result["stderr"] == "late" and result["limit_s"] == suite.LIMITS_S["data"]
    # each command's seconds, the one cut short too: what to raise next time
    assert result["seconds"] == {"corpus": 6, "tokenizer": 6, "shard-rows": 6, "shard-packed": 6}


def test_the_bare_steps_mfu_is_the_median_steps_as_the_trainers_is(suite):
    flops, seconds = [4e12] * 5, [1.0, 1.0, 30.0, 1.0, 1.0]  # one step recompiles
    assert suite.median_mfu(flops, seconds, peak_tflops=10.0) == pytest.approx(0.4)  # (not 20e12 / 34 s / 10e12)
    assert suite.median_mfu(flops, seconds, peak_tflops=None) is None


def test_the_report_is_written_after_every_phase_and_after_an_exception(suite, tmp_path, monkeypatch):
    out, seen = tmp_path / "out", []
    out.mkdir()

    def on_disk() -> dict:
        return json.loads((out / "gpu_suite.json").read_text())

    def fake_trainer(wl, run, data, work):
        seen.append((run.phase, on_disk()))
        if run.phase == "trainer-packed":
            raise RuntimeError("the packed run broke the suite")
        return {"ok": True, "step_s": 2.0, "mfu": 0.4}

    monkeypatch.setattr(suite, "versions", lambda: {"device": "test", "torch": "0", "date": "today"})
    monkeypatch.setattr(suite, "gpu_check", lambda wl, work: {"ok": True})
    monkeypatch.setattr(suite, "data_phase", lambda wl, work: {"ok": True, "paths": {"rows": {}, "packed": {}}})
    monkeypatch.setattr(suite, "trainer", fake_trainer)
    monkeypatch.setattr(suite, "bare", lambda wl, mode, data, work, phase=None: {"ok": True, "step_s": 1.0})
    with pytest.raises(RuntimeError):
        suite.run_suite(suite.GPU, tmp_path / "work", out)
    [(_, before_rows), (_, before_packed)] = seen
    assert before_rows["gpu_check"] == {"ok": True} and before_rows["data"]["ok"]
    assert before_rows["rows"]["trainer"]["not_run"] and list(before_rows["phases_s"]) == ["gpu_check", "data"]
    assert before_packed["rows"]["bare"]["ok"] and before_packed["rows"]["trainer_over_bare"] == 0.5
    report = on_disk()
    assert "RuntimeError: the packed run broke the suite" in report["error"] and not report["ok"]
    assert report["rows"]["trainer"]["ok"] and report["packed"]["trainer"] == {"ok": False, "not_run": True}
    assert "trainer-packed" in report["phases_s"] and "tp" in report and "packed.trainer.step_s" in report["missing"]
    markdown = (out / "gpu_suite.md").read_text()
    assert "| packed | trainer (not run) |" in markdown and "stopped by an error: RuntimeError" in markdown
    assert sorted(path.name for path in out.iterdir()) == ["gpu_suite.json", "gpu_suite.md"]


def test_a_second_call_can_leave_gpu_check_out(suite, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    ran = []
    monkeypatch.setattr(suite, "versions", lambda: {"device": "test", "torch": "0", "date": "today"})
    monkeypatch.setattr(suite, "tp_skip", lambda wl: "one GPU")
    monkeypatch.setattr(suite, "gpu_check", lambda wl, work: ran.append("gpu_check") or {"ok": True})
    monkeypatch.setattr(suite, "data_phase", lambda wl, work: {"ok": True, "paths": {"rows": {}, "packed": {}}})
    monkeypatch.setattr(suite, "trainer", lambda wl, run, data, work: {"ok": True, "step_s": 2.0, "mfu": 0.4})
    monkeypatch.setattr(suite, "bare", lambda wl, mode, data, work, phase=None: {"ok": True, "step_s": 1, "ns_s": 1})
    report = suite.run_suite(suite.GPU, tmp_path / "work", out, skip_gpu_check=True)
    assert ran == [] and report["gpu_check"] == {"skipped": "--skip-gpu-check"}
    assert "gpu_check" not in report["phases_s"]
    assert "- gpu_check skipped (--skip-gpu-check); data ok: True" in (out / "gpu_suite.md").read_text()
    assert report["ok"]  # (the figures are fakes; a skipped gpu_check is not a failed one)


def test_the_core_wheel_list_brings_every_requirement_of_what_it_installs(suite, monkeypatch):
    assert suite.unmet_requirements() == []
    wheels = suite.wheel_list
    monkeypatch.setattr(suite, "wheel_list", lambda mode="core": [w for w in wheels(mode) if w != "psutil"])
    assert suite.unmet_requirements() == ["psutil (required by deepspeed)"]
    assert "psutil (required by deepspeed)" in suite.import_check(set())["missing"]
