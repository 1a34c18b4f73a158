"""The quick check before W&B's own start-up wait: an HTTP answer within seconds, or the run goes offline.
Every server here is on loopback."""

from __future__ import annotations

import http.server
import socket
import time

import pytest
from support.loopback import serving

from megatransformer.training.observability.trackers import unreachable


class Answering(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_HEAD(self):  # noqa: N802 - http.server's name
        Answering.seen.append(self.requestline)
        self.send_response(404)  # an error page is an answer
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Answering.seen = []
    with serving(Answering) as url:
        yield url


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_a_server_that_answers_is_reachable(server):
    assert unreachable(server) is None
    assert Answering.seen == ["HEAD / HTTP/1.1"]


def test_a_closed_port_says_why():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed when the block ends: nothing listens there)
    assert unreachable(f"http://127.0.0.1:{port}").startswith(f"http://127.0.0.1:{port}: ")


def test_a_port_that_accepts_but_never_answers_is_unreachable():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        start = time.monotonic()
        why = unreachable(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=0.25)
        assert time.monotonic() - start < 5
    assert why is not None and ("timed out" in why or "no answer within 0.25 s" in why)


def test_the_check_goes_through_the_proxy_w_and_b_would_use(server, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", server)  # the loopback server stands in for the proxy
    assert unreachable("http://wandb.invalid") is None
    assert Answering.seen == ["HEAD http://wandb.invalid HTTP/1.1"]  # (the absolute URL: a proxy request)
