"""The tests' forked runs (support/forked_cli.py): a run in the test process's environment is forked even after that
environment changed (libraries and in-process tests set variables as they go), from a server started again in it;
a run with an environment of its own is not forked."""

from __future__ import annotations

import os

from support.forked_cli import ForkedCli

BAD_CONFIG = ["info", "--config", "/nonexistent.yaml"]  # (exit 2 before any heavy work)


def test_a_changed_test_process_environment_starts_the_server_again_and_a_runs_own_is_not_forked(monkeypatch):
    forked = ForkedCli()
    try:
        first = forked.run(BAD_CONFIG)
        assert first.returncode == 2 and "does not exist" in first.stderr
        server = forked._server.pid
        monkeypatch.setenv("FORKED_CLI_TEST", "1")  # (as DeepSpeed sets DS_ACCELERATOR when a rank starts in-process)
        assert forked.serves(dict(os.environ))
        assert not forked.serves({**os.environ, "TORCH_LOGS": "graph_breaks"})
        assert forked.run(BAD_CONFIG).returncode == 2
        restarted = forked._server.pid
        assert restarted != server
        assert forked.run(BAD_CONFIG).returncode == 2 and forked._server.pid == restarted  # (kept while it serves)
    finally:
        forked.close()
