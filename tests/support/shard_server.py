"""A loopback HTTP server of a shard directory that can fail on demand."""

from __future__ import annotations

import functools
import http.server
import socket
import threading
import time
from pathlib import Path

from support import loopback


class ShardServer:
    """http.server serving ``root`` on a fixed loopback port. ``die_in(name, after_bytes, back_after)``: the
    next response for ``name`` stops after ``after_bytes`` bytes, the whole server goes down with it and comes
    back on the same port ``back_after`` seconds later (None: never). ``refuse(name)``: 503 for ``name``."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, 0
        self.faults: dict[str, tuple[int, float | None]] = {}
        self.refused: set[str] = set()
        self.deaths, self.requests = 0, []
        self.server: http.server.ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> None:
        owner = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet tests
                pass

            def send_head(self):
                name = self.path.strip("/")
                if self.command == "GET":  # (fsspec may ask for the size with a HEAD first)
                    owner.requests.append(name)
                if name in owner.refused:
                    self.send_error(503, "unavailable")
                    return None
                return super().send_head()

            def copyfile(self, source, outputfile) -> None:
                fault = owner.faults.pop(self.path.strip("/"), None)
                if fault is None:
                    return super().copyfile(source, outputfile)
                after_bytes, back_after = fault
                outputfile.write(source.read(after_bytes))
                outputfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)  # the body ends early, then the server is gone
                threading.Thread(target=owner.die, args=(back_after,)).start()

        handler = functools.partial(Handler, directory=str(self.root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self.port = self.server.server_address[1]
        loopback.serve(self.server)

    def die(self, back_after: float | None) -> None:
        self.deaths += 1
        loopback.stop(self.server)
        if back_after is not None:
            time.sleep(back_after)
            self.start()

    def die_in(self, name: str, after_bytes: int, back_after: float | None) -> None:
        self.faults[name] = (after_bytes, back_after)

    def stop(self) -> None:
        loopback.stop(self.server)
