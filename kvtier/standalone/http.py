"""`MetricsServer`: a threaded HTTP server for one WSGI app whose connections end with it.

The standard library's threaded servers (and `prometheus_client.start_http_server` over them)
leave a connection's thread running after `shutdown()` while its client keeps the connection
open: a slow or idle client held 128 threads and 132 descriptors after `KVTier.close()` on
7e6c7c1. Here each connection is recorded while it is served; `stop()` stops accepting, closes the
listening socket, shuts every open connection down (its thread sees the end of the stream and
returns) and joins those threads. A client that sends nothing for `CONNECTION_TIMEOUT_S` is
dropped meanwhile.

Only the standard library is imported: the app (`prometheus_client.make_wsgi_app`) is the caller's.
"""

from __future__ import annotations

import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

CONNECTION_TIMEOUT_S = 10.0  # a scrape takes milliseconds; a client silent this long is dropped
STOP_TIMEOUT_S = 5.0  # how long `stop()` waits for the server's threads in all


class _QuietHandler(WSGIRequestHandler):
    """One connection: requests logged nowhere, the socket given up after `CONNECTION_TIMEOUT_S`
    without a byte from the client."""

    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Log nothing (a scrape every few seconds would flood stderr)."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """Serves `app` on `(addr, port)` (`family`: the address family of `addr`) from `start()` to
    `stop()`, one daemon thread per connection, every one of them ended by `stop()`."""

    daemon_threads = True
    block_on_close = False  # `stop()` ends and joins the connections itself

    def __init__(self, addr: str, port: int, family: int, app: Any):
        self.address_family = family
        super().__init__((addr, port), _QuietHandler)
        self.set_app(app)
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._thread = threading.Thread(target=self.serve_forever, name="kvtier-metrics", daemon=True)

    @property
    def connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._connections)

    def start(self) -> None:
        self._thread.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve `request` on a thread of its own, recorded until it ends."""
        thread = threading.Thread(target=self._serve, args=(request, client_address), daemon=True,
                                  name="kvtier-metrics-connection")
        with self._lock:
            self._connections[request] = thread
        thread.start()

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: S110 - a client gone mid-request (reset, shut down by stop()) is no error
            pass
        finally:
            with self._lock:
                self._connections.pop(request, None)
            self.shutdown_request(request)

    def stop(self) -> None:
        """Stop accepting, close the listening socket, end every open connection and join the
        threads (at most `STOP_TIMEOUT_S` in all). Call once, after `start()`."""
        self.shutdown()
        self.server_close()
        with self._lock:
            open_now = list(self._connections.items())
        for sock, _thread in open_now:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the handler's read or write ends at once
            except OSError:
                pass  # closed meanwhile
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for thread in [self._thread] + [thread for _sock, thread in open_now]:
            thread.join(max(0.0, deadline - time.monotonic()))
