"""Latest work shared across processes on Redis, in one process: queues with a RedisBackend of
their own on one namespace, as processes (the backend cannot tell them apart: each has its own
share, member ids and channel), and a view of key k's line in Redis from the side.

The Redis twin of latest_across.py's helpers (the file backend's).
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis
from redis.asyncio.cluster import RedisCluster

from inturn import KeyedQueue
from inturn.backends.redis import RedisBackend
from inturn.backends.redis._scripts import Line

from .helpers import PATIENCE
from .latest_across import Holder
from .redis_checks import cluster_keys_left, keys_left


class Seen:
    """Key k's line in Redis as it is now, read from the side (a client of its own).

    Read with a blocking client, so that a predicate of settle() or
    wait_until() can ask it; each read is a round trip to a local server.
    """

    def __init__(self, url: str, namespace: str, key: str = "k", cluster: bool = False) -> None:
        self.redis: Any = (redis.RedisCluster if cluster else redis.Redis).from_url(url)
        self.line, self.q, self.lease, self.info = Line(namespace, key).names[:4]

    def ids(self) -> list[str]:
        """Its members' ids: its holder (if any), then its waiters in line order."""
        holder = self.redis.hget(self.line, "holder")
        ids = ([] if holder is None else [holder]) + list(self.redis.zrange(self.q, 0, -1))
        return [member.decode() for member in ids]

    def members(self) -> list[str]:
        """Its holder (if any) then its waiters, in line order: their info."""
        infos = [self.redis.hget(self.info, member) for member in self.ids()]
        return [info.decode() for info in infos if info is not None]

    def waiters(self) -> int:
        return int(self.redis.zcard(self.q))

    def held(self) -> bool:
        return bool(self.redis.hexists(self.line, "holder"))

    def posts(self) -> int:
        """How many members of the line carry a post of latest work."""
        return sum(" @" in info for info in self.members())

    def fresh(self) -> int:
        """How many of them carry a fresh post (written as their turn joined again)."""
        return sum(" @" in info and info.endswith(" 1") for info in self.members())

    def pids(self) -> list[int]:
        """The process ids of the line's members, holder first."""
        return [int(info.split(" @")[0].rsplit(" ", 2)[1]) for info in self.members()]

    def close(self) -> None:
        self.redis.close()


class Processes:
    """Makes queues on one Redis and namespace, each with a RedisBackend of its own (one
    "process" each); all closed by close()."""

    def __init__(self, url: str, namespace: str, lease: float, cluster: bool = False) -> None:
        self.url = url
        self.namespace = namespace
        self.lease = lease
        self.cluster = cluster  # url is a Redis Cluster's node: each backend a RedisCluster's
        self.made: list[KeyedQueue] = []
        self.backends: list[RedisBackend] = []  # every one made here
        self.seen = Seen(url, namespace, cluster=cluster)

    def backend(self, **options: Any) -> RedisBackend:
        """A backend of a process of its own (closed by close())."""
        if self.cluster:
            client = RedisCluster.from_url(self.url, **options)
            made = RedisBackend(
                client, namespace=self.namespace, lease=self.lease, owns_client=True
            )
        else:
            made = RedisBackend.from_url(self.url, namespace=self.namespace, lease=self.lease)
        self.backends.append(made)
        return made

    def latest(self, **settings: Any) -> KeyedQueue:
        """A queue whose latest work is the key's among every queue made here."""
        return self.keep(
            KeyedQueue(backend=self.backend(), pending="latest", across="processes", **settings)
        )

    def plain(self, **settings: Any) -> KeyedQueue:
        """A queue of plain turns (every call runs, in line)."""
        return self.keep(KeyedQueue(backend=self.backend(), **settings))

    def holder(self) -> Holder:
        holder = Holder(self.backend())
        self.keep(holder.queue)
        return holder

    def keep(self, queue: KeyedQueue) -> KeyedQueue:
        self.made.append(queue)
        return queue

    async def key_free(self) -> bool:
        """Whether key k is free: a plain turn takes it, alone in its line (within PATIENCE:
        a dead process's place lasts its lease)."""
        queue = self.plain()
        async with queue.keyed("k", timeout=PATIENCE):
            return self.seen.waiters() == 0 and self.seen.held()

    async def nothing_left(self) -> bool:
        """Whether the namespace's keys are all gone from Redis (marks of members that left
        early last three leases: waited for), and no line is shown."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PATIENCE
        left = cluster_keys_left if self.cluster else keys_left
        while await left(self.url, self.namespace):
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.01)
        return await self.backend().lines() == []

    async def close(self) -> None:
        """Close every queue made here, and its backend (what still waits gets
        BackendUnavailable: a test that failed half way)."""
        for queue in self.made:
            queue.close()
        for backend in self.backends:
            await asyncio.wait_for(backend.aclose(), PATIENCE)
        self.seen.close()
