"""RESP2 and RESP3, as the Redis backend's own connections read and write them.

Why by hand: ``hiredis.Reader`` (3.5) returns a RESP3 attribute frame as a
reply of its own and raises on a blob error (``!``), either of which would
hand one call another's reply; and this parser keeps pace with it on the
backend's short replies. It knows nothing of sockets or redis-py.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError


class Incomplete(Exception):
    """More bytes are needed before the next frame is whole."""


class Push(list):  # type: ignore[type-arg]
    """A RESP3 push frame (``>``): out of band, the reply to no call."""

    __slots__ = ()


def bulk(value: bytes) -> bytes:
    """Pack one RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


def command(*parts: bytes) -> bytes:
    """Pack a command: an array of bulk strings."""
    return b"*%d\r\n" % len(parts) + b"".join(bulk(part) for part in parts)


def parse(buffer: bytearray, at: int) -> tuple[Any, int]:
    """Parse the frame that starts at buffer[at]: (value, where the next one starts).

    Bulk and simple strings come as bytes, errors (``-`` and ``!``) as
    :class:`~redis.exceptions.ResponseError` instances (returned, not
    raised), arrays, sets and maps as lists, pushes as :class:`Push`, null
    as None. An attribute frame (``|``) is read and dropped with the value
    it annotates, which is returned.

    :raises Incomplete: the frame is not whole yet.
    :raises ValueError: the bytes are not RESP.
    """
    end = buffer.find(b"\r\n", at)
    if end < 0:
        raise Incomplete
    kind, line, at = buffer[at], buffer[at + 1 : end], end + 2
    if kind == 0x3A:  # ':' integer
        return int(line), at
    if kind in (0x24, 0x3D, 0x21):  # '$' bulk string, '=' verbatim string, '!' blob error
        size = int(line)
        if size < 0:
            return None, at
        if len(buffer) < at + size + 2:
            raise Incomplete
        value = bytes(buffer[at : at + size])
        if kind == 0x21:
            return ResponseError(value.decode("utf-8", "replace")), at + size + 2
        return value, at + size + 2
    if kind in (0x2A, 0x3E, 0x7E, 0x25, 0x7C):  # '*' array, '>' push, '~' set, '%' map, '|' attr
        count = int(line) * (2 if kind in (0x25, 0x7C) else 1)
        if count < 0:
            return None, at
        items = Push() if kind == 0x3E else []
        for _ in range(count):
            item, at = parse(buffer, at)
            items.append(item)
        if kind == 0x7C:  # attributes annotate the value that follows: skip them
            return parse(buffer, at)
        return items, at
    if kind == 0x2B:  # '+' simple string
        return bytes(line), at
    if kind == 0x2D:  # '-' error
        return ResponseError(line.decode("utf-8", "replace")), at
    if kind == 0x5F:  # '_' null
        return None, at
    if kind == 0x23:  # '#' boolean
        return line == b"t", at
    if kind in (0x2C, 0x28):  # ',' double, '(' big number
        return (float(line) if kind == 0x2C else int(line)), at
    raise ValueError(f"not a Redis reply: {bytes(buffer[at - len(line) - 3 : at])[:80]!r}")
