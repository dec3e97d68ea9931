"""The file tier: blocks in slots of one slab file under `root_dir`, a journal and a manifest.

`FileBackend` (backend.py) is the tier; the other modules are its parts: `opening` (a root_dir to
a locked, replayed tier), `rootdir` (the directory and its files), `fileio` (`BlockIO`: posix or
kvikio I/O), `slab` and `slot_format` (the slots), `journal`, `commit_log` and `manifest` (what is
committed), `checksum`, `own_files` and `inspection` (`kvtier inspect`). All of them log to the
logger `kvtier.tiers.file`. A YAML config names the tier `kvtier.tiers.file:FileBackend` (or `file`).
"""

from kvtier.tiers.file.backend import FileBackend

__all__ = ["FileBackend"]
