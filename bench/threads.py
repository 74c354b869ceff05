"""(t) Sync turns from threads, in one process: inturn beside a hand-written dict of threading.Lock.

    python -m bench.threads [--repeats 3] [--quick] [--threads 4] [--seconds 1.0]
                            [--json out.json]

No event loop anywhere: plain threads, taking keys with blocking calls.

- (t1) uncontended: one thread, n turns in a row, each on a key of its
  own (so each turn also creates and drops its key's bookkeeping), doing
  nothing inside; ns per turn above a bare call of the same function.
- (t2) hand-off: T threads (4 by default) take one key again and again for
  a fixed wall time, nothing outside the turn; ns per turn (the wall time
  over every thread's turns) and, as in bench/multiproc.py, from each
  turn's arrival, grant and release (bench/mp_metrics.py): the median
  hand-off, the share of grants in arrival order, fairness between the
  threads and the longest wait.

Contenders:

- ``handwritten``, the baseline: what a careful user writes, a dict of
  ``threading.Lock`` with a reference count behind one guard lock, deleting
  a key's lock once nobody holds or waits for it, used as ``run(key, fn)``;
- ``handwritten with``: the same dict, used as ``with locks.hold(key):``,
  written with ``@contextmanager`` as most users would;
- ``defaultdict(Lock)``: ``with locks[key]:``, which never forgets a key;
- ``inturn keyed``: ``with queue.keyed(key):`` on ``KeyedQueue()``;
- ``inturn run_sync``: ``queue.run_sync(key, fn)`` on ``KeyedQueue()``.

A ``threading.Lock`` promises no order: the thread that releases it
usually takes it straight back (it holds the GIL), so its hand-off rows
measure a lock that is rarely handed off at all. inturn hands the key to
the thread that asked first, which costs a switch of threads (and of the
GIL) every turn. The arrival order and fairness rows show the difference.

Contenders are interleaved (each repeat runs all of them, in a rotated
order) and every number is the median of the repeats; timed sections run
with the garbage collector paused. A run in which two turns on one key
overlapped raises :class:`~bench.scenarios.Verification`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: python bench/threads.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

import inturn

from .mp_metrics import measure_run
from .scenarios import Verification
from .targets import ratio, valid

BASELINE = "handwritten"
FLOOR = "bare"
#: The one key of (t2).
KEY = "k"


class Sizes:
    def __init__(self, quick: bool, threads: int = 4, seconds: float | None = None) -> None:
        self.turns = 10_000 if quick else 200_000  # (t1)
        self.threads = threads  # (t2)
        self.seconds = seconds if seconds is not None else (0.25 if quick else 1.0)  # (t2)


def work() -> int:
    """The work inside every turn: nothing, so that only the lock's cost shows."""
    return 1


# -- the contenders ---------------------------------------------------------------


class HandwrittenKeyedLock:
    """What a careful user writes by hand for threads: a dict of threading.Lock
    with a reference count, behind one guard lock, deleting a key's lock once
    nobody holds or waits for it (so idle keys cost nothing)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()  # guards _locks and every users count
        self._locks: dict[Hashable, list[Any]] = {}  # key -> [lock, users]

    def _enter(self, key: Hashable) -> list[Any]:
        with self._guard:
            entry = self._locks.get(key)
            if entry is None:
                entry = self._locks[key] = [threading.Lock(), 0]
            entry[1] += 1
        return entry

    def _leave(self, key: Hashable, entry: list[Any]) -> None:
        with self._guard:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[key]

    def run(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        entry = self._enter(key)
        try:
            with entry[0]:
                return fn()
        finally:
            self._leave(key, entry)

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        entry = self._enter(key)
        try:
            with entry[0]:
                yield
        finally:
            self._leave(key, entry)

    def __len__(self) -> int:
        return len(self._locks)


class ThreadContender:
    name = ""
    holds = True  # False for the floor, which holds nothing

    def reset(self) -> None:
        """Start from fresh state."""

    def sequential(self, n: int) -> None:
        """(t1): n uncontended turns on distinct keys, in the loop a user would write."""
        raise NotImplementedError

    def turn(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """(t2): fn() in key's turn, through the contender's own API."""
        raise NotImplementedError

    def keys_kept(self) -> int:
        """How many keys the contender still references when idle."""
        return 0


class Bare(ThreadContender):
    name = FLOOR
    holds = False

    def sequential(self, n: int) -> None:
        for _ in range(n):
            work()

    def turn(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        return fn()


class Handwritten(ThreadContender):
    name = BASELINE

    def reset(self) -> None:
        self.locks = HandwrittenKeyedLock()

    def sequential(self, n: int) -> None:
        run = self.locks.run
        for i in range(n):
            run(i, work)

    def turn(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        return self.locks.run(key, fn)

    def keys_kept(self) -> int:
        return len(self.locks)


class HandwrittenWith(Handwritten):
    name = "handwritten with"

    def sequential(self, n: int) -> None:
        hold = self.locks.hold
        for i in range(n):
            with hold(i):
                work()

    def turn(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        with self.locks.hold(key):
            return fn()


class DefaultDict(ThreadContender):
    name = "defaultdict(Lock)"

    def reset(self) -> None:
        self.locks: defaultdict[Hashable, Any] = defaultdict(threading.Lock)

    def sequential(self, n: int) -> None:
        locks = self.locks
        for i in range(n):
            with locks[i]:
                work()

    def turn(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        with self.locks[key]:
            return fn()

    def keys_kept(self) -> int:
        return len(self.locks)


class InturnKeyed(ThreadContender):
    name = "inturn keyed"
    module: ModuleType = inturn  # the inturn measured: this tree's, or an earlier one's

    def reset(self) -> None:
        self.queue = self.module.KeyedQueue()

    def sequential(self, n: int) -> None:
        keyed = self.queue.keyed
        for i in range(n):
            with keyed(i):
                work()

    def turn(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        with self.queue.keyed(key):
            return fn()

    def keys_kept(self) -> int:
        return self.queue.active_count


class InturnRunSync(InturnKeyed):
    name = "inturn run_sync"

    def sequential(self, n: int) -> None:
        run_sync = self.queue.run_sync
        for i in range(n):
            run_sync(i, work)

    def turn(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        return self.queue.run_sync(key, fn)


ALL: list[type[ThreadContender]] = [
    Bare,
    Handwritten,
    HandwrittenWith,
    DefaultDict,
    InturnKeyed,
    InturnRunSync,
]
NAMES = [cls.name for cls in ALL]


# -- the scenarios ----------------------------------------------------------------


def sequential(contender: ThreadContender, n: int) -> float:
    """(t1) ns per turn of n uncontended turns on distinct keys, in this thread."""
    contender.reset()
    contender.sequential(1)  # first use: a queue's switch to threads, say
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        contender.sequential(n)
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return elapsed / n * 1e9


class _Critical:
    """(t2)'s work in the turn: a read-modify-write of a counter, and an overlap check."""

    def __init__(self) -> None:
        self.counter = 0
        self.inside = 0
        self.overlaps = 0

    def __call__(self) -> None:
        if self.inside:
            self.overlaps += 1
        self.inside += 1
        value = self.counter
        self.counter = value + 1
        self.inside -= 1


def handoff(contender: ThreadContender, threads: int, seconds: float) -> dict[str, float]:
    """(t2) threads take KEY again and again for seconds: bench/mp_metrics.py's metrics."""
    contender.reset()
    contender.turn(KEY, work)  # first use, outside the measurement
    critical = _Critical()
    records: list[dict[str, list[int]]] = [{} for _ in range(threads)]
    start = [0]

    def go() -> None:  # run by the last thread to arrive at the barrier, before it opens
        start[0] = time.monotonic_ns()

    barrier = threading.Barrier(threads, action=go)

    def worker(index: int) -> None:
        arrivals: list[int] = []
        grants: list[int] = []
        releases: list[int] = []
        now, turn = time.monotonic_ns, contender.turn

        def body() -> None:
            grants.append(now())
            critical()
            releases.append(now())

        barrier.wait()
        deadline = start[0] + int(seconds * 1e9)
        while (arrival := now()) < deadline:
            arrivals.append(arrival)
            turn(KEY, body)
        records[index] = {"arrivals": arrivals, "grants": grants, "releases": releases}

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    gc.collect()
    gc.disable()
    try:
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        gc.enable()
    if contender.holds and critical.overlaps:
        raise Verification(f"{contender.name}: {critical.overlaps} turns overlapped on one key")
    result = measure_run(records, start[0], critical.counter)
    result["ns_per_turn"] = 1e9 / result["ops_per_s"]
    result["keys_kept"] = float(contender.keys_kept())
    return result


T = TypeVar("T")


def _rotated(items: Sequence[T], by: int) -> list[T]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def measure(
    sizes: Sizes,
    repeats: int,
    log: Callable[[str], None],
    kinds: Sequence[type[ThreadContender]] = ALL,
) -> dict[str, dict[str, float]]:
    """Median of repeats of every measure, by measure and contender."""
    contenders = [cls() for cls in kinds]
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for repeat in range(repeats):
        log(f"(t) repeat {repeat + 1}/{repeats}")
        for contender in _rotated(contenders, repeat):
            name = contender.name
            samples["t1"][name].append(sequential(contender, sizes.turns))
            if contender.holds:
                for metric, value in handoff(contender, sizes.threads, sizes.seconds).items():
                    samples[f"t2 {metric}"][name].append(value)
    return {
        measure: {name: statistics.median(values) for name, values in by_name.items()}
        for measure, by_name in samples.items()
    }


def title(sizes: Sizes) -> str:
    return "(t) sync turns from threads, in process, no event loop"


#: (t2)'s rows: the metric, its label, its format, and whether a ratio to the baseline
#: means something (a cost) or not (a share, a count).
T2_ROWS = (
    ("ns_per_turn", "ns/turn", "{:,.0f}", True),
    ("handoff_p50_us", "hand-off p50 (µs)", "{:,.1f}", True),
    ("arrival_order_pct", "arrival order (%)", "{:.1f}", False),
    ("fairness", "fairness (min/max turns per thread)", "{:.2f}", False),
    ("longest_wait_ms", "longest wait (ms)", "{:,.1f}", False),
    ("keys_kept", "keys kept when idle", "{:,.0f}", False),
)
T1 = "(t1) ns/turn above bare, uncontended"


def _t2_label(text: str, sizes: Sizes) -> str:
    return f"(t2) {text}, {sizes.threads} threads on one key"


def derive(medians: dict[str, dict[str, float]], sizes: Sizes) -> dict[str, dict[str, float]]:
    """The reported rows: (t1) above the bare floor, then (t2)'s metrics."""
    floor = medians["t1"][FLOOR]
    rows = {T1: {name: value - floor for name, value in medians["t1"].items() if name != FLOOR}}
    for metric, text, _, _ in T2_ROWS:
        rows[_t2_label(text, sizes)] = medians[f"t2 {metric}"]
    return rows


def table(rows: dict[str, dict[str, float]], sizes: Sizes) -> str:
    """One Markdown table: a row per measure, a column per contender, costs also as ratios."""
    names = [name for name in NAMES if name != FLOOR]
    shapes = {T1: ("{:,.0f}", True)}
    shapes.update({_t2_label(text, sizes): (form, cost) for _, text, form, cost in T2_ROWS})
    lines = ["| scenario | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, values in rows.items():
        form, cost = shapes[label]
        base = values.get(BASELINE)
        cells = []
        for name in names:
            value = values.get(name)
            text = "-" if value is None else form.format(value)
            quotient = ratio(value, base)
            if cost and valid(quotient):
                text += f" ({quotient:.2f}x)"
            cells.append(text)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from .run import machine

    parser = argparse.ArgumentParser(
        prog="python -m bench.threads", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender (median)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--threads", type=int, default=4, help="(t2): threads on the one key")
    parser.add_argument("--seconds", type=float, default=None, help="(t2): wall time of each run")
    parser.add_argument("--json", type=Path, default=None, help="write medians and rows here")
    options = parser.parse_args(argv)
    sizes = Sizes(options.quick, options.threads, options.seconds)

    def log(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    medians = measure(sizes, options.repeats, log)
    rows = derive(medians, sizes)
    print(f"## {title(sizes)}: {machine()}, median of {options.repeats}\n")
    print(table(rows, sizes))
    log(f"(t) done in {time.perf_counter() - started:.0f} s")
    if options.json:
        options.json.write_text(json.dumps({"medians": medians, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
