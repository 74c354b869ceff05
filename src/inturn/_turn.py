"""The turn a holder has while it runs."""

from __future__ import annotations

from collections.abc import Hashable
from typing import final

__all__ = ("Turn",)


@final
class Turn:
    """What the holder of one or more keys has while its turn lasts.

    Bound by ``async with queue.keyed(...) as turn:``. A turn is only valid
    inside the block that took it.

    :ivar keys: the keys held, in the order they were taken (the queue's
        global key order, so two holders of overlapping keys never deadlock).
    :ivar token: a fencing token: an integer that is larger than the token of
        every turn granted earlier on any of these keys, so a downstream store
        can refuse a write that carries an older token.
    """

    __slots__ = ("keys", "token")

    keys: tuple[Hashable, ...]
    token: int

    def __init__(self, keys: tuple[Hashable, ...], token: int) -> None:
        self.keys = keys
        self.token = token

    @property
    def lease_lost(self) -> bool:
        """Whether the backend could no longer vouch for this turn.

        Always ``False`` in process: an in-process turn cannot be lost.
        """
        return False

    def __repr__(self) -> str:
        return f"<Turn keys={self.keys!r} token={self.token}>"
