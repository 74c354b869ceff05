"""A worker process on the PostgreSQL backend.

``python tests/support/pg_worker.py URL NAMESPACE CMD ...``: the backend is
``PostgresBackend.from_url(URL, namespace=NAMESPACE)``; the
test puts an ``application_name`` of the worker's own in URL, so that it can
tell this worker's sessions apart in ``pg_stat_activity`` and ``pg_locks``.
The worker reports on stdout, one line per event, and waits for a line on
stdin where a command says so, so the test drives it step by step:

- ``hold KEY``: take KEY (``async with``); print ``holding TOKEN``; wait for
  a stdin line; release; print ``released``, or ``raised LeaseLost LOST``
  (LOST: ``turn.lease_lost`` once the block ended), or
  ``raised BackendUnavailable``.
- ``take KEY``: as ``hold``, without waiting for a stdin line: the turn
  ends as soon as it began.
- ``hold-sync KEY``: as ``hold``, with ``with queue.keyed(KEY)`` in a
  process that has no event loop of its own.
- ``increment KEY TABLE N``: N read-modify-write increments of the one row
  of TABLE (a SELECT, then an UPDATE of what it read: two statements on a
  connection of the worker's own), each under KEY; print ``done``.
- ``fork-increment KEY TABLE N``: take a turn (``run_sync``), then fork a
  child (multiprocessing's ``fork``); the child and this process each do
  N increments of TABLE with ``run_sync``; print ``done CODE`` with the
  child's exit code (``hung`` if it did not end within PATIENCE).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
from typing import Any

import psycopg

from inturn import BackendUnavailable, KeyedQueue, LeaseLost
from inturn.backends.postgres import PostgresBackend

#: How long the fork command waits for its child (a hang, past it).
PATIENCE = 30.0


def say(*words: object) -> None:
    print(*words, flush=True)


async def read_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def increment(connection: Any, table: str) -> None:
    """Add one to TABLE's row: a lost update if two run at once."""
    cursor = await connection.execute(f"SELECT value FROM {table}")
    (value,) = await cursor.fetchone()
    await connection.execute(f"UPDATE {table} SET value = %s", (value + 1,))


def increment_sync(connection: Any, table: str) -> None:
    """Add one to TABLE's row, from a thread: a lost update if two run at once."""
    (value,) = connection.execute(f"SELECT value FROM {table}").fetchone()
    connection.execute(f"UPDATE {table} SET value = %s", (value + 1,))


async def hold(queue: KeyedQueue, key: str, wait: bool) -> None:
    turn = queue.keyed(key)
    try:
        async with turn:
            say("holding", turn.token)
            if wait:
                await read_line()
    except LeaseLost:
        say("raised", "LeaseLost", turn.lease_lost)
    except BackendUnavailable:
        say("raised", "BackendUnavailable")
    else:
        say("released")


def hold_sync(queue: KeyedQueue, key: str) -> None:
    turn = queue.keyed(key)
    try:
        with turn:
            say("holding", turn.token)
            sys.stdin.readline()
    except LeaseLost:
        say("raised", "LeaseLost", turn.lease_lost)
    else:
        say("released")


def fork_increment(queue: KeyedQueue, url: str, key: str, table: str, n: int) -> None:
    queue.run_sync(key, lambda: None)  # the backend is in use before the fork

    def increments() -> None:
        with psycopg.connect(url, autocommit=True) as connection:
            for _ in range(n):
                queue.run_sync(key, increment_sync, connection, table)

    child = multiprocessing.get_context("fork").Process(target=increments)
    child.start()
    increments()
    child.join(PATIENCE)
    if child.exitcode is None:
        child.kill()
        say("done", "hung")
    else:
        say("done", child.exitcode)


async def main(url: str, namespace: str, command: str, *args: str) -> None:
    queue = KeyedQueue(backend=PostgresBackend.from_url(url, namespace=namespace))
    if command in ("hold", "take"):
        (key,) = args
        await hold(queue, key, wait=command == "hold")
    elif command == "increment":
        key, table, n = args
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
            for _ in range(int(n)):
                await queue.run(key, increment, connection, table)
        say("done")
    else:
        raise SystemExit(f"unknown command {command!r}")
    await queue.aclose()


if __name__ == "__main__":
    url, namespace, command, *rest = sys.argv[1:]
    if command == "hold-sync":
        hold_sync(KeyedQueue(backend=PostgresBackend.from_url(url, namespace=namespace)), *rest)
    elif command == "fork-increment":
        key, table, n = rest
        queue = KeyedQueue(backend=PostgresBackend.from_url(url, namespace=namespace))
        fork_increment(queue, url, key, table, int(n))
    else:
        asyncio.run(main(url, namespace, command, *rest))
