"""The benchmark's delaying proxy (bench/delay_proxy.py) in front of a real Redis server.

It stands in for a network round trip in bench/rtt.py: what goes through it
must come out intact and in order, and not sooner than the delay. (Only
lower bounds on time: how much later depends on the machine.)
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from bench.delay_proxy import Delayed, delayed

#: The round trip the proxy adds, in ms: uncalibrated, each direction waits half of it.
RTT_MS = 2.0


@pytest.fixture
def proxy(redis_url: str) -> Iterator[Delayed]:
    with delayed(redis_url, RTT_MS, calibrate=False, pings=20) as through:
        yield through


@pytest.fixture
def client(proxy: Delayed) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(proxy.url)
    try:
        yield connection
    finally:
        connection.close()


def test_values_small_and_large_round_trip_intact(client: redis.Redis) -> None:
    key = f"proxy-{uuid.uuid4().hex}"
    try:
        assert client.set(key, b"small\r\nvalue\x00")
        assert client.get(key) == b"small\r\nvalue\x00"
        large = os.urandom(1 << 20)
        assert client.set(key, large)
        assert client.get(key) == large
    finally:
        client.delete(key)


def test_a_ping_takes_at_least_the_round_trip(proxy: Delayed, client: redis.Redis) -> None:
    client.ping()  # (connected)
    for _ in range(5):
        start = time.perf_counter()
        assert client.ping()
        assert time.perf_counter() - start >= RTT_MS / 1e3
    assert proxy.ping_ms >= RTT_MS


def test_pipelined_commands_keep_their_order(client: redis.Redis) -> None:
    key = f"proxy-{uuid.uuid4().hex}"
    count = 2000
    try:
        with client.pipeline(transaction=False) as pipe:
            for i in range(count):
                pipe.rpush(key, i)
                pipe.echo(f"m{i}")
            replies = pipe.execute()
        assert replies[0::2] == list(range(1, count + 1))
        assert replies[1::2] == [f"m{i}".encode() for i in range(count)]
        assert client.lrange(key, 0, -1) == [str(i).encode() for i in range(count)]
    finally:
        client.delete(key)
