"""(w) Latest wins (issue 32): a burst of 1,000 submissions on one busy key.

    python -m bench.latest [--repeats 3] [--quick] [--before GIT_REF] [--json out.json]

One work holds a key, its body waiting on an event; while it holds, 1,000
more works are submitted for the same key; then the holder is released, and
the burst ends once every caller has its answer. Each work's body yields
once while it holds the key, as the bodies of scenarios (b) to (e) do, and
does nothing else: so the times compare the machinery, and a work that
costs more (a download, a sync) widens the gap by the 999 works not run.
Contenders:

- ``pending=all``: ``KeyedQueue()`` as it is by default: every work runs,
  in turn (1,001 runs);
- ``pending=latest``: ``KeyedQueue(pending="latest")``: the key keeps at
  most one waiting work, each submission takes the place of the one before;
  a replaced caller gets the outcome of the work that replaced it (2 runs:
  the holder and the last submission);
- ``pending=latest raise``: the same with ``on_superseded="raise"``: a
  replaced caller gets :exc:`inturn.Superseded` (2 runs);
- ``lock+ticket``: what a user writes by hand instead, a dict of
  ``asyncio.Lock`` with a reference count (as bench/contenders.py's
  hand-written lock) and the key's newest ticket: each caller takes a
  ticket, and once it holds the lock runs only if its ticket is still the
  newest, else it returns at once with no result (2 runs; but every
  replaced caller still waits for the lock, as a task, and takes it in
  turn).

Two ways to submit, each its own rows: ``await q.submit(key, fn, i)``,
which returns a :class:`~inturn.Handle` (the hand-written lock has no
submit: it creates a task, as a user would), and
``asyncio.create_task(q.run(key, fn, i))``.

Measures, for each contender and way:

- works run: the bodies that ran, holder included, checked against what
  the contender promises (with every caller's answer: its own result, the
  latest's, :exc:`~inturn.Superseded`, or the hand-written lock's
  ``None``), else :class:`~bench.scenarios.Verification`;
- µs per burst: from the first submission to the last answer, the holder's
  release included (timed with the garbage collector paused; the mean of
  several bursts, each on a fresh queue);
- peak traced bytes per submission: tracemalloc's peak over the whole burst,
  callers' handles or tasks kept, above what was traced once the holder
  held the key, over the 1,000 submissions;
- with ``submit()`` only: the bytes held for the key while the burst waits,
  after the callers dropped their handles and the loop ran what the
  submissions scheduled (the hand-written lock's tasks cannot be dropped:
  the lock's waiters keep them): what the queue's own bookkeeping keeps for
  one busy key. Measured at 1,000 and at 100
  submissions; their difference over the 900 more is the bytes held per
  waiting submission, which is 0 for memory that is O(1) per key;
- with ``submit()`` only, handles dropped: the errors kept for
  ``drain(raise_errors=True)`` (a replaced caller's
  :exc:`~inturn.Superseded` that nobody awaited, if the queue keeps it);
  and the bytes still traced once the key is idle again (``drain()``
  returned) after a burst on the same queue, above what was traced before
  it, the least of 3 bursts (after 3 that sized the queue's own tables: a
  set may still be resized by one burst, up or down): 0 unless something
  stays after every burst, for the key or for its callers.

Each row's figures are ratios to ``pending=all``, measured in the same run
(counts and signed bytes are shown as they are).
Contenders are interleaved (each repeat runs all of them, in a rotated
order) and every number is the median of the repeats. With ``--before``,
``pending=all`` is measured again on that revision's inturn (the options of
issue 32 did not exist before it).

Then (w3), unless ``--no-processes``: bench/latest_across.py, the burst spread
over 8 processes with ``across="processes"`` (issue 46), on the file backend,
on Redis and on PostgreSQL (servers of the run's own, or those that
INTURN_REDIS_URL and INTURN_POSTGRES_URL name; without one, no rows of it).

Then (w2): one uncontended turn on ``KeyedQueue(pending="latest")`` over the
same turn on ``KeyedQueue()``, for ``run``, ``keyed`` and the decorator,
from bench/turns.py's scenario (u), which times both shapes in the same
repeats (``python -m bench`` reuses its run; alone, this module times them).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections import defaultdict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

if __package__ in (None, ""):  # run as a script: python bench/latest.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

import inturn

from . import contenders, latest_across, turns
from .scenarios import Verification
from .targets import Rows, Target, cell, evaluate, ratio, valid

#: The burst's key.
KEY = "manifest"
#: The holder's result, beside the burst's (each work returns its index).
HOLDER = -1
SUBMIT, RUN = "submit()", "create_task(run())"
WAYS = (SUBMIT, RUN)
#: Submissions while the key is busy, in quick runs too; and the smaller burst, for the bytes
#: held per waiting submission.
BURST, SMALL = 1_000, 100


class Sizes:
    def __init__(self, quick: bool) -> None:
        self.burst = BURST
        self.small = SMALL
        self.bursts = 3 if quick else 20  # timed bursts per sample (their mean)
        self.turns = turns.Sizes(quick)  # (w2), when this module times it alone


# -- the contenders -----------------------------------------------------------------


class BurstContender:
    """A queue (or hand-written lock) taking a burst on one busy key."""

    name = ""
    module: ModuleType = inturn  # the inturn measured: this tree's, or an earlier one's
    options: ClassVar[dict[str, Any]] = {}

    def reset(self) -> None:
        """A fresh queue."""
        self.queue = self.module.KeyedQueue(**self.options)

    async def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """``await q.submit(...)``: the caller's handle."""
        return await self.queue.submit(key, fn, *args)

    def spawn(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> asyncio.Task[Any]:
        """``create_task(q.run(...))``: the caller's task."""
        return asyncio.get_running_loop().create_task(self.queue.run(key, fn, *args))

    async def settle(self) -> None:
        """Wait until the key is idle: every work has run or was replaced, and answered."""
        await self.queue.drain()

    async def forget(self) -> int:
        """Clear what the queue keeps of errors nobody awaited; how many there were."""
        try:
            await self.queue.drain(raise_errors=True)
        except Exception as group:  # an ExceptionGroup: Python 3.10 has it from a backport
            return len(getattr(group, "exceptions", ()))
        return 0

    def superseded(self) -> float:
        """How many works the queue counts as replaced (``stats().superseded``)."""
        return float(getattr(self.queue.stats(), "superseded", 0))

    def keys_kept(self) -> int:
        return int(self.queue.active_count)

    def runs(self, n: int) -> int:
        """How many bodies a burst of n on a busy key runs, the holder's included."""
        return n + 1

    def expected(self, index: int, n: int) -> Any:
        """The answer of the burst's caller index: a value, or the error class it raises."""
        return index


class All(BurstContender):
    name = "pending=all"  # KeyedQueue() as it is by default: so it runs on --before too


class Latest(BurstContender):
    name = "pending=latest"
    options: ClassVar[dict[str, Any]] = {"pending": "latest"}

    def runs(self, n: int) -> int:
        return 2

    def expected(self, index: int, n: int) -> Any:
        return n - 1  # each replaced caller joins the last submission


class LatestRaise(Latest):
    name = "pending=latest raise"
    options: ClassVar[dict[str, Any]] = {"pending": "latest", "on_superseded": "raise"}

    def expected(self, index: int, n: int) -> Any:
        return n - 1 if index == n - 1 else self.module.Superseded


class TicketLock:
    """Latest wins by hand: a dict of asyncio.Lock with a reference count and the key's
    newest ticket. A caller that holds the lock runs only if no newer caller came; else it
    returns None at once, without running."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, list[Any]] = {}  # key -> [lock, users, newest ticket]
        self.idle = asyncio.Event()  # set while no key is held or waited for
        self.idle.set()

    async def run(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> Any:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = [asyncio.Lock(), 0, 0]
            self.idle.clear()
        entry[1] += 1
        entry[2] = ticket = entry[2] + 1
        try:
            async with entry[0]:
                if ticket != entry[2]:
                    return None  # a newer caller came: its run brings the key up to date
                return await fn(*args)
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[key]
                if not self._locks:
                    self.idle.set()

    def __len__(self) -> int:
        return len(self._locks)


class Ticket(BurstContender):
    name = "lock+ticket"

    def reset(self) -> None:
        self.locks = TicketLock()

    async def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        return self.spawn(key, fn, *args)  # no submit: a task, as a user would write

    def spawn(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> asyncio.Task[Any]:
        return asyncio.get_running_loop().create_task(self.locks.run(key, fn, *args))

    async def settle(self) -> None:
        await self.locks.idle.wait()
        await asyncio.sleep(0)  # the last task ends just after it left the lock

    async def forget(self) -> int:
        return 0

    def superseded(self) -> float:
        return 0.0

    def keys_kept(self) -> int:
        return len(self.locks)

    def runs(self, n: int) -> int:
        return 2

    def expected(self, index: int, n: int) -> Any:
        return n - 1 if index == n - 1 else None


ALL: list[type[BurstContender]] = [All, Latest, LatestRaise, Ticket]
BASELINE = All.name


def kinds(before: str | None = None) -> list[type[BurstContender]]:
    """The contenders, and ``pending=all`` again on the inturn of ``before``."""
    return [*ALL, *(contenders.at_version(before, [All]) if before else ())]


# -- one burst --------------------------------------------------------------------


class Probe:
    """The works' bodies: the holder, which waits for the release, and the burst's."""

    def __init__(self) -> None:
        self.runs = 0
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def hold(self) -> int:
        self.runs += 1
        self.holding.set()
        await self.release.wait()
        return HOLDER

    async def work(self, index: int) -> int:
        self.runs += 1
        await asyncio.sleep(0)  # as the bodies of (b) to (e): one yield while it holds the key
        return index


class Raised:
    """An answer that was an error: its class only, so that the answers do not keep the error
    and its traceback (the caller's handle or task keeps what it keeps)."""

    __slots__ = ("kind",)

    def __init__(self, kind: type[BaseException]) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"raised {self.kind.__name__}"


async def _answer(caller: Awaitable[Any]) -> Any:
    try:
        return await caller
    except Exception as error:
        return Raised(type(error))


def _matches(answer: Any, expected: Any) -> bool:
    if isinstance(expected, type) and issubclass(expected, BaseException):
        return isinstance(answer, Raised) and issubclass(answer.kind, expected)
    return not isinstance(answer, Raised) and bool(answer == expected)


class Burst:
    """One burst of n on a busy key: start() holds it, then submit(), answer().

    On a fresh queue, unless not ``fresh``: then on the contender's queue as it is.
    """

    def __init__(self, contender: BurstContender, way: str, n: int, *, fresh: bool = True) -> None:
        if fresh:
            contender.reset()
        self.contender, self.way, self.n = contender, way, n
        self.probe = Probe()
        self.holder: Awaitable[Any] | None = None
        self.callers: list[Awaitable[Any]] = []

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        if self.way == SUBMIT:
            return await self.contender.submit(KEY, fn, *args)
        return self.contender.spawn(KEY, fn, *args)

    async def start(self) -> None:
        """The holder holds the key."""
        self.holder = await self._call(self.probe.hold)
        await self.probe.holding.wait()

    async def submit(self) -> None:
        """The n submissions, each in the key's line (or in place of the one before) after it."""
        work, call = self.probe.work, self._call
        self.callers = [await call(work, i) for i in range(self.n)]
        if self.way == RUN:
            await asyncio.sleep(0)  # each task takes its first step: it calls run()

    async def answer(self) -> list[Any]:
        """Release the holder; every caller's answer, the holder's last."""
        self.probe.release.set()
        answers = [await _answer(caller) for caller in self.callers]
        assert self.holder is not None
        answers.append(await _answer(self.holder))
        return answers

    def verify(self, answers: list[Any] | None = None) -> None:
        """The bodies run, the answers (if kept), nothing kept for the key once it is idle."""
        contender, n, name = self.contender, self.n, self.contender.name
        if self.probe.runs != contender.runs(n):
            raise Verification(
                f"{name}, {self.way}: {self.probe.runs} works ran, not {contender.runs(n)}"
            )
        if answers is not None:
            *burst, holder = answers
            if holder != HOLDER:
                raise Verification(f"{name}, {self.way}: the holder answered {holder!r}")
            wrong = [
                (i, answer)
                for i, answer in enumerate(burst)
                if not _matches(answer, contender.expected(i, n))
            ]
            if wrong:
                i, answer = wrong[0]
                raise Verification(
                    f"{name}, {self.way}: {len(wrong)} callers answered wrong, first caller "
                    f"{i}: {answer!r}, not {contender.expected(i, n)!r}"
                )
        if contender.keys_kept():
            raise Verification(f"{name}, {self.way}: {contender.keys_kept()} keys kept when idle")


async def timed(contender: BurstContender, way: str, n: int, bursts: int) -> dict[str, float]:
    """µs per burst (mean of bursts, garbage collector paused), its runs and superseded count."""
    elapsed = 0.0
    for _ in range(bursts):
        burst = Burst(contender, way, n)
        await burst.start()
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            await burst.submit()
            answers = await burst.answer()
            elapsed += time.perf_counter() - start
        finally:
            gc.enable()
        await contender.settle()
        burst.verify(answers)
    return {
        "us": elapsed * 1e6 / bursts,
        "runs": float(burst.probe.runs),
        "superseded": contender.superseded(),
    }


async def peak_memory(contender: BurstContender, way: str, n: int) -> float:
    """tracemalloc's peak over the burst, callers' handles or tasks kept, per submission."""
    burst = Burst(contender, way, n)
    await burst.start()
    gc.collect()
    gc.disable()  # as in the timed run: garbage in cycles counts until the next collection
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        await burst.submit()
        answers = await burst.answer()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        gc.enable()
    await contender.settle()
    burst.verify(answers)
    return (peak - base) / n


async def _settled() -> None:
    """Let the loop run what the last steps scheduled (callbacks of futures answered, tasks'
    steps), then collect: what is traced then is held, not on its way out."""
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()


#: Bursts on the same queue before those whose idle memory is traced, and how many are: the
#: queue's own tables (a set of the handles not finished) settle at their size over the first
#: few, but a set may still be resized by a burst, a few tens of kB up or down, so each of the
#: traced bursts is traced alone, and the least is kept: what stays after every burst.
SIZING, TRACED = 3, 3


async def _dropped(contender: BurstContender, n: int) -> Burst:
    """A burst whose callers drop their handles, on the contender's queue as it is; the key
    idle again once it returns (drain()), the holder's handle dropped too."""
    burst = Burst(contender, SUBMIT, n, fresh=False)
    await burst.start()
    await burst.submit()
    burst.callers.clear()
    burst.probe.release.set()
    await contender.settle()
    burst.holder = None
    burst.verify()
    return burst


async def held_memory(contender: BurstContender, n: int) -> dict[str, float]:
    """With submit() and the handles dropped: the bytes held for the key while n wait, on a
    fresh queue; the errors kept for drain(raise_errors=True); and the bytes kept once the key
    is idle after a burst on the same queue, the least of TRACED bursts after SIZING."""
    burst = Burst(contender, SUBMIT, n)
    gc.collect()
    tracemalloc.start()
    try:
        await burst.start()
        await _settled()
        base = tracemalloc.get_traced_memory()[0]
        await burst.submit()
        burst.callers.clear()  # the callers let go of their handles
        await _settled()
        held = tracemalloc.get_traced_memory()[0]
        burst.probe.release.set()
        await contender.settle()
        burst.verify()
        unclaimed = await contender.forget()
        for _ in range(SIZING - 1):
            await _dropped(contender, n)
        await contender.forget()
        kept = []
        for _ in range(TRACED):
            await _settled()
            before = tracemalloc.get_traced_memory()[0]
            await _dropped(contender, n)
            await _settled()
            kept.append(tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()
    await contender.forget()
    return {"held": float(held - base), "idle": float(min(kept)), "unclaimed": float(unclaimed)}


# -- the scenario -------------------------------------------------------------------


def _rotated(items: Sequence[BurstContender], by: int) -> list[BurstContender]:
    by %= len(items)
    return [*items[by:], *items[:by]]


async def measure(
    sizes: Sizes,
    repeats: int,
    log: Callable[[str], None],
    kinds: Sequence[type[BurstContender]] = ALL,
) -> dict[str, dict[str, float]]:
    """Median of repeats of every measure, by measure and contender.

    One untimed burst of each first (asyncio's own tables grow to size); a
    ``--before`` contender that its revision cannot take is left out then.
    """
    chosen = []
    for contender in (cls() for cls in kinds):
        try:
            for way in WAYS:
                await timed(contender, way, sizes.burst, 1)
        except (AttributeError, TypeError) as error:
            if "@" not in contender.name:
                raise
            log(f"(w) {contender.name}: left out, that revision cannot take it ({error})")
        else:
            chosen.append(contender)
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for repeat in range(repeats):
        log(f"(w) repeat {repeat + 1}/{repeats}")
        for contender in _rotated(chosen, repeat):
            name = contender.name
            for way in WAYS:
                result = await timed(contender, way, sizes.burst, sizes.bursts)
                for field, value in result.items():
                    samples[f"{field} {way}"][name].append(value)
                samples[f"peak {way}"][name].append(await peak_memory(contender, way, sizes.burst))
            for n in (sizes.small, sizes.burst):
                for field, value in (await held_memory(contender, n)).items():
                    samples[f"{field} {n}"][name].append(value)
    return {
        measure: {name: statistics.median(values) for name, values in by_name.items()}
        for measure, by_name in samples.items()
    }


def measured(
    medians: dict[str, dict[str, float]], kinds: Sequence[type[BurstContender]]
) -> list[str]:
    """The names of the contenders measured (a --before one may have been left out)."""
    return [cls.name for cls in kinds if cls.name in medians.get(f"runs {SUBMIT}", {})]


def title(sizes: Sizes) -> str:
    return f"(w) latest wins: a burst of {sizes.burst:,} submissions on one busy key, in process"


def runs_label(way: str) -> str:
    return f"(w) works run, {way}"


def time_label(way: str) -> str:
    return f"(w) µs per burst, {way}"


def peak_label(way: str) -> str:
    return f"(w) peak traced bytes per submission, {way}"


def held_label(sizes: Sizes) -> str:
    return f"(w) bytes held for the key while {sizes.burst:,} wait, handles dropped"


def slope_label(sizes: Sizes) -> str:
    return f"(w) bytes held per waiting submission ({sizes.burst:,} vs {sizes.small:,} waiting)"


IDLE = f"(w) bytes kept by a burst once the key is idle (least of {TRACED})"
UNCLAIMED = "(w) errors kept for drain(raise_errors=True), handles dropped"
SUPERSEDED = f"(w) stats().superseded, {SUBMIT}"


def derive(medians: dict[str, dict[str, float]], sizes: Sizes) -> dict[str, dict[str, float]]:
    """The reported rows, in the order of table()."""
    rows: dict[str, dict[str, float]] = {}
    for way in WAYS:
        rows[runs_label(way)] = dict(medians[f"runs {way}"])
    rows[SUPERSEDED] = dict(medians[f"superseded {SUBMIT}"])
    for way in WAYS:
        rows[time_label(way)] = dict(medians[f"us {way}"])
    for way in WAYS:
        rows[peak_label(way)] = dict(medians[f"peak {way}"])
    big, small = medians[f"held {sizes.burst}"], medians[f"held {sizes.small}"]
    rows[held_label(sizes)] = dict(big)
    rows[slope_label(sizes)] = {
        name: (value - small[name]) / (sizes.burst - sizes.small) for name, value in big.items()
    }
    rows[IDLE] = dict(medians[f"idle {sizes.burst}"])
    rows[UNCLAIMED] = dict(medians[f"unclaimed {sizes.burst}"])
    return rows


#: Rows of counts or signed bytes: shown as they are, with no ratio to pending=all.
_PLAIN = ("(w) works run", "(w) stats()", "(w) errors kept", "(w) bytes kept", "per waiting")


def _cell(label: str, value: float | None, baseline: float | None) -> str:
    if value is None:
        return "-"
    if any(part in label for part in _PLAIN):
        return f"{value:,.0f}" if abs(value) >= 10 or value == int(value) else f"{value:,.1f}"
    text = f"{value:,.0f}"
    quotient = ratio(value, baseline)
    if valid(quotient):
        text += f" ({quotient:.2f}x)"
    return text


def table(rows: Rows, names: Sequence[str]) -> str:
    """One Markdown table: a column per contender, each cost beside its ratio to pending=all."""
    lines = ["| scenario | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, values in rows.items():
        cells = [_cell(label, values.get(name), values.get(BASELINE)) for name in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- (w2): an uncontended turn, from (u) ----------------------------------------------

#: (w2)'s shapes: each shape on KeyedQueue(pending="latest") beside it on KeyedQueue().
UNCONTENDED = (
    ("`q.run(key, fn)`", contenders.InturnRun, turns.InturnRunLatest),
    ("`async with q.keyed(key)`", contenders.InturnKeyed, turns.InturnKeyedLatest),
    ("`@queue_by_key` async function", contenders.InturnDecorator, turns.InturnDecoratorLatest),
)
W2 = '(w2) one uncontended turn, KeyedQueue(pending="latest") / KeyedQueue()'


def uncontended_kinds() -> list[type[Any]]:
    """What (w2) times when this module runs alone: (u)'s floor, hand-written lock and shapes."""
    shapes = [kind for _, default, latest in UNCONTENDED for kind in (default, latest)]
    return [contenders.Bare, contenders.Handwritten, *shapes]


def uncontended(turn_rows: Rows) -> dict[str, float]:
    """Each shape's ns above bare on the latest queue over the same on the default queue."""
    values = turn_rows.get(turns.ROW, {})
    return {
        text: ratio(values.get(latest.name), values.get(default.name))
        for text, default, latest in UNCONTENDED
    }


def uncontended_table(turn_rows: Rows) -> str:
    values = turn_rows.get(turns.ROW, {})
    heads = ["ns above bare, `KeyedQueue()`", 'ns above bare, `pending="latest"`', "ratio"]
    lines = [f"| {W2} | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    quotients = uncontended(turn_rows)
    for text, default, latest in UNCONTENDED:
        cells = [
            f"{values[kind.name]:,.0f}" if kind.name in values else "-"
            for kind in (default, latest)
        ]
        quotient = quotients[text]
        cells.append(f"{quotient:.2f}x" if valid(quotient) else "-")
        lines.append(f"| {text} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- targets ------------------------------------------------------------------------


def target_table(sizes: Sizes | None = None) -> list[Target]:
    """Issue 32's: a burst on a busy key costs two runs and O(1) memory per key.

    (Its uncontended turns are bench/turns.py's targets, each shape's own.)
    """
    sizes = sizes or Sizes(quick=False)
    table = []
    for kind in (Latest, LatestRaise):
        name = kind.name
        table.extend(
            Target(
                f"(w) {name}: {sizes.burst:,} submitted on a busy key run 2 works, {way}",
                (name,),
                lambda rows, way=way, name=name: cell(rows, runs_label(way), name),
                2.0,
                form="{:,.0f}",
            )
            for way in WAYS
        )
        slope = slope_label(sizes)
        table.append(
            Target(
                f"(w) {name}: O(1) bytes per key, <= 1 B held per waiting submission",
                (name,),
                lambda rows, slope=slope, name=name: cell(rows, slope, name),
                1.0,
                signed=True,
                form="{:,.1f} B",
            )
        )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    from .run import machine

    parser = argparse.ArgumentParser(
        prog="python -m bench.latest", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender (median)")
    parser.add_argument("--quick", action="store_true", help="fewer bursts: a smoke test")
    parser.add_argument(
        "--before",
        metavar="GIT_REF",
        default=None,
        help="also measure pending=all as it was at this git revision, in the same run",
    )
    parser.add_argument("--json", type=Path, default=None, help="write medians and rows here")
    parser.add_argument(
        "--no-processes",
        action="store_true",
        help="leave out (w3), the burst spread over 8 processes, on the file backend, Redis and "
        "PostgreSQL (bench/latest_across.py)",
    )
    options = parser.parse_args(argv)
    sizes = Sizes(options.quick)

    def log(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    chosen = kinds(options.before)
    medians = asyncio.run(measure(sizes, options.repeats, log, chosen))
    rows = derive(medians, sizes)
    names = measured(medians, chosen)
    print(f"## {title(sizes)}: {machine()}, median of {options.repeats}\n")
    print(table(rows, names))
    turn_medians = turns.measure(sizes.turns, options.repeats, log, uncontended_kinds())
    turn_rows = turns.derive(turn_medians)
    print(f"\n## {W2}: {machine()}, median of {options.repeats}\n")
    print(uncontended_table(turn_rows))
    print("\nTargets (issue 32; SKIP: not measured in this run):\n")
    latest_shapes = {latest.name for _, _, latest in UNCONTENDED}
    targets = [
        *target_table(sizes),
        *(t for t in turns.target_table() if t.needs[0] in latest_shapes),
    ]
    seen = [*names, *turn_medians]
    for verdict, label, value in (evaluate(t, {**rows, **turn_rows}, seen) for t in targets):
        print(f"- {verdict} {label}: {value}")
    across: Rows = {}
    if not options.no_processes:
        across = asyncio.run(
            latest_across.measure(latest_across.Sizes(options.quick), options.repeats, log)
        )
        print("\n" + latest_across.report(across, options.repeats, machine()))
    log(f"(w) done in {time.perf_counter() - started:.0f} s")
    if options.json:
        options.json.write_text(
            json.dumps(
                {
                    "medians": medians,
                    "rows": rows,
                    "turns": {"medians": turn_medians, "rows": turn_rows},
                    "across": across,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
