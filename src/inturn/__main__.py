"""The command line: ``python -m inturn demo``, ``python -m inturn inspect --redis URL``."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from . import BackendUnavailable, KeyedQueue

__all__ = ("main",)


async def _hammer(
    increment: Callable[[str], Awaitable[None]], counters: dict[str, int], tasks: int
) -> float:
    """Run `tasks` concurrent increments spread over the counters; return seconds taken."""
    names = list(counters)
    start = time.perf_counter()
    await asyncio.gather(*(increment(names[i % len(names)]) for i in range(tasks)))
    return time.perf_counter() - start


async def demo(tasks: int = 1000, keys: int = 4) -> tuple[dict[str, int], dict[str, int]]:
    """Increment counters with read-modify-write, without inturn and with it.

    Each increment reads a counter, waits a moment (the database round trip
    of a real read-modify-write) and writes the value it read plus one.
    Return the final counters: (without, with).
    """
    queue = KeyedQueue()

    async def read_modify_write(counters: dict[str, int], name: str) -> None:
        value = counters[name]  # read
        await asyncio.sleep(0)  # ... the round trip, where other tasks run ...
        counters[name] = value + 1  # write: lost if another task wrote meanwhile

    unsafe = dict.fromkeys((f"counter-{i}" for i in range(keys)), 0)
    safe = dict(unsafe)

    async def increment_unsafe(name: str) -> None:
        await read_modify_write(unsafe, name)

    @queue.queue_by_key(key="{name}")
    async def increment_safe(name: str) -> None:
        await read_modify_write(safe, name)

    expected = {name: tasks // keys + (i < tasks % keys) for i, name in enumerate(unsafe)}
    plural = "s" if keys != 1 else ""
    print(
        f"inturn demo: {tasks} concurrent read-modify-write increments over {keys} counter{plural}"
    )
    for label, increment, counters in (
        ("without inturn", increment_unsafe, unsafe),
        ("with inturn   ", increment_safe, safe),
    ):
        seconds = await _hammer(increment, counters, tasks)
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


def format_lines(lines: Sequence[Any], namespace: str) -> str:
    """Render RedisBackend.lines() for people: one block per key, holder then waiters."""
    if not lines:
        return f"namespace {namespace!r}: no active lines"
    out = [f"namespace {namespace!r}: {len(lines)} active line{'s' if len(lines) != 1 else ''}"]
    for line in lines:
        out.append(f"  {line.key}")
        if line.holder is None:
            out.append("    held by nobody (being handed over)")
        else:
            h = line.holder
            out.append(
                f"    held by {h.host} pid {h.pid} for {h.held_for:.1f} s, token {h.token}, "
                f"lease {h.lease_left:.1f} s left"
            )
        for place, w in enumerate(line.waiters, 1):
            out.append(
                f"    {place}. {w.host} pid {w.pid} waiting {w.waiting_for:.1f} s, "
                f"lease {w.lease_left:.1f} s left"
            )
    return "\n".join(out)


async def inspect_redis(url: str, namespace: str, watch: float | None) -> None:
    """Print the live lines of a namespace; with watch, again every watch seconds."""
    from .backends.redis import RedisBackend

    backend = RedisBackend.from_url(url, namespace=namespace)
    try:
        while True:
            report = format_lines(await backend.lines(), namespace)
            if watch is None:
                print(report)
                return
            print("\033[2J\033[H" + time.strftime("%H:%M:%S ") + report, flush=True)
            await asyncio.sleep(watch)
    finally:
        await backend.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inturn", description="inturn's command line")
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="show lost updates without inturn, none with it")
    run_demo.add_argument("--tasks", type=int, default=1000, help="increments (default 1000)")
    run_demo.add_argument("--keys", type=int, default=4, help="counters (default 4)")
    inspect = commands.add_parser(
        "inspect", help="show who holds and who waits for each key of a Redis namespace"
    )
    inspect.add_argument("--redis", required=True, metavar="URL", help="redis://host:port/db")
    inspect.add_argument("--namespace", default="inturn", help="the backend's namespace")
    inspect.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=1.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 1) until interrupted",
    )
    options = parser.parse_args(argv)
    if options.command == "inspect":
        try:
            asyncio.run(inspect_redis(options.redis, options.namespace, options.watch))
        except KeyboardInterrupt:
            pass
        except BackendUnavailable as error:
            parser.exit(1, f"{error}\n")
        return 0
    if options.tasks < 1 or options.keys < 1:
        parser.error("--tasks and --keys must be at least 1")
    asyncio.run(demo(options.tasks, options.keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
