"""``bench/gpu_check.py``'s own bookkeeping, on CPU: the commands it builds, how it reads pytest's output and
judges the step probe, and the CUDA sync counter it gates on (torch.cuda's sync debug mode, faked here)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from support import REPO, bench_script

from megatransformer.training.observability.probes import CudaSyncCounter


@pytest.fixture(scope="module")
def gpu_check():
    with bench_script("gpu_check") as module:
        yield module


def pytest_run(monkeypatch, gpu_check, returncode: int, stdout: str, stderr: str = "") -> list[list[str]]:
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)

    monkeypatch.setattr(gpu_check, "run", run)
    return commands


def test_every_gpu_test_of_the_repository_runs(monkeypatch, gpu_check):
    commands = pytest_run(monkeypatch, gpu_check, 0, "....\n12 passed, 850 deselected in 40.0s\n")
    assert gpu_check.gpu_tests() == {"ok": True, "summary": "12 passed, 850 deselected in 40.0s"}
    command = commands[0]
    assert command[:3] == [sys.executable, "-m", "pytest"] and command[command.index("-m", 3) + 1] == "gpu"
    # every file of the test tree that marks a test gpu, and no other (their imports need not be the GPU's)
    files = command[command.index("no:cacheprovider") + 1 :]
    marked = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "tests").rglob("test_*.py"))
        if "@pytest.mark.gpu" in path.read_text() or "pytestmark = pytest.mark.gpu" in path.read_text()
    ]
    assert marked and set(marked) <= set(files) and "tests/unit/test_gpu_cores.py" in files
    assert "tests/unit/test_data_inputs.py" not in files  # (pyarrow's: not on the GPU image)


@pytest.mark.parametrize(
    "returncode, stdout, stderr",
    [
        (1, "", "ImportError: something\n"),  # pytest printed nothing
        (5, "no tests ran in 0.5s\n", ""),  # nothing collected
        (1, "1 failed, 3 passed in 9s\n", ""),
    ],
)
def test_a_run_that_did_not_pass_fails_without_crashing(monkeypatch, gpu_check, returncode, stdout, stderr):
    pytest_run(monkeypatch, gpu_check, returncode, stdout, stderr)
    report = gpu_check.gpu_tests()
    assert not report["ok"] and report["summary"] == (stdout or stderr).strip().splitlines()[-1]


FLASH_SKIP = "SKIPPED [11] tests/unit/test_flash_decomposition.py:198: needs CUDA and the flash-attn package"
ULYSSES_SKIP = (
    "SKIPPED [1] tests/e2e/test_ulysses_core.py:108: needs 2 CUDA GPUs (NCCL gives each rank its own) and the "
    "flash-attn package; CPU machines check the same exchange with gloo above"
)
FA4_TORCH_SKIP = "SKIPPED [7] tests/unit/test_gpu_cores.py:291: flash-attn 4 on torch 2.11.0+cu130: needs torch >= 2.13"
FA4_MISSING_SKIP = (
    "SKIPPED [7] tests/unit/test_gpu_cores.py:291: needs a Hopper or Blackwell GPU and flash-attn 4 "
    "(pip install --pre flash-attn-4)"
)
H200_TORCH_2_11 = {"flash_attn": False, "gpus": 1, "fa4_torch_refusal": "torch 2.11's varlen_attn passes ..."}


def test_expected_skips_are_reported_with_their_reasons_not_failed(monkeypatch, gpu_check):
    """The first H200: no flash-attn 2 (not installable offline), one GPU, torch 2.11."""
    skips = [FLASH_SKIP, ULYSSES_SKIP, FA4_TORCH_SKIP]
    pytest_run(monkeypatch, gpu_check, 0, "..s\n" + "\n".join(skips) + "\n13 passed, 19 skipped in 5s\n")
    report = gpu_check.gpu_tests(H200_TORCH_2_11)
    assert report["ok"] and "skipped" not in report
    assert [(s["skip"], s["rule"]) for s in report["expected_skips"]] == [
        (FLASH_SKIP, "flash-attn 2"),
        (ULYSSES_SKIP, "flash-attn 2"),
        (FA4_TORCH_SKIP, "flash-attn 4 on this torch"),
    ]
    assert "not installable offline" in report["expected_skips"][0]["why"]


@pytest.mark.parametrize(
    "skip, machine",
    [
        (FLASH_SKIP, {**H200_TORCH_2_11, "flash_attn": True}),  # installed, yet skipped: something is wrong
        (ULYSSES_SKIP, {**H200_TORCH_2_11, "flash_attn": True, "gpus": 2}),
        (FA4_TORCH_SKIP, {**H200_TORCH_2_11, "fa4_torch_refusal": None}),  # this torch passes windows right
        (FA4_MISSING_SKIP, H200_TORCH_2_11),  # flash-attn 4 comes with the wheels: its absence is a failure
        ("SKIPPED [1] tests/e2e/test_step_probes.py:70: page-locked memory needs CUDA", H200_TORCH_2_11),
    ],
)
def test_unexpected_skips_fail_the_check_with_their_reasons(monkeypatch, gpu_check, skip, machine):
    pytest_run(monkeypatch, gpu_check, 0, f"..s\n{skip}\n3 passed, 12 skipped in 5s\n")
    report = gpu_check.gpu_tests(machine)
    assert not report["ok"] and report["skipped"] == [skip]
    assert report["summary"] == "3 passed, 12 skipped in 5s"


def test_the_machine_facts_behind_the_expected_skips_are_read_here(gpu_check):
    facts = gpu_check.machine_facts()
    assert facts == {"flash_attn": False, "gpus": 0, "fa4_torch_refusal": None}  # this CPU, torch 2.13


def test_training_runs_this_interpreters_megatransformer(gpu_check, tmp_path):
    command = gpu_check.training_command(tmp_path)
    assert command[:4] == [sys.executable, "-m", "megatransformer", "quickstart"]
    done = subprocess.run([*command[:3], "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "quickstart" in done.stdout


def test_the_packed_runs_attention_core_is_read_from_the_run_log(gpu_check):
    core = gpu_check.packed_attention_core
    assert core(["attention: auto -> flash for every mask on cuda in bfloat16"]) == "flash"
    assert (
        core(
            [
                "attention: auto -> sdpa for causal/bidirectional, varlen for packed documents, prefix-LM, "
                "cross-attention on cuda in bfloat16 (flash-attn is not installed: pip install flash-attn "
                "--no-build-isolation)"
            ]
        )
        == "varlen"
    )
    assert (
        core(
            [
                "attention: auto -> sdpa for every mask on cuda in bfloat16 (flash-attn is not installed: "
                "pip install flash-attn --no-build-isolation)"
            ]
        )
        == "sdpa"
    )
    assert core(["attention: auto -> fa4 for every mask on cuda in bfloat16 (blackwell GPU; ...)"]) == "fa4"
    assert core([]) is None


def test_the_step_probe_is_judged_by_cudas_own_sync_count(gpu_check):
    sites = {"megatransformer/training/engine/train_module.py:293": 1, "deepspeed/runtime/utils.py:422": 8}
    probe = {"zero": 2, "collective_devices": ["cuda:0"], "host_syncs": 5, "cuda_syncs": 9, "cuda_sync_sites": sites}
    assert gpu_check.probe_ok(probe)
    assert not gpu_check.probe_ok({**probe, "cuda_syncs": 10})  # copies, synchronize()
    assert not gpu_check.probe_ok({**probe, "zero": 1})  # ZeRO-1 waits less
    assert not gpu_check.probe_ok({**probe, "host_syncs": 6})
    # a second wait of our own fails, even within the total
    ours_twice = {**sites, "megatransformer/training/loop.py:10": 1, "deepspeed/runtime/utils.py:422": 7}
    assert not gpu_check.probe_ok({**probe, "cuda_sync_sites": ours_twice})
    assert not gpu_check.probe_ok({**probe, "cuda_syncs": None})  # not counted: not judged as passing
    assert not gpu_check.probe_ok({**probe, "collective_devices": ["cpu", "cuda:0"]})


def test_cuda_sync_counter_counts_cudas_sync_warnings(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with CudaSyncCounter() as syncs:
        for _ in range(3):  # what CUDA's sync debug mode raises at each synchronising call
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert syncs.total == 3 and modes == ["warn", "default"]
    [(site, waits)] = syncs.sites.items()  # where each wait was asked for: this file's line
    assert site.split(":")[0].endswith("test_gpu_check.py") and waits == 3


def test_the_report_is_on_disk_after_each_part(monkeypatch, gpu_check, tmp_path):
    """A time limit that ends the check in its training run leaves the tests' and the probe's results written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(gpu_check, "gpu_tests", lambda: {"ok": True, "passed": 64})
    monkeypatch.setattr(gpu_check, "step_probe", lambda: {"ok": True})

    def ended(out):
        raise KeyboardInterrupt  # (as the suite's kill would end it, mid-run)

    monkeypatch.setattr(gpu_check, "training", ended)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main()
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["gpu_tests"] == {"ok": True, "passed": 64} and written["step_probe"] == {"ok": True}
    assert "training" not in written and "ok" not in written
