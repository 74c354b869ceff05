"""The benchmark's file-fifo-floor is a lock: the yardstick of (s1) excludes and keeps order.

Real processes (fork), one key: each adds to a counter in a file under the
floor's turn; a lost update would show the floor lets two hold at once. The
order test lines the processes up with pipes, not sleeps: each draws its
ticket while the first holds.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
from bench.mp_contenders import FileFifoFloor, Run

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes: POSIX only")

FORK = multiprocessing.get_context("fork")


def _add(workdir: str, turns: int) -> None:
    floor = FileFifoFloor()
    floor.setup(Run(Path(workdir)))
    counter = Path(workdir) / "counter"
    for _ in range(turns):
        with floor.hold("k"):
            counter.write_text(str(int(counter.read_text()) + 1))
    floor.teardown()


def test_no_update_is_lost_under_the_file_fifo_floor(tmp_path: Path) -> None:
    (tmp_path / "counter").write_text("0")
    workers = [FORK.Process(target=_add, args=(str(tmp_path), 300)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert (tmp_path / "counter").read_text() == "1200"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["counter", "k.floor"]


def _queue_up(workdir: str, name: str, queued: int, log: str) -> None:
    floor = FileFifoFloor()
    floor.setup(Run(Path(workdir)))
    os.close(queued)  # (the parent reads its end: this one is queued once it is closed)
    with floor.hold("k"), open(log, "a") as file:
        file.write(name + "\n")
    floor.teardown()


def test_the_file_fifo_floor_serves_in_the_order_of_the_tickets(tmp_path: Path) -> None:
    log = str(tmp_path / "log")
    floor = FileFifoFloor()
    floor.setup(Run(tmp_path))
    workers = []
    with floor.hold("k"):
        for name in "abc":
            read, write = os.pipe()
            worker = FORK.Process(target=_queue_up, args=(str(tmp_path), name, write, log))
            worker.start()
            os.close(write)
            assert os.read(read, 1) == b""  # its end closed: it is about to draw its ticket
            os.close(read)
            deadline = time.monotonic() + 60
            while not (tmp_path / f"k.floor.{len(workers) + 1}").exists():
                assert time.monotonic() < deadline, f"{name} drew no ticket in 60 s"
                os.sched_yield()  # (its pipe made: it drew ticket len(workers) + 1)
            workers.append(worker)
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    floor.teardown()
    assert Path(log).read_text() == "a\nb\nc\n"
