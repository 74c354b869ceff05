"""A worker process for the multi-process tests: ``python tests/worker.py BACKEND COMMAND ...``.

BACKEND is ``file:DIRECTORY`` or ``redis:URL#NAMESPACE#LEASE``. It reports on stdout, one
line per event, and waits for a line on stdin where a command says so, so
the test drives it step by step:

- ``hold KEY``: take KEY; print ``holding TOKEN``; wait for a stdin line;
  print ``lease-lost`` if the turn lost its lease meanwhile; release;
  print ``released``, or ``raised LeaseLost`` if the release raised it.
- ``increment KEY COUNTER N``: N read-modify-write increments of the
  integer in the file COUNTER, each under KEY; print ``done``.
- ``increment-redis KEY COUNTER N``: the same on the Redis key COUNTER, read
  and written with GET and SET by a client of its own.
- ``fork-hold KEY``: take KEY, fork a child that keeps every inherited file
  open and waits; print ``forked PID``; wait for a stdin line; release;
  print ``released``; wait for a stdin line; end the child.
- ``fork-increment KEY COUNTER N CHILDREN WHEN``: make one queue at module
  level, as a preforking server does; if WHEN is ``after``, use it once
  (``asyncio.run``) before forking; fork CHILDREN children, and each of them
  and this process run ``increment-redis`` N times, each in an event loop of
  its own; print ``done ERRORS`` with the errors any of them met (``-``:
  none).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

from inturn import KeyedQueue, LeaseLost


def make_backend(spec: str) -> Any:
    kind, _, where = spec.partition(":")
    if kind == "file":
        from inturn.backends.file import FileBackend

        return FileBackend(where)
    if kind == "redis":
        from inturn.backends.redis import RedisBackend

        url, namespace, lease = where.split("#")
        return RedisBackend.from_url(url, namespace=namespace, lease=float(lease))
    raise SystemExit(f"unknown backend {spec!r}")


def read_counter(path: str) -> int:
    with open(path) as file:
        return int(file.read() or 0)


def write_counter(path: str, value: int) -> None:
    with open(path, "w") as file:
        file.write(str(value))


def say(*words: object) -> None:
    print(*words, flush=True)


async def read_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def main(spec: str, command: str, *args: str) -> None:
    queue = KeyedQueue(backend=make_backend(spec))
    if command == "hold":
        (key,) = args
        try:
            async with queue.keyed(key) as turn:
                say("holding", turn.token)
                await read_line()
                if turn.lease_lost:
                    say("lease-lost")
        except LeaseLost:
            say("raised", "LeaseLost")
        else:
            say("released")
    elif command == "increment":
        key, counter, n = args

        async def increment() -> None:
            value = read_counter(counter)
            await asyncio.sleep(0)  # others run here: a lost update, were it not for the key
            write_counter(counter, value + 1)

        for _ in range(int(n)):
            await queue.run(key, increment)
        say("done")
    elif command == "increment-redis":
        import redis.asyncio as aioredis

        key, counter, n = args
        url = spec.split(":", 1)[1].split("#")[0]
        client = aioredis.Redis.from_url(url)

        async def increment_redis() -> None:
            value = int(await client.get(counter) or 0)
            await asyncio.sleep(0)  # others run here: a lost update, were it not for the key
            await client.set(counter, value + 1)

        for _ in range(int(n)):
            await queue.run(key, increment_redis)
        await client.aclose()
        say("done")
    elif command == "fork-hold":
        (key,) = args
        async with queue.keyed(key):
            reader, writer = os.pipe()
            child = os.fork()
            if child == 0:  # pragma: no cover - the child
                os.close(writer)
                os.read(reader, 1)  # until the parent goes
                os._exit(0)
            os.close(reader)
            say("forked", child)
            await read_line()
        say("released")
        await read_line()
        os.kill(child, signal.SIGTERM)
        await asyncio.get_running_loop().run_in_executor(None, os.waitpid, child, 0)
    else:
        raise SystemExit(f"unknown command {command!r}")
    await queue.aclose()


def fork_increment(spec: str, key: str, counter: str, n: str, children: str, when: str) -> None:
    """``fork-increment``: the queue is made before fork(), as ``gunicorn --preload`` does."""
    import redis

    queue = KeyedQueue(backend=make_backend(spec))
    url = spec.split(":", 1)[1].split("#")[0]
    if when == "after":
        asyncio.run(queue.run(f"{key}-warm-up", lambda: None))

    async def increments() -> None:
        client = redis.asyncio.Redis.from_url(url)

        async def increment() -> None:
            value = int(await client.get(counter) or 0)
            await asyncio.sleep(0)  # others run here: a lost update, were it not for the key
            await client.set(counter, value + 1)

        try:
            for _ in range(int(n)):
                await queue.run(key, increment)
        finally:
            await client.aclose()

    def work() -> str:
        try:
            asyncio.run(increments())
        except BaseException as error:
            return f"{type(error).__name__}:{error}".replace(" ", "_")
        return ""

    pids = []
    errors: list[str] = []
    for _ in range(int(children)):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            problem = work()
            if problem:
                print(problem, file=sys.stderr, flush=True)
            os._exit(1 if problem else 0)
        pids.append(pid)
    if problem := work():
        errors.append(problem)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            errors.append(f"child-{pid}-failed")
    say("done", " ".join(errors) or "-")


if __name__ == "__main__":
    if sys.argv[2] == "fork-increment":
        fork_increment(sys.argv[1], *sys.argv[3:])
    else:
        asyncio.run(main(*sys.argv[1:]))
