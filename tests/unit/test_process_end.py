"""How a command's process ends, started any way: with the command's exit code, through the interpreter's shutdown
(exit handlers run), the objects it loaded frozen out of the garbage collector's last collections first."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from support import REPO

SAY_AT_EXIT = "import atexit, gc; atexit.register(lambda: print('frozen:', gc.get_freeze_count() > 0, flush=True))"
BAD_CONFIG = ["info", "--config", "/nonexistent.yaml"]  # an exit code of its own (2) before any heavy import


@pytest.mark.parametrize(
    ("argv", "start", "says"),
    [
        (["megatransformer", *BAD_CONFIG], "from megatransformer.cli import command; command()", "does not exist"),
        (["megatransformer", *BAD_CONFIG], "runpy.run_module('megatransformer', run_name='__main__')", "not exist"),
        (["cli", *BAD_CONFIG], "runpy.run_module('megatransformer.cli', run_name='__main__')", "does not exist"),
        (["launch"], "runpy.run_module('launch', run_name='__main__')", "usage: python -m launch"),
    ],
)
def test_each_start_exits_with_the_commands_code_after_the_exit_handlers_with_objects_frozen(argv, start, says):
    script = f"{SAY_AT_EXIT}; import runpy, sys; sys.argv = {argv!r}; {start}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert (done.returncode, done.stdout) == (2, "frozen: True\n"), done.stderr
    assert says in done.stderr


def test_the_installed_script_is_the_command():
    (script,) = entry_points(group="console_scripts", name="megatransformer")
    assert script.value == "megatransformer.cli:command"
