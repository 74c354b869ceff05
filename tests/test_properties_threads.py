"""Random mixes of threads and asyncio tasks on one queue, driven step by step.

Threads call ``run_sync()``, a decorated plain def, or ``with keyed()``;
tasks run in an event loop in a thread of its own and call ``run()``, a
decorated async def, or ``async with keyed()``. Hypothesis draws a list of
actions: submit a caller, let one running body finish, cancel a task. Every
body, once started, holds its keys until the driver lets it go, and after
each action the driver waits until the system is quiescent (see
``Driver.quiet``): submissions are serialized, so their order is known, and
no order is ever set up by sleeping.

Whatever hypothesis generates, these must hold:

- mutual exclusion: no two bodies hold one key at once, whether threads,
  tasks, or one of each;
- FIFO: on each key, the callers that joined its line when submitted (the
  single-key ones, and those whose first key in the global order it is) and
  ran, started in submission order;
- progress: whenever a caller waits, some body runs (no deadlock, no lost
  hand-off);
- timeouts: a caller with timeout 0 raised TimeoutError, and never ran,
  exactly when one of its keys was busy at its submission; else it ran;
- no lost work: a caller that was neither cancelled nor timed out ran, and
  got its own result or its own Boom(i); a cancelled task got CancelledError;
- reentrancy: a body taking its first key again (``run_sync`` in a thread,
  ``run`` in a task) runs at once: in the same thread or task, while the
  body holds the key, a task without yielding to its loop; the key is still
  held afterwards;
- nothing left: afterwards no key is active.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inturn import KeyedQueue

from support.helpers import PATIENCE, wait_until

KEYS = ("a", "b", "c")
MAX_ACTIONS = 12


class Boom(Exception):
    pass


@dataclass(frozen=True)
class Spec:
    kind: Literal["thread", "task"]
    keys: tuple[str, ...]  # one key, or several taken with keyed()
    fails: bool  # the body raises Boom(i)
    reenter: bool  # the body takes its first key again
    timeout: float | None  # 0: TimeoutError at once if a key is busy


@dataclass(frozen=True)
class Submit:
    spec: Spec


@dataclass(frozen=True)
class Release:
    index: int  # which running body finishes (modulo how many run)


@dataclass(frozen=True)
class Cancel:
    index: int  # which task, waiting or running, is cancelled (modulo how many)


Action = Submit | Release | Cancel


@dataclass(eq=False)
class Caller:
    seq: int  # submission order
    spec: Spec
    first: Hashable  # the key it takes first: it joined that line when submitted
    busy: bool  # a key of it was held or awaited when it was submitted
    thread_gate: threading.Event = field(default_factory=threading.Event)
    task_gate: asyncio.Event = field(default_factory=asyncio.Event)
    future: concurrent.futures.Future[None] | None = None  # a task's
    thread: threading.Thread | None = None
    # Written under Driver.lock:
    started: int | None = None  # the body's place among all bodies started
    me: object = None  # the thread id or task running the body
    at_gate: bool = False  # past its reentrant call, held on its gate
    ended: bool = False  # the body returned or raised
    finished: bool = False  # the call returned or raised, its keys released
    released: bool = False  # the driver opened its gate
    cancelled: bool = False  # the driver cancelled it
    result: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class State:
    """One instant of the system: the queue's lines and the callers' progress."""

    pending: int  # sum of queue.pending(key): callers waiting in a line
    running: tuple[int, ...]  # bodies held on their gate
    between: int  # bodies started, not yet on their gate (in their reentrant call)
    finished: int
    leaving: int  # released or cancelled, not finished yet


class Driver:
    """One queue, a loop in a thread of its own, and the callers of one example."""

    def __init__(self) -> None:
        self.queue = KeyedQueue()
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="loop", daemon=True)
        self.loop_thread.start()
        self.lock = threading.Lock()
        self.callers: list[Caller] = []
        self.inside: Counter[str] = Counter()  # key -> bodies holding it now
        self.holder: dict[str, int] = {}  # key -> the last body that entered it
        self.starts = 0
        self.violations: list[str] = []

    # -- the bodies -------------------------------------------------------------

    def enter(self, caller: Caller, me: object) -> None:
        with self.lock:
            for key in caller.spec.keys:
                if self.inside[key]:
                    self.violations.append(
                        f"caller {caller.seq} entered {key!r} while caller "
                        f"{self.holder[key]} held it"
                    )
                self.inside[key] += 1
                self.holder[key] = caller.seq
            caller.started = self.starts
            self.starts += 1
            caller.me = me

    def reentered(self, caller: Caller, me: object) -> tuple[str, int]:
        key = caller.spec.keys[0]
        with self.lock:
            if me != caller.me:
                self.violations.append(f"caller {caller.seq}: the reentrant call ran elsewhere")
            if self.inside[key] != 1 or self.holder[key] != caller.seq:
                self.violations.append(f"caller {caller.seq}: reentered {key!r} it did not hold")
        return ("reentered", caller.seq)

    def after_reentry(self, caller: Caller, nested: object, yielded: bool) -> None:
        key = caller.spec.keys[0]
        with self.lock:
            if nested != ("reentered", caller.seq):
                self.violations.append(f"caller {caller.seq}: the reentrant call gave {nested!r}")
            if yielded:
                self.violations.append(f"caller {caller.seq}: the reentrant call waited")
            if not self.queue.is_active(key):
                self.violations.append(f"caller {caller.seq}: the reentrant call released {key!r}")

    def reach_gate(self, caller: Caller) -> None:
        with self.lock:
            caller.at_gate = True

    def leave(self, caller: Caller) -> None:
        with self.lock:
            for key in caller.spec.keys:
                self.inside[key] -= 1
            caller.ended = True

    def outcome(self, caller: Caller, result: Any, error: BaseException | None) -> None:
        with self.lock:
            caller.result = result
            caller.error = error
            caller.finished = True

    def thread_body(self, caller: Caller) -> str:
        self.enter(caller, threading.get_ident())
        try:
            if caller.spec.reenter:
                nested = self.queue.run_sync(
                    caller.spec.keys[0], self.reentered, caller, threading.get_ident()
                )
                self.after_reentry(caller, nested, yielded=False)
            self.reach_gate(caller)
            caller.thread_gate.wait()
            if caller.spec.fails:
                raise Boom(caller.seq)
            return f"result {caller.seq}"
        finally:
            self.leave(caller)

    async def task_body(self, caller: Caller) -> str:
        task = asyncio.current_task()
        self.enter(caller, task)
        try:
            if caller.spec.reenter:
                # Runs on the loop's next round: only if the call below yields to the loop.
                ticked: list[bool] = []
                self.loop.call_soon(ticked.append, True)
                nested = await self.queue.run(caller.spec.keys[0], self.reentered, caller, task)
                self.after_reentry(caller, nested, yielded=bool(ticked))
            self.reach_gate(caller)
            await caller.task_gate.wait()
            if caller.spec.fails:
                raise Boom(caller.seq)
            return f"result {caller.seq}"
        finally:
            self.leave(caller)

    # -- the callers ------------------------------------------------------------

    def thread_caller(self, caller: Caller) -> None:
        spec = caller.spec

        def body() -> str:
            return self.thread_body(caller)

        try:
            if len(spec.keys) > 1:
                with self.queue.keyed(*spec.keys, timeout=spec.timeout):
                    result = body()
            elif spec.timeout is None:
                result = self.queue.run_sync(spec.keys[0], self.thread_body, caller)
            else:
                result = self.queue.queue_by_key(key=spec.keys[0], timeout=spec.timeout)(body)()
        except BaseException as error:
            self.outcome(caller, None, error)
        else:
            self.outcome(caller, result, None)

    async def task_caller(self, caller: Caller) -> None:
        spec = caller.spec

        async def body() -> str:
            return await self.task_body(caller)

        try:
            if len(spec.keys) > 1:
                async with self.queue.keyed(*spec.keys, timeout=spec.timeout):
                    result = await body()
            elif spec.timeout is None:
                result = await self.queue.run(spec.keys[0], self.task_body, caller)
            else:
                limited = self.queue.queue_by_key(key=spec.keys[0], timeout=spec.timeout)
                result = await limited(body)()
        except BaseException as error:  # CancelledError too: recorded, the test checks it
            self.outcome(caller, None, error)
        else:
            self.outcome(caller, result, None)

    # -- watching ---------------------------------------------------------------

    def state(self) -> State:
        """The queue's lines and the callers' progress, both at one instant.

        Taken in the loop's thread, between two steps of its tasks, holding
        the lock under which threads (and tasks, once the queue is shared)
        change the lines: nothing changes them meanwhile. Summing pending()
        key by key without that could count a caller moving from one line to
        the next twice, and another one handed a key not at all.
        """
        answer: concurrent.futures.Future[State] = concurrent.futures.Future()

        def take() -> None:
            try:
                with self.queue._registry.mode.locked():
                    pending = sum(self.queue.pending(key) for key in KEYS)
                    with self.lock:
                        callers = self.callers
                        state = State(
                            pending=pending,
                            running=tuple(c.seq for c in callers if c.at_gate and not c.ended),
                            between=sum(c.started is not None and not c.at_gate for c in callers),
                            finished=sum(c.finished for c in callers),
                            leaving=sum(
                                (c.released or c.cancelled) and not c.finished for c in callers
                            ),
                        )
                answer.set_result(state)
            except BaseException as error:
                answer.set_exception(error)

        self.loop.call_soon_threadsafe(take)
        return answer.result(timeout=PATIENCE)

    def quiet(self) -> bool:
        """Whether every caller is running its body (on its gate), waiting in a line, or finished.

        Exact: a caller not yet in its first line, one handed a key whose
        body has not started, and one whose body ended but whose keys are
        not all released, are in none of the three. A caller waits in one
        line at a time (holding the keys before it), so it counts once. A
        caller the driver let go (opened its gate, or cancelled it) may not
        have noticed yet, and would still count in its old place: it must
        have finished. A body stuck in its reentrant call, so waiting in its
        own key's line, would count once: ``between`` catches it.
        """
        state = self.state()
        return (
            state.between == 0
            and state.leaving == 0
            and len(state.running) + state.pending + state.finished == len(self.callers)
        )

    def settle(self, what: str) -> State:
        wait_until(self.quiet, f"quiescence after {what}")
        state = self.state()
        # Every waiter waits for a key held by a body, or by a caller waiting
        # for a later key in the global order: a chain ending at a body.
        assert state.running or not state.pending, f"after {what}: callers wait, none runs"
        return state

    # -- the actions --------------------------------------------------------------

    def submit(self, spec: Spec) -> None:
        busy = any(self.queue.is_active(key) for key in spec.keys)
        first = self.queue.keyed(*spec.keys).keys[0]  # the global order of several keys
        caller = Caller(seq=len(self.callers), spec=spec, first=first, busy=busy)
        with self.lock:
            self.callers.append(caller)
        if spec.kind == "thread":
            caller.thread = threading.Thread(
                target=self.thread_caller, args=(caller,), name=f"caller-{caller.seq}", daemon=True
            )
            caller.thread.start()
        else:
            caller.future = asyncio.run_coroutine_threadsafe(self.task_caller(caller), self.loop)
        self.settle(f"submitting caller {caller.seq} {spec}")

    def open_gate(self, caller: Caller) -> None:
        with self.lock:
            caller.released = True
        if caller.spec.kind == "thread":
            caller.thread_gate.set()
        else:
            self.loop.call_soon_threadsafe(caller.task_gate.set)

    def release(self, index: int) -> None:
        running = self.state().running
        if running:
            seq = running[index % len(running)]
            self.open_gate(self.callers[seq])
            self.settle(f"releasing caller {seq}")

    def cancel(self, index: int) -> None:
        with self.lock:
            tasks = [
                c
                for c in self.callers
                if c.spec.kind == "task" and not c.finished and not c.cancelled
            ]
            if not tasks:
                return
            caller = tasks[index % len(tasks)]
            caller.cancelled = True
        assert caller.future is not None
        # cancels the task too, in its loop (asyncio chains the two futures)
        assert caller.future.cancel()
        self.settle(f"cancelling caller {caller.seq}")

    def act(self, action: Action) -> None:
        if isinstance(action, Submit):
            self.submit(action.spec)
        elif isinstance(action, Release):
            self.release(action.index)
        else:
            self.cancel(action.index)

    def finish(self) -> None:
        """Let every running body go, round after round, until every caller finished."""
        state = self.state()
        while state.finished < len(self.callers):
            for seq in state.running:
                self.open_gate(self.callers[seq])
            state = self.settle("releasing every running body")

    def close(self) -> None:
        """Let everything go and stop the loop (after a failure too, as best it can)."""
        for caller in self.callers:
            self.open_gate(caller)
            if caller.future is not None and not caller.finished:
                caller.future.cancel()
        for caller in self.callers:
            if caller.thread is not None:
                caller.thread.join(timeout=PATIENCE)
            if caller.future is not None:
                concurrent.futures.wait([caller.future], timeout=PATIENCE)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=PATIENCE)
        if not self.loop.is_running():
            self.loop.close()


specs = st.builds(
    Spec,
    kind=st.sampled_from(("thread", "task")),
    keys=st.one_of(
        st.tuples(st.sampled_from(KEYS)),
        st.lists(st.sampled_from(KEYS), min_size=2, max_size=3, unique=True).map(tuple),
    ),
    fails=st.booleans(),
    reenter=st.booleans(),
    timeout=st.sampled_from((None, None, 0.0)),
)
indexes = st.integers(0, MAX_ACTIONS - 1)
actions = st.one_of(
    specs.map(Submit),
    specs.map(Submit),
    specs.map(Submit),  # three times as many submissions as either other action
    st.builds(Release, indexes),
    st.builds(Cancel, indexes),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(actions, min_size=3, max_size=MAX_ACTIONS))
def test_invariants_hold_for_threads_and_tasks_mixed(action_list: list[Action]) -> None:
    driver = Driver()
    try:
        for action in action_list:
            driver.act(action)
        driver.finish()
    finally:
        driver.close()
    callers = driver.callers

    assert driver.violations == []
    assert driver.queue.active_count == 0

    for caller in callers:
        i, spec, error = caller.seq, caller.spec, caller.error
        assert caller.finished
        if caller.cancelled:
            assert spec.kind == "task"
            assert isinstance(error, asyncio.CancelledError), f"cancelled caller {i}: {error!r}"
            continue
        if spec.timeout is not None:
            # timeout 0: it times out exactly when a key of it was busy
            assert isinstance(error, TimeoutError) == caller.busy, f"caller {i}: {error!r}"
        if isinstance(error, TimeoutError):
            assert caller.started is None, f"caller {i} ran after timing out"
            continue
        # Neither cancelled nor timed out: it ran, with its own outcome.
        assert caller.started is not None, f"caller {i} was lost"
        assert caller.ended
        if spec.fails:
            assert isinstance(error, Boom), f"caller {i} raised {error!r}"
            assert error.args == (i,)
        else:
            assert error is None, f"caller {i} raised {error!r}"
            assert caller.result == f"result {i}"

    # FIFO among the callers that joined each key's line when submitted.
    for key in KEYS:
        ran = [c for c in callers if c.first == key and c.started is not None]
        by_start = sorted(ran, key=lambda c: c.started or 0)
        assert [c.seq for c in by_start] == sorted(c.seq for c in ran), f"key {key!r}"
