"""The exception hierarchy. Expected unavailability is a return value, never one of these."""

from __future__ import annotations


class KVTierError(Exception):
    """Root of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration is invalid. `problems` lists every `(field_path, message)` found."""

    def __init__(self, problems: list[tuple[str, str]] | str):
        if isinstance(problems, str):
            problems = [("", problems)]
        self.problems: list[tuple[str, str]] = list(problems)
        super().__init__("\n".join(f"{p}: {m}" if p else m for p, m in self.problems))


class TransferError(KVTierError, OSError):
    """Moving bytes between two tiers failed for one job."""


class IntegrityError(TransferError):
    """Stored bytes failed verification (header, checksum, fingerprint); they are never served."""
