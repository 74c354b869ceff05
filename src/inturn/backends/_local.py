"""The in-process backend: lines that live in their queue's process only."""

from __future__ import annotations

from collections.abc import Hashable
from typing import final

from .._order import order_keys


@final
class LocalBackend:
    """Lines that live in the queue's own process: the default backend.

    A :class:`~inturn.KeyedQueue` with this backend (or none) is its own
    whole story: its per-key lines grant every turn, with direct hand-off
    and nothing but a dict entry per active key. Keys are any hashable
    value; several keys are taken in an order fixed for the life of the
    process.

    It is not a :class:`~inturn.backends.Backend`: there is nothing to share,
    so there is nothing to acquire from; ``KeyedQueue(backend=LocalBackend())``
    is the same as ``KeyedQueue()``.
    """

    __slots__ = ()

    def order(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        """Drop duplicate keys and sort the rest into the process-wide order."""
        return order_keys(keys)

    def __repr__(self) -> str:
        return "LocalBackend()"
