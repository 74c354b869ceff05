"""Drive real worker processes (tests/support/worker.py) step by step from a test."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from .helpers import PATIENCE

WORKER = Path(__file__).with_name("worker.py")


class Worker:
    """One worker process; its reports are read line by line."""

    def __init__(self, process: asyncio.subprocess.Process, name: str) -> None:
        self.process = process
        self.name = name

    @classmethod
    async def start(
        cls, backend: str, *command: str, name: str = "", script: Path = WORKER
    ) -> Worker:
        """Start script (worker.py by default) with backend and command as its arguments."""
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            backend,
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(process, name or " ".join(command))

    @property
    def pid(self) -> int:
        return self.process.pid

    async def report(self) -> list[str]:
        """The worker's next report, split into words."""
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), PATIENCE)
        if not line:
            code = await self.process.wait()
            raise AssertionError(f"worker {self.name} ended (exit {code}) instead of reporting")
        return line.decode().split()

    async def expect(self, word: str) -> list[str]:
        """Wait for the next report and check it is ``word ...``; return its other words."""
        words = await self.report()
        assert words[0] == word, f"worker {self.name} said {words}, expected {word!r}"
        return words[1:]

    async def go(self) -> None:
        """Let the worker past its wait for a stdin line."""
        await self.send("go")

    async def send(self, line: str) -> None:
        """Write line to the worker's stdin."""
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()

    async def release(self) -> None:
        """Let a worker that holds its key go on, and wait until it has released it."""
        await self.go()
        await self.expect("released")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # dead already, and reaped

    async def finish(self) -> int:
        """Wait for the worker to exit; return its exit code."""
        return await asyncio.wait_for(self.process.wait(), PATIENCE)

    async def close(self) -> None:
        if self.process.returncode is None:
            self.kill()
            await self.process.wait()


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait until another process has made predicate true (checked every millisecond).

    For states that only another process can bring about and that give no
    signal: the wait ends on the state, not on a time; PATIENCE only bounds
    a hang.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PATIENCE
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"never reached: {what}")
        await asyncio.sleep(0.001)


def stopped(pid: int) -> bool:
    """Whether process pid is stopped (SIGSTOP): its state in /proc is T."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


async def first_to_hold(workers: list[Worker]) -> Worker:
    """Of workers that wait for one key, the one that reports holding it first."""
    reports = {asyncio.ensure_future(worker.expect("holding")): worker for worker in workers}
    done, pending = await asyncio.wait(reports, return_when=asyncio.FIRST_COMPLETED)
    for report in pending:
        report.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return reports[done.pop()]
