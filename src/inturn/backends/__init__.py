"""Where the lines live.

A :class:`~inturn.KeyedQueue` keeps its lines in its own process unless it is
given a backend that shares them with other processes::

    KeyedQueue()                                    # in process: LocalBackend
    KeyedQueue(backend=FileBackend("/run/myapp"))   # processes of one host
    KeyedQueue(backend=RedisBackend.from_url(url))  # processes of many hosts
    KeyedQueue(backend=PostgresBackend.from_url(url))  # ... on one database

This package holds what every backend has in common: the :class:`Backend`
protocol and the :class:`Capabilities` a backend declares, the
:class:`Grant` it hands out for one key, :class:`BlockingBackend` (threads
block in it), :class:`SessionBackend` and the :class:`TurnSession` that holds
a turn's keys on one connection, the in-process :class:`LocalBackend`, and the
snapshots of shared lines that ``lines()`` of the Redis, the file and the
PostgreSQL backends returns (:class:`LineInfo`, :class:`HolderInfo`,
:class:`WaiterInfo`). Each backend
that shares lines lives in a public module of its own
(``inturn.backends.file``, ``.redis``, ``.postgres``), imported only by
those who use it.
"""

from __future__ import annotations

from ._base import Backend as Backend
from ._base import BlockingBackend as BlockingBackend
from ._base import BlockingTurnSession as BlockingTurnSession
from ._base import Capabilities as Capabilities
from ._base import Grant as Grant
from ._base import SessionBackend as SessionBackend
from ._base import TurnSession as TurnSession
from ._lines import HolderInfo as HolderInfo
from ._lines import LineInfo as LineInfo
from ._lines import WaiterInfo as WaiterInfo
from ._local import LocalBackend as LocalBackend

__all__ = (
    "Backend",
    "BlockingBackend",
    "BlockingTurnSession",
    "Capabilities",
    "Grant",
    "HolderInfo",
    "LineInfo",
    "LocalBackend",
    "SessionBackend",
    "TurnSession",
    "WaiterInfo",
)
