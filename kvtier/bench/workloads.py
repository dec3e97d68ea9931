"""Prefix-cache workloads for the replay (`kvtier.bench.replay`): a `Trace` is requests as lists of
block hashes, read from a Mooncake-format JSONL file (`load_trace`), written back (`write_trace`), or
generated: multi-turn conversations (`generate_trace`), agentic sessions (`generate_agentic_trace`)
and chat mixed with one-shot document scans (`generate_scan_trace`).
"""

from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.errors import KVTierError

_HASH_LIMIT = 1 << 64  # block hashes become 8-byte keys
MOONCAKE_BLOCK_TOKENS = 512  # tokens per block of Mooncake's published traces


class TraceError(KVTierError, ValueError):
    """A trace file is missing or malformed (the message names the line)."""


@dataclass
class Trace:
    """Requests as lists of block hashes (ints), in arrival order."""

    name: str
    requests: list[list[int]]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    @property
    def total_blocks(self) -> int:
        return sum(len(r) for r in self.requests)

    def optimum_hit_rate(self) -> float:
        """Hit rate with unlimited space: every block seen before at the same prefix is a hit."""
        seen: set[int] = set()
        hits = 0
        for hashes in self.requests:
            hits += leading_hits(hashes, seen)
            seen.update(hashes)
        return hits / max(1, self.total_blocks)


def leading_hits(hashes: list[int], held: Container[int]) -> int:
    """How many of `hashes`, from the first, are in `held` (a request's prefix hit: the blocks
    after the first miss are recomputed, whether held or not)."""
    for n, h in enumerate(hashes):
        if h not in held:
            return n
    return len(hashes)


def load_trace(path: str | Path, limit: int | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read a Mooncake-format JSONL trace (`hash_ids` per line: ids in [0, 2**64)), whose blocks
    hold `block_tokens` tokens (the replay passes its config's; Mooncake's own are 512).
    Raises TraceError naming the file and line; the message never repeats more than 80
    characters of the offending input."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    requests: list[list[int]] = []
    with handle:
        for lineno, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"{where}: not UTF-8 text (byte {exc.start} of the line)") from None
            try:
                record = json.loads(line)
            except RecursionError:
                raise TraceError(f"{where}: not valid JSON (nested too deeply)") from None
            except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
                raise TraceError(f"{where}: not valid JSON ({str(exc)[:120]})") from None
            hashes = record.get("hash_ids") if isinstance(record, dict) else None
            if not isinstance(hashes, list) or not all(
                    type(h) is int and 0 <= h < _HASH_LIMIT for h in hashes):
                raise TraceError(f"{where}: expected an object with 'hash_ids': a list of integers in "
                                 f"[0, 2**64), got {line.strip()[:80]!r}")
            requests.append(hashes)
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise TraceError(f"{path}: no requests in trace")
    return Trace(path.name, requests, block_tokens)


def generate_trace(num_conversations: int = 300, turns: int = 5, system_prompts: int = 8,
                   system_blocks: int = 6, turn_blocks: int = 3, seed: int = 0) -> Trace:
    """A synthetic multi-turn workload: shared system prompts, conversations that grow turn by
    turn (each turn re-sends the whole history), interleaved across conversations."""
    import random

    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 62))
    systems = [[next(next_id) for _ in range(system_blocks)] for _ in range(system_prompts)]
    histories = [list(rng.choice(systems)) for _ in range(num_conversations)]
    remaining = [turns] * num_conversations
    requests: list[list[int]] = []
    active = list(range(num_conversations))
    while active:
        conv = rng.choice(active)
        histories[conv].extend(next(next_id) for _ in range(rng.randint(1, turn_blocks)))
        requests.append(list(histories[conv]))
        remaining[conv] -= 1
        if remaining[conv] == 0:
            active.remove(conv)
    return Trace("synthetic-multiturn", requests)


def generate_agentic_trace(num_sessions: int = 40, turns: int = 25, concurrent: int = 8, system_blocks: int = 8,
                           turn_blocks: int = 2, seed: int = 0) -> Trace:
    """A hit-heavy agentic workload: sessions of many turns (tool calls) that share one system
    prompt; each turn re-sends the session's whole context plus 1..`turn_blocks` new blocks.
    At most `concurrent` sessions run at once, interleaved turn by turn, so most blocks hit."""
    import random

    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 62))
    system = [next(next_id) for _ in range(system_blocks)]
    waiting = list(range(num_sessions))
    running: dict[int, list[int]] = {}
    left: dict[int, int] = {}
    requests: list[list[int]] = []
    while waiting or running:
        while waiting and len(running) < concurrent:
            session = waiting.pop(0)
            running[session], left[session] = list(system), turns
        session = rng.choice(list(running))
        context = running[session]
        context.extend(next(next_id) for _ in range(rng.randint(1, turn_blocks)))
        requests.append(list(context))
        left[session] -= 1
        if not left[session]:
            del running[session]
    return Trace("synthetic-agentic", requests)


def generate_scan_trace(num_requests: int = 3000, scan_fraction: float = 0.25, prefixes: int = 12,
                        prefix_blocks: int = 12, question_blocks: int = 2, doc_blocks: tuple[int, int] = (48, 160),
                        seed: int = 0) -> Trace:
    """A one-shot-scan workload: chat requests on a few hot shared prefixes (`prefixes` system
    prompts of `prefix_blocks` blocks, then 1..`question_blocks` unique blocks), interleaved
    with long unique documents (`doc_blocks` blocks, drawn uniformly) read once. A fraction
    `scan_fraction` of the requests are scans; they stream many blocks that are never used again
    through the cache, past the hot prefixes that most other requests hit."""
    import random

    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 62))
    hot = [[next(next_id) for _ in range(prefix_blocks)] for _ in range(prefixes)]
    requests: list[list[int]] = []
    for _ in range(num_requests):
        if rng.random() < scan_fraction:
            requests.append([next(next_id) for _ in range(rng.randint(*doc_blocks))])
        else:
            requests.append(rng.choice(hot) + [next(next_id) for _ in range(rng.randint(1, question_blocks))])
    return Trace("synthetic-scan", requests)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write `trace` in the Mooncake JSONL format that `load_trace` reads."""
    with Path(path).open("w") as out:
        for hashes in trace.requests:
            out.write(json.dumps({"hash_ids": hashes}) + "\n")
