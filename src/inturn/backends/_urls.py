"""What a wrong server URL is told: what is wrong with it, and how a right one looks.

Written once for ``RedisBackend.from_url``, ``PostgresBackend`` and
``python -m inturn inspect``. A message shows a URL or conninfo string
without its password, and shows nothing of a client library's error that
repeats it.
"""

from __future__ import annotations

import re
from typing import Final

from .._describe import SHOWN, cut
from .._describe import describe as show

#: How a right Redis URL looks.
REDIS_FORMS: Final = "redis://host:6379/0, rediss:// for TLS, or unix:///path/to.sock"
#: The schemes redis-py reads (in any case: it lowers them).
_REDIS_SCHEMES: Final = ("redis", "rediss", "unix")

#: How a right PostgreSQL URL or conninfo string looks.
POSTGRES_FORMS: Final = (
    "postgresql://user:password@host:5432/dbname (or postgres://), "
    "or a conninfo string: 'host=host port=5432 dbname=dbname user=user'"
)
#: The schemes libpq reads as a URL (in lower case only); anything else is key=value.
_POSTGRES_SCHEMES: Final = ("postgresql", "postgres")

# "scheme://": a scheme is a run without "/", spaces or "=" (a conninfo's values may hold "://")
_SCHEME = re.compile(r"([^\s=/]+)://")
# the password of a URL's user info: [scheme://]user:PASSWORD@host
_URL_PASSWORD = re.compile(r"^(?:[^\s=/]+://)?[^:/@\s]*:([^@/]*)@")
# a conninfo's or a URL query's password: password=VALUE or password='VALUE'
_PASSWORD_VALUE = re.compile(r"\bpassword\s*=\s*('(?:[^'\\]|\\.)*'|[^\s&]+)")


def _passwords(source: str) -> list[str]:
    """The passwords written in source (a URL or a conninfo string), longest first."""
    found = [match.group(1) for match in _PASSWORD_VALUE.finditer(source)]
    url = _URL_PASSWORD.match(source)
    if url is not None:
        found.append(url.group(1))
    return sorted({secret for secret in found if secret}, key=len, reverse=True)


def hidden(text: str, source: str) -> str:
    """text (source itself, or a library's message about it) with source's passwords as ***."""
    for secret in _passwords(source):
        text = text.replace(secret, "***")
    return text


def _scheme(url: str) -> str | None:
    """url's scheme, if it is written ``scheme://...``; else None."""
    match = _SCHEME.match(url)
    return None if match is None else match.group(1)


#: A redis:// or rediss:// URL written without its two slashes (redis:/host, redis:host):
#: redis-py reads no host in it, and would connect to localhost.
_NO_SLASHES = re.compile(r"(rediss?):(?!//)", re.IGNORECASE)


def slashless_redis_url(url: str) -> ValueError | None:
    """The error for url if it is ``redis:`` or ``rediss:`` without ``//`` (else None)."""
    match = _NO_SLASHES.match(url)
    if match is None:
        return None
    return ValueError(
        f"inturn: in the Redis URL {show(hidden(url, url))}, {show(match.group(0))} must be "
        f"followed by two slashes (redis-py would read no host in it, and connect to "
        f"localhost); use {REDIS_FORMS}"
    )


def refused_redis_url(url: str, reason: str) -> ValueError:
    """The error for a url that redis-py could not read (reason: its error's message)."""
    shown = hidden(url, url)
    scheme = _scheme(url)
    if scheme is None:
        where = shown if len(shown) <= SHOWN else "host:port"
        return ValueError(
            f"inturn: {show(shown)} is not a Redis URL; give it with its scheme: "
            f"redis://{where}, rediss:// for TLS, or unix:///path/to.sock"
        )
    if scheme.lower() not in _REDIS_SCHEMES:
        return ValueError(f"inturn: {show(scheme)} is not a Redis URL's scheme; use {REDIS_FORMS}")
    return ValueError(
        f"inturn: redis-py cannot read the Redis URL {show(shown)} "
        f"({cut(hidden(reason, url))}); a right one looks like {REDIS_FORMS}"
    )


def refused_conninfo(conninfo: str, reason: str) -> ValueError:
    """The error for a conninfo (URL or key=value) that libpq could not read (reason: why)."""
    scheme = _scheme(conninfo)
    if scheme is not None and scheme not in _POSTGRES_SCHEMES:
        problem = f"{show(scheme)} is not a PostgreSQL URL's scheme"
    elif scheme is None and "=" not in conninfo:
        problem = (
            f"{show(hidden(conninfo, conninfo))} is neither a PostgreSQL URL nor a conninfo string"
        )
    else:
        problem = (
            f"libpq cannot read the {'URL' if scheme else 'conninfo string'} "
            f"{show(hidden(conninfo, conninfo))} ({cut(hidden(reason, conninfo))})"
        )
    return ValueError(f"inturn: {problem}; use {POSTGRES_FORMS}")
