"""``bench/gpu_suite.py``'s own bookkeeping on CPU: its ``--dry`` run end to end (tiny model, the real trainer and
bare step, every figure of the report present), and how it reads dynamo's log, the run's metrics and the
checkpoint's stall."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import REPO, bench_script


@pytest.fixture(scope="module")
def suite():
    with bench_script("gpu_suite") as module:
        yield module


def test_the_dry_run_reports_every_figure_of_every_phase(suite, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_suite.py"), "--dry", "--out", str(out), "--work", str(work)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == ["gpu_suite.json", "gpu_suite.md"]  # the work stays out
    report = json.loads((out / "gpu_suite.json").read_text())
    assert report["ok"] and report["missing"] == []
    assert report["gpu_check"]["exit"] == 2 and report["gpu_check"]["collected"]  # no CUDA; its tests import here
    for mode in ("rows", "packed"):
        trainer, bare = report[mode]["trainer"], report[mode]["bare"]
        assert trainer["step_s"] > 0 and bare["step_s"] > 0 and 0 < trainer["mfu"] < 1 and 0 < bare["mfu"] < 1
        assert report[mode]["trainer_over_bare"] == pytest.approx(bare["step_s"] / trainer["step_s"])
        assert trainer["compile"]["recompiles"] == 0  # (uncompiled when dry)
        assert trainer["attention"] and trainer["attention"][0].startswith("attention: auto -> chunked")
    # short documents packed, long ones one to a row
    assert report["packed"]["bare"]["documents_per_row"] > 1.5 > report["rows"]["bare"]["documents_per_row"]
    # one checkpoint in the whole suite: the packed run's, at its end
    [save] = report["packed"]["trainer"]["checkpoints"]
    assert save["step"] == 6 and save["gib"] > 0 and 0 <= save["setup_s"] <= save["stall_s"]
    for run in (
        report["rows"]["trainer"],
        report["muon"]["trainer"],
        report["zero3"]["trainer"],
        report["tp"]["trainer"],
    ):
        assert run["checkpoints"] == []
    assert not list(work.glob("run-*/checkpoints/*"))  # (removed once measured: 15 GB at 1.1B)
    # Muon against AdamW on the same rows; Newton-Schulz alone
    muon = report["muon"]
    assert muon["muon_over_adamw"] == pytest.approx(muon["trainer"]["step_s"] / report["rows"]["trainer"]["step_s"])
    assert muon["ns"]["ns_s"] > 0 and muon["ns"]["matrices"] == 2 * 7 and muon["ns_share"] > 0
    # the rows' trainer and bare step profiled after their timed steps, side by side
    assert report["rows"]["trainer"]["steps"] == suite.DRY.warmup + suite.DRY.steps + suite.PROFILE_STEPS
    profile = report["rows"]["profile"]
    assert report["rows"]["trainer"]["profile"]["steps"] == report["rows"]["bare"]["profile"]["steps"] == 3
    assert profile["trainer_step_ms"] > 0 and profile["bare_step_ms"] > 0 and profile["by"] == "self_cpu_us"
    assert len(profile["difference"]) == 12 and "profile" not in report["packed"]["trainer"]  # (the rows' alone)
    # ZeRO-3 on one rank: the compiled block between DeepSpeed's hooks there
    assert report["zero3"]["trainer"]["ok"] and report["zero3"]["trainer"]["steps"] == 2
    # tensor parallelism: two gloo ranks here (two GPUs there)
    assert report["tp"]["trainer"]["ok"] and report["tp"]["trainer"]["steps"] == 2
    assert set(report["phases_s"]) == {
        "gpu_check",
        "data",
        "trainer-rows",
        "bare-rows",
        "trainer-packed",
        "bare-packed",
        "trainer-muon",
        "muon-ns",
        "trainer-zero3",
        "trainer-tp",
    }
    # every process of every phase imported only what the image or the wheel list has, and shared one cache
    imports = report["imports"]
    assert imports["missing"] == [] and imports["missing_fa4"] == [] and imports["processes"] >= 10
    assert {"deepspeed", "pydantic", "webdataset"} <= set(imports["from_wheels"])  # (the core list's)
    assert "flash-attn-4" not in imports["from_wheels"]
    [caches] = [json.loads(env) for env in report["caches"]]
    assert caches["TORCHINDUCTOR_CACHE_DIR"] == str(work / "cache" / "inductor")
    assert caches["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(work / "cache" / "flash-attn-4")
    assert caches["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    markdown = (out / "gpu_suite.md").read_text()
    assert (
        "| packed | trainer |" in markdown and "| rows, muon | trainer |" in markdown and "| rows, tp 2 |" in markdown
    )
    assert "| rows, ZeRO-3 | trainer |" in markdown and "- profile (rows, 3 steps after the timed ones): " in markdown
    assert "checkpoint (the suite's one, packed run, step 6)" in markdown and markdown in done.stdout + "\n"


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


def test_step_times_and_the_checkpoint_come_from_the_metrics(suite):
    records = [
        {"step": 1, "tokens": 100, "tokens_per_s": 50.0, "time": 10.0, "kind": "train"},
        {"step": 2, "tokens": 200, "tokens_per_s": 100.0, "time": 11.0, "kind": "train"},
        {
            "step": 2,
            "kind": "checkpoint",
            "ckpt_stall_s": 1.5,
            "ckpt_setup_s": 1.2,
            "ckpt_write_s": 20.0,
            "ckpt_bytes": 3 * 2**30,
        },
    ]
    assert suite.step_times(records[:2]) == [(1, 2.0), (2, 1.0)]
    assert suite.saved(records) == [{"step": 2, "stall_s": 1.5, "setup_s": 1.2, "write_s": 20.0, "gib": 3.0}]
    assert suite.saved(records[:2]) == []


def complete_report(tp_skipped: bool = False) -> dict:
    report = {
        mode: {
            "trainer": {"step_s": 1.0, "mfu": 0.4, "compile": {"recompiles": 0}},
            "bare": {"step_s": 1.0, "mfu": 0.5, "compile": {"recompiles": 0}, "documents_per_row": 1.0},
            "trainer_over_bare": 1.0,
        }
        for mode in ("rows", "packed")
    }
    report["packed"]["trainer"]["checkpoints"] = [{"step": 30, "stall_s": 2.0, "gib": 15.0, "write_s": 9.0}]
    report["muon"] = {"trainer": {"step_s": 1.2}, "ns": {"ns_s": 0.1}, "muon_over_adamw": 1.2, "ns_share": 0.08}
    report["zero3"] = {"trainer": {"step_s": 1.1, "compile": {"recompiles": 1, "graph_breaks": 0}}}
    report["rows"]["profile"] = {"trainer_step_ms": 120.0, "bare_step_ms": 110.0}
    skip = {"skipped": "needs 2 GPUs"}
    report["tp"] = skip if tp_skipped else {"trainer": {"step_s": 1.0, "compile": {"graph_breaks": 0}}}
    return report


def test_a_missing_figure_is_named(suite):
    report = complete_report()
    assert suite.missing_figures(report) == []
    report["packed"]["trainer"]["mfu"] = None
    del report["rows"]["bare"]["compile"]
    report["packed"]["trainer"]["checkpoints"] = []  # the one checkpoint was not written
    report["tp"]["trainer"] = {"ok": False}
    report["zero3"]["trainer"]["compile"] = {}
    assert suite.missing_figures(report) == [
        "packed.trainer.mfu",
        "rows.bare.compile.recompiles",
        "packed.trainer.checkpoints.0.stall_s",
        "packed.trainer.checkpoints.0.gib",
        "zero3.trainer.compile.recompiles",
        "zero3.trainer.compile.graph_breaks",
        "tp.trainer.step_s",
        "tp.trainer.compile.graph_breaks",
    ]
    assert suite.missing_figures(complete_report(tp_skipped=True)) == []  # a skip with its reason is complete


def test_the_profiles_differences_come_first_by_their_size(suite):
    def profile(step_ms, kernels_ms, **us):
        top = [{"name": name, "on": "cuda", "self_device_us": t} for name, t in us.items()]
        top.append({"name": "aten::mm", "on": "cpu", "self_device_us": us["gemm"]})  # (its kernel's time again)
        return {
            "profile": {
                "step_ms": step_ms,
                "device_busy_ms": kernels_ms,
                "sorted_by": "self_device_time_total",
                "top": top,
            }
        }

    trainer = profile(120.0, 100.0, gemm=90_000.0, copy=6_000.0, adam=3_000.0)
    bare = profile(110.0, 99.0, gemm=90_500.0, adam=2_000.0, clip=100.0)
    compared = suite.profile_difference(trainer, bare, rows=3)
    assert compared["trainer_step_ms"] == 120.0 and compared["bare_kernels_ms"] == 99.0
    assert compared["by"] == "self_device_us"
    assert [(d["name"], d["trainer_us"], d["bare_us"]) for d in compared["difference"]] == [
        ("copy", 6_000.0, 0.0),  # (in the trainer's top rows only)
        ("adam", 3_000.0, 2_000.0),
        ("gemm", 90_000.0, 90_500.0),
    ]
    assert "aten::mm" not in [d["name"] for d in suite.profile_difference(trainer, bare)["difference"]]
    assert suite.profile_difference(trainer, {"ok": False}) is None


def test_tensor_parallelism_is_skipped_on_one_gpu_with_its_reason(suite, monkeypatch):
    import torch

    assert suite.tp_skip(suite.DRY) is None  # (gloo's CPU ranks)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    reason = suite.tp_skip(suite.GPU)
    assert reason.startswith("needs 2 GPUs, this machine has 1: NCCL runs one rank per GPU")
    assert "at tensor_parallel=1 DeepSpeed applies no AutoTP" in reason
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert suite.tp_skip(suite.GPU) is None


def test_the_wheel_list_is_read_from_gpu_wheels_sh(suite):
    core, fa4 = suite.wheel_list(), suite.wheel_list("fa4")
    assert {"deepspeed", "zstandard", "pydantic", "pydantic-core", "typing-extensions", "py-cpuinfo"} <= set(core)
    assert not {"flash-attn-4", "nvidia-cutlass-dsl"} & set(core)  # (core mode: no flash-attn 4)
    assert set(core) | {"flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels"} <= set(fa4)
    assert "torch" not in fa4  # (the image's own)
    assert {"torch", "transformers", "tokenizers", "numpy"} <= suite.image_distributions()


def test_an_import_neither_the_image_nor_the_wheels_bring_is_named(suite, monkeypatch):
    assert suite.import_check({"deepspeed", "zstandard", "numpy", "torch"})["missing"] == []
    wheels = suite.wheel_list
    monkeypatch.setattr(suite, "wheel_list", lambda mode="core": [w for w in wheels(mode) if w != "zstandard"])
    check = suite.import_check({"deepspeed", "zstandard"})
    assert check["missing"] == ["zstandard (import zstandard)"]  # the H200's data phase, before the fix
    monkeypatch.setattr(suite, "GPU_ONLY_IMPORTS", {"triton": "triton-9"})
    assert suite.import_check(set())["missing"] == ["triton-9 (import triton)"]
    monkeypatch.setattr(suite, "FA4_IMPORTS", {"flash_attn": "flash-attn-5"})
    check = suite.import_check(set())
    assert check["missing_fa4"] == ["flash-attn-5 (import flash_attn)"] and "flash-attn-5" not in str(check["missing"])


def test_a_dry_runs_processes_cannot_import_what_the_gpu_machine_lacks(suite, tmp_path):
    """lm-eval and pyarrow are installed here, not on the H200's image nor in the wheel list: a dry run's
    processes behave as there (an optional import degrades, a required one fails the phase)."""
    blocked = suite.blocked_modules()
    assert {"lm_eval", "pyarrow"} <= set(blocked)
    keep = {"deepspeed", "torch", "zstandard", "megatransformer", "data_pipeline", "yaml", "matplotlib"}
    assert not keep & set(blocked) and "more_itertools" not in blocked  # (setuptools vendors it)
    (tmp_path / "blocked.json").write_text(json.dumps(blocked))
    env = suite.environment(suite.DRY, tmp_path / "work")
    env["MT_RECORD_IMPORTS"] = str(tmp_path)
    probe = "import importlib.util, sys; print(importlib.util.find_spec('lm_eval')); import yaml; import lm_eval"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert done.stdout.splitlines() == ["None"] and "ModuleNotFoundError" in done.stderr
    [record] = [json.loads(path.read_text()) for path in tmp_path.glob("[0-9]*.json")]
    assert "yaml" in record["modules"] and "lm_eval" not in record["modules"]


def test_the_work_directory_stays_outside_the_output(suite, tmp_path):
    with pytest.raises(SystemExit):
        suite.parse_args(["--out", str(tmp_path), "--work", str(tmp_path / "suite-work")])
    args = suite.parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    assert args.work == tmp_path / "work"


def test_every_process_of_the_suite_shares_the_compile_caches(suite, tmp_path):
    env = suite.environment(suite.GPU, tmp_path)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "cache" / "flash-attn-4")
    assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"  # (flash-attn 4 keeps nothing on disk without it)
    assert "MT_RECORD_IMPORTS" not in env and str(suite.RECORDER) not in env["PYTHONPATH"]  # (dry runs only)
    assert str(suite.RECORDER) in suite.environment(suite.DRY, tmp_path)["PYTHONPATH"]


# Each phase's seconds on the H200 of 2026-12-04 (BENCHMARKS.md section 6), the first 1.1B phase compiling
H200_SECONDS = {
    "gpu_check": 131.1,
    "data": 14.0,
    "trainer-rows": 35.3,
    "bare-rows": 23.3,
    "trainer-packed": 53.7,
    "bare-packed": 21.4,
    "trainer-muon": 29.6,
    "muon-ns": 4.9,
}


def test_the_phases_and_the_install_fit_in_one_device_call_and_limits_are_given_on_the_command_line(suite, monkeypatch):
    one_gpu = sum(seconds for phase, seconds in suite.LIMITS_S.items() if phase != "trainer-tp")  # (tp: two GPUs)
    assert one_gpu + suite.INSTALL_S + suite.START_S <= suite.CALL_S == 600
    for phase, seconds in H200_SECONDS.items():  # (empty compile caches but gpu_check's)
        assert suite.LIMITS_S[phase] >= 1.1 * seconds, phase
    monkeypatch.setattr(suite, "LIMITS_S", dict(suite.LIMITS_S))
    suite.parse_args(["--limit", "gpu_check=200"])
    assert suite.LIMITS_S["gpu_check"] == 200
    with pytest.raises(SystemExit):
        suite.parse_args(["--limit", "nothing=3"])
