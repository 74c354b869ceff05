"""Registry: the key -> line map of one queue, the only writer of it, and the tally of turns.

Invariant: a key is in ``lines`` exactly while a task or thread holds or
waits for it, mapped to its holder while nobody else asked about it (no
object is made on the uncontended path), to a Line (or a Gate, with
``concurrency`` above 1) otherwise. This module is the only writer of
that map, except the facade's inlined uncontended ``run()``, which inserts
and pops a bare holder on the mode's ``fast_loop`` exactly as
``Registry.try_take`` and ``Registry.release`` would.

Every verb takes the lock of a shared mode itself (see ``_threads``), but
those marked "under the guard", whose callers make several changes at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Hashable, Sequence
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, final

from ._checks import Waited, missed, others
from ._describe import describe
from ._errors import QueueClosed, QueueFull, closed
from ._line import HELD, Deferred, Drain, Gate, Held, Line, Waiter, hand, held_by, rewake
from ._order import order_keys, unhashable
from ._stats import Observer, Tally
from ._tasks import in_loop_of as _soon
from ._threads import ThreadHolder, ThreadMode, thread_holder

if TYPE_CHECKING:
    from ._slots import Slots
    from .backends._base import Backend


def _outcome(future: asyncio.Future[Any], error: BaseException | None, result: Any) -> None:
    """Give a current() future the holder's outcome, unless its awaiter left."""
    if future.done():  # its awaiter was cancelled
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, Exception):
        future.set_exception(error)
        future.exception()  # the holder's own caller gets the error; don't log it again
    else:  # cancelled, or interrupted
        future.cancel()


@final
class Registry:
    """One queue's lines: the key -> line map, its thread mode, and the tally of its turns.

    Its verbs take and release one key's turn for one holder (a task, or a
    thread's :class:`~inturn._threads.ThreadHolder`); taking several keys,
    slots and backend grants is the Turn's.
    """

    __slots__ = (
        "__weakref__",
        "_plain",
        "backend",
        "concurrency",
        "lines",
        "max_pending",
        "mode",
        "name",
        "open",
        "slots",
        "tally",
        "timed",
        "tokens",
    )

    def __init__(
        self,
        *,
        backend: Backend | None,
        concurrency: int,
        max_pending: int | None,
        plain: bool,
        name: str | None = None,
    ) -> None:
        self.name = name  # the queue's, for its log lines
        self.lines: dict[Hashable, Any] = {}  # key -> holder, Line or Gate (see the module's doc)
        self.backend = backend  # shares the lines with other processes, or None
        self.concurrency = concurrency  # holders per key: a Gate per key above 1
        self.max_pending = max_pending
        self.slots: Slots | None = None  # max_running's, set by the queue
        self.open = True
        self.tally = Tally()
        self.tokens = itertools.count(1)  # in-process fencing tokens
        self.mode = ThreadMode(backend is not None and backend.capabilities.one_loop)
        # Whether the queue's settings make turns the bare lines: no backend, no
        # flow control; and whether turns are timed (not bare, or observed).
        self._plain = plain
        self.timed = not plain
        self.mode.allow_fast(plain)

    def forked(self, task: object = None) -> None:
        """In a forked child: forget the parent's other threads and tasks, and its locks.

        Only the thread that forked lives on in the child, in the step of the
        task it ran then, if any. They keep the keys they held bare or at the
        head of a line (a raw ``os.fork()`` inside a ``with keyed()`` block
        returns into it); every other holder and waiter, and every lock they
        may have held at that instant, are the parent's (the slots' too).
        """
        keep = (thread_holder(), task)
        lines = self.lines
        for key, line in list(lines.items()):
            if type(line) is Line and line.holder in keep:
                lines[key] = line.holder
            elif type(line) is Gate and any(holder in line.holders for holder in keep):
                line.forked(keep)  # (a Gate is always in the lines while anyone holds it)
            elif line not in keep:  # (a bare holder of keep keeps its key)
                del lines[key]
        if self.slots is not None:
            self.slots.forked(keep)
        self.mode.forked()
        self.mode.allow_fast(self.open and not self.timed)

    def close(self) -> None:
        """Refuse new turns (a holder may still take its keys again)."""
        self.open = False
        self.mode.allow_fast(False)

    def observe(self, observer: Observer | None) -> None:
        """Tell observer of every turn from now on (None: stop).

        An observed queue times every turn, so it takes none of the bare
        paths (run()'s inline, a single key's try_take alone): they count a
        turn without timing it, and they check nothing for an observer, so
        that an unobserved queue pays nothing. A turn already on such a path
        ends on it, unreported.
        """
        self.tally.observer = observer
        self.timed = not self._plain or observer is not None
        self.mode.allow_fast(self.open and not self.timed)

    def ordered(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        """keys checked (hashable; a backend's kinds) and in the one global order of turns."""
        if self.backend is not None:
            return self.backend.order(keys)
        try:
            if len(keys) == 1:
                hash(keys[0])
                return keys
            return order_keys(keys)
        except TypeError:
            for key in keys:
                try:
                    hash(key)
                except TypeError:
                    raise unhashable(key) from None
            raise

    # -- one key's turn, and counting turns --------------------------------------------

    def try_take(self, key: Hashable, holder: object, admitted: bool = False) -> bool | Held:
        """Take key's turn for holder if it is free: True; HELD if holder holds it; else False.

        The fast verb: no wait, nothing allocated for a free key. ``admitted``:
        holder's turn took or waits for another key already, so it goes on if
        the queue closed since.

        :raises QueueClosed: the queue is closed (and holder does not hold the key).
        """
        lines = self.lines
        if self.mode.shared:
            with self.mode.lock or self.mode.locked():
                if key in lines or self.concurrency != 1 or not self.open:
                    return self._try_take(key, holder, admitted)
                lines[key] = holder  # (as below)
                return True
        if key not in lines and self.concurrency == 1 and self.open:
            lines[key] = holder  # (the free key: _try_take's first case, one call less)
            return True
        return self._try_take(key, holder, admitted)

    def _try_take(self, key: Hashable, holder: object, admitted: bool = False) -> bool | Held:
        lines = self.lines
        line = lines.get(key)
        open_ = self.open or admitted
        if line is None and open_:
            if self.concurrency == 1:
                lines[key] = holder
                return True
            line = lines[key] = Gate(self.concurrency)
            return self._enter(line, holder)
        if line is not None and held_by(line, holder):
            return HELD
        if not open_:
            raise closed(self.name, key)
        if type(line) is Gate:
            return self._enter(line, holder)
        return False

    def _enter(self, gate: Gate, holder: object) -> bool | Held:
        """Take a free place of gate for holder. Submitted work's place counts as handed until
        its task starts (see start): newcomers wait behind it, as behind a waiter handed one."""
        got = gate.enter(holder)
        if got is True and isinstance(holder, Deferred):
            gate.handed += 1
        return got

    def join(
        self,
        key: Hashable,
        holder: object,
        waiter: Waiter,
        timeout: float | None,
        guarded: bool = False,
        admitted: bool = False,
    ) -> Line | Gate | None:
        """Put waiter in key's line for holder, as _drive.Place.join (QueueFull: the line is full).

        ``guarded``: the caller holds the guard already; ``admitted``: see
        try_take. Submitted work joins as data: it is the holder and the
        waiter (a Deferred), under the guard.
        """
        if self.mode.shared and not guarded:
            with self.mode.lock or self.mode.locked():
                return self.join(key, holder, waiter, timeout, True, admitted)
        lines = self.lines
        line = lines.get(key)
        # (holder holds no key it waits for: a bare holder or a Line is busy)
        if line is None or type(line) is Gate or not self.open:
            if self._try_take(key, holder, admitted) is True:  # (free after all, or a place)
                return None
            line = lines[key]
        if type(line) is not Line and type(line) is not Gate:
            line = lines[key] = Line(line)
        if self.max_pending is not None and line.waiting >= self.max_pending:
            raise QueueFull(
                f"inturn: key {describe(key)} already has {line.waiting} waiting "
                f"(max_pending={self.max_pending}); the work was not queued"
            )
        if timeout is not None and timeout <= 0:
            raise self.too_late(key, 0, False)
        line.waiting += 1  # NOTE: then the append: an interrupt after it finds both done
        line.waiters.append(waiter)
        return line

    def requeue(self, key: Hashable, waiter: Deferred) -> Line | None:
        """Put work that waited in key's line already back at its head, however full or closed
        the queue (work waiting again: see _latest); None if the key is free: the work holds
        it now. Under the guard."""
        line = self.lines.get(key)
        if line is None:
            self.lines[key] = waiter
            return None
        line = self.lined(key)
        line.waiters.appendleft(waiter)
        line.waiting += 1
        return line

    def settle(self, key: Hashable, line: Line | Gate, waiter: Waiter, holder: object) -> bool:
        """As Place.settle. A Line's needs no lock: once handed, its holder is the waiter's to
        change (the hander may still hold the lock, waking other waiters)."""
        if type(line) is Gate:
            with self.mode.guard():
                if waiter not in line.holders:
                    return False
                line.seat(waiter, holder, self.mode.shared)
                return True
        if line.holder is not waiter:
            return False  # (not handed: abandon() passes on a turn handed just after this)
        line.holder = holder
        return True

    def abandon(
        self, key: Hashable, line: Line | Gate, waiter: Waiter, guarded: bool = False
    ) -> None:
        """As Place.abandon. ``line`` is the object the waiter joined: by now it may have left
        the lines (its holder left and no live waiter remained), and a new line may even stand
        for the same key. ``guarded``: the caller holds the guard already."""
        if self.mode.shared and not guarded:
            with self.mode.lock or self.mode.locked():
                self._abandon(key, line, waiter)
        else:
            self._abandon(key, line, waiter)

    def _abandon(self, key: Hashable, line: Line | Gate, waiter: Waiter) -> None:
        if type(line) is Gate:
            line.drop(waiter, self.mode.shared)
            if line.idle:
                del self.lines[key]
        elif line.holder is waiter:
            # The turn was handed over just as the waiter was interrupted:
            # pass it on, or the line would stall behind a caller that left.
            self.leave(key, line, None, None)
        else:
            waiter.cancel()  # so that the hand-off skips it
            line.waiting -= 1
            line.compact()

    def too_late(self, key: Hashable, limit: float | None, queued: bool) -> TimeoutError:
        """The error of key's turn not reached within limit (see _drive.Place)."""
        line = self.lines.get(key)
        waiting = line.waiting - queued if type(line) is Line or type(line) is Gate else 0
        return missed((key,), Waited.LINE, limit, f" (the key was busy, {others(waiting)})")

    def release(
        self,
        keys: Sequence[Hashable],
        holder: object,
        error: BaseException | None,
        result: Any,
        started: float | None,
        cut: bool = False,
        counted: bool = False,
    ) -> None:
        """End holder's turns on keys (taken in that order), newest first, and count the turn
        once: as ended if it started (``started``: when, monotonic, for a timed turn; 0.0
        for an untimed one), with error (None: it returned) and ``cut`` by its max_hold; as
        missed (error) if it never did (None). ``counted``: it was counted already (a
        conflating call answered without its turn: see _latest)."""
        if self.mode.shared:
            with self.mode.lock or self.mode.locked():
                self._release(keys, holder, error, result, started, cut, counted)
            return
        self._release(keys, holder, error, result, started, cut, counted)

    def release_one(
        self, key: Hashable, holder: object, error: BaseException | None, result: Any
    ) -> None:
        """release((key,), holder, error, result, 0.0): holder's untimed turn on one key.

        Its fast verb, called first: a turn that returned, with nobody waiting,
        ends with a dict delete (_release's first case, with the checks the
        caller's untimed turn on one key makes needless); once threads share
        the lines, _release itself, under their lock.
        """
        mode = self.mode
        if mode.shared:  # (threads: _release itself under the lines' lock, as release takes it)
            with mode.lock or mode.locked():
                self._release((key,), holder, error, result, 0.0, False, False)
            return
        lines = self.lines
        if error is None and lines.get(key) is holder:
            del lines[key]  # NOTE: no call from here to the count (an interrupt: see _turn)
            self.tally.completed += 1
            return
        self._release((key,), holder, error, result, 0.0, False, False)

    def _release(
        self,
        keys: Sequence[Hashable],
        holder: object,
        error: BaseException | None,
        result: Any,
        started: float | None,
        cut: bool,
        counted: bool,
    ) -> None:
        lines = self.lines
        if len(keys) == 1 and lines.get(keys[0]) is holder:  # (_give_back's first case)
            del lines[keys[0]]
        else:
            for key in reversed(keys):
                self._give_back(key, holder, error, result)
        if counted:
            return
        tally = self.tally
        if error is None and started == 0.0:  # (an untimed turn: unobserved, see observe)
            tally.completed += 1
        elif started is None:
            if not isinstance(error, QueueClosed):  # (not queued: not a turn)
                tally.missed(error)  # type: ignore[arg-type]
        else:
            tally.ended(error, cut, (_monotonic() - started) if started else None)

    def _give_back(
        self, key: Hashable, holder: object, error: BaseException | None, result: Any
    ) -> None:
        """End holder's turn on key: the key leaves the lines, or passes to the next in line.

        NOTE: restartable: wherever an exception lands in it, the line is left
        held by holder still, or handed to a waiter (woken or not: see settle_up).
        """
        lines = self.lines
        line = lines[key]
        if line is holder:
            del lines[key]
        elif type(line) is Gate:
            if isinstance(holder, Deferred):  # (its task never started: see _enter)
                line.drop(holder, self.mode.shared)
            else:
                line.leave(holder, self.mode.shared)
            if line.idle:
                del lines[key]
        else:
            self.leave(key, line, error, result)

    def withdraw(self, key: Hashable, holder: object, waiter: Waiter | None) -> None:
        """Undo what a take or join of key for holder did before an exception cut it short.

        A thread's clean-up, wherever an interrupt landed: the key, if holder
        took it (it did not hold it before), is given back; waiter, if it is in
        the line, leaves it, or passes on the key it was handed. Idempotent:
        a hand-on that an interrupt cut short is completed (see settle_up).
        """
        with self.mode.guard():
            line = self.lines.get(key)
            if line is None:
                return
            if held_by(line, holder):
                self._give_back(key, holder, None, None)
            elif waiter is not None and type(line) is Gate:
                if waiter in line.holders or (not waiter.done() and waiter in line.waiters):
                    line.drop(waiter, self.mode.shared)
                    if line.idle:
                        del self.lines[key]
            elif waiter is not None and type(line) is Line:
                if line.holder is waiter:
                    self.leave(key, line, None, None)  # (passes it on)
                elif not waiter.done() and waiter in line.waiters:
                    waiter.cancel()  # so that the hand-off skips it
                    line.waiting -= 1
                    line.compact()
            self._rewake(key)

    def settle_up(self, keys: Sequence[Hashable], holder: object) -> None:
        """Complete holder's release of keys that an exception cut short (a thread's exit):
        give back each it still holds, and wake the waiter a hand-off made holder but did
        not wake. Idempotent."""
        with self.mode.guard():
            lines = self.lines
            for key in reversed(keys):
                line = lines.get(key)
                if type(line) is Gate:  # (its place left, handed on, the gate gone if idle)
                    line.settle_up(holder, self.mode.shared)
                    if line.idle:
                        del lines[key]
                elif line is not None and held_by(line, holder):
                    self._give_back(key, holder, None, None)
                self._rewake(key)

    def _rewake(self, key: Hashable) -> None:
        """Wake the waiters that key's hand-on made holders, if an exception kept it from
        waking them (see rewake). Under the guard."""
        line, shared = self.lines.get(key), self.mode.shared
        if type(line) is Line:
            rewake(line.holder, shared)
        elif type(line) is Gate:
            line.rewake(shared)

    def hand_on(self, key: Hashable, line: Line, result: Any) -> None:
        """Hand on key's line, just popped by run()'s inline release (its holder returned)."""
        self.lines[key] = line
        self.leave(key, line, None, result)

    def leave(self, key: Hashable, line: Line, error: BaseException | None, result: Any) -> None:
        """End the turn of line's holder: tell its watchers, then hand the key on (the line
        stays in the lines) or take it out of the lines if nobody waits. Under the guard."""
        if line.watchers is not None:
            watchers, line.watchers = line.watchers, None
            for watcher in watchers:
                _soon(watcher, _outcome, watcher, error, result)
        shared = self.mode.shared
        while (waiter := line.hand_on()) is not None:
            # NOTE: the line is the waiter's before it is woken: a task of another loop
            # may run at once and make itself the holder.
            if not shared and type(waiter) is asyncio.Future:
                waiter.set_result(None)  # (hand's first case, one call less)
                return
            if hand(waiter, shared):
                return
        del self.lines[key]  # nobody waits (or nobody can take it: their loops are closed)

    def start(self, key: Hashable, work: Deferred, task: object) -> None:
        """Make the task of submitted work the holder of key in the work's place (handed to
        it, or taken free: see _enter). Under the guard."""
        lines = self.lines
        line = lines[key]
        if line is work:
            lines[key] = task
        elif type(line) is Gate:
            line.seat(work, task, self.mode.shared)
        else:
            line.holder = task

    def started(self, since: float) -> float:
        """Count the wait of a timed turn that was submitted at since and starts now; return now."""
        now = _monotonic()
        if self.mode.shared:
            with self.mode.lock or self.mode.locked():
                self.tally.started(now - since)
        else:
            self.tally.started(now - since)
        return now

    def missed(self, error: BaseException) -> None:
        """Count a turn that was never reached (see Tally.missed)."""
        if isinstance(error, QueueClosed):
            return  # (not queued: not a turn)
        with self.mode.guard():
            self.tally.missed(error)

    # -- looking at the lines ----------------------------------------------------------

    def pending(self, key: Hashable) -> int:
        """How many wait for key, not counting its holder(s)."""
        line = self.lines.get(key)
        return line.waiting if type(line) is Line or type(line) is Gate else 0

    def watch(self, key: Hashable, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any] | None:
        """A future of the outcome of key's holder (see KeyedQueue.current). Under the guard."""
        line = self.lines.get(key)
        if line is None or type(line) is Gate or isinstance(line, Deferred):
            return None  # (several holders: no one outcome; or submitted work, its task unstarted)
        if type(line) is not Line:
            line = self.lined(key)
        elif not isinstance(line.holder, asyncio.Task | ThreadHolder):
            return None  # handed over to a waiter that has not started yet
        watcher: asyncio.Future[Any] = loop.create_future()
        if line.watchers is None:
            line.watchers = []
        line.watchers.append(watcher)
        return watcher

    def lined(self, key: Hashable) -> Line:
        """Key's line, made a Line if it is a bare holder (key is held). Under the guard."""
        line = self.lines[key]
        if type(line) is not Line:
            line = self.lines[key] = Line(line)
        return line

    def holders(self) -> tuple[set[object], dict[Hashable, int]]:
        """Who holds a key, and how many wait for each key that has waiters. Under the guard."""
        holders: set[object] = set()
        waiting: dict[Hashable, int] = {}
        # (a copy, made without running Python code: another thread may read
        # the stats while the solo loop changes the lines without a lock)
        for key, line in tuple(self.lines.items()):
            kind = type(line)
            if kind is Line:
                holders.add(line.holder)
            elif kind is Gate:
                holders.update(line.holders)
            else:
                holders.add(line)
                continue
            if line.waiting:
                waiting[key] = line.waiting
        return holders, waiting

    def mark(self, finish: Any) -> bool:
        """Put a drain mark (see Drain) at the tail of every active line; False if there is
        none. Under the guard."""
        lines = self.lines
        if not lines:
            return False
        drain = Drain(len(lines), finish)
        for key, line in list(lines.items()):
            if type(line) is Gate and not line.waiting:
                line.mark(drain)  # nobody waits: it waits for the present holders
                continue
            if type(line) is not Line and type(line) is not Gate:
                line = lines[key] = Line(line)
            line.waiters.append(drain)
        return True

    def summary(self, most: int) -> tuple[list[str], int]:
        """The first ``most`` active keys as ``"key: held, N waiting"``, and how many are active."""
        lines = self.lines.copy()
        shown = []
        for key, line in itertools.islice(lines.items(), most):
            waiting = line.waiting if type(line) is Line or type(line) is Gate else 0
            shown.append(f"{describe(key)}: held, {waiting} waiting")
        return shown, len(lines)
