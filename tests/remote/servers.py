"""Real Valkey / Redis servers for tests: the installed `valkey-server` (else `redis-server`), on free
loopback ports, persistence off, `maxmemory 64mb` with `allkeys-lru`, each in its own directory,
stopped by PID. No mocks: the shared tier's tests talk to a real server.

Import as `remote.servers` (tests/ is on sys.path); tests/conftest.py imports the fixtures, so every
test can use them: `valkey_server` / `valkey_cluster` (one each per session, shared: use a key prefix
of your own, leave them running and unpaused), `private_server` / `private_cluster` (per test, for
tests that kill, pause or fill them), `make_store` (RemoteStores closed at teardown).
`start_server` / `start_cluster` / `start_tls_server` start more. Helpers for failure tests:
`Server.pause` (CLIENT PAUSE), `Server.kill` / `Server.restart`, `Server.add_acl_user` (a user limited
to one key prefix), `Cluster.server_for` (the master that holds a key).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from kvtier.tiers.remote.options import ClientOptions
from kvtier.tiers.remote.store import RemoteStore

SERVER_ARGS = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--maxmemory", "64mb",
               "--maxmemory-policy", "allkeys-lru", "--daemonize", "no", "--protected-mode", "no"]


def binaries() -> tuple[str, str]:
    """(server, cli): valkey's when installed, else redis' (KVTIER_TEST_SERVER=redis-server prefers
    redis'). Fails the test (never skips) without one: scripts/setup.sh installs valkey-server (or
    redis-server) where apt-get can."""
    pairs = [("valkey-server", "valkey-cli"), ("redis-server", "redis-cli")]
    if os.environ.get("KVTIER_TEST_SERVER") == "redis-server":  # run the tests on Redis although Valkey is there
        pairs.reverse()
    for server, cli in pairs:
        found_server, found_cli = shutil.which(server), shutil.which(cli)
        if found_server and found_cli:
            return found_server, found_cli
    pytest.fail("neither valkey-server nor redis-server (with its cli) is on PATH: the shared-tier tests need "
                "a real server; run scripts/setup.sh as root (it installs valkey-server from bookworm-backports "
                "or redis-server) or `apt-get install valkey-server`", pytrace=False)


def free_port(cluster: bool = False) -> int:
    """A free loopback port (and, for a cluster node, its bus port + 10000 too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port < 55000:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free loopback port found")


class Server:
    """One server process on 127.0.0.1:`port`, data and log in `workdir`."""

    def __init__(self, workdir: Path, port: int, extra: list[str] | None = None, cluster: bool = False,
                 tls_ca: Path | None = None):
        self.binary, self.cli_binary = binaries()
        self.workdir, self.port, self.cluster, self.tls_ca = workdir, port, cluster, tls_ca
        self.args = [self.binary, "--port", str(port), "--dir", str(workdir), "--logfile", f"server-{port}.log",
                     *SERVER_ARGS, *(extra or [])]
        if cluster:
            self.args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                          "--cluster-require-full-coverage", "no", "--cluster-node-timeout", "2000"]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls_ca else 'redis'}://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> Server:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.args, cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.workdir / f"server-{self.port}.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                err = self.proc.stderr.read().decode() if self.proc.poll() is not None and self.proc.stderr else ""
                self.stop()
                raise RuntimeError(f"{self.binary} on port {self.port} did not start: {err}{tail}")
            time.sleep(0.02)

    def client(self, **kwargs) -> redis.Redis:
        """An admin client (default user), 2 s timeouts."""
        if self.tls_ca:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls_ca))
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2, **kwargs)

    def cli(self, *args: str) -> str:
        tls = ["--tls", "--cacert", str(self.tls_ca)] if self.tls_ca else []
        out = subprocess.run([self.cli_binary, "-h", "127.0.0.1", "-p", str(self.port), *tls, *args],
                             capture_output=True, text=True, timeout=30)
        if out.returncode:
            raise RuntimeError(f"{self.cli_binary} {' '.join(args)}: {out.stderr or out.stdout}")
        return out.stdout

    def pause(self, ms: int) -> None:
        """CLIENT PAUSE `ms` ALL: the server answers no client (this one's reply comes first)."""
        self.client().execute_command("CLIENT", "PAUSE", ms, "ALL")

    def kill(self) -> None:
        """SIGKILL the server (by its PID) and wait for it to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self) -> Server:
        self.kill()
        return self.start()

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL after 5 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stderr:
            self.proc.stderr.close()

    def add_acl_user(self, user: str, password: str, prefix: str) -> None:
        """An ACL user allowed every non-dangerous command on keys `{prefix}:*` only."""
        self.client().execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", f"~{prefix}:*",
                                      "resetchannels", "+@all", "-@dangerous")

    def memory_usage(self, key: bytes) -> int:
        return int(self.client().memory_usage(key))


class Cluster:
    """Three masters, no replicas, `cluster-require-full-coverage no` (a dead shard leaves the others up)."""

    def __init__(self, workdir: Path, masters: int = 3, tls: bool = False):
        self.tls = tls
        self.servers = []
        certs = make_certificates(workdir / "certs") if tls else None
        for i in range(masters):
            port = free_port(cluster=True)
            extra = _tls_args(port, *certs) + ["--tls-cluster", "yes"] if certs else []
            self.servers.append(Server(workdir / f"node{i}", port, extra, cluster=True,
                                       tls_ca=certs[0] if certs else None))

    @property
    def url(self) -> str:
        return ("clusters://" if self.tls else "cluster://") + ",".join(s.name for s in self.servers)

    def start(self, timeout: float = 30.0) -> Cluster:
        try:
            for s in self.servers:
                s.start()
            self.servers[0].cli("--cluster", "create", *(s.name for s in self.servers), "--cluster-replicas", "0",
                                "--cluster-yes")
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and knows every master's slots."""
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for s in self.servers:
                if s.proc is not None and s.proc.poll() is None:
                    info = s.client().execute_command("CLUSTER", "INFO").decode()
                    states.append("cluster_state:ok" in info and "cluster_slots_assigned:16384" in info)
            if states and all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout} s: {states}")
            time.sleep(0.05)

    def wait_failed(self, dead: Server, timeout: float = 15.0) -> None:
        """Until a live master flags `dead` as failed (cluster-node-timeout is 2 s here)."""
        live = next(s for s in self.servers if s is not dead and s.proc is not None and s.proc.poll() is None)
        deadline = time.monotonic() + timeout
        while True:
            nodes = live.client().execute_command("CLUSTER", "NODES").decode().splitlines()
            line = next(n for n in nodes if f":{dead.port}@" in n)
            if "fail" in line.split()[2].split(",") or time.monotonic() > deadline:
                assert "fail" in line.split()[2].split(","), f"not marked failed after {timeout} s: {line}"
                return
            time.sleep(0.05)

    def server_for(self, key: bytes) -> Server:
        """The master that holds `key`'s slot."""
        slot = redis.crc.key_slot(key)
        for begin, end, master, *_ in self.servers[0].client().execute_command("CLUSTER", "SLOTS"):
            if begin <= slot <= end:
                port = int(master[1])
                return next(s for s in self.servers if s.port == port)
        raise LookupError(f"slot {slot} is not assigned")

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def start_server(workdir: Path, extra: list[str] | None = None) -> Server:
    return Server(workdir, free_port(), extra).start()


def make_certificates(workdir: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate for 127.0.0.1, server key), made with the openssl command."""
    workdir.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (workdir / n for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt"))
    ext = workdir / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for args in (["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=kvtier-test-ca"],
                 ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
                 ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                  "-days", "2", "-extfile", ext]):
        out = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, timeout=30)
        if out.returncode:
            raise RuntimeError(f"openssl {args[0]}: {out.stderr}")
    return ca, cert, key


def start_tls_server(workdir: Path) -> Server:
    """A server that speaks TLS only (port 0 closes the plain port); its CA file is `server.tls_ca`."""
    ca, cert, key = make_certificates(workdir / "certs")
    port = free_port()
    return Server(workdir, port, _tls_args(port, ca, cert, key), tls_ca=ca).start()


def _tls_args(port: int, ca: Path, cert: Path, key: Path) -> list[str]:
    """Server arguments for TLS only on `port` (port 0 closes the plain one), clients not authenticated."""
    return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]


def start_cluster(workdir: Path, tls: bool = False) -> Cluster:
    return Cluster(workdir, tls=tls).start()


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory):
    """A real server for the session, 64 MiB allkeys-lru; shared (module docstring)."""
    server = start_server(tmp_path_factory.mktemp("valkey"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory):
    """A real 3-master cluster for the session; shared (module docstring)."""
    cluster = start_cluster(tmp_path_factory.mktemp("valkey-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def private_server(tmp_path):
    server = start_server(tmp_path / "valkey")
    yield server
    server.stop()


@pytest.fixture
def private_cluster(tmp_path):
    cluster = start_cluster(tmp_path / "cluster")
    yield cluster
    cluster.stop()


_prefixes = itertools.count()


@pytest.fixture
def make_store():
    """`make_store(url, **kw)`: a RemoteStore with a prefix unique to the session, closed at teardown.
    Timeouts default to 2 s here (tests about timeouts pass their own): a busy CI machine can hold a
    1 MiB SET past 250 ms while the server evicts, and those tests are not about that."""
    stores = []

    def make(url: str, *, block_bytes: int = 4096, tp: int = 1, fingerprint: str = "model:abc", layout: str = "L1",
             key_prefix: str | None = None, wait: bool = True, **options) -> RemoteStore:
        options.setdefault("timeout_s", 2.0)
        prefix = key_prefix or f"kvt:test{next(_prefixes)}"
        store = RemoteStore(ClientOptions(url, **options), key_prefix=prefix, fingerprint=fingerprint,
                            layout=layout, block_bytes=block_bytes, tp=tp)
        stores.append(store)
        if wait and store.options.parsed.cluster:  # the slot map loads in the background
            assert store.wait_ready(10.0), store.reason
        return store

    yield make
    for store in stores:
        store.close()
