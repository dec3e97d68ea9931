"""The host owner's wire format: one JSON object per frame, a 4-byte big-endian length before it.

A request is `{"id": n, "op": name, ...arguments}`; its answer `{"id": n, ...}` or `{"id": n,
"error": text}`. Keys travel as hex strings. A frame larger than `MAX_FRAME_BYTES` is refused by
both sides (the connection is closed): a bounded buffer, whatever the peer sends.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvtier.core.errors import KVTierError
from kvtier.core.keys import OffloadKey

if TYPE_CHECKING:
    from kvtier.control.hints import Hint

MAX_FRAME_BYTES = 64 << 20  # a request for ~500 K keys; nothing legitimate comes near it
_LENGTH = struct.Struct(">I")


class HostUnavailable(KVTierError):
    """The host owner did not answer in time, is not running, or refused the call."""


class FrameError(HostUnavailable):
    """The peer sent something that is not a frame of this protocol."""


def encode(message: dict[str, Any]) -> bytes:
    """One frame holding `message`."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"a message of {len(body)} bytes is larger than a frame ({MAX_FRAME_BYTES} bytes)")
    return _LENGTH.pack(len(body)) + body


class FrameReader:
    """Frames from a byte stream, across partial reads: a read that times out mid-frame keeps what
    it got, so the next read goes on from there (the stream never loses its place)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next_frame(self) -> dict[str, Any] | None:
        """The next whole frame's message, or None when more bytes are needed; `FrameError` on a
        frame too large or a body that is not a JSON object."""
        if len(self._buffer) < _LENGTH.size:
            return None
        (size,) = _LENGTH.unpack_from(self._buffer)
        if size > MAX_FRAME_BYTES:
            raise FrameError(f"the peer announced a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
        end = _LENGTH.size + size
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[_LENGTH.size:end])
        del self._buffer[:end]
        try:
            message = json.loads(body)
        except ValueError as exc:
            raise FrameError(f"a frame that is not JSON: {exc}") from None
        if not isinstance(message, dict):
            raise FrameError(f"a frame that is not a JSON object: {type(message).__name__}")
        return message


def read_frame(sock: socket.socket, reader: FrameReader) -> dict[str, Any]:
    """The next message from `sock` (blocking as the socket's timeout says: `TimeoutError` leaves
    the partial frame in `reader`); `HostUnavailable` when the peer closed the connection."""
    while True:
        message = reader.next_frame()
        if message is not None:
            return message
        data = sock.recv(1 << 16)
        if not data:
            raise HostUnavailable("the connection was closed by the peer")
        reader.feed(data)


def hex_keys(keys: Iterable[bytes]) -> list[str]:
    return [bytes(key).hex() for key in keys]


def parse_keys(values: Any, field: str = "keys") -> list[OffloadKey]:
    """Keys from their hex strings; `ValueError` naming `field` on anything else."""
    if not isinstance(values, list):
        raise ValueError(f"{field}: expected a list of hex strings, got {type(values).__name__}")
    try:
        return [OffloadKey(bytes.fromhex(value)) for value in values]
    except (TypeError, ValueError):
        raise ValueError(f"{field}: expected a list of hex strings") from None


def hint_fields(hint: Hint | None) -> dict[str, Any] | None:
    """A retention hint checked by the engine (`parse_hint`), as sent to the owner, which reads
    it back the same: plain JSON values, whatever mapping the caller gave it in; None: none."""
    if hint is None:
        return None
    return {"session": hint.session, "retain_s": hint.retain_s, "priority": hint.priority, "tenant": hint.tenant,
            "session_ended": hint.ended}
