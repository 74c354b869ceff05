"""queue_by_key: the decorator, built on wrapt so functions and methods keep their identity.

wrapt's part, the wrapper classes, is ``_wrapped``: imported at the first
decoration, not with ``import inturn`` (see there).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Coroutine, Hashable
from types import FunctionType
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Final,
    NamedTuple,
    ParamSpec,
    Protocol,
    TypeVar,
    final,
    overload,
)

from ._checks import Policy
from ._checks import Unset as _Unset
from ._checks import check_hold as _check_hold
from ._checks import check_timeout as _check_timeout
from ._describe import describe, function_name
from ._keyspec import KeyFunction, KeySpec, KeysSpec, compile_key
from ._tasks import current_task as _current_task
from ._tasks import in_loop_of, outside_asyncio

if TYPE_CHECKING:
    from ._queue import KeyedQueue

P = ParamSpec("P")
P2 = ParamSpec("P2")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
T = TypeVar("T")

# (key, args, kwargs) -> the coroutine that runs the decorated function in key's turn
_Start = Callable[[Any, tuple[Any, ...], dict[str, Any]], Coroutine[Any, Any, Any]]


class Runner(NamedTuple):
    """What the decorator uses of a queue: the queue builds it (see KeyedQueue.queue_by_key)."""

    #: The queue; its ``run`` takes a call's turn on one key with its settings (the hot path).
    queue: KeyedQueue
    #: ``(keys, fn, args, kwargs, timeout, max_hold, task, policy)``: several keys, or
    #: settings of the call's own.
    run_keyed: Callable[..., Coroutine[Any, Any, Any]]
    #: ``(keys, fn, args, kwargs, timeout, policy)``: the same for a thread, blocking it.
    run_keyed_sync: Callable[..., Any]
    #: The queue's conflation (pending, on_superseded, debounce, max_wait).
    policy: Policy


class QueuedFunction(Protocol[P, R_co]):
    """An ``async def`` function whose calls queue by key: what ``queue_by_key`` returns.

    Calling it returns a coroutine; the call is submitted to its key's line
    when that coroutine starts running. The key is computed by the call
    itself: arguments the key template cannot format (a missing attribute
    or item, a ``__format__`` that raises) raise there, and nothing runs.
    The exception is of the original's kind: a new one of the same builtin
    class (``AttributeError``, ``KeyError``...) naming the template, the
    field, the parameter and the function, with the original as its
    ``__cause__``; or the user's own exception itself, with those words as
    a note.
    """

    @property
    def queue(self) -> KeyedQueue:
        """The queue the calls wait in."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R_co]: ...

    def key_of(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """The key (a tuple of keys for ``keys=``) a call with these arguments would use."""

    @overload
    def __get__(
        self, instance: None, owner: type[Any] | None = None, /
    ) -> QueuedFunction[P, R_co]: ...

    @overload
    def __get__(
        self: QueuedFunction[Concatenate[T, P2], R_co],
        instance: T,
        owner: type[Any] | None = None,
        /,
    ) -> QueuedFunction[P2, R_co]: ...


class SyncQueuedFunction(Protocol[P, R_co]):
    """A plain ``def`` function whose calls queue by key: what ``queue_by_key`` returns for it.

    Calling it blocks the calling thread until the key's turn, runs the
    function, and returns its result (see ``KeyedQueue.run_sync``). Arguments
    the key template cannot format raise before any wait, as for
    :class:`QueuedFunction`.
    """

    @property
    def queue(self) -> KeyedQueue:
        """The queue the calls wait in."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def key_of(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """The key (a tuple of keys for ``keys=``) a call with these arguments would use."""

    @overload
    def __get__(
        self, instance: None, owner: type[Any] | None = None, /
    ) -> SyncQueuedFunction[P, R_co]: ...

    @overload
    def __get__(
        self: SyncQueuedFunction[Concatenate[T, P2], R_co],
        instance: T,
        owner: type[Any] | None = None,
        /,
    ) -> SyncQueuedFunction[P2, R_co]: ...


class Decorator(Protocol):
    """What ``queue_by_key(...)`` called with settings returns: it decorates a function."""

    @overload
    def __call__(  # type: ignore[overload-overlap]  # a coroutine function is decorated
        self, fn: Callable[P, Coroutine[Any, Any, R]], /
    ) -> QueuedFunction[P, R]: ...

    @overload
    def __call__(self, fn: Callable[P, R], /) -> SyncQueuedFunction[P, R]: ...


@final
class _Flight:
    """A coalescing function's call in flight, and its joiners (each woken in its own loop)."""

    __slots__ = ("joiners", "task")

    def __init__(self, task: object) -> None:
        self.task = task
        self.joiners: list[asyncio.Future[Any]] = []

    def finish(self, error: BaseException | None, result: Any) -> None:
        """Wake every joiner with the call's outcome; call once nobody can join any more."""
        for joiner in self.joiners:
            in_loop_of(joiner, _settle, joiner, error, result)


def _settle(joiner: asyncio.Future[Any], error: BaseException | None, result: Any) -> None:
    if joiner.done():  # that joiner was cancelled
        return
    if error is None:
        joiner.set_result(result)
    elif isinstance(error, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
        joiner.set_result(_RERUN)
    else:
        joiner.set_exception(error)


#: What a joiner gets when the call it joined did not finish (was cancelled).
_RERUN: Final = object()


def _coalescing(start: _Start) -> _Start:
    """Wrap start so that a call joins an in-flight call with the same key.

    Joining a flight and ending it happen under one lock shared by every loop
    and thread, so a call either joins before the end (and is woken by it) or starts its own.
    """
    flights: dict[Hashable, _Flight] = {}
    lock = threading.Lock()

    async def coalesced(key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            task = _current_task()
        except RuntimeError:
            raise outside_asyncio("a queue_by_key(coalesce=True) function") from None
        loop = task.get_loop() if task is not None else asyncio.get_running_loop()
        while True:
            with lock:
                flight = flights.get(key)
                if flight is None:
                    flight = flights[key] = _Flight(task)
                    break
                if flight.task is task:  # a reentrant call: run it inside the turn
                    flight = None
                    break
                joiner: asyncio.Future[Any] = loop.create_future()
                flight.joiners.append(joiner)
            outcome = await joiner
            if outcome is not _RERUN:
                return outcome
        if flight is None:
            return await start(key, args, kwargs)
        try:
            result = await start(key, args, kwargs)
        except BaseException as error:
            with lock:
                del flights[key]
            flight.finish(error, None)
            raise
        with lock:
            del flights[key]
        flight.finish(None, result)
        return result

    return coalesced


def is_decoratable(obj: object) -> bool:
    """Whether obj, queue_by_key's argument by position, is a function (not None) to decorate.

    :raises TypeError: anything else but None, with the fix (``key=``, or ``queue_by_key()(...)``).
    """
    if obj is None:
        return False
    function = obj.__func__ if isinstance(obj, classmethod | staticmethod) else obj
    if isinstance(function, FunctionType):
        if function.__name__ == "<lambda>":
            raise TypeError(
                "inturn: queue_by_key() got a lambda by position; a key function goes in key=: "
                "queue_by_key(key=lambda args: ...)"
            )
        return True
    shown = describe(obj)
    if not callable(function):
        raise TypeError(
            "inturn: queue_by_key() takes the function to decorate by position, not a key; "
            f"got {shown}: write @queue_by_key(key={shown})"
        )
    raise TypeError(
        f"inturn: queue_by_key() takes a def or async def by position, and got {shown}: "
        "a key function goes in key=, as in @queue_by_key(key=lambda args: ...); "
        "another callable is decorated by the called form, queue_by_key()(...)"
    )


def decorate(
    runner: Runner,
    fn: Any,
    key: KeySpec,
    keys: KeysSpec | None,
    timeout: float | _Unset | None,
    coalesce: bool,
    max_hold: float | _Unset | None,
    policy: Policy,
) -> Any:
    """Apply queue_by_key to fn, or return the decorator when fn is None (``policy``: its
    conflation, checked)."""
    queue = runner.queue
    limit = queue.timeout if isinstance(timeout, _Unset) else _check_timeout(timeout)
    hold = queue.max_hold if isinstance(max_hold, _Unset) else _check_hold(max_hold)
    if not isinstance(coalesce, bool):
        raise TypeError(f"inturn: coalesce must be True or False, got {describe(coalesce)}")
    if coalesce and policy.conflates and policy is not runner.policy:
        raise TypeError(
            "inturn: coalesce=True joins a call in flight, and pending='latest' or debounce "
            "replaces a waiting call; use one or the other"
        )
    if keys is not None and policy.conflates and policy is not runner.policy:
        raise TypeError(
            "inturn: pending='latest' and debounce replace one key's waiting work; "
            "a keys= function takes several keys at once"
        )
    if fn is None:
        return lambda fn: decorate(runner, fn, key, keys, limit, coalesce, hold, policy)
    kind = type(fn) if isinstance(fn, classmethod | staticmethod) else FunctionType
    target = fn.__func__ if kind is not FunctionType else fn
    if not callable(target) or isinstance(target, type):
        raise TypeError(
            f"inturn: queue_by_key() decorates functions and methods; got {describe(fn)}"
        )
    sync = not inspect.iscoroutinefunction(target)  # its calls block their thread for the turn
    if sync and hold is not None:
        raise TypeError(
            f"inturn: max_hold={hold:g} s cannot cut a thread's turn short, and "
            f"{function_name(target)} is a plain def (its calls block their thread); "
            "decorate an async def, or leave max_hold out"
        )
    if sync and coalesce:
        raise TypeError(
            "inturn: coalesce=True is for async def functions; "
            f"{function_name(target)} is a plain def"
        )
    extract, several = compile_key(target, key, keys)
    if sync:
        run_keyed_sync = runner.run_keyed_sync

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            found = extract(args, kwargs)
            keys = found if several else (found,)
            return run_keyed_sync(keys, target, args, kwargs, limit, policy)

    else:
        call = _async_call(runner, target, extract, several, limit, coalesce, hold, policy)
    from ._wrapped import Queued  # wrapt, at the first decoration: see _wrapped

    queued = type("_Queued", (Queued,), {"__call__": call, "__module__": __name__})
    return queued(fn, kind, queue, extract)


def _async_call(
    runner: Runner,
    target: Callable[..., Any],
    extract: KeyFunction,
    several: bool,
    limit: float | None,
    coalesce: bool,
    hold: float | None,
    policy: Policy,
) -> Callable[..., Any]:
    """The __call__ of an async def's wrapper: (self, *args, **kwargs) -> the turn's coroutine."""
    queue = runner.queue
    own = policy != runner.policy
    if several or limit != queue.timeout or hold != queue.max_hold or own:
        # keys=, or settings of its own: turns are taken as keyed() takes them
        run_keyed = runner.run_keyed

        def start(
            key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Coroutine[Any, Any, Any]:
            keys = key if several else (key,)
            return run_keyed(keys, target, args, kwargs, limit, hold, None, policy)

    else:
        run = runner.queue.run

        def start(
            key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Coroutine[Any, Any, Any]:
            return run(key, target, *args, **kwargs)

        if not coalesce:
            # The hot path: straight into what queue.run() does.
            def hot(self: Any, *args: Any, **kwargs: Any) -> Any:
                return run(extract(args, kwargs), target, *args, **kwargs)

            return hot

    begin: _Start = _coalescing(start) if coalesce else start

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return begin(extract(args, kwargs), args, kwargs)

    return call
