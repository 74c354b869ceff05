"""Latest wins across real processes (file backend): each process conflates its own burst.

A holder process keeps the key while two processes (a worker and this test's
own) each queue a burst on a ``pending="latest"`` queue; once it lets go, each
burst costs its process one run: the first of the burst, which went on to
wait at the backend, runs the latest work instead of its own; never overlapping.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from inturn import KeyedQueue
from inturn.backends.file import FileBackend

from support.file_checks import spec
from support.helpers import settle
from support.processes import Worker

BURST = 20


async def test_each_process_runs_the_first_and_the_latest_of_its_burst(
    tmp_path: Path, workers: list[Worker]
) -> None:
    directory = tmp_path / "lines"
    log = tmp_path / "log"
    holder = await Worker.start(spec(directory), "hold", "k", name="holder")
    workers.append(holder)
    await holder.expect("holding")
    burster = await Worker.start(
        spec(directory), "latest-burst", "k", str(log), str(BURST), name="burster"
    )
    workers.append(burster)
    queue = KeyedQueue(backend=FileBackend(directory), pending="latest")

    async def work(i: int) -> int:
        with log.open("a") as file:
            file.write(f"{os.getpid()} start {i}\n")
        await asyncio.sleep(0.001)
        with log.open("a") as file:
            file.write(f"{os.getpid()} end {i}\n")
        return i

    try:
        calls = [asyncio.create_task(queue.run("k", work, i)) for i in range(BURST)]
        await settle(lambda: queue.pending("k") == BURST - 1)
        await burster.expect("queued")
        await holder.go()
        await holder.expect("released")
        answers = await asyncio.gather(*calls)
        theirs = await burster.expect("answered")
    finally:
        await queue.aclose()
    last = BURST - 1
    assert answers == [last] * BURST  # every caller: the latest's outcome
    assert theirs == [str(last)] * BURST
    lines = [line.split() for line in log.read_text().splitlines()]
    runs = {
        pid: [int(i) for p, what, i in lines if p == pid and what == "start"] for pid, *_ in lines
    }
    # one run per process: the first of the burst, waiting at the backend, ran the latest
    assert runs == {str(os.getpid()): [last], str(burster.pid): [last]}
    for start, end in zip(lines[::2], lines[1::2], strict=True):  # one at a time across processes
        assert start[1:] == ["start", start[2]]
        assert end == [start[0], "end", start[2]]
    assert await burster.finish() == 0
    assert await holder.finish() == 0
