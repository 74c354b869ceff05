"""The connection slots of a PostgresBackend's threads (src/inturn/backends/postgres/_places.py).

No server: a slot is taken before any connection is made. Orderings come
from checkpoints on the slots' own line of waiting threads; the only real
waits are bounds meant to run out.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("psycopg")

from inturn.backends.postgres._connections import Connections
from inturn.backends.postgres._places import Lease
from inturn.backends.postgres._steps import Limits

from support.helpers import PATIENCE


def connections(size: int = 1) -> Connections:
    """A backend's connections that never connect (the slots come first)."""
    return Connections("postgresql://nobody@127.0.0.1:1/none", size, Limits(None, 10.0), "test")


def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached within {PATIENCE:g} s: {what}")
        time.sleep(0.001)


def parked(place: Connections, count: int) -> Callable[[], bool]:
    """Whether count threads wait for a slot of tier 0."""
    return lambda: len(place._thread_place().slots(0).waiters) == count


def waiter(place: Connections, got: list[str], name: str) -> threading.Thread:
    """A thread that waits for a slot of tier 0 (as a turn's SLOT op does), then notes it."""

    def wait() -> None:
        if place.slot_sync(Lease(0), None):
            got.append(name)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


def test_a_freed_slot_goes_to_the_thread_waiting_for_it_not_to_a_newcomer() -> None:
    """A slot given back is handed to the thread waiting for it: a turn that asks at that
    moment (try_slot, the turn's first try) waits behind it, as it arrived later."""
    place = connections()
    holder = Lease(0)
    assert place.try_slot(holder)
    got: list[str] = []
    thread = waiter(place, got, "waiting")
    until(parked(place, 1), "the thread waits for the slot")
    holder.give_back()
    assert not place.try_slot(Lease(0))  # (a semaphore would let it barge in here)
    thread.join(PATIENCE)
    assert got == ["waiting"]


def test_threads_waiting_for_a_slot_get_it_in_arrival_order() -> None:
    place = connections()
    holder = Lease(0)
    assert place.try_slot(holder)
    got: list[str] = []
    threads = []
    for n in range(4):
        threads.append(waiter(place, got, f"t{n}"))
        until(parked(place, n + 1), f"t{n} waits for the slot")
    for n in range(4):
        holder.give_back()
        until(lambda n=n: len(got) == n + 1, f"t{n} takes the slot")  # type: ignore[misc]
        holder = Lease(0)
        holder.place = place._thread_place()  # (the slot t{n} took: given back next)
    holder.give_back()
    for thread in threads:
        thread.join(PATIENCE)
    assert got == ["t0", "t1", "t2", "t3"]
    assert place.try_slot(Lease(0))  # (every slot came back)


def test_a_thread_whose_wait_for_a_slot_runs_out_leaves_the_line() -> None:
    place = connections(size=1)
    holder = Lease(0)
    assert place.try_slot(holder)
    assert not place.slot_sync(Lease(0), time.monotonic() + 0.05)
    assert parked(place, 0)()
    holder.give_back()
    assert place.try_slot(Lease(0))  # (the slot is free, not handed to the one that left)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.usefixtures("collector_paused")
def test_a_thread_interrupted_while_it_waits_for_a_slot_leaves_the_line() -> None:
    """A signal handler's exception in a thread waiting for a slot: it leaves the line, so
    the slot given back next is free for the next turn, not lost to a thread gone."""
    place = connections(size=1)
    holder = Lease(0)
    assert place.try_slot(holder)

    main, left, raised = threading.get_ident(), threading.Event(), []

    def interrupt(signum: int, frame: object) -> None:
        if not raised:  # (once: see kick)
            raised.append(frame)
            raise KeyboardInterrupt("interrupted while waiting for a slot")

    def kick() -> None:
        """Signal the main thread once it waits, again until it left: a signal that comes
        just before its lock's wait begins is handled only once that wait ends."""
        until(parked(place, 1), "the main thread waits")
        while not left.wait(0.05):
            signal.pthread_kill(main, signal.SIGUSR1)

    kicker = threading.Thread(target=kick)
    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        kicker.start()
        with pytest.raises(KeyboardInterrupt):
            place.slot_sync(Lease(0), None)
    finally:
        left.set()
        kicker.join(PATIENCE)
        signal.signal(signal.SIGUSR1, previous)
    assert parked(place, 0)()
    holder.give_back()
    assert place.try_slot(Lease(0))


def test_a_turn_interrupted_while_it_checks_a_kept_connection_gives_its_slot_back() -> None:
    """A signal handler's exception in the check of a kept connection (Connections.kept,
    a turn's fast verb): the slot it took is free again, not lost with the turn, and the
    connection was closed first (issue 42: not left to the collector)."""

    class Interrupted:
        closed = False
        checked = False

        def poll(self, timeout: int) -> list[Any]:  # (its socket's poller: the check)
            if not self.checked:
                self.checked = True
                raise KeyboardInterrupt("interrupted while the kept connection was checked")
            return []

        @property
        def pgconn(self) -> Any:
            return SimpleNamespace(status=None, finish=self.close)  # (not OK: not kept)

        def close(self) -> None:
            self.closed = True

    place = connections(size=1)
    place._thread_place().slots(0)
    kept = Interrupted()
    place._thread_place().idle.append((kept, SimpleNamespace(reader=kept)))  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):
        place.kept(0)
    assert kept.closed
    assert place.try_slot(Lease(0))
