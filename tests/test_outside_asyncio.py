"""Under trio (or anyio's trio backend), every call says that inturn needs asyncio.

The call fails at once, before any work runs or is queued, naming the call
and the fix, instead of asyncio's "no running event loop" from deep inside.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio  # in the dev extra: a real trio, not a stand-in

import inturn
from inturn import KeyedQueue


def _calls(queue: KeyedQueue) -> dict[str, Callable[[], Awaitable[Any]]]:
    ran: list[str] = []

    async def work() -> None:
        ran.append("ran")

    @queue.queue_by_key(key="k")
    async def decorated() -> None:
        ran.append("ran")

    @queue.queue_by_key(key="k", coalesce=True)
    async def coalesced() -> None:
        ran.append("ran")

    async def keyed() -> None:
        async with queue.keyed("k"):
            ran.append("ran")

    async def batch() -> None:
        async with queue.batch() as b:
            await b.submit("k", work)

    return {
        "run()": lambda: queue.run("k", work),
        "queue_by_key": decorated,
        "queue_by_key(coalesce=True)": coalesced,
        "keyed()": keyed,
        "submit()": lambda: queue.submit("k", work),
        "batch()": batch,
        "drain()": queue.drain,
        "aclose()": queue.aclose,
        "inturn.run()": lambda: inturn.run("k", work),
    }


@pytest.mark.parametrize("name", list(_calls(KeyedQueue())))
def test_a_call_under_trio_says_inturn_needs_asyncio(name: str) -> None:
    queue = KeyedQueue()
    call = _calls(queue)[name]

    async def main() -> None:
        with pytest.raises(RuntimeError, match=r"needs a running asyncio event loop.*asyncio\.run"):
            await call()

    trio.run(main)
    assert not queue.closed  # aclose() under trio did not close the queue either
    assert queue.active_count == 0
