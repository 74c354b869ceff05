"""Processes that make bursts of latest work shared across processes.

Driven over stdin, one command a line, by tests/test_latest_across_processes.py:

    python latest_worker.py BACKEND LOG MODE [KEY]

``BACKEND`` is as worker.py's (``file:DIRECTORY``, ``redis:URL#NAMESPACE#LEASE``,
``postgres:URL#NAMESPACE``),
``MODE`` is ``on_superseded`` ("join" or "raise"), ``KEY`` the key (``k``). Commands:

- ``burst N TAG``: N calls of the key on a queue with ``pending="latest",
  across="processes"``, as tasks, each work appending ``run <pid> <TAG> <i>``
  to LOG as it starts and ``done <pid> <TAG> <i>`` as it ends (it holds the
  key a few milliseconds between). Says ``queued <pid>`` once they all wait
  (the first at the backend, the rest behind it in this process), then
  ``answered <pid> <outcome>...`` once every caller is answered: ``i`` (a
  work's result), ``none``, ``superseded``, or ``error:<type>``.
- ``fork N TAG``: the same burst in a child forked for it (so that a test
  can kill it, and start another at once: nothing of inturn is imported
  here before the fork). The child says ``queued``/``answered`` as above.
- ``quit``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

#: How long a work holds the key (seconds): long enough for a kill to land in it.
WORK = 0.005


def say(*words: object) -> None:
    """One report line, written whole (under PIPE_BUF: children share the pipe)."""
    os.write(1, (" ".join(map(str, words)) + "\n").encode())


def outcome(answer: object) -> str:
    from inturn import Superseded

    if isinstance(answer, Superseded):
        return "superseded"
    if isinstance(answer, BaseException):
        return f"error:{type(answer).__name__}"
    return "none" if answer is None else str(answer)


async def burst(backend: str, log: str, mode: str, key: str, n: int, tag: str) -> None:
    from worker import make_backend  # (imports inturn: in a forked child, after the fork)

    from inturn import KeyedQueue

    queue = KeyedQueue(
        backend=make_backend(backend), pending="latest", across="processes", on_superseded=mode
    )
    pid = os.getpid()

    def append(line: str) -> None:
        with open(log, "a") as file:  # (O_APPEND: each line lands whole)
            file.write(line + "\n")

    async def work(i: int) -> int:
        append(f"run {pid} {tag} {i}")
        await asyncio.sleep(WORK)
        append(f"done {pid} {tag} {i}")
        return i

    calls = [asyncio.create_task(queue.run(key, work, i)) for i in range(n)]
    waiting = n - 1 if mode == "join" else min(n - 1, 1)
    for _ in range(100 * n):  # (the first posts at the backend, the rest wait behind it)
        if queue.pending(key) == waiting or any(call.done() for call in calls):
            break
        await asyncio.sleep(0)
    await posted(queue.backend, key, calls)
    say("queued", pid)
    answers = await asyncio.gather(*calls, return_exceptions=True)
    say("answered", pid, *map(outcome, answers))
    await queue.aclose()


async def posted(backend: Any, key: str, calls: list[asyncio.Task[int]]) -> None:
    """Return once this process's turn is in the key's line at the backend (its post with
    it), or a call was answered (Redis's enqueue is on its way when the call returns)."""
    pid = os.getpid()
    while not any(call.done() for call in calls):
        for line in await backend.lines():
            members = [line.holder, *line.waiters]
            if line.key == key and any(m is not None and m.pid == pid for m in members):
                return
        await asyncio.sleep(0.001)


def reap() -> None:
    """Reap the children that ended (killed by the test, or done)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(backend: str, log: str, mode: str, key: str = "k") -> None:
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            return
        n, tag = int(args[0]), args[1]
        if command == "burst":
            asyncio.run(burst(backend, log, mode, key, n, tag))
        elif command == "fork":
            child = os.fork()
            if child == 0:  # pragma: no cover - the child
                try:
                    asyncio.run(burst(backend, log, mode, key, n, tag))
                finally:
                    os._exit(0)
            reap()
        else:
            raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
