"""The only place that touches asyncio's privates; and the asyncio helpers the core shares.

The privates: the current task, cheaply (every turn asks for it on the hot
path), a selector loop's reader of a client library's socket without the
check that no transport owns it, and what is left of a backend's share of
an event loop that will never run again (closed without
``shutdown_asyncgens()``, or abandoned with its thread): its sockets closed
and its tasks let go.
"""

from __future__ import annotations

import asyncio
import operator
import sys
from collections.abc import Callable, Coroutine
from contextvars import Context
from inspect import iscoroutine
from typing import Any

#: The event loop running in this thread, or None (no error, no getpid(): in C).
loop_here: Callable[[], asyncio.AbstractEventLoop | None] = asyncio._get_running_loop

#: A task's loop: the attribute behind ``get_loop()``, on C and Python tasks
#: alike, read in C (half the cost of the call on the hot path).
loop_of: Callable[[asyncio.Task[Any]], asyncio.AbstractEventLoop] = operator.attrgetter("_loop")

if sys.version_info >= (3, 12):
    from asyncio import current_task  # implemented in C: cheap
else:  # pragma: no cover - depends on the interpreter
    from asyncio.tasks import _current_tasks  # type: ignore[attr-defined]

    #: Before 3.12: the task a loop is running a step of, if any, from
    #: asyncio's own table (see ThreadMode.current_task, which knows its loop).
    task_of_loop: Callable[[object], asyncio.Task[Any] | None] = _current_tasks.get

    # Before 3.12, asyncio.current_task() is Python, with argument handling
    # around this same lookup. (Caching the loop per thread to skip
    # get_running_loop(), whose getpid() call is most of its cost, measured
    # slower here: thread identity costs as much from Python.)
    def current_task(
        _get: Callable[[object], asyncio.Task[Any] | None] = _current_tasks.get,
        _loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.get_running_loop,
    ) -> asyncio.Task[Any] | None:
        return _get(_loop())


#: The loops whose own _add_reader and _remove_reader skip the public methods' check that
#: no transport of theirs owns the descriptor (a weak dictionary's lookup that raises and
#: catches a KeyError, each call): asyncio's selector loops (None: not as expected, the
#: public methods then).
_SELECTOR_LOOP: type[asyncio.AbstractEventLoop] | None = (
    asyncio.selector_events.BaseSelectorEventLoop
    if callable(getattr(asyncio.selector_events.BaseSelectorEventLoop, "_add_reader", None))
    and callable(getattr(asyncio.selector_events.BaseSelectorEventLoop, "_remove_reader", None))
    else None
)


def add_reader(loop: asyncio.AbstractEventLoop, fd: int, callback: Callable[[], object]) -> None:
    """``loop.add_reader(fd, callback)``, for a socket no transport of loop owns (a client
    library's): on a selector loop without the check that none does (a task's PostgreSQL
    turn, two statements, 405k to 386k instructions)."""
    if _SELECTOR_LOOP is not None and isinstance(loop, _SELECTOR_LOOP):
        loop._add_reader(fd, callback)  # type: ignore[attr-defined]
    else:
        loop.add_reader(fd, callback)


def remove_reader(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    """``loop.remove_reader(fd)``, for a socket as :func:`add_reader`'s."""
    if _SELECTOR_LOOP is not None and isinstance(loop, _SELECTOR_LOOP):
        loop._remove_reader(fd)  # type: ignore[attr-defined]
    else:
        loop.remove_reader(fd)


def retrieve(future: asyncio.Future[Any]) -> None:
    """(A done callback.) Retrieve future's outcome, so that an error nobody awaits is not
    logged as never retrieved: whoever owns it reports it otherwise, or it does not matter."""
    if not future.cancelled():
        future.exception()


def retrieve_when_closed(writer: asyncio.StreamWriter) -> None:
    """Retrieve the error a stream's connection ends with, once it ends: none is logged.

    asyncio keeps it in the protocol's close waiter (what ``wait_closed()``
    awaits), which only the protocol's ``__del__`` retrieves. A write that
    failed in ``drain()`` leaves the protocol in a reference cycle (the
    error's traceback holds drain's frame, and so the writer), and the
    collector finalizes the objects of a cycle in no set order: the waiter,
    finalized before its protocol, logs "Future exception was never retrieved".
    """
    protocol = writer.transport.get_protocol()
    closed = getattr(protocol, "_closed", None)  # (asyncio.StreamReaderProtocol's)
    if isinstance(closed, asyncio.Future):
        closed.add_done_callback(retrieve)


def in_context(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], context: Context
) -> asyncio.Task[Any]:
    """A task of loop that runs coro in context (contextvars)."""
    if sys.version_info >= (3, 11):
        return loop.create_task(coro, context=context)
    return context.run(loop.create_task, coro)  # pragma: no cover - depends on the interpreter


def in_caller_context(
    context: Context,
    home: asyncio.AbstractEventLoop | None,
    fn: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Call a newer caller's work in its context (contextvars): a coroutine, as a task of home."""
    result = context.run(fn, *args, **kwargs)
    if home is not None and iscoroutine(result):
        return in_context(home, result, context)
    return result


def in_loop_of(future: asyncio.Future[Any], callback: Callable[..., None], *args: Any) -> bool:
    """Call callback(*args) in future's loop: now if it runs this code, else from its thread.

    Return False if that loop is closed, so nothing will ever run there again.
    """
    loop = future.get_loop()
    if loop is asyncio._get_running_loop():
        callback(*args)
        return True
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # closed: nobody awaits the future any more
        return False
    return True


def call_soon_in(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> bool:
    """Schedule callback() in loop, from any thread; False if that loop is closed."""
    try:
        if loop is asyncio._get_running_loop():
            loop.call_soon(callback)
        else:
            loop.call_soon_threadsafe(callback)
    except RuntimeError:  # closed: nothing runs there any more
        return False
    return True


def makes_plain_tasks(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether loop runs this code and makes plain tasks: a task made runs no step until later.

    (No task factory: an eager one, or any other, may run a step at once.)
    """
    return loop is asyncio._get_running_loop() and loop.get_task_factory() is None


def outside_asyncio(what: str) -> RuntimeError:
    """The error of a call of what where no asyncio event loop runs (under trio, for example)."""
    return RuntimeError(
        f"inturn: {what} needs a running asyncio event loop, and none runs here: inturn's "
        "async API runs on asyncio only, not under trio (or anyio's trio backend). Call it "
        "from a coroutine that asyncio runs (asyncio.run(), or anyio with backend='asyncio'), "
        "or from plain code in a thread with run_sync() or `with keyed(...)`; nothing was queued"
    )


def running_loop(what: str) -> asyncio.AbstractEventLoop:
    """The running event loop, for a call of what.

    :raises RuntimeError: no asyncio event loop runs here (see outside_asyncio).
    """
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise outside_asyncio(what) from None


def abandon_transport(transport: asyncio.BaseTransport | None) -> None:
    """Close a transport's socket without its event loop, which will never run again.

    ``transport.close()`` would need the loop to finish closing; the socket
    is closed here at once, and the transport no longer holds it (so it
    neither warns nor closes a reused descriptor when collected).
    """
    sock = getattr(transport, "_sock", None)
    if sock is not None:
        transport._sock = None  # type: ignore[union-attr]
        sock.close()


def abandon_task(task: asyncio.Future[Any] | None) -> None:
    """Let a task of a loop that will never run again go, with no "destroyed but pending" log."""
    if task is not None and not task.done():
        task._log_destroy_pending = False  # type: ignore[attr-defined]
