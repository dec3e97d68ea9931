"""The slow TCP proxy the hostile shared-tier tests stand between kvtier and Valkey
(`tests.support.slow_proxy`) cleans up after itself."""


def test_a_stopped_slow_proxy_leaves_no_descriptor_open():
    """`stop()` closes the proxy's event loop too (its selector and wake-up sockets: three
    descriptors per proxy were left to the garbage collector)."""
    import os
    import socket

    from tests.support.slow_proxy import SlowProxy

    with socket.create_server(("127.0.0.1", 0)) as server:
        before = set(os.listdir("/proc/self/fd"))
        with SlowProxy(server.getsockname()[1], delay_s=0.01) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10):
                pass
        assert set(os.listdir("/proc/self/fd")) <= before


def test_a_proxy_stopped_while_it_connects_upstream_closes_the_accepted_socket(monkeypatch):
    """`stop()` while a connection's upstream connect is still running (its task cancelled there)
    closes the accepted client socket too: it was left open, one descriptor per such connection."""
    import asyncio
    import os
    import socket
    import time

    from tests.support import slow_proxy

    connecting = []

    async def never_connects(host, port):
        connecting.append(port)
        await asyncio.sleep(3600)

    monkeypatch.setattr(slow_proxy.asyncio, "open_connection", never_connects)
    with socket.create_server(("127.0.0.1", 0)) as server:
        before = set(os.listdir("/proc/self/fd"))
        proxy = slow_proxy.SlowProxy(server.getsockname()[1], delay_s=0.01).start()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10):
            deadline = time.monotonic() + 10
            while not connecting and time.monotonic() < deadline:
                time.sleep(0.01)
            assert connecting, "the proxy never started its upstream connect"
            proxy.stop()
        assert set(os.listdir("/proc/self/fd")) <= before
