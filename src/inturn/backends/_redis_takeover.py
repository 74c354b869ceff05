"""The one place that touches redis-py's private connection internals.

The Redis backend's hot calls skip redis-py's per-command machinery: once
redis-py has opened and set up a connection (TLS, AUTH, HELLO, SELECT),
the backend reads and writes its transport itself (see ``_redis_wire``).
That needs the connection's private ``_writer`` to be an
:class:`asyncio.StreamWriter`, as it is from redis-py 4.2 to 8.1. Nothing
else in inturn reads or writes redis-py's privates; :func:`transport_of`
checks what it needs on every connection and says why when it cannot, and
the caller then talks through redis-py's public API instead.

``INTURN_REDIS_WIRE=public`` in the environment turns the takeover off (the
tests run the Redis suite both ways).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

__all__ = ("ENABLED", "forget", "transport_of")

#: Whether to take connections over at all (else: always redis-py's public API).
ENABLED = os.environ.get("INTURN_REDIS_WIRE", "fast") != "public"


def transport_of(connection: Any) -> asyncio.Transport | str:
    """The transport under a connected redis-py connection, or why it cannot be taken over."""
    writer = getattr(connection, "_writer", None)
    if not isinstance(writer, asyncio.StreamWriter):
        return f"its _writer is {type(writer).__name__}, not an asyncio.StreamWriter"
    transport = writer.transport
    if not isinstance(transport, asyncio.Transport) or transport.is_closing():
        return f"its transport is {transport!r}"
    if not hasattr(connection, "_reader"):
        return "it has no _reader"
    return transport


def forget(connection: Any) -> None:
    """Tell redis-py a taken-over connection is closed (its transport is, or is closing).

    Its own ``disconnect()`` would close the transport again and wait for a
    protocol that is no longer its own.
    """
    with contextlib.suppress(Exception):
        connection._writer.close()
    connection._reader = connection._writer = None
