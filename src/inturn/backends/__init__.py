"""Where the lines live.

A :class:`~inturn.KeyedQueue` keeps its lines in its own process unless it is
given a backend that shares them with other processes::

    KeyedQueue()                                    # in process: LocalBackend
    KeyedQueue(backend=FileBackend("/run/myapp"))   # processes of one host
    KeyedQueue(backend=RedisBackend.from_url(url))  # processes of many hosts
    KeyedQueue(backend=PostgresBackend.from_url(url))  # ... on one database

This package holds what every backend has in common: the :class:`Backend`
protocol, the :class:`Grant` it hands out for one key and the optional
:class:`Session` that holds a turn's keys on one connection, the :class:`Turn`
a holder is given, the in-process :class:`LocalBackend`, and the snapshots
of shared lines that ``lines()`` of the Redis and the file backends returns
(:class:`LineInfo`, :class:`HolderInfo`, :class:`WaiterInfo`). Each backend
that shares lines lives in a public module of its own
(``inturn.backends.file``, ``.redis``, ``.postgres``), imported only by
those who use it.
"""

from __future__ import annotations

from .._turn import Turn as Turn
from ._base import Backend as Backend
from ._base import Grant as Grant
from ._base import Session as Session
from ._lines import HolderInfo as HolderInfo
from ._lines import LineInfo as LineInfo
from ._lines import WaiterInfo as WaiterInfo
from ._local import LocalBackend as LocalBackend

__all__ = (
    "Backend",
    "Grant",
    "HolderInfo",
    "LineInfo",
    "LocalBackend",
    "Session",
    "Turn",
    "WaiterInfo",
)
