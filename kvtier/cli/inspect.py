"""`kvtier inspect ROOT_DIR`: what a file tier holds, read-only."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.errors import KVTierError


def run_inspect(args) -> int:
    from kvtier.tiers.file_inspect import inspect_root

    root = Path(args.root_dir)
    if not root.is_dir():
        raise KVTierError(f"{root} is not a directory (give the root_dir of a file tier)")
    report = inspect_root(str(root), verify=args.verify) if args.verify else inspect_root(str(root))
    width = max((len(k) for k in report), default=0)
    for key, value in report.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value, default=str)
        print(f"{key:<{width}}  {value}")
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        except OSError as exc:
            raise KVTierError(f"cannot write {args.json}: {exc.strerror or exc}") from None
    return 0
