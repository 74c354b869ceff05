"""Functions and methods decorated at module level, for the tests that pickle them.

A decorated function pickles by reference, as a plain one does: a child
process (``ProcessPoolExecutor``) imports this module by name and gets its
own decorated function, with its own queue.
"""

from __future__ import annotations

import os

from inturn import KeyedQueue

#: The queue of this module's functions: each process that imports the module has its own.
queue = KeyedQueue()


@queue.queue_by_key(key="settle-{order_id}")
def settle(order_id: int) -> tuple[int, int, bool]:
    """The order's id, the process that ran it, and whether it ran in its key's turn."""
    return order_id, os.getpid(), queue.is_active(f"settle-{order_id}")


@queue.queue_by_key(key="settle-{order_id}")
async def settle_later(order_id: int) -> int:
    return order_id


class Ledger:
    def __init__(self, name: str) -> None:
        self.name = name

    @queue.queue_by_key(key="ledger-{self.name}")
    def post(self, cents: int) -> str:
        return f"{self.name}:{cents}"

    @queue.queue_by_key(key="ledgers")
    @classmethod
    def kind(cls, name: str) -> str:
        return f"{cls.__name__}:{name}"

    @queue.queue_by_key(key="ledgers")
    @staticmethod
    def total(*cents: int) -> int:
        return sum(cents)
