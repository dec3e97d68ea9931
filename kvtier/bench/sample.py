"""The sample trace shipped in the package: `kvtier bench trace --trace sample`.

The first 600 requests of the Mooncake project's conversation trace (its FAST'25 trace release,
Apache License 2.0; see kvtier/bench/traces/README.md), under 200 KB, so a replay runs anywhere
without downloading anything.
"""

from __future__ import annotations

from pathlib import Path

SAMPLE_TRACE = "sample"  # the --trace value that names it
SAMPLE_FILE = "mooncake_conversation_sample.jsonl"
SAMPLE_BLOCK_TOKENS = 512  # tokens per block of the sample (Mooncake's), whatever the config says


def sample_trace_path() -> Path:
    """Where the installed package keeps the sample trace."""
    return Path(__file__).resolve().parent / "traces" / SAMPLE_FILE
