"""The command line: ``python -m inturn demo``, ``inspect`` (Redis, PostgreSQL, a directory),
``--version``.

::

    python -m inturn --version
    python -m inturn demo
    python -m inturn inspect --redis URL [--namespace NAME] [--watch] [--json]
    python -m inturn inspect --postgres URL [--namespace NAME] [--watch] [--json]
    python -m inturn inspect --dir PATH [--watch] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from . import BackendUnavailable, KeyedQueue, __version__
from ._describe import describe
from .backends import LineInfo

__all__ = ("main",)


async def demo(tasks: int = 1000, keys: int = 4) -> tuple[dict[str, int], dict[str, int]]:
    """Increment counters with read-modify-write, without inturn and with it.

    Return the final counters: (without, with).
    """
    queue = KeyedQueue()

    async def read_modify_write(counters: dict[str, int], name: str) -> None:
        value = counters[name]  # read
        await asyncio.sleep(0)  # ... the database's round trip, where other tasks run ...
        counters[name] = value + 1  # write: lost if another task wrote meanwhile

    names = [f"counter-{i}" for i in range(keys)]
    unsafe = dict.fromkeys(names, 0)
    safe = dict(unsafe)
    expected = {name: tasks // keys + (i < tasks % keys) for i, name in enumerate(unsafe)}
    plural = "s" if keys != 1 else ""
    print(
        f"inturn demo: {tasks} concurrent read-modify-write increments over {keys} counter{plural}"
    )
    for label, increment, counters in (
        ("without inturn", read_modify_write, unsafe),
        ("with inturn   ", queue.queue_by_key(key="{name}")(read_modify_write), safe),
    ):
        start = time.perf_counter()
        await asyncio.gather(*(increment(counters, names[i % keys]) for i in range(tasks)))
        seconds = time.perf_counter() - start
        total = sum(counters.values())
        print(
            f"  {label}: {total:>6} counted, {tasks - total:>6} updates lost, "
            f"in {seconds * 1000:7.1f} ms"
        )
    if safe != expected:  # pragma: no cover - the guarantee the demo shows
        raise RuntimeError(f"inturn lost an update: {safe} != {expected}")
    print(
        "  each counter's increments ran one at a time, in arrival order; the counters in parallel"
    )
    return unsafe, safe


def show_key(key: str | bytes | int) -> str:
    """A key as describe() writes it, at most 120 characters: "1", b"1" and 1 never look alike."""
    return describe(key, 120)


def _who(host: str | None, pid: int, server_pid: int | None) -> str:
    who = f"pid {pid or '?'}" if host is None else f"{host} pid {pid or '?'}"
    return who if server_pid is None else f"{who} (server pid {server_pid})"


def _lease(left: float | None) -> str:
    return "" if left is None else f", lease {left:.1f} s left"


def _latest(called: float | None) -> str:
    return "" if called is None else f", latest work called {called:.1f} s ago"


def format_lines(
    lines: Sequence[LineInfo], where: str, elsewhere: Sequence[str] | None = None
) -> str:
    """Render a backend's ``lines()`` for people: one block per key, holder then waiters.

    where names the place of the lines (``namespace 'shop'``); elsewhere, with
    no lines, the other places that have some (Redis's and PostgreSQL's
    namespaces). A host, token or lease is shown where the backend knows it
    (Redis), a server's process id too (PostgreSQL), a process id it does not
    know as ``?``, and when a process's latest work was called, where it
    waits as such (``across="processes"``: the file backend).
    """
    if not lines:
        if elsewhere is None:
            return f"{where}: no active lines"
        others = ", ".join(map(repr, elsewhere)) if elsewhere else "none"
        return f"{where}: no active lines; namespaces with lines: {others}"
    out = [f"{where}: {len(lines)} active line{'s' if len(lines) != 1 else ''}"]
    for line in lines:
        out.append(f"  {show_key(line.key)}")
        if line.holder is None:
            out.append("    held by nobody (being handed over)")
        else:
            h = line.holder
            token = "" if h.token is None else f", token {h.token}"
            out.append(
                f"    held by {_who(h.host, h.pid, h.server_pid)} for {h.held_for:.1f} s{token}"
                f"{_lease(h.lease_left)}{_latest(h.latest_called)}"
            )
        for place, w in enumerate(line.waiters, 1):
            out.append(
                f"    {place}. {_who(w.host, w.pid, w.server_pid)} waiting {w.waiting_for:.1f} s"
                f"{_lease(w.lease_left)}{_latest(w.latest_called)}"
            )
    return "\n".join(out)


class _Lines(Protocol):
    """A backend that can show its lines (RedisBackend, PostgresBackend, FileBackend)."""

    async def lines(self) -> list[LineInfo]: ...

    async def aclose(self) -> None: ...


def json_lines(
    lines: Sequence[LineInfo], where: str, elsewhere: Sequence[str] | None = None
) -> str:
    """Render a backend's ``lines()`` for scripts: one JSON object, keys shown as by show_key.

    ``{"where": ..., "lines": [{"key": ..., "holder": {...} or null, "waiters":
    [...]}]}``, holders and waiters as ``HolderInfo`` and ``WaiterInfo``; with
    no lines on Redis or PostgreSQL, ``"namespaces_with_lines"`` too.
    """
    extra = {} if elsewhere is None else {"namespaces_with_lines": list(elsewhere)}
    return json.dumps(
        {
            "where": where,
            **extra,
            "lines": [
                {
                    "key": show_key(line.key),
                    "holder": None if line.holder is None else dataclasses.asdict(line.holder),
                    "waiters": [dataclasses.asdict(waiter) for waiter in line.waiters],
                }
                for line in lines
            ],
        }
    )


async def inspect_lines(
    backend: _Lines,
    where: str,
    watch: float | None,
    as_json: bool = False,
    namespaces: Callable[[], Awaitable[list[str]]] | None = None,
) -> None:
    """Print the live lines of backend (as JSON with as_json); with watch, every watch seconds.

    namespaces: where else lines are, to name when there are none here (Redis, PostgreSQL).
    """
    render = json_lines if as_json else format_lines
    try:
        while True:
            lines = await backend.lines()
            elsewhere = await namespaces() if namespaces is not None and not lines else None
            report = render(lines, where, elsewhere)
            if watch is None:
                print(report)
                return
            # JSON: one object per line; for people: a cleared screen, and the time
            head = "" if as_json else "\033[2J\033[H" + time.strftime("%H:%M:%S ")
            print(head + report, flush=True)
            await asyncio.sleep(watch)
    finally:
        await backend.aclose()


def _open_lines(
    options: argparse.Namespace,
) -> tuple[_Lines, str, Callable[[], Awaitable[list[str]]] | None]:
    """Open what inspect looks at: (backend, where its lines are, other places with lines)."""
    if options.redis is not None:
        from .backends.redis import RedisBackend  # (ImportError without redis-py: see main)

        namespace = options.namespace or "inturn"
        # (a wrong URL: from_url's ValueError says what is wrong and how a right one looks)
        redis = RedisBackend.from_url(options.redis, namespace=namespace)
        return redis, f"namespace {describe(namespace)}", redis.namespaces
    if options.postgres is not None:
        from .backends.postgres import PostgresBackend  # (ImportError without psycopg)

        namespace = options.namespace or "inturn"
        postgres = PostgresBackend.from_url(options.postgres, namespace=namespace)
        return postgres, f"namespace {describe(namespace)}", postgres.namespaces
    from .backends.file import FileBackend

    if not os.path.isdir(options.dir):
        raise FileNotFoundError(f"inturn: there is no directory {options.dir}")
    backend = FileBackend(options.dir)
    return backend, f"directory {str(backend.directory)!r}", None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inturn", description="inturn's command line")
    parser.add_argument("--version", action="version", version=f"inturn {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="show lost updates without inturn, none with it")
    run_demo.add_argument("--tasks", type=int, default=1000, help="increments (default 1000)")
    run_demo.add_argument("--keys", type=int, default=4, help="counters (default 4)")
    inspect = commands.add_parser(
        "inspect",
        help="show who holds and who waits for each key: in a Redis or PostgreSQL "
        "namespace, or in a file backend's directory",
    )
    where = inspect.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--redis", metavar="URL", help="a Redis backend's server: redis://host:port/db"
    )
    where.add_argument(
        "--postgres",
        metavar="URL",
        help="a PostgreSQL backend's database: postgresql://user@host:5432/dbname",
    )
    where.add_argument("--dir", metavar="PATH", help="a file backend's directory, as given to it")
    inspect.add_argument(
        "--namespace", help="the Redis or PostgreSQL backend's namespace (default: inturn)"
    )
    inspect.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=1.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 1) until interrupted",
    )
    inspect.add_argument(
        "--json", action="store_true", help="one JSON object per report, for scripts"
    )
    options = parser.parse_args(argv)
    if options.command == "inspect":
        if options.dir is not None and options.namespace is not None:
            parser.error("--namespace goes with --redis or --postgres")
        try:
            backend, place, others = _open_lines(options)
            asyncio.run(inspect_lines(backend, place, options.watch, options.json, others))
        except KeyboardInterrupt:
            pass
        except (BackendUnavailable, OSError, ImportError, ValueError) as error:
            # a user's mistake or a missing piece: said in a sentence, never a traceback
            parser.exit(1, f"{error}\n")
        return 0
    if options.tasks < 1 or options.keys < 1:
        parser.error("--tasks and --keys must be at least 1")
    asyncio.run(demo(options.tasks, options.keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
