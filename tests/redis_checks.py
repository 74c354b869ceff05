"""Looking at a Redis server from the side, as an operator would."""

from __future__ import annotations

import redis.asyncio as aioredis


async def keys_left(url: str, namespace: str) -> list[str]:
    """Every key the namespace still has on the server at url."""
    client = aioredis.Redis.from_url(url)
    try:
        return sorted(
            [key.decode() async for key in client.scan_iter(match=f"inturn:{{{namespace}:*")]
        )
    finally:
        await client.aclose()
