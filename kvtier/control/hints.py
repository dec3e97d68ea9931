"""The retention hint a request carries (`Hint`), read from untrusted input by `parse_hint`.

Under vLLM a hint comes in the request's `kv_transfer_params["kvtier"]` (`HINTS_KEY`); in the
standalone API as `store(..., hints=...)` or `load(..., hints=...)`. Fields: `session` (required),
`retain_s` (required unless `session_ended`; 0 releases the session), `priority`, `tenant`,
`session_ended`. A session name is its tenant's own (`session_name`). What a hint does:
`kvtier.control.retention`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from kvtier.core.errors import ArgumentError
from kvtier.core.quoting import brief

log = logging.getLogger("kvtier.retention")

HINTS_KEY = "kvtier"  # the entry of vLLM's kv_transfer_params that holds kvtier's hints
MAX_RETAIN_S = 3600.0  # the longest retention a hint may ask for
MAX_PRIORITY = 9
MAX_NAME = 128
_FIELDS = ("session", "retain_s", "priority", "session_ended", "tenant")
_FIELD_SET = frozenset(_FIELDS)
_WHERE = f"kv_transfer_params.{HINTS_KEY}"  # (the errors' name for a hint from vLLM)


class Hint(NamedTuple):
    """One request's retention hint. A named tuple: one is made per request, and a tuple is made
    several times faster than a frozen dataclass."""

    session: str
    retain_s: float = 0.0
    priority: int = 0
    ended: bool = False
    tenant: str = ""


def parse_hint(value: Any, where: str = HINTS_KEY, max_retain_s: float = MAX_RETAIN_S) -> Hint | None:
    """The hint in `value` (a mapping of `_FIELDS`), or None when `value` is None. Raises
    `ArgumentError` naming the field (`where.field`), what was wrong and what would be right."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ArgumentError(f"{where}: must be a mapping with 'session' and 'retain_s', got {type(value).__name__}")
    if not _FIELD_SET.issuperset(value):
        unknown = sorted(str(k) for k in value if k not in _FIELD_SET)
        raise ArgumentError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
    get = value.get
    session = _name(get("session"), where, "session", required=True)
    tenant = _name(get("tenant", ""), where, "tenant", required=False)
    ended = get("session_ended", False)
    if not isinstance(ended, bool):
        raise ArgumentError(f"{where}.session_ended: must be true or false, got {brief(ended)}")
    if "retain_s" not in value and not ended:
        raise ArgumentError(f"{where}.retain_s: missing; give the seconds to keep the session's blocks after "
                            f"this turn (0 releases them), or session_ended: true")
    retain = get("retain_s", 0.0)
    if isinstance(retain, bool) or not isinstance(retain, (int, float)) or not 0 <= retain <= max_retain_s:
        raise ArgumentError(f"{where}.retain_s: must be a number of seconds from 0 to {max_retain_s:g}, "
                            f"got {brief(retain)}")
    priority = get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise ArgumentError(f"{where}.priority: must be an integer from 0 to {MAX_PRIORITY}, got {brief(priority)}")
    return Hint(session, float(retain), priority, ended, tenant)


def _name(value: Any, where: str, name: str, required: bool) -> str:
    """`value`, checked to be a session or tenant name (`where.name` in the error, built only then)."""
    if not isinstance(value, str) or (required and not value):
        raise ArgumentError(f"{where}.{name}: must be a non-empty string, got {brief(value)}" if required
                            else f"{where}.{name}: must be a string, got {brief(value)}")
    if len(value) > MAX_NAME:
        raise ArgumentError(f"{where}.{name}: must be at most {MAX_NAME} printable characters, got "
                            f"{len(value):,} characters ({brief(value)})")
    if not value.isprintable():
        raise ArgumentError(f"{where}.{name}: must be at most {MAX_NAME} printable characters, got a "
                            f"control character (a newline, a tab, ...) in {brief(value)}")
    return value


def session_name(hint: Hint) -> str:
    """The name `hint`'s session is tracked under: its `session`, within its `tenant` (a session
    name another tenant uses is another session; names are printable, the separator is not)."""
    return f"{hint.tenant}\x1f{hint.session}" if hint.tenant else hint.session


class _Counts(Protocol):
    hints: int
    hints_refused: int


class RequestHints:
    """The hints vLLM's requests carry in `kv_transfer_params["kvtier"]`, read once per request
    (a request's later calls find it parsed, unless the client changed it) and counted in
    `counts` once per request: `hints` when valid, `hints_refused` when not (a null one is no
    hint: not counted). Under vLLM the hints come from clients: an invalid one is logged once per
    request and the request served without it. Remembers the last 4,096 requests' hints and
    1,024 refusals."""

    def __init__(self, counts: _Counts) -> None:
        self._counts = counts
        self._parsed: OrderedDict[Any, tuple[dict, Hint | None]] = OrderedDict()  # req_id -> (raw hint, Hint)
        self._warned: OrderedDict[Any, None] = OrderedDict()  # requests whose bad hint was logged

    def of(self, req_context: Any) -> Hint | None:
        """The hint `req_context` carries, or None (none, or an invalid one)."""
        params = getattr(req_context, "kv_transfer_params", None)
        if not params or HINTS_KEY not in params:
            return None
        raw = params[HINTS_KEY]
        if raw is None:  # (`"kvtier": null`: no hint, so nothing counted)
            return None
        req_id = getattr(req_context, "req_id", None)
        parsed = self._parsed.get(req_id)
        if parsed is not None and parsed[0] == raw:  # (a request's later calls: parsed and counted once)
            return parsed[1]
        try:
            hint = parse_hint(raw, _WHERE)
        except ArgumentError as exc:
            if req_id not in self._warned:
                self._counts.hints_refused += 1
                self._warned[req_id] = None
                if len(self._warned) > 1024:
                    self._warned.popitem(last=False)
                log.warning("request %s: retention hint refused (%s); served without it", req_id, exc)
            return None
        self._counts.hints += 1
        if isinstance(raw, Mapping):
            self._parsed[req_id] = (dict(raw), hint)
            if len(self._parsed) > 4096:
                self._parsed.popitem(last=False)
        return hint
