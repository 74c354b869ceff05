"""An exception from a signal handler at any point of a thread's taking of its turn.

A signal's Python handler (KeyboardInterrupt from Ctrl-C, SystemExit from
a server's SIGTERM, a SIGALRM timeout) runs in the main thread at the
start of a Python function that is called, wherever that is. Its
exception must leave nothing of the turn behind: no key held in this
process, no ticket in a file backend's line, no file left open.

Each test takes a turn again and again, traced (sys.settrace): each try
raises KeyboardInterrupt at the first Python call the thread makes at a
point not tried yet, and the tries end with one that reaches no such
point. A point is where a call is: the function called and every frame
under it, with its line. So every point any try reaches is tried, once,
in one deterministic run, without real signals. The tries are as many as
the points of a turn (a loop's later rounds, at points tried already, add
none), and each try passes the points tried before it, so work done only
once (the start of a backend's thread loop, say) is tried at each of its
points too.

Two kinds of point: ``calls`` (Interrupter), the start of each Python
function called; ``checks`` (CheckInterrupter), each point inside a
function where the running CPython checks for a signal: right after a call
returns, and at a jump it checks at (3.10: after every call and every jump
an ``if`` takes). Swept for a thread's way in, and for its way out (from
its work's end to its caller).
"""

from __future__ import annotations

import asyncio
import dis
import functools
import gc
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest

from inturn import KeyedQueue, current_turn
from inturn.backends.file import FileBackend

from support.helpers import PATIENCE

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX: the file backend"),
    # (a sweep is many tries: it may take a while on a loaded machine)
    pytest.mark.timeout(120),
]

#: How long a later turn may wait for the key before the test says it was left held.
FREE_WITHIN = 2.0
#: The Python functions a thread blocks in while it waits for a turn.
_WAITS = frozenset(
    {"until_left_blocking", "lock_blocking", "_wait_in_sync", "_ticket_sync", "wait", "answer_sync"}
)


#: Where a call is: the function it enters (at the line it starts or resumes
#: at) and each frame under it down to the test's own, as (file, function, line).
Point = tuple[tuple[str, str, int], ...]


class Interrupter:
    """A trace function that raises KeyboardInterrupt at the first Python call at an untried point.

    It counts the calls of every function but this file's (and but weak
    references' callbacks and finalizers, which the garbage collector runs,
    not the turn: an exception there is only printed). ``at`` is the point
    it fired at (None: it reached no untried point). ``waiting`` is set at
    the call of a function the thread blocks in.
    """

    def __init__(self, number: int, tried: set[Point]) -> None:
        self.number = number  #: this try's number, to name what it makes
        self.tried = tried
        self.at: Point | None = None
        self.armed = True
        self.where = ""
        self.waiting = threading.Event()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" or code.co_filename in _NOT_COUNTED:
            if code.co_filename == _TIMED_OUT:  # (the test failed: let the report be made)
                self.armed = False
            return
        if code.co_name in _WAITS:
            self.waiting.set()
        if not self.armed or code.co_name == "__del__":  # (a finalizer, that GC runs)
            return
        if _RESUMES_OUTSIDE and code.co_flags & inspect.CO_GENERATOR and frame.f_lasti > 0:
            return
        point = _point(frame)
        if point not in self.tried:
            self.armed = False
            self.at = point
            self.where = " < ".join(f"{name}:{line}" for _, name, line in point)
            raise KeyboardInterrupt(f"interrupted at {self.where}")

    def run(self, call: Callable[[], Any]) -> Any:
        """call(), traced: interrupted at the first Python call it makes at an untried point."""
        sys.settrace(self)  # type: ignore[arg-type]
        try:
            return call()
        finally:
            sys.settrace(None)


def _point(frame: FrameType | None) -> Point:
    """Where frame's call is: it and each frame under it, down to this file's."""
    point = []
    while frame is not None and frame.f_code.co_filename not in _NOT_COUNTED:
        point.append((frame.f_code.co_filename, frame.f_code.co_name, frame.f_lineno))
        frame = frame.f_back
    return tuple(point)


class CheckInterrupter(Interrupter):
    """An Interrupter that raises where CPython checks for a pending signal inside a function,
    not only at its start: right after a call returns, and after a jump it checks at.

    Traced instruction by instruction (``f_trace_opcodes``), it fires before the first
    instruction, at an untried point, that follows a call where the running CPython
    checks (3.10: after every call; later ones: after a call into C, as a Python
    function's call and return are made inside the eval loop), or that is the target of
    a jump taken where it checks (3.10: each conditional jump and each absolute one,
    forward too; later: each backward one). 3.10 does not check before an instruction
    that opens a ``try``, a ``with`` or an ``async with``, nor does this. Issue 41's
    storm on 3.10 found a turn whose way out an interrupt at such a jump left held.
    """

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if event == "call" and frame.f_back is not None:
            self._entered.add(id(frame.f_back))  # (its call ran Python: see _CALL_CHECKS)
        if code.co_filename in _NOT_COUNTED:
            if code.co_filename == _TIMED_OUT:
                self.armed = False
            return None
        if event == "call":
            if code.co_name in _WAITS:
                self.waiting.set()
            if not self.armed or code.co_name == "__del__":
                return None
            frame.f_trace = self  # (3.13: else only a code's first frame is traced so)
            frame.f_trace_opcodes = True
            if _RETRACE:
                sys.settrace(self)  # type: ignore[arg-type]  # (3.12: see _RETRACE)
            self._last[id(frame)] = -1
            return self
        if event != "opcode" or not self.armed:
            return self
        here, last = frame.f_lasti, self._last.get(id(frame), -1)
        self._last[id(frame)] = here
        entered = id(frame) in self._entered
        self._entered.discard(id(frame))
        if last < 0:
            return self
        instructions = _instructions(code)
        before, now = instructions.get(last), instructions.get(here)
        if before is None or now is None or now.opname in _UNCHECKED_BEFORE:
            return self
        if (before.opname in _CALLS and (_CALL_CHECKS or not entered)) or (
            before.opname in _CHECKED_JUMPS and here == before.argval and _checks_at(before)
        ):
            point = ((code.co_filename, code.co_name, here), *_point(frame.f_back))
            if point not in self.tried:
                self.armed = False
                self.at = point
                self.where = f"{code.co_name}:{frame.f_lineno} (after {before.opname})" + "".join(
                    f" < {name}:{line}" for _, name, line in point[1:]
                )
                raise KeyboardInterrupt(f"interrupted at {self.where}")
        return self

    def run(self, call: Callable[[], Any]) -> Any:
        self._last: dict[int, int] = {}  # id(frame) -> its last instruction (frames hold turns)
        self._entered: set[int] = set()  # id(frame) of those whose last call ran Python code
        return super().run(call)


#: 3.12 traces a frame's instructions only once tracing is set again after its call event
#: asked for them (f_trace_opcodes); 3.11 and 3.13 at once (and 3.13 not if it is set again).
_RETRACE = sys.version_info[:2] == (3, 12)
#: Whether CPython checks after every call returns (3.10), not only after a call into C.
_CALL_CHECKS = sys.version_info < (3, 11)
#: The instructions that call (after which CPython 3.10 checks, later ones after C's).
_CALLS = frozenset(
    {"CALL", "CALL_KW", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_FUNCTION_EX", "CALL_METHOD"}
)
#: The jumps CPython may check at, taken (see _checks_at).
_CHECKED_JUMPS = frozenset(
    {"JUMP_ABSOLUTE", "POP_JUMP_IF_FALSE", "POP_JUMP_IF_TRUE", "JUMP_IF_FALSE_OR_POP"}
    | {"JUMP_IF_TRUE_OR_POP", "JUMP_BACKWARD", "POP_JUMP_BACKWARD_IF_FALSE"}
    | {"POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE"}
)
#: 3.10 does not check before these (its eval loop goes on to them at once).
_UNCHECKED_BEFORE = (
    frozenset({"SETUP_FINALLY", "SETUP_WITH", "BEFORE_ASYNC_WITH", "YIELD_FROM"})
    if sys.version_info < (3, 11)
    else frozenset()
)


def _checks_at(jump: dis.Instruction) -> bool:
    """Whether the running CPython checks for signals at jump, taken: 3.10 at each of the
    set above, later ones at backward jumps only."""
    return sys.version_info < (3, 11) or jump.argval < jump.offset


@functools.cache
def _instructions(code: CodeType) -> dict[int, dis.Instruction]:
    return {instruction.offset: instruction for instruction in dis.get_instructions(code)}


#: Before 3.11, a trace function's exception at a generator's resume ends the
#: generator at once, outside its handlers; a signal's comes inside them,
#: at the resumed instruction. Those points are not tried there.
_RESUMES_OUTSIDE = sys.version_info < (3, 11)


#: pytest-timeout's module: its SIGALRM handler runs on top of a try that
#: took too long; an interrupt raised in it (or in the report it makes)
#: would stop the report and hang the test.
_TIMED_OUT = getattr(sys.modules.get("pytest_timeout"), "__file__", None)

_NOT_COUNTED = frozenset(
    {__file__, os.path.join(os.path.dirname(__file__), "support", "helpers.py"), _TIMED_OUT}
    | {module.__file__ for module in (sys.modules["weakref"], sys.modules["_weakrefset"])}
)


def open_files() -> set[str]:
    gc.collect()
    return set(os.listdir("/proc/self/fd"))


@contextmanager
def holder(take: Callable[[], Any], release: threading.Event) -> Iterator[None]:
    """A thread holds a turn (take() is its context manager) until release is set."""
    held = threading.Event()

    def hold() -> None:
        with take():
            held.set()
            release.wait(PATIENCE)

    thread = threading.Thread(target=hold, name="holder")
    thread.start()
    try:
        assert held.wait(PATIENCE), "the holder never took its turn"
        yield
    finally:
        release.set()
        thread.join(PATIENCE)


def free_in_another_thread(take: Callable[[], Any]) -> str | None:
    """Take a turn (take(): its context manager) in another thread: None, or why it failed."""
    outcome: list[str | None] = []

    def go() -> None:
        try:
            with take():
                outcome.append(None)
        except BaseException as error:  # reported
            outcome.append(f"{type(error).__name__}: {error}")

    thread = threading.Thread(target=go, name="next turn")
    thread.start()
    thread.join(PATIENCE)
    return outcome[0] if outcome else "the next turn hung"


def _note(into: list[str], what: Any) -> None:
    """An unraisable exception (a finalizer's warning, say), noted into into."""
    into.append(f"{type(what.exc_value).__name__}: {what.exc_value}")


def each_interrupt(
    trial: Callable[[Interrupter], str | None], kind: type[Interrupter] = Interrupter
) -> None:
    """Run trial interrupted at each point in turn, until a try reaches no untried point.

    trial returns what it found left behind (None: nothing). The test fails
    with every point that left something, and every one after which the
    garbage collector found something left open (a connection: a
    ResourceWarning); and if the last try, uninterrupted, left something.

    The objects made before the sweep are frozen (gc.freeze) for its length:
    each try's collections then look at the objects made since, which hold
    all that a try can leave behind, and not at the session's.
    """
    left: list[str] = []
    tried: set[Point] = set()
    gc.collect()
    gc.freeze()
    try:
        while True:
            interrupter = kind(len(tried) + 1, tried)
            found = _try(trial, interrupter)
            if interrupter.at is None:
                if found is not None:
                    left.append(f"uninterrupted: {found}")
                break
            tried.add(interrupter.at)
            if found is not None:
                left.append(f"try {interrupter.number}, at {interrupter.where}: {found}")
    finally:
        gc.unfreeze()
    # (the shortest shape, a free key alone, makes some 8 calls, and closes a file)
    least = 5 if kind is Interrupter else 1
    assert len(tried) >= least, f"only {len(tried)} points were tried: is tracing working?"
    assert not left, "an interrupt left the turn behind:\n" + "\n".join(left)


def _try(trial: Callable[[Interrupter], str | None], interrupter: Interrupter) -> str | None:
    """trial(interrupter): what it found left, with what the collector found left open."""
    unraisable: list[str] = []
    hook, sys.unraisablehook = sys.unraisablehook, partial(_note, unraisable)
    try:
        found = trial(interrupter)
        gc.collect()
    finally:
        sys.unraisablehook = hook
    if unraisable:
        found = "; ".join(filter(None, [found, *unraisable]))
    return found


# -- a file backend's own taking -----------------------------------------------------------------


@pytest.mark.parametrize("kind", [Interrupter, CheckInterrupter], ids=["calls", "checks"])
@pytest.mark.parametrize("contended", [False, True], ids=["free", "held"])
@pytest.mark.parametrize("latest", [False, True], ids=["plain", "latest"])
def test_an_interrupt_anywhere_in_a_file_backends_taking_leaves_no_ticket(
    tmp_path: Path, contended: bool, kind: type[Interrupter], latest: bool
) -> None:
    """FileBackend.acquire_sync either puts a grant into its caller's list, or raises having
    left nothing; and so does acquire_latest_sync, whose turn, once it comes, reads the line
    file again to judge it (see _line._judged)."""

    def trial(interrupter: Interrupter) -> str | None:
        place = tmp_path / f"lines-{interrupter.number}"
        backend, other = FileBackend(place), FileBackend(place)
        backend.line("k"), other.line("k")  # (each opens the directory at its first use)
        release = threading.Event()
        with (
            holder(lambda: KeyedQueue(backend=other).keyed("k"), release)
            if contended
            else (_nothing())
        ):
            before = open_files()
            threading.Thread(
                target=lambda: interrupter.waiting.wait(PATIENCE) and release.set(), daemon=True
            ).start()
            grants: list[Any] = []  # (where the grant goes as it is made: see acquire_sync)
            try:
                interrupter.run(
                    (lambda: backend.acquire_latest_sync("k", PATIENCE, lambda: 1, grants))
                    if latest
                    else (lambda: backend.acquire_sync("k", PATIENCE, grants))
                )
            except KeyboardInterrupt:
                pass
            finally:  # (the caller's clean-up: a grant it got, it gives back)
                for grant in grants:
                    backend.release_sync(grant)
        interrupter.waiting.set()
        try:
            next_grant = other.acquire_sync("k", FREE_WITHIN)
        except TimeoutError:
            return "the key stayed held"
        other.release_sync(next_grant)
        leaked = open_files() - before
        return f"{len(leaked)} file(s) left open" if leaked else None

    each_interrupt(trial, kind)


@pytest.mark.parametrize("kind", [Interrupter, CheckInterrupter], ids=["calls", "checks"])
def test_an_interrupt_anywhere_in_a_file_backends_release_leaves_no_file_open(
    tmp_path: Path, kind: type[Interrupter]
) -> None:
    """FileBackend.release_sync interrupted anywhere (its hand-off, its tidy of the line
    file), then released again as its caller's clean-up (a grant released already is
    released as a no-op): the key is free, and no file of the turn stays open (a line file
    left open, shared-locked, would keep every later tidy from deleting it)."""

    def trial(interrupter: Interrupter) -> str | None:
        place = tmp_path / f"lines-{interrupter.number}"
        backend, other = FileBackend(place), FileBackend(place)
        backend.line("k"), other.line("k")  # (each opens the directory at its first use)
        before = open_files()
        grant = backend.acquire_sync("k", PATIENCE)
        try:
            interrupter.run(lambda: backend.release_sync(grant))
        except KeyboardInterrupt:
            backend.release_sync(grant)
        try:
            next_grant = other.acquire_sync("k", FREE_WITHIN)
        except TimeoutError:
            return "the key stayed held"
        other.release_sync(next_grant)
        leaked = open_files() - before
        return f"{len(leaked)} file(s) left open" if leaked else None

    each_interrupt(trial, kind)


# -- a thread's whole taking, through the queue ---------------------------------------------------


#: The shapes of a thread's turn: its queue's kind and options, and the key its holder holds.
SHAPES = {
    "alone": ("memory", {}, "k"),  # one key, untimed: the turn taken alone (no steps)
    "steps": ("memory", {"timeout": PATIENCE}, "k"),  # timed: taken by its steps
    "slot": ("memory", {"max_running": 1}, "other"),  # it waits for a running slot
    # latest wins: it waits on its ticket, is handed the key, and starts its work
    "latest": ("memory", {"pending": "latest"}, "k"),
    "file": ("file", {}, "k"),  # a shared backend: the backend's grant too
    "redis": ("redis", {}, "k"),  # a thread's calls run on the backend's loop
    # a thread's own connection: a new key's record goes ahead of its wait (issue 45)
    "postgres": ("postgres", {}, "k"),
}


def _queues(
    kind: str, options: dict[str, Any], request: pytest.FixtureRequest
) -> tuple[KeyedQueue, KeyedQueue]:
    """The queue under test and another of the same place (for a server's: another process's).

    Their backends are closed at the test's end (a Redis one's subscription
    would otherwise outlive the session's server, and say so on stderr).
    """
    if kind == "memory":
        queue = KeyedQueue(**options)
        return queue, queue
    place = request.getfixturevalue("tmp_path") / "lines"
    namespace = request.getfixturevalue("namespace")
    url = "" if kind == "file" else request.getfixturevalue(f"{kind}_url")

    def make() -> Any:
        if kind == "redis":
            from inturn.backends.redis import RedisBackend

            backend: Any = RedisBackend.from_url(url, namespace=namespace)
        elif kind == "postgres":
            from inturn.backends.postgres import PostgresBackend

            backend = PostgresBackend.from_url(url, namespace=namespace)
        else:
            backend = FileBackend(place)
            backend.line("k")  # (it opens the directory at its first use: not a turn's file)
        request.addfinalizer(lambda: asyncio.run(backend.aclose()))
        return backend

    return KeyedQueue(backend=make(), **options), KeyedQueue(backend=make(), **options)


#: The PostgreSQL backend's package: its shape is swept there only (psycopg's connect alone
#: makes thousands of calls, and an interrupt in it leaves nothing: there is no connection).
_POSTGRES = str(Path(__file__).resolve().parent.parent / "src" / "inturn" / "backends" / "postgres")


class PostgresInterrupter(Interrupter):
    """An Interrupter that fires at calls of the PostgreSQL backend's own code only."""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if frame.f_code.co_filename.startswith(_POSTGRES):
            super().__call__(frame, event, arg)


class PostgresCheckInterrupter(CheckInterrupter):
    """A CheckInterrupter that fires inside the PostgreSQL backend's own code only."""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and not frame.f_code.co_filename.startswith(_POSTGRES):
            if frame.f_back is not None:
                self._entered.add(id(frame.f_back))  # (its call ran Python: see _CALL_CHECKS)
            return None
        return super().__call__(frame, event, arg)


#: The shapes whose taking is swept at every check (CheckInterrupter): all of them.
CHECKED = frozenset(SHAPES)
#: The kinds of sweep of each shape, and their names.
_SWEEPS = {"postgres": (PostgresInterrupter, PostgresCheckInterrupter)}
_KINDS = {
    Interrupter: "calls",
    CheckInterrupter: "checks",
    PostgresInterrupter: "calls",
    PostgresCheckInterrupter: "checks",
}


@pytest.mark.parametrize("contended", [False, True], ids=["free", "held"])
@pytest.mark.parametrize(
    ("shape", "kind"),
    [
        (shape, kind)
        for shape in SHAPES
        for kind in _SWEEPS.get(shape, (Interrupter, CheckInterrupter))
        if kind is not CheckInterrupter or shape in CHECKED
    ],
    ids=lambda value: _KINDS.get(value, value),
)
def test_an_interrupt_anywhere_in_a_threads_taking_leaves_the_key_free(
    request: pytest.FixtureRequest, shape: str, contended: bool, kind: type[Interrupter]
) -> None:
    """run_sync interrupted before its work: the work did not run, the key is free everywhere.

    Each try takes a key of its own, so that one left held shows in its own try only.
    (A server's connections open as they are needed: files are counted in process only.)
    """
    backend, options, held_key = SHAPES[shape]
    queue, other = _queues(backend, options, request)

    def trial(interrupter: Interrupter) -> str | None:
        key = f"k{interrupter.number}"
        holds = f"{held_key}{interrupter.number}"
        ran: list[int] = []

        def work() -> None:
            interrupter.armed = False  # the turn is taken: its end is not under test here
            ran.append(1)

        release = threading.Event()
        with holder(lambda: other.keyed(holds), release) if contended else _nothing():
            before = open_files()
            threading.Thread(
                target=lambda: interrupter.waiting.wait(PATIENCE) and release.set(), daemon=True
            ).start()
            interrupted = False
            try:
                interrupter.run(lambda: queue.run_sync(key, work))
            except KeyboardInterrupt:
                interrupted = True
        interrupter.waiting.set()
        problems = []
        if interrupted and ran:
            problems.append("the work ran, yet the caller was told it was interrupted")
        if queue.is_active(key):
            problems.append("the key is still active in its queue")
        if current_turn() is not None:
            problems.append(f"current_turn() still names a turn ({current_turn()!r})")
        failed = free_in_another_thread(lambda: other.keyed(key, timeout=FREE_WITHIN))
        if failed is not None:
            problems.append(f"a later turn failed ({failed})")
        leaked = open_files() - before
        if leaked and backend in ("memory", "file"):
            problems.append(f"{len(leaked)} file(s) left open")
        return "; ".join(problems) or None

    each_interrupt(trial, kind)


#: (run_sync takes one key: the pair's way out is keyed()'s alone)
_NO_SUCH = ("pair", "run_sync")
#: The shapes of a thread's way out: its queue's options, its turn's keys but the first, and
#: what the other thread waits for: the turn's key (its line) or another key (a slot).
ENDINGS: dict[str, tuple[dict[str, Any], tuple[str, ...], str]] = {
    "alone": ({}, (), "key"),  # one key, untimed: the turn taken alone (no steps)
    "steps": ({"timeout": PATIENCE}, (), "key"),  # timed: taken by its steps
    "pair": ({}, ("b",), "key"),  # two keys: taken by steps, each released
    "slot": ({"max_running": 1}, (), "key"),  # a running slot too
    "slot-handed": ({"max_running": 1}, (), "slot"),  # its slot goes to a thread waiting
    "latest": ({"pending": "latest"}, (), "key"),  # a conflating call: its Latest ends too
    # a key of two holders (a gate), the other place held throughout: its place goes to
    # the thread waiting
    "gate": ({"concurrency": 2}, (), "key"),
}


@pytest.mark.parametrize("kind", [Interrupter, CheckInterrupter], ids=["calls", "checks"])
@pytest.mark.parametrize(
    ("shape", "how"),
    [(shape, how) for shape in ENDINGS for how in ("with", "run_sync") if (shape, how) != _NO_SUCH],
)
def test_an_interrupt_anywhere_in_a_threads_ending_of_its_turn_leaves_the_key_free(
    shape: str, how: str, kind: type[Interrupter]
) -> None:
    """A thread's turn interrupted as it ends, from its work's end to its caller: the work ran
    once, a thread waiting for the key gets its turn, and the key ends free.

    (Issue 41's storm on 3.10 found a way out that an interrupt at a jump left held.)
    """
    options, more, waits_for = ENDINGS[shape]
    queue = KeyedQueue(**options)

    def trial(interrupter: Interrupter) -> str | None:
        key = f"k{interrupter.number}"
        keys = (key, *(f"{key}{suffix}" for suffix in more))
        theirs = keys if waits_for == "key" else (f"other{interrupter.number}",)
        ran: list[int] = []
        waited: list[str | None] = []
        waiter = threading.Thread(
            target=lambda: waited.append(
                free_in_another_thread(lambda: queue.keyed(*theirs, timeout=2 * FREE_WITHIN))
            ),
            name="waiter",
        )

        def waiting() -> bool:
            if waits_for == "key":
                return sum(queue.pending(k) for k in keys) >= 1
            return queue.stats().waiting_for_slot >= 1

        def work() -> None:
            ran.append(1)
            waiter.start()  # (it waits for the turn, or the slot: the way out hands it on)
            if not _until(waiting):
                waited.append("the waiter never waited")
            interrupter.armed = True  # from here to the caller: the way out

        def take() -> None:
            if how == "with":
                with queue.keyed(*keys):
                    work()
            else:
                queue.run_sync(key, work)

        interrupter.armed = False
        with _other_holder(queue, key) if "concurrency" in options else _nothing():
            try:
                interrupter.run(take)
            except KeyboardInterrupt:
                pass
            waiter.join(PATIENCE)
        problems = []
        if len(ran) != 1:
            problems.append(f"the work ran {len(ran)} times")
        if waiter.is_alive() or waited != [None]:
            problems.append(f"the thread waiting for the key never got its turn ({waited})")
        if any(queue.is_active(k) for k in keys):
            problems.append("the key is still active in its queue")
        failed = free_in_another_thread(lambda: queue.keyed(*keys, timeout=FREE_WITHIN))
        if failed is not None:
            problems.append(f"a later turn failed ({failed})")
        return "; ".join(problems) or None

    each_interrupt(trial, kind)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _other_holder(queue: KeyedQueue, key: str) -> Iterator[None]:
    """A thread holding one of key's places while the block runs (a key of several holders)."""
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with queue.keyed(key):
            holding.set()
            done.wait(PATIENCE)

    thread = threading.Thread(target=hold, name="other holder")
    thread.start()
    assert holding.wait(PATIENCE)
    try:
        yield
    finally:
        done.set()
        thread.join(PATIENCE)


# -- latest wins: a call that replaces another's waiting work ---------------------------------


@pytest.mark.parametrize("kind", [Interrupter, CheckInterrupter], ids=["calls", "checks"])
@pytest.mark.parametrize("on_superseded", ["join", "raise"])
def test_an_interrupt_anywhere_in_a_replacing_call_leaves_the_replaced_caller_answered(
    on_superseded: str, kind: type[Interrupter]
) -> None:
    """A newer call interrupted as it replaces an older one's waiting work: the older caller
    is answered (its own work ran, or the newer work's outcome, or Superseded), never left
    waiting; each work runs at most once; the key ends free.

    An interrupt before the replacement leaves the older work in its place; after it,
    the replaced caller has its answer, whatever of the newer call's entry was cut short.
    """
    queue = KeyedQueue(pending="latest", on_superseded=on_superseded)  # type: ignore[arg-type]

    def trial(interrupter: Interrupter) -> str | None:
        key = f"k{interrupter.number}"
        ran: list[str] = []
        older: list[object] = []

        def work(name: str) -> str:
            interrupter.armed = False  # the turn is taken: its end is not under test here
            ran.append(name)
            return name

        def call_older() -> None:
            try:
                older.append(queue.run_sync(key, work, "older"))
            except BaseException as error:  # reported
                older.append(error)

        release = threading.Event()
        with holder(lambda: queue.keyed(key), release):
            thread = threading.Thread(target=call_older, name="older")
            thread.start()
            assert _until(lambda: queue.pending(key) == 1), "the older call never waited"
            threading.Thread(
                target=lambda: interrupter.waiting.wait(PATIENCE) and release.set(), daemon=True
            ).start()
            try:
                interrupter.run(lambda: queue.run_sync(key, work, "newer"))
            except KeyboardInterrupt:
                pass
        interrupter.waiting.set()
        thread.join(PATIENCE)
        problems = []
        if thread.is_alive() or not older:
            problems.append("the older caller was never answered")
        if len(ran) != len(set(ran)):
            problems.append(f"a work ran twice ({ran})")
        if queue.is_active(key):
            problems.append("the key is still active in its queue")
        failed = free_in_another_thread(lambda: queue.keyed(key, timeout=FREE_WITHIN))
        if failed is not None:
            problems.append(f"a later turn failed ({failed})")
        return "; ".join(problems) or None

    each_interrupt(trial, kind)


def _until(done: Callable[[], bool]) -> bool:
    """Whether done() becomes true within PATIENCE (checked as another thread gets there)."""
    deadline = time.monotonic() + PATIENCE
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
