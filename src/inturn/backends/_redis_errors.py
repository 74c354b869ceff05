"""What an error from Redis means: unreachable, or refused, and what to do about it.

redis-py's own parser strips an error's code into an exception class
(``NoPermissionError`` for ``NOPERM``...); this process's parser keeps the
code in the message. Both forms are read here, and nowhere else.
"""

from __future__ import annotations

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

from .._describe import SHOWN
from .._errors import BackendUnavailable
from ._urls import REDIS_FORMS

#: Errors that mean the server could not be reached (as opposed to a refusal); among them
#: InvalidResponse, redis-py's word for an answer that is not Redis's protocol (what
#: answered is another server: HTTP, SSH, ...). NOTE: the builtin TimeoutError (a missed
#: deadline) is an OSError: catch it before these.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, InvalidResponse)

#: What a refusal's first word means, and what to do about it.
_REFUSALS = {
    "NOPERM": "this Redis user lacks a permission the backend needs ({}): grant it "
    "+evalsha +eval +script +publish +subscribe +ping, its namespace's keys and channels",
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


def describe(error: BaseException) -> str:
    """What an error from Redis means, in words that name it and its fix."""
    text = str(error) or type(error).__name__
    word = text.split(" ", 1)[0]
    if word in _REFUSALS:
        return _REFUSALS[word].format(text)
    for kind, word in _REFUSED_AS:
        if isinstance(error, kind):
            return _REFUSALS[word].format(text)
    if "can't run this command" in text:  # from a script: PUBLISH, the only one it may lack
        return _REFUSALS["NOPERM"].format(f"{text} Its scripts PUBLISH grants")
    if isinstance(error, ResponseError):
        return f"Redis answered with an error ({text})"
    if isinstance(error, InvalidResponse):  # (its text: the first line of the answer)
        brief = text if len(text) <= SHOWN else text[: SHOWN - 1] + "\N{HORIZONTAL ELLIPSIS}"
        return (
            f"what answered is not a Redis server ({brief}): check the URL's host and "
            f"port, as in {REDIS_FORMS}"
        )
    return f"Redis could not be reached ({text})"


def unavailable(error: BaseException) -> BackendUnavailable:
    """The error an acquire raises for error: the turn was not taken, the work did not run."""
    failure = BackendUnavailable(f"inturn: {describe(error)}; the work did not run")
    failure.__cause__ = error
    return failure


def demoted(error: BaseException) -> bool:
    """Whether error says the server is a replica now (a failover demoted it)."""
    return isinstance(error, ReadOnlyError) or str(error).startswith("READONLY")
