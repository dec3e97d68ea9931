"""A `kvtier serve` owner in a process of its own, for tests that kill, stop and restart it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class OwnerProcess:
    """`kvtier serve --socket path` as a subprocess, its output in `log_path`: `start`, `kill` (-9),
    `stop` (SIGTERM), `pause` / `resume` (SIGSTOP / SIGCONT: an owner that hangs)."""

    def __init__(self, socket_path: str, log_path: Path):
        self.socket_path = socket_path
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> OwnerProcess:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "serve", "--socket",
                                          self.socket_path], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited: {self.log()}")
            if self.log().count("kvtier serve: listening") > self._starts:
                self._starts += 1
                return self
            time.sleep(0.02)
        raise RuntimeError(f"kvtier serve did not start within 60 s: {self.log()}")

    _starts = 0

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP, returning once every thread of the owner has stopped."""
        os.kill(self.pid, signal.SIGSTOP)
        tasks = Path(f"/proc/{self.pid}/task")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
            if all(state == "T" for state in states):
                return
            time.sleep(0.005)
        raise RuntimeError("the owner did not stop")

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stop(self, timeout: float = 60) -> str:
        """SIGTERM (the owner writes its CPU tiers down first); its whole log."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()  # (never left running after a test)
                raise
        return self.log()
