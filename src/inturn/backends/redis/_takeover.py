"""The one place that touches redis-py's private connection internals.

The Redis backend's hot calls skip redis-py's per-command machinery: once
redis-py has opened and set up a connection (TLS, AUTH, HELLO, SELECT),
the backend reads and writes its transport itself (see ``_wire``).
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

from redis.exceptions import ConnectionError as RedisConnectionError

from ..._tasks import retrieve_when_closed

#: Whether to take connections over at all (else: always redis-py's public API).
ENABLED = os.environ.get("INTURN_REDIS_WIRE", "fast") != "public"


def transport_of(connection: Any) -> asyncio.Transport | str:
    """The transport under a connected redis-py connection, or why it cannot be taken over.

    :raises ConnectionError: the connection closed while redis-py set it up
        (its reader saw the end: a taken-over transport would never say so).
    """
    writer = getattr(connection, "_writer", None)
    reader = getattr(connection, "_reader", None)
    if not isinstance(writer, asyncio.StreamWriter):
        return f"its _writer is {type(writer).__name__}, not an asyncio.StreamWriter"
    if not isinstance(reader, asyncio.StreamReader):
        return f"its _reader is {type(reader).__name__}, not an asyncio.StreamReader"
    transport = writer.transport
    if not isinstance(transport, asyncio.Transport):
        return f"its transport is {transport!r}"
    if transport.is_closing() or reader.at_eof():
        raise RedisConnectionError("Redis closed the connection as it was set up")
    return transport


def retrieve_close(connection: Any) -> None:
    """Have the error a redis-py connection's stream ends with retrieved, from the moment
    each of its streams opens (call it before connecting).

    redis-py's ``disconnect(nowait=True)`` never awaits the stream's close,
    whose error asyncio would log if collected unretrieved (see
    :func:`~inturn._tasks.retrieve_when_closed`). A write that fails in
    redis-py's handshake (the server dropped the new connection) does that
    and leaves no stream to find afterwards: so the retrieval is set up in
    the handshake itself, first, wrapping redis-py's ``redis_connect_func``
    (or its ``on_connect``). A taken-over connection's stream never hears of
    its end: nothing to retrieve.
    """
    if not hasattr(connection, "redis_connect_func"):
        return  # (not redis-py's: no stream of asyncio's)
    original = connection.redis_connect_func

    async def handshake(opened: Any) -> None:
        writer = getattr(opened, "_writer", None)
        if isinstance(writer, asyncio.StreamWriter):
            retrieve_when_closed(writer)
        if original is None:
            await opened.on_connect()
        elif asyncio.iscoroutinefunction(original):
            await original(opened)
        else:
            original(opened)

    connection.redis_connect_func = handshake


def writer_transport(connection: Any) -> asyncio.BaseTransport | None:
    """The transport of a redis-py connection (to close it without its loop), if it has one."""
    writer = getattr(connection, "_writer", None)
    return writer.transport if isinstance(writer, asyncio.StreamWriter) else None


def forget(connection: Any) -> None:
    """Tell redis-py a taken-over connection is closed (its transport is, or is closing).

    Its own ``disconnect()`` would close the transport again and wait for a
    protocol that is no longer its own.
    """
    with contextlib.suppress(Exception):
        connection._writer.close()
    connection._reader = connection._writer = None
