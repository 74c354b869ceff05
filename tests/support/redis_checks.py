"""Looking at a Redis server from the side, as an operator would."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from inturn import KeyedQueue
from inturn.backends.redis import LineInfo, RedisBackend

from .helpers import PATIENCE

#: Makes a RedisBackend for a test: ``make_backend(lease=..., url=..., **client_options)``.
BackendFactory = Callable[..., RedisBackend]


async def keys_left(url: str, namespace: str) -> list[str]:
    """Every key the namespace still has on the server at url."""
    client = aioredis.Redis.from_url(url)
    try:
        return sorted(
            [key.decode() async for key in client.scan_iter(match=f"inturn:{{{namespace}:*")]
        )
    finally:
        await client.aclose()


async def cluster_keys_left(url: str, namespace: str) -> list[str]:
    """Every key the namespace still has on the Redis Cluster that url is a node of.

    Scans every master (``RedisCluster.scan_iter`` walks each primary node).
    """
    client = RedisCluster.from_url(url)
    try:
        return sorted(
            [key.decode() async for key in client.scan_iter(match=f"inturn:{{{namespace}:*")]
        )
    finally:
        await client.aclose()


async def waiting(backend: RedisBackend, n: int) -> LineInfo:
    """Wait until Redis shows the only line held, with n waiters; return it.

    The state is brought about by other backends or processes, which give no
    signal: it is looked at every millisecond, up to PATIENCE seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PATIENCE
    while True:
        lines = await backend.lines()
        if len(lines) == 1 and lines[0].holder is not None and len(lines[0].waiters) == n:
            return lines[0]
        assert loop.time() < deadline, f"Redis never showed a holder and {n} waiters: {lines}"
        await asyncio.sleep(0.001)


async def hand_over(a: RedisBackend, b: RedisBackend) -> str:
    """a holds "k" while b waits for it; a lets go: what b's work returned."""
    gate = asyncio.Event()
    holder = asyncio.create_task(KeyedQueue(backend=a).run("k", gate.wait))
    await waiting(a, 0)
    follower = asyncio.create_task(KeyedQueue(backend=b).run("k", lambda: "next"))
    await waiting(a, 1)
    gate.set()
    result = await asyncio.wait_for(follower, 10)
    await holder
    return result
