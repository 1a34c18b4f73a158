"""A regular (non-editable) install works on its own: the package holds every module and the shipped configs,
and `megatransformer quickstart` runs from an empty directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from support import REPO


def test_pyproject_lists_every_package():
    """pyproject.toml names its packages (to map configs/ into the package); a new package must be added."""
    from setuptools import find_packages
    from setuptools.config.pyprojecttoml import read_configuration

    listed = set(read_configuration(REPO / "pyproject.toml")["tool"]["setuptools"]["packages"])
    found = set(find_packages(str(REPO), include=["megatransformer*", "data_pipeline*", "launch*"]))
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_quickstart_from_a_regular_install_in_an_empty_directory(tmp_path):
    # a copy of the source (pip builds in the source directory; the checkout stays untouched)
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git",
            "runs",
            "data",
            "wandb",
            "build",
            "dist",
            "*.egg-info",
            ".venv",
            "__pycache__",
            ".pytest_cache",
            "tests",
            "bench",
            "slurm",
        ),
    )
    # system site packages: torch and the rest are not downloaded again; no pip of its own, so the system's
    # pip and setuptools build the wheel (the ones ensurepip bundles may be too old to, without `wheel`)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python, script = venv / "bin" / "python", venv / "bin" / "megatransformer"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the installed copy
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["OMP_NUM_THREADS"] = "2"  # (a user's machine: more than one intra-op thread, unlike the other tests)
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(source)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    shutil.rmtree(source)  # the install must not need its source

    empty = tmp_path / "empty"
    empty.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess:
        result = subprocess.run(args, cwd=empty, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result

    where = run(str(python), "-c", "import megatransformer; print(megatransformer.__file__)").stdout
    assert where.startswith(str(venv)), f"the venv's copy must shadow any other: {where}"
    result = run(
        str(script),
        "quickstart",
        "model.d_model=128",  # (an embedding of more than one block of initial values: drawn on the threads)
        "model.n_layers=1",
        "model.d_ff=128",
        "data.seq_len=32",
        "train.max_steps=2",
        "train.micro_batch_size=2",
        "train.log_every=1",
        "train.eval_batches=1",
        "wandb.mode=disabled",
    )
    assert (empty / "runs" / "quickstart" / "checkpoints" / "step_000002").is_dir()
    assert (
        "done: 2 of 2 steps" in result.stdout and "megatransformer eval --checkpoint runs/quickstart" in result.stdout
    )
    run(str(script), "data", "inspect", "--config", "quickstart", "--batches", "1", "data.seq_len=32")
    assert "run_dir: runs/llama-style" in run(str(script), "info", "--config", "llama-style").stdout
