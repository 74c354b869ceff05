"""One worker process of the multi-process benchmark: ``python -m bench.mp_worker CONFIG``.

CONFIG is a JSON object: ``contender`` (a name in bench/mp_contenders.py,
or ``name@REF`` with ``package`` and ``package_path``: inturn at git REF),
``workdir`` (the run's shared directory), ``redis_url`` (the Redis server,
null outside the Redis scenarios), ``postgres_url`` (the PostgreSQL server,
null outside the PostgreSQL scenarios), ``tag`` (unique to the run), ``key``
and ``outside`` (seconds of work between two turns, 0 for none).

The conversation with the parent (bench/multiproc.py), over stdin/stdout:

1. the worker sets its contender up, takes and releases the lock once on a
   key of its own (so that imports and first-use costs fall outside the
   measurement), and prints ``ready``; if either raised, it prints
   ``unavailable:`` and the error on one line instead, and exits;
2. it waits for one line on stdin: the deadline, in ``time.monotonic_ns()``
   (CLOCK_MONOTONIC is one clock for every process of a Linux host);
3. until the deadline it loops: note the arrival time, take the lock, note
   the grant time, run the critical section, note the release time,
   release; then the work outside the lock, if any;
4. it prints ``finished`` and waits for one more line on stdin, which the
   parent sends once every worker has finished: so no worker's teardown
   (closing its client, interpreter exit) takes CPU from the last turns of
   the others;
5. it tears its contender down and prints one JSON line of its records:
   ``arrivals``, ``grants`` and ``releases``, one entry per turn, in
   nanoseconds, and ``cpu_ns``: the process's CPU time over its turns.

The critical section is a read-modify-write of a decimal counter in the
file ``counter`` of the workdir (read it, write it back plus one), with
nothing in between that would make the update atomic: if two workers ever
overlap, an update is lost, and the counter ends below the number of turns.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .mp_contenders import AsyncContender, Run, SyncContender, contender

#: Digits of the counter: fixed, so that every write covers the previous one.
WIDTH = 20
#: What a worker says instead of ``ready`` when its set-up or first turn raised.
UNAVAILABLE = "unavailable:"

Records = dict[str, list[int]]


def open_counter(workdir: Path) -> int:
    """The run's shared counter file, opened for reading and writing."""
    return os.open(workdir / "counter", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def read_counter(workdir: Path) -> int:
    """The counter's value: the number of turns that were not lost."""
    text = (workdir / "counter").read_bytes()
    return int(text) if text else 0


def critical_section(fd: int) -> None:
    """Read the counter, write it back plus one: a lost update if two workers overlap."""
    value = int(os.pread(fd, WIDTH, 0) or b"0")
    os.pwrite(fd, b"%0*d" % (WIDTH, value + 1), 0)


def run_of(config: dict[str, Any]) -> Run:
    """What the workers of this run share, from the config."""
    return Run(
        Path(config["workdir"]),
        config.get("redis_url"),
        config.get("tag", "run"),
        config.get("package", "inturn"),
        config.get("postgres_url"),
    )


def warm_up_key(key: str) -> str:
    """A key of this worker's own, for the op before the measurement."""
    return f"{key}-warm-up-{os.getpid()}"


class SetupFailed(Exception):
    """The contender's set-up or its first turn raised: it cannot run here."""


def ready_or_not(error: BaseException) -> SetupFailed:
    """Tell the parent this worker cannot run its contender, and why; the error to raise."""
    why = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    print(f"{UNAVAILABLE} {why}", flush=True)
    return SetupFailed(why)


def wait_for_go() -> int:
    """Tell the parent this worker is ready; return the deadline it answers with."""
    print("ready", flush=True)
    return int(sys.stdin.readline())


def wait_for_all() -> None:
    """Tell the parent this worker is done measuring; return once every worker is."""
    print("finished", flush=True)
    sys.stdin.readline()


def run_sync(contender: SyncContender, config: dict[str, Any], go: Callable[[], int]) -> Records:
    """The worker's whole life with a sync contender; its records."""
    run = run_of(config)
    key: str = config["key"]
    outside: float = config["outside"]
    try:
        contender.setup(run)
    except Exception as error:
        raise ready_or_not(error) from error
    try:
        try:
            with contender.hold(warm_up_key(key)):
                pass
        except Exception as error:
            raise ready_or_not(error) from error
        fd = open_counter(run.workdir)
        arrivals: list[int] = []
        grants: list[int] = []
        releases: list[int] = []
        now, hold, sleep = time.monotonic_ns, contender.hold, time.sleep
        deadline = go()
        cpu = time.process_time_ns()
        while (arrival := now()) < deadline:
            with hold(key):
                grant = now()
                critical_section(fd)
                release = now()
            arrivals.append(arrival)
            grants.append(grant)
            releases.append(release)
            if outside:
                sleep(outside)
        cpu = time.process_time_ns() - cpu
        os.close(fd)
        wait_for_all()
    finally:
        contender.teardown()
    return {"arrivals": arrivals, "grants": grants, "releases": releases, "cpu_ns": [cpu]}


async def run_async(
    contender: AsyncContender, config: dict[str, Any], go: Callable[[], int]
) -> Records:
    """The worker's whole life with an async contender, in its event loop; its records."""
    run = run_of(config)
    key: str = config["key"]
    outside: float = config["outside"]
    try:
        await contender.setup(run)
    except Exception as error:
        raise ready_or_not(error) from error
    try:
        try:
            async with contender.hold(warm_up_key(key)):
                pass
        except Exception as error:
            raise ready_or_not(error) from error
        fd = open_counter(run.workdir)
        arrivals: list[int] = []
        grants: list[int] = []
        releases: list[int] = []
        now, hold, sleep = time.monotonic_ns, contender.hold, asyncio.sleep
        deadline = go()  # blocks the loop, which has nothing else to do yet
        cpu = time.process_time_ns()
        while (arrival := now()) < deadline:
            async with hold(key):
                grant = now()
                critical_section(fd)
                release = now()
            arrivals.append(arrival)
            grants.append(grant)
            releases.append(release)
            if outside:
                await sleep(outside)
        cpu = time.process_time_ns() - cpu
        os.close(fd)
        wait_for_all()  # blocks the loop: nothing of this worker's is in line any more
    finally:
        await contender.teardown()
    return {"arrivals": arrivals, "grants": grants, "releases": releases, "cpu_ns": [cpu]}


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    if "package_path" in config:  # an earlier revision of inturn (--before)
        sys.path.insert(0, config["package_path"])
    chosen = contender(config["contender"])
    try:
        if isinstance(chosen, AsyncContender):
            records = asyncio.run(run_async(chosen, config, wait_for_go))
        elif isinstance(chosen, SyncContender):
            records = run_sync(chosen, config, wait_for_go)
        else:
            raise TypeError(f"{chosen!r} is neither a SyncContender nor an AsyncContender")
    except SetupFailed:
        return 3  # the parent has the reason already
    print(json.dumps(records), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
