"""What an error from Redis means: unreachable, or refused, and what to do about it.

redis-py's own parser strips an error's code into an exception class
(``NoPermissionError`` for ``NOPERM``...); this process's parser keeps the
code in the message. Both forms are read here, and nowhere else.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Sequence
from typing import Any

from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    InvalidResponse,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._describe import cut
from ..._errors import BackendUnavailable
from .._urls import REDIS_FORMS
from ._scripts import called_at

#: Errors that mean the server could not be reached (as opposed to a refusal); among them
#: InvalidResponse, redis-py's word for an answer that is not Redis's protocol (what
#: answered is another server: HTTP, SSH, ...). NOTE: the builtin TimeoutError (a missed
#: deadline) is an OSError: catch it before these.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, InvalidResponse)

#: What a refusal's first word means, and what to do about it.
_REFUSALS = {
    "NOPERM": "this Redis user lacks a permission the backend needs ({}): grant it {} "
    "(the Backends page's Permissions item gives the whole ACL line)",
    "WRONGPASS": "Redis refused the credentials ({}): check the username and password",
    "NOAUTH": "Redis wants credentials ({}): give a password (and username) in the URL",
    "OOM": "Redis is out of memory ({}): raise maxmemory, or free memory; an evicting "
    "policy could evict a line, so keep noeviction",
    "BUSY": "Redis is busy running another client's script ({})",
    "LOADING": "Redis is loading its data set ({})",
    "READONLY": "the connection reached a read-only replica, not the master ({})",
    "MASTERDOWN": "the replica lost its master ({})",
}


#: The classes redis-py's own parser raises for those words (it strips the word).
_REFUSED_AS = (
    (NoPermissionError, "NOPERM"),
    (AuthenticationError, "WRONGPASS"),
    (OutOfMemoryError, "OOM"),
    (BusyLoadingError, "LOADING"),
    (ReadOnlyError, "READONLY"),
)


#: What a permission refusal names, in Redis's words (a call's own NOPERM, a script's
#: on Redis 7.2 and later, the greeting's): a command, the keys, the channels.
_NAMED = re.compile(r"run the '([^']+)' command|(of the keys)|(the channel)")
#: Where Redis 7.0 refused a script's call: the script's SHA-1 and the line.
_WHERE = re.compile(r"script: ([0-9a-f]{40}), on @user_script:(\d+)")
#: The grants for a refusal of the keys, or of the channels.
_KEYS, _CHANNELS = "the keys ~inturn:{<namespace>:*", "the channels &inturn:<namespace>:*"
#: How a script's refusal begins: on Redis 7.0 (which names no command), and later.
_SCRIPT_REFUSED = ("The user executing the script can't", "ACL failure in script")


def server_of(client: Any) -> str | None:
    """Where client connects (``host:port``, or a socket's path), for messages; None if
    it does not say (a Sentinel's master, a cluster not yet set up)."""
    try:
        if hasattr(client, "get_default_node"):  # a RedisCluster
            node = client.get_default_node()
            return None if node is None else f"{node.host}:{node.port}"
        kwargs = client.connection_pool.connection_kwargs
    except Exception:  # (a client of another shape: said without its address)
        return None
    if "path" in kwargs:
        return str(kwargs["path"])
    return f"{kwargs['host']}:{kwargs.get('port', 6379)}" if "host" in kwargs else None


def _closed_unanswered(error: BaseException) -> bool:
    """Whether error is the server closing (or resetting) a connection without a word."""
    if isinstance(error, ConnectionResetError | BrokenPipeError):
        return True
    text = str(error)
    return isinstance(error, RedisConnectionError) and (
        text == "Connection closed by server." or f"({errno.ECONNRESET}, " in text
    )


def describe(error: BaseException, server: str | None = None, starting: bool = False) -> str:
    """What an error from Redis means, in words that name it and its fix.

    ``server``: where the client connects, named where the error does not;
    ``starting``: error came as the backend's first connections were set up,
    before Redis answered anything (a server that closes a new connection
    then, without a word, is not Redis: HTTP, or a TLS port).
    """
    text = str(error) or type(error).__name__
    at = "" if server is None else f" ({server})"
    if starting and _closed_unanswered(error):
        return (
            f"what answered is not a Redis server, or one that wants TLS: it closed the "
            f"connection without a reply ({cut(text)}); check the URL's host and port{at}, "
            f"as in {REDIS_FORMS}"
        )
    word = text.split(" ", 1)[0]
    if (
        word == "NOPERM"
        or isinstance(error, NoPermissionError)
        or any(begun in text for begun in _SCRIPT_REFUSED)
    ):
        return _REFUSALS["NOPERM"].format(text, _grants(text))
    if word in _REFUSALS:
        return _REFUSALS[word].format(text)
    for kind, word in _REFUSED_AS:
        if isinstance(error, kind):
            return _REFUSALS[word].format(text)
    if isinstance(error, ResponseError):
        return f"Redis answered with an error ({text})"
    if isinstance(error, InvalidResponse):  # (its text: the first line of the answer)
        return (
            f"what answered is not a Redis server ({cut(text)}): check the URL's host and "
            f"port{at}, as in {REDIS_FORMS}"
        )
    if server is not None and server not in text:
        return f"Redis could not be reached at {server} ({text})"
    return f"Redis could not be reached ({text})"


def _grants(text: str) -> str:
    """The grants a permission refusal's text asks for, from its words (see _NAMED), or
    from the script line it names (Redis 7.0's)."""
    grants: list[str] = []
    for command, keys, _ in _NAMED.findall(text):
        grants.append(f"+{command.lower()}" if command else _KEYS if keys else _CHANNELS)
    if not grants and (where := _WHERE.search(text)):
        grants = [f"+{name.lower()}" for name in called_at(where[1], int(where[2]))]
    if not grants:
        return "what its ACL LOG says it was refused"
    return " ".join(dict.fromkeys(grants))


def refused(reply: Sequence[bytes | str]) -> NoPermissionError | None:
    """The error for what the greeting found this user may not do (its reply after the
    run_id, in Redis's words); None when nothing."""
    if not reply:
        return None
    said = "; ".join(w.decode() if isinstance(w, bytes) else w for w in reply)
    return NoPermissionError(f"this user has {said}")


def unavailable(
    error: BaseException, server: str | None = None, starting: bool = False
) -> BackendUnavailable:
    """The error an acquire raises for error: the turn was not taken, the work did not run.

    ``server`` and ``starting``: as :func:`describe`'s.
    """
    failure = BackendUnavailable(
        f"inturn: {describe(error, server, starting)}; the work did not run"
    )
    failure.__cause__ = error
    return failure


def demoted(error: BaseException) -> bool:
    """Whether error says the server is a replica now (a failover demoted it)."""
    return isinstance(error, ReadOnlyError) or str(error).startswith("READONLY")
