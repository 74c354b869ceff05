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
that shares lines lives in a package of its own (``inturn.backends.file``,
``.redis``, ``.postgres``: its public face in the package's ``__init__``, its
parts in private modules beside it), imported only by those who use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._base import Backend as Backend
from ._base import BlockingBackend as BlockingBackend
from ._base import BlockingTurnSession as BlockingTurnSession
from ._base import Capabilities as Capabilities
from ._base import Grant as Grant
from ._base import LatestBackend as LatestBackend
from ._base import LatestGrant as LatestGrant
from ._base import LatestSession as LatestSession
from ._base import Newest as Newest
from ._base import Replaced as Replaced
from ._base import SessionBackend as SessionBackend
from ._base import TurnSession as TurnSession
from ._local import LocalBackend as LocalBackend

if TYPE_CHECKING:
    from ._lines import HolderInfo as HolderInfo
    from ._lines import LineInfo as LineInfo
    from ._lines import WaiterInfo as WaiterInfo


#: Imported when first asked for: only ``lines()`` and ``inspect`` use them, and their
#: dataclasses cost ``import inturn`` more than any other module of it.
_LINES = ("HolderInfo", "LineInfo", "WaiterInfo")


def __getattr__(name: str) -> Any:
    """The snapshots of lines (:class:`LineInfo`...), imported when first asked for."""
    if name not in _LINES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _lines

    found = globals()[name] = getattr(_lines, name)
    return found


def __dir__() -> list[str]:
    """The package's names, the snapshots of lines among them before they are imported."""
    return sorted({*globals(), *_LINES})


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
