"""inturn: run work that shares a key one at a time, in arrival order.

Work with different keys runs concurrently. Think of a FIFO line per key that
exists only while someone is in it::

    from inturn import queue_by_key, keyed

    @queue_by_key(key="stock-{product_id}")
    async def take_stock(product_id: str, n: int) -> None: ...

    async with keyed("system-log"):
        ...

The same line serves threads: ``@queue_by_key`` on a plain ``def``, ``with
keyed(...)``, :func:`run_sync`.

The module-level :func:`queue_by_key`, :func:`keyed`, :func:`run` and
:func:`run_sync` act on :data:`default_queue`; make a :class:`KeyedQueue` of
your own for separate settings (timeout, max_pending) or a separate set of lines.
"""

from __future__ import annotations

from ._batch import Batch as Batch
from ._checks import UNSET as UNSET
from ._errors import BackendUnavailable as BackendUnavailable
from ._errors import HoldTimeout as HoldTimeout
from ._errors import InturnError as InturnError
from ._errors import LeaseLost as LeaseLost
from ._errors import QueueClosed as QueueClosed
from ._errors import QueueFull as QueueFull
from ._errors import Superseded as Superseded
from ._queue import KeyedQueue as KeyedQueue
from ._queue import QueuedFunction as QueuedFunction
from ._queue import SyncQueuedFunction as SyncQueuedFunction
from ._stats import Observer as Observer
from ._stats import QueueStats as QueueStats
from ._submit import Handle as Handle
from ._turn import Turn as Turn
from ._turn import current_turn as current_turn

#: The installed distribution's version, read from its metadata when first asked
#: for: importing importlib.metadata and reading it costs more than the rest of
#: ``import inturn`` together.
__version__: str  # (bound by __getattr__ below)


def __getattr__(name: str) -> str:
    """Read ``__version__`` from the package's metadata, once, the first time it is asked for."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("inturn")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        found = "0+unknown"
    globals()["__version__"] = found
    return found


def __dir__() -> list[str]:
    """The module's names, ``__version__`` among them before it is first read."""
    return sorted({*globals(), "__version__"})


#: The queue behind the module-level :func:`queue_by_key`, :func:`keyed`, :func:`run`
#: and :func:`run_sync`.
default_queue = KeyedQueue(name="default")

queue_by_key = default_queue.queue_by_key
keyed = default_queue.keyed
run = default_queue.run
run_sync = default_queue.run_sync

__all__ = (
    "UNSET",
    "BackendUnavailable",
    "Batch",
    "Handle",
    "HoldTimeout",
    "InturnError",
    "KeyedQueue",
    "LeaseLost",
    "Observer",
    "QueueClosed",
    "QueueFull",
    "QueueStats",
    "QueuedFunction",
    "Superseded",
    "SyncQueuedFunction",
    "Turn",
    "__version__",
    "current_turn",
    "default_queue",
    "keyed",
    "queue_by_key",
    "run",
    "run_sync",
)
