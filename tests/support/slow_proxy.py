"""`SlowProxy`: a TCP proxy on 127.0.0.1 in front of a server, slowing what the server sends back.

For tests and figures about hostile servers (tests/remote/test_remote_hostile.py,
tests/remote/hostile_figures.py): requests go to the server as they come; each chunk of the
server's replies is held `delay_s` before it is forwarded (a slow server: latency, not bandwidth),
or replies are sent on one byte every `drip_s` (a server that answers, but too slowly to finish).
Loopback only: it listens on 127.0.0.1 and connects to 127.0.0.1:`target_port`.

    with SlowProxy(server.port, drip_s=0.02) as proxy:
        url = proxy.url          # redis://127.0.0.1:PORT
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any


class SlowProxy:
    """See the module docstring. `start()` (or `with`) opens it; `stop()` closes every connection
    and the proxy's event loop."""

    def __init__(self, target_port: int, *, delay_s: float = 0.0, drip_s: float = 0.0):
        if (delay_s > 0) == (drip_s > 0):
            raise ValueError(f"SlowProxy: give one of delay_s or drip_s (> 0), got {delay_s}, {drip_s}")
        self.target_port, self.delay_s, self.drip_s = target_port, delay_s, drip_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slow-proxy", daemon=True)
        self._server: Any = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> SlowProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()  # its selector and wake-up socket pair

    def __enter__(self) -> SlowProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except (OSError, asyncio.CancelledError):  # (refused, or stop() while connecting)
            writer.close()
            return
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._slow_pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):  # (closed, or stop())
            pass
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _slow_pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def forward() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                for i in range(0, len(data), 1 if self.drip_s else len(data)):
                    writer.write(data[i:i + 1] if self.drip_s else data)
                    await writer.drain()
                    if self.drip_s:
                        await asyncio.sleep(self.drip_s)

        task = asyncio.ensure_future(forward())
        while data := await reader.read(65536):
            queue.put_nowait((time.monotonic() + self.delay_s, data))
        queue.put_nowait((0.0, b""))
        await task
        writer.close()
