"""A storm of threads on latest work shared across processes, interrupted at random moments.

Three queues, each with a FileBackend of its own on one directory (processes, as
the backend sees them: see test_latest_across.py), with ``pending="latest",
across="processes"``. Threads of each call ``run_sync`` on a few keys, with
random timeouts, while :class:`storm.Thrown` is thrown into them at random
moments as they take their turns (``PyThreadState_SetAsyncExc``): the steps of
the file backend's latest turn (its post, its judging, its queueing again) are
where it lands. What must hold: no two works of a key ever run at once; every
caller ends (answered as documented, timed out, or interrupted); nobody hangs;
and at the end every key is free and the directory empty. The same storm runs over
plain turns too: they queue, release and tidy by the same steps (see _line.taking).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from inturn import KeyedQueue, Superseded
from inturn.backends.file import FileBackend

from support.file_checks import files
from support.helpers import PATIENCE
from support.storm import Interrupts, Thrown, seeds

pytestmark = [pytest.mark.storm, pytest.mark.usefixtures("collector_paused")]

KEYS = ("k0", "k1")
#: Calls per thread, threads per queue, queues.
CALLS, THREADS, QUEUES = 30, 3, 3
#: The turns a storm takes: latest work shared across processes, or plain ones.
TURNS: dict[str, dict[str, Any]] = {
    "latest": {"pending": "latest", "across": "processes"},
    "plain": {},
}


def tidied() -> None:
    """Wait for the tidies that releases left to threads of their own (see _tidy.retry_aside)."""
    for thread in threading.enumerate():
        if thread.name == "inturn-file-tidy":
            thread.join(PATIENCE)


@pytest.mark.parametrize("turns", TURNS)
@pytest.mark.parametrize("seed", seeds(5))
def test_interrupted_threads_of_three_processes_never_overlap_nor_hang(
    tmp_path: Path, seed: int, turns: str
) -> None:
    rng = random.Random(seed)
    directory = tmp_path / "lines"
    queues = [
        KeyedQueue(
            backend=FileBackend(directory),
            on_superseded=rng.choice(["join", "raise"]),
            **TURNS[turns],
        )
        for _ in range(QUEUES)
    ]
    interrupts = Interrupts(random.Random(rng.random()), gap=0.002)
    running: dict[str, int] = dict.fromkeys(KEYS, 0)
    guard = threading.Lock()
    problems: list[str] = []
    outcomes: dict[str, int] = {}

    def work(key: str) -> str:
        interrupts.hold()  # (the storm strikes while the turn is taken, never in the work)
        with guard:
            running[key] += 1
            if running[key] > 1:
                problems.append(f"two works of {key} at once")
        time.sleep(0.0005)  # (holds the key a moment: where a second one would overlap)
        with guard:
            running[key] -= 1
        return key

    def caller(queue: KeyedQueue, draw: random.Random) -> None:
        for _ in range(CALLS):
            key = draw.choice(KEYS)
            timed = queue.queue_by_key(key=key, timeout=draw.choice([None, 0.01, 0.1]))(work)
            try:
                interrupts.arm()
                try:
                    answer: Any = timed(key)
                finally:
                    interrupts.hold()
            except Thrown:
                answer = Thrown
            except (Superseded, TimeoutError) as error:
                answer = type(error)
            if answer not in (key, None, Thrown, Superseded, TimeoutError):
                problems.append(f"a caller of {key} got {answer!r}")
            with guard:
                name = getattr(answer, "__name__", "result")
                outcomes[name] = outcomes.get(name, 0) + 1

    threads = [
        threading.Thread(target=caller, args=(queue, random.Random(rng.random())))
        for queue in queues
        for _ in range(THREADS)
    ]
    with interrupts.running():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(PATIENCE)
    assert not [thread for thread in threads if thread.is_alive()], "a caller hung"
    assert problems == []
    assert sum(outcomes.values()) == CALLS * THREADS * QUEUES
    tidied()
    for key in KEYS:  # every key free at once, in every "process"
        for queue in queues:
            with queue.keyed(key, timeout=PATIENCE):
                pass
    tidied()
    left = {
        name: (directory / name).read_text() if name.endswith(".line") else "(a ticket)"
        for name in files(directory)
    }
    assert left == {}, "left behind"
