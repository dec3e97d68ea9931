"""`kvtier inspect ROOT_DIR`: what a file tier holds, read-only (`--metrics URL` instead: a running
engine's tiers, `kvtier.cli.inspect_live`).

Sizes are printed in binary units (the `--json` report keeps bytes). Exit status: 0; 2 when
ROOT_DIR is not a directory or holds none of a file tier's files; 1 with `--verify` when a block
failed verification, or a file it needs could not be read: the slab, or a journal that is there
but unreadable (the report is printed first; the failed blocks are named by key, and slot, on
stderr and in the report's `failures`; a file not read by its path and the reason, on stderr and
in the report's `verify_error`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvtier.core.errors import KVTierError
from kvtier.core.keys import OffloadKey, get_offload_block_hash, get_offload_group_idx

EXIT_VERIFY_FAILED = 1
SIZES = ("block_bytes", "slot_bytes", "slab_bytes", "bytes")
_UNITS = (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10))


def human_size(n: int | None) -> str:
    """`n` bytes as e.g. '1.5 GiB', '32 KiB', '512 B' (two decimals at most); '-' for None."""
    if n is None:
        return "-"
    for unit, shift in _UNITS:
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} B"


def _lines(report: dict) -> list[tuple[str, str]]:
    """The report as (label, text) rows: sizes in units, the lock in words, the manifest last."""
    rows = []
    for key, value in report.items():
        if key in ("manifest", "lock_holder", "is_tier"):
            continue
        if key in SIZES and (value is None or isinstance(value, int)):
            value = human_size(value)
        elif isinstance(value, (dict, list)):
            value = json.dumps(value, default=str)
        rows.append((key, str(value)))
    rows.append(("manifest", json.dumps(report.get("manifest"), default=str)))
    return rows


def run_inspect(args) -> int:
    from kvtier.tiers.file.inspection import inspect_root

    if args.metrics is not None:
        if args.root_dir is not None:
            raise KVTierError("give ROOT_DIR (a file tier at rest, --verify allowed) or --metrics URL (a running "
                              "engine), not both")
        if args.verify:
            raise KVTierError("--verify reads a file tier's blocks: give it with ROOT_DIR, not with --metrics URL "
                              "(a running engine's counters)")
        from kvtier.cli.inspect_live import run_inspect_live

        return run_inspect_live(args.metrics, args.json)
    if args.root_dir is None:
        raise KVTierError("give the ROOT_DIR of a file tier, or --metrics URL for a running engine's tiers")
    root = Path(args.root_dir)
    if not root.is_dir():
        raise KVTierError(f"{root} is not a directory (give the root_dir of a file tier)")
    report = inspect_root(str(root), verify=args.verify) if args.verify else inspect_root(str(root))
    if not report["is_tier"]:
        raise KVTierError(f"{root} is not a file tier's root_dir: none of its files (lock, manifest.json, slab.0, "
                          f"journal) is there")
    rows = _lines(report)
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"{label:<{width}}  {text}")
    if args.json:
        write_report(args.json, report)
    if args.verify and (report.get("verify_failed") or report.get("verify_error")):
        print(_verify_failure(report), file=sys.stderr)
        return EXIT_VERIFY_FAILED
    return 0


def _verify_failure(report: dict) -> str:
    """The line `--verify` prints when it fails: the failed blocks (the first three), then what
    could not be read (`verify_error`); only the latter when no block failed."""
    failed, error = report.get("verify_failed", 0), report.get("verify_error")
    if not failed:
        return f"kvtier inspect: could not verify the tier: {error}"
    named = "; ".join(f"{key_text(f['key'])} (slot {f['slot']}): {f['reason']}" for f in report["failures"][:3])
    return (f"kvtier inspect: {failed} block(s) failed verification" + (f": {named}" if named else "")
            + ("; ..." if failed > 3 else "") + (f"; {error}" if error else ""))


def write_report(path: str, report: dict) -> None:
    """Write `report` as JSON to `path` (`--json`); a `KVTierError` naming the path when it cannot."""
    try:
        Path(path).write_text(json.dumps(report, indent=2, default=str))
    except OSError as exc:
        raise KVTierError(f"cannot write {path}: {exc.strerror or exc}") from None


def key_text(key_hex: str) -> str:
    """A block's key (hex) in words: 'key 0a1b... group 0' (block hash cut to 16 bytes)."""
    key = OffloadKey(bytes.fromhex(key_hex))
    block = get_offload_block_hash(key)
    return f"key {block[:16].hex()}{'...' if len(block) > 16 else ''} group {get_offload_group_idx(key)}"
