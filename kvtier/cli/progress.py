"""Progress reporting: a bar redrawn in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`Progress(stream)(label)` returns a callback `update(done, total)` for one phase."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, label: str):
        start = time.perf_counter()
        last_line = [-1]

        def update(done: int, total: int) -> None:
            if not self.enabled or total <= 0:
                return
            fraction = min(1.0, done / total)
            elapsed = time.perf_counter() - start
            if self.tty:
                width = 30
                filled = int(width * fraction)
                bar = "#" * filled + "-" * (width - filled)
                end = "\n" if done >= total else ""
                self.stream.write(f"\r  {label:<28} [{bar}] {fraction:6.1%} {elapsed:6.1f}s{end}")
                self.stream.flush()
            else:
                # One line when a phase starts to take time, one when it ends.
                stage = 2 if done >= total else (1 if elapsed > 2.0 else 0)
                if stage > last_line[0] and stage > 0:
                    last_line[0] = stage
                    self.stream.write(f"  {label}: {fraction:.0%} ({elapsed:.1f}s)\n")
                    self.stream.flush()

        return update

    def note(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()
