"""How a message quotes a value it refuses: `brief(value)`, at most about `BRIEF_CHARS` characters
whatever the value's size; `clip` cuts quoted text; `suggest` names the closest valid option.
(kvtier.config.input reads configs with them; backends' validators and the registry too.)"""

from __future__ import annotations

import difflib
import reprlib
from typing import Any

BRIEF_CHARS = 60

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = BRIEF_CHARS
_BRIEF.maxother = BRIEF_CHARS
_BRIEF.maxlevel = 3
for _attr in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset", "maxdeque", "maxarray"):
    setattr(_BRIEF, _attr, 4)


def brief(value: Any, limit: int = BRIEF_CHARS) -> str:
    """`repr(value)` cut to about `limit` characters, in time independent of the value's size.

    Large integers are described by their number of digits (their full text can take long to
    build, or be refused by Python); nested or shared containers are shown a few items deep.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 192:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    try:
        text = _BRIEF.repr(value)
    except Exception:  # a broken __repr__ must not hide the real problem
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def clip(text: str, limit: int = 200) -> str:
    """`text` cut to at most `limit` characters (for messages quoting other messages or paths)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def suggest(value: Any, options) -> str:
    """" (did you mean 'x'?)" for the option closest to a short string `value`, else "";
    compared case-insensitively (`LRU` suggests 'lru'), the option named as it is spelled."""
    if not isinstance(value, str) or len(value) > 64:
        return ""
    folded: dict[str, Any] = {}
    for option in options:
        folded.setdefault(str(option).casefold(), option)
    close = difflib.get_close_matches(value.casefold(), list(folded), n=1)
    return f" (did you mean {folded[close[0]]!r}?)" if close else ""
