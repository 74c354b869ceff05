"""(u) One uncontended turn of each shape, as a ratio to its yardstick (issue 45's targets).

    python -m bench.turns [--repeats 3] [--quick] [--before GIT_REF] [--no-threads]
                          [--json out.json]

Each shape takes n turns in a row, each on a key (or two) of its own, doing
nothing inside (a trivial function), in the loop a user would write, as
scenario (a) and (t1) do: ns per turn above a bare call of the same
function, timed with the garbage collector paused. Shapes are interleaved
(each repeat times all of them, in a rotated order) and every number is the
median of the repeats. Each shape's ratio is to the hand-written lock
measured in the same run: a dict of ``asyncio.Lock`` with a reference count
(bench/contenders.py) for tasks, of ``threading.Lock`` (bench/threads.py)
for threads, and for two keys the same lock taken for both, in order.
``keyed``, the decorator and a thread's ``with keyed`` are measured against
the floor of the one protocol instead (issue 45): the *named-call turn* of
``bench/floor.py``, a turn on a free key through the calls the protocol
makes, each doing only that, timed here in the same run, so a slower
interpreter's floor is seen, not hidden. Their targets are ratios to it;
``run``, two keys and the stepped shapes (``max_hold``, an observed queue,
``max_running`` with ``timeout``) keep theirs to the hand-written lock.
``run``, ``keyed`` and the decorator are timed again on
``KeyedQueue(pending="latest")`` (issue 32), each with its shape's target
on the default queue: the option's path is only taken while a key is busy.

With ``--before GIT_REF``, inturn's shapes are also timed on the inturn of
that revision, in the same repeats; a shape that revision lacks is left out.
Part of ``python -m bench``; the targets are printed with the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python bench/turns.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from . import contenders, floor, scenarios, threads
from .contenders import SLOTS, HandwrittenKeyedLock, InturnDecorator, InturnKeyed, InturnRun, work
from .targets import Target, at_most, evaluate, ratio, valid

ROW = "(u) ns/turn above bare, one uncontended turn"
TITLE = "(u) one uncontended turn of each shape, in process"
#: The queues' max_hold and timeout: never reached, only paid for.
LIMIT = 60.0


class Sizes:
    def __init__(self, quick: bool) -> None:
        self.turns = 5_000 if quick else 100_000


# -- the shapes that bench/contenders.py and bench/threads.py do not time ---------


async def run_two(locks: HandwrittenKeyedLock, a: Hashable, b: Hashable, fn: Any) -> Any:
    """The hand-written lock, holding two keys: one order for every caller, so no deadlock."""
    first, second = sorted((a, b))
    return await locks.run(first, partial(locks.run, second, fn))


class HandwrittenPair(contenders.Handwritten):
    name = "handwritten 2 keys"

    async def sequential(self, n: int) -> None:
        locks = self.locks
        for i in range(n):
            await run_two(locks, 2 * i, 2 * i + 1, work)


class InturnKeyedPair(InturnKeyed):
    name = "inturn.keyed 2 keys"

    async def sequential(self, n: int) -> None:
        keyed = self.queue.keyed
        for i in range(n):
            async with keyed(2 * i, 2 * i + 1):
                await work()


#: Issue 32's option: a key keeps at most one waiting work. Its path is only taken while
#: the key is busy, so an uncontended turn should cost what it costs on the default queue.
LATEST: dict[str, Any] = {"pending": "latest"}


class InturnRunLatest(InturnRun):
    name = "inturn.run pending=latest"
    options = LATEST


class InturnKeyedLatest(InturnKeyed):
    name = "inturn.keyed pending=latest"
    options = LATEST


class InturnDecoratorLatest(InturnDecorator):
    name = "@queue_by_key pending=latest"
    options = LATEST


class InturnMaxHold(InturnRun):
    name = "inturn.run max_hold"

    def reset(self) -> None:
        self.queue = self.module.KeyedQueue(max_hold=LIMIT)


class NoObserver:
    """An Observer (inturn.Observer) that does nothing: what observing itself costs."""

    def started(self, waited: float, function: str | None) -> None:
        pass

    def ended(self, held: float | None, error: object, cut: bool, function: str | None) -> None:
        pass

    def missed(self, error: object, function: str | None) -> None:
        pass


class InturnObserved(InturnRun):
    name = "inturn.run observed"

    def reset(self) -> None:
        super().reset()
        self.queue.observe(NoObserver())


class InturnSlotsTimeout(InturnRun):
    name = f"inturn.run max_running={SLOTS} timeout"

    def reset(self) -> None:
        self.queue = self.module.KeyedQueue(max_running=SLOTS, timeout=LIMIT)


def run_two_sync(locks: threads.HandwrittenKeyedLock, a: Hashable, b: Hashable, fn: Any) -> Any:
    """run_two, for threads."""
    first, second = sorted((a, b))
    return locks.run(first, partial(locks.run, second, fn))


class ThreadBare(threads.Bare):
    name = "thread bare"


class ThreadHandwritten(threads.Handwritten):
    name = "thread handwritten"


class ThreadHandwrittenPair(threads.Handwritten):
    name = "thread handwritten 2 keys"

    def sequential(self, n: int) -> None:
        locks = self.locks
        for i in range(n):
            run_two_sync(locks, 2 * i, 2 * i + 1, threads.work)


class ThreadKeyed(threads.InturnKeyed):
    name = "thread inturn keyed"


class ThreadKeyedPair(threads.InturnKeyed):
    name = "thread inturn keyed 2 keys"

    def sequential(self, n: int) -> None:
        keyed = self.queue.keyed
        for i in range(n):
            with keyed(2 * i, 2 * i + 1):
                threads.work()


class ThreadNamedFloor(threads.ThreadContender):
    """bench/floor.py's named-call turn as a thread takes it: each registry call under a lock."""

    name = "thread floor: named calls, locked"

    def reset(self) -> None:
        self.queue = floor.NamedLockedQueue()

    def sequential(self, n: int) -> None:
        keyed = self.queue.keyed
        for i in range(n):
            with keyed(i):
                threads.work()


class NamedFloor(contenders.Contender):
    """bench/floor.py's named-call turn: what a turn through the one protocol's calls costs."""

    name = "floor: named calls"

    def reset(self) -> None:
        self.queue = floor._NamedQueue()

    async def sequential(self, n: int) -> None:
        keyed = self.queue.keyed
        for i in range(n):
            async with keyed(i):
                await work()


# -- the table of shapes ----------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    kind: type[Any]  # its contender: a Contender (tasks) or a ThreadContender
    text: str  # how the table names it
    baseline: str = ""  # the yardstick it is a ratio to; "": it is one (an inturn shape's not)
    limit: float | None = None  # its target, as that ratio

    @property
    def thread(self) -> bool:
        return issubclass(self.kind, threads.ThreadContender)


HANDWRITTEN, PAIR = contenders.Handwritten.name, HandwrittenPair.name
THREAD_HANDWRITTEN, THREAD_PAIR = ThreadHandwritten.name, ThreadHandwrittenPair.name
NAMED = NamedFloor.name
#: Issue 45: a turn that needs no setting, at most this much the named-call floor;
#: a stepped shape (a setting that the protocol's steps check), the hand-written lock.
ON_THE_FLOOR, STEPPED = 1.3, 3.0
SHAPES = (
    Shape(contenders.Handwritten, "hand-written dict of asyncio.Lock, `locks.run(key, fn)`"),
    Shape(NamedFloor, "floor: a free key's turn through the protocol's named calls"),
    Shape(InturnRun, "`q.run(key, fn)`", HANDWRITTEN, 0.6),
    Shape(InturnKeyed, "`async with q.keyed(key)`", NAMED, ON_THE_FLOOR),
    Shape(InturnDecorator, "`@queue_by_key` async function", NAMED, ON_THE_FLOOR),
    # issue 32: each at its own shape's target, on the default queue
    Shape(InturnRunLatest, '`q.run` on `KeyedQueue(pending="latest")`', HANDWRITTEN, 0.6),
    Shape(
        InturnKeyedLatest,
        '`async with q.keyed(key)` on `KeyedQueue(pending="latest")`',
        NAMED,
        ON_THE_FLOOR,
    ),
    Shape(
        InturnDecoratorLatest,
        '`@queue_by_key` async function on `KeyedQueue(pending="latest")`',
        NAMED,
        ON_THE_FLOOR,
    ),
    Shape(InturnMaxHold, f"`q.run` on `KeyedQueue(max_hold={LIMIT:g})`", HANDWRITTEN, STEPPED),
    Shape(InturnObserved, "`q.run` on a queue observed (no-op observer)", HANDWRITTEN, STEPPED),
    Shape(
        InturnSlotsTimeout,
        f"`q.run` on `KeyedQueue(max_running={SLOTS}, timeout={LIMIT:g})`",
        HANDWRITTEN,
        STEPPED,
    ),
    Shape(HandwrittenPair, "hand-written, two keys in order"),
    Shape(InturnKeyedPair, "`async with q.keyed(a, b)`", PAIR, 2.5),
    Shape(ThreadHandwritten, "thread: hand-written dict of threading.Lock, `locks.run(key, fn)`"),
    Shape(
        ThreadNamedFloor,
        "thread floor: the same named calls, the registry's under the lines' lock",
        NAMED,
    ),
    Shape(ThreadKeyed, "thread: `with q.keyed(key)`", NAMED, ON_THE_FLOOR),
    Shape(ThreadHandwrittenPair, "thread: hand-written, two keys in order"),
    Shape(ThreadKeyedPair, "thread: `with q.keyed(a, b)`", THREAD_PAIR, 2.5),
)
FLOOR, THREAD_FLOOR = contenders.Bare.name, ThreadBare.name


def kinds(before: str | None = None, *, with_threads: bool = True) -> list[type[Any]]:
    """The contenders to time: the floors, every shape, and inturn's again at ``before``."""
    shapes = [shape for shape in SHAPES if with_threads or not shape.thread]
    chosen = [contenders.Bare, *([ThreadBare] if with_threads else []), *(s.kind for s in shapes)]
    if before:
        chosen += contenders.at_version(before, [s.kind for s in shapes if s.baseline])
    return chosen


def target_table() -> list[Target]:
    """Issue 45's targets: each inturn shape's ratio to its yardstick (see the docstring)."""
    return [
        at_most(ROW, shape.kind.name, shape.limit, shape.baseline)
        for shape in SHAPES
        if shape.limit is not None
    ]


# -- measuring --------------------------------------------------------------------


def _time(contender: Any, n: int) -> float:
    """ns per turn of n uncontended turns: (a)'s timing for tasks, (t1)'s for threads."""
    if isinstance(contender, threads.ThreadContender):
        return threads.sequential(contender, n)
    return asyncio.run(scenarios.sequential(contender, n))


def measure(
    sizes: Sizes, repeats: int, log: Callable[[str], None], kinds: Sequence[type[Any]]
) -> dict[str, float]:
    """Median ns per turn of each contender (floors included), interleaved over repeats.

    One untimed turn of each first; a ``--before`` shape that its revision
    cannot take is left out then.
    """
    chosen = []
    for contender in (cls() for cls in kinds):
        try:
            _time(contender, 1)
        except (AttributeError, TypeError) as error:
            if "@" not in contender.name:
                raise
            log(f"(u) {contender.name}: left out, that revision cannot take it ({error})")
        else:
            chosen.append(contender)
    samples: dict[str, list[float]] = defaultdict(list)
    for repeat in range(repeats):
        log(f"(u) repeat {repeat + 1}/{repeats}")
        for contender in threads._rotated(chosen, repeat):
            samples[contender.name].append(_time(contender, sizes.turns))
    return {name: statistics.median(values) for name, values in samples.items()}


def derive(medians: dict[str, float]) -> dict[str, dict[str, float]]:
    """The reported row: each contender's ns per turn above its floor (tasks', threads')."""

    def floor(name: str) -> float:
        return medians[THREAD_FLOOR if name.startswith("thread ") else FLOOR]

    return {
        ROW: {
            name: value - floor(name)
            for name, value in medians.items()
            if name not in (FLOOR, THREAD_FLOOR)
        }
    }


def _short(baseline: str) -> str:
    """How the table names a yardstick."""
    return "floor" if baseline == NAMED else "hand-written"


def _ratio_text(value: float) -> str:
    return f"{value:.2f}x" if valid(value) else "-"


def table(rows: dict[str, dict[str, float]], before: str | None = None) -> str:
    """One Markdown table: a line per shape measured, its ratio to its hand-written lock."""
    values = rows[ROW]
    heads = ["ns above bare", "ratio to its yardstick", "target"]
    if before:
        heads += [f"ratio at {before}", f"this / {before}"]
    lines = [f"| {TITLE} | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for shape in SHAPES:
        name = shape.kind.name
        if name not in values:
            continue
        # (a yardstick's ratio: the floor's to the hand-written lock, the others' 1.00x)
        base = values.get(shape.baseline or (HANDWRITTEN if shape.kind is NamedFloor else name))
        cells = [
            f"{values[name]:,.0f}",
            _ratio_text(ratio(values[name], base)),
            "-" if shape.limit is None else f"<= {shape.limit:g}x {_short(shape.baseline)}",
        ]
        if before:
            earlier = values.get(f"{name}@{before}") if shape.baseline else None
            cells += [_ratio_text(ratio(earlier, base)), _ratio_text(ratio(values[name], earlier))]
        lines.append(f"| {shape.text} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from .run import machine

    parser = argparse.ArgumentParser(
        prog="python -m bench.turns", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per shape (median)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument(
        "--threads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the thread shapes",
    )
    parser.add_argument(
        "--before",
        metavar="GIT_REF",
        default=None,
        help="also time inturn's shapes as they were at this git revision, in the same run",
    )
    parser.add_argument("--json", type=Path, default=None, help="write medians and rows here")
    options = parser.parse_args(argv)
    sizes = Sizes(options.quick)

    def log(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    medians = measure(
        sizes, options.repeats, log, kinds(options.before, with_threads=options.threads)
    )
    rows = derive(medians)
    print(f"## {TITLE}: {machine()}, median of {options.repeats}\n")
    print(table(rows, options.before))
    print("\nTargets (issue 45; SKIP: not measured in this run):\n")
    for verdict, label, value in (evaluate(t, rows, list(medians)) for t in target_table()):
        print(f"- {verdict} {label}: {value}")
    log(f"(u) done in {time.perf_counter() - started:.0f} s")
    if options.json:
        options.json.write_text(json.dumps({"medians": medians, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
