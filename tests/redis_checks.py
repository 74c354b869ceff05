"""Looking at a Redis server from the side, as an operator would."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster


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
