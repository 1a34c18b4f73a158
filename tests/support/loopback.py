"""Loopback HTTP servers served from a thread, which stop at once: ``serve_forever`` looks for a shutdown
request every ``poll_interval`` (0.5 s by default, what every ``shutdown()`` would wait)."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator

POLL_SECONDS = 0.01


def serve(server: http.server.HTTPServer) -> None:
    """``server`` answers from a daemon thread until :func:`stop`."""
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL_SECONDS}, daemon=True).start()


def stop(server: http.server.HTTPServer) -> None:
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """The URL of a threading HTTP server of ``handler`` on a free loopback port, for the ``with`` block."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    serve(server)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop(server)
