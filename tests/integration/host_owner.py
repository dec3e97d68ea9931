"""A real host owner (`kvtier serve`) in a subprocess, for the `shared: host` tests under vLLM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Owner:
    """`python -m kvtier.cli.main serve --socket <dir>/run/host.sock`: `start`, `kill` (-9), `stop`.

    The socket's directory does not exist before the first start (the owner makes it, 0700),
    under a short private directory (a Unix socket path holds at most 107 bytes)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvh", dir="/tmp")
        os.chmod(self.dir, 0o700)
        self.socket = os.path.join(self.dir, "run", "host.sock")
        self.proc: subprocess.Popen | None = None
        self.log = Path(self.dir) / "owner.log"

    def start(self, timeout: float = 30.0) -> Owner:
        env = {**os.environ}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "serve", "--socket", self.socket,
                                          "--flush-timeout", "5", "--max-namespaces", "256"],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while "listening on" not in self.log.read_text().split("kvtier serve: stopped")[-1]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"kvtier serve did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """kill -9: no flush, no goodbye; its socket file and region name stay behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def shared(self, timeout_ms: int = 200) -> dict:
        """The YAML's `shared:` mapping for this owner."""
        return {"scope": "host", "socket": self.socket, "timeout_ms": timeout_ms}
