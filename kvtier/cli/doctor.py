"""`kvtier doctor`: does kvtier work on this machine? One line per check, OK / WARN / FAIL.

Checks, in under a minute: the compiled policy indexes (built, or the pure-Python fallback),
kvikio (importable, and whether cuFile/GDS may be used here), CUDA (through torch), /dev/shm
(size and free space), each valkey tier of the config (one PING, `kvtier.tiers.remote.env`), and
one store -> close -> reopen -> load round trip on a temporary cpu + file hierarchy
(`doctor_roundtrip`). Exit status 1 when a check FAILs, 0 otherwise (WARNs included).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

OK, WARN, FAIL = "OK", "WARN", "FAIL"
Result = tuple[str, str]  # (status, what was found)


def check_extensions() -> Result:
    from kvtier.policies import lru_compiled, prefix_compiled

    indexes = [index for index in (lru_compiled.INDEX, prefix_compiled.INDEX) if index.cls is None]
    missing = [f"{index.policy} ({index.error})" for index in indexes]
    for index in indexes:
        index.warned = True  # said here: the round trip's policies need not log it again
    if missing:
        return WARN, ("not built, pure-Python fallback (same decisions, slower): " + "; ".join(missing)
                      + "; reinstall with a C compiler and Cython (pip install -e .)")
    return OK, "compiled lru and prefix-freq indexes loaded"


def check_kvikio() -> Result:
    from kvtier.tiers.file.fileio import gds_platform, gpu_present, kvikio_importable

    if not kvikio_importable():
        return (WARN if gpu_present() else OK), "not importable: file tiers use posix I/O (io: auto)"
    import kvikio

    from kvtier.transfer.handlers.file_path import file_path

    mode = ("cuFile may be used (nvidia-fs and /proc/modules present)" if gds_platform()
            else "compat mode (no nvidia-fs here: kvikio's own POSIX I/O, no GPUDirect Storage)")
    choice, why = file_path("auto")
    return OK, (f"kvikio {getattr(kvikio, '__version__', '?')} importable; {mode}; "
                f"engine<->file under io: auto: {choice} ({why})")


def check_cuda() -> Result:
    try:
        import torch
    except ImportError as exc:
        return FAIL, f"torch is not importable ({exc}): no engine tensors can be copied"
    if torch.cuda.is_available():
        return OK, f"{torch.cuda.device_count()} device(s), {torch.cuda.get_device_name(0)}"
    return OK, f"no CUDA device (torch {torch.__version__}): engine tensors in CPU memory only"


def check_shm() -> Result:
    from kvtier.cli.inspect import human_size
    from kvtier.tiers.cpu.backend import SHM_DIR

    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        return FAIL, f"{SHM_DIR}: {exc.strerror or exc}: a cpu tier cannot be created"
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if not os.access(SHM_DIR, os.W_OK):
        return FAIL, f"{SHM_DIR} is not writable by you: a cpu tier cannot be created"
    return OK, f"{SHM_DIR}: {human_size(size)}, {human_size(free)} free (bounds the cpu tiers' capacity)"


def valkey_checks(config) -> list[tuple[str, Callable[[], Result]]]:
    """One check per valkey tier of `config` (none without one)."""
    tiers = config.tiers if config is not None else ()
    return [(f"valkey tiers[{i}]", functools.partial(_reach, tier.options))
            for i, tier in enumerate(tiers) if tier.backend == "valkey"]


def _reach(options) -> Result:
    from kvtier.tiers.remote.backend import ValkeyBackend

    notes, problems = ValkeyBackend.check_environment(dict(options))
    if problems:
        return FAIL, "; ".join(f"{field}: {message}" for field, message in problems)
    return OK, "; ".join(notes)


def check_round_trip() -> Result:
    from kvtier.cli.doctor_roundtrip import round_trip

    try:
        return OK, round_trip()
    except Exception as exc:  # noqa: BLE001 - every failure is the check's finding
        return FAIL, f"{type(exc).__name__}: {exc}"


def run_doctor(args) -> int:
    config = None
    if args.config:
        from kvtier.config import load_config

        config = load_config(args.config, import_code=False)  # a ConfigError is a usage error (exit 2)
    checks: list[tuple[str, Callable[[], Result]]] = [
        ("extensions", check_extensions), ("kvikio", check_kvikio), ("cuda", check_cuda), ("/dev/shm", check_shm),
        *valkey_checks(config), ("round trip", check_round_trip)]
    failed = 0
    for name, check in checks:
        started = time.monotonic()
        try:
            status, detail = check()
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check
            status, detail = FAIL, f"{type(exc).__name__}: {exc}"
        failed += status == FAIL
        print(f"{status:<4}  {name}: {detail} ({time.monotonic() - started:.1f} s)", flush=True)
    print(f"kvtier doctor: {failed} check(s) failed" if failed else "kvtier doctor: everything needed works here")
    return 1 if failed else 0
