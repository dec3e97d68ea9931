"""The exception hierarchy. Expected unavailability is a return value, never one of these."""

from __future__ import annotations

from collections.abc import Sequence


class KVTierError(Exception):
    """Root of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration is invalid. `problems` lists every `(field_path, message)` found; `source`
    names the file (or text) they are in, where a loader knew it."""

    def __init__(self, problems: list[tuple[str, str]] | str):
        if isinstance(problems, str):
            problems = [("", problems)]
        self.problems: list[tuple[str, str]] = list(problems)
        self.source: str | None = None
        super().__init__("\n".join(f"{p}: {m}" if p else m for p, m in self.problems))


class ArgumentError(KVTierError, ValueError):
    """An argument of an API call has a wrong value; the message names the argument (`keys[3]`)."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of an API call has a wrong type; also a `ValueError`, so one `except` catches both."""


class ClosedError(KVTierError, RuntimeError):
    """An object was used after `close()`."""


class TransferError(KVTierError, OSError):
    """Moving bytes between two tiers failed for one job."""


class IntegrityError(TransferError):
    """Stored bytes failed verification (header, checksum, fingerprint); they are never served.
    `slots`: the slots that failed, when the tier knows them (its other blocks read fine)."""

    def __init__(self, message: str, slots: Sequence[int] = ()):
        super().__init__(message)
        self.slots = tuple(slots)


class BlocksFailed(TransferError):
    """Some blocks of a transfer job failed: `positions`, in the job's block order. Every other
    block of the job was delivered, byte-exact, `moved` bytes (a handler raises it after
    delivering them)."""

    def __init__(self, message: str, positions: Sequence[int], moved: int = 0):
        super().__init__(message)
        self.positions = tuple(positions)
        self.moved = moved


class WaitTimeout(KVTierError, TimeoutError):
    """Transfer jobs did not finish in the time allowed; `jobs` describes each one still running."""

    def __init__(self, message: str, jobs: list[str]):
        super().__init__(message)
        self.jobs = jobs


class PolicyError(KVTierError, RuntimeError):
    """A tier's policy (a user's `package.module:Class`) broke its contract (`CachePolicy`): its
    `evict(n, protected)` did not name exactly `n` distinct resident blocks that may be evicted.
    The message names the tier, the policy's class and what was wrong. The block table frees
    nothing and puts back in the policy the blocks it dropped, so the call that needed the room
    (a store, a copy between tiers) fails with this error and nothing is lost or served wrong."""
