"""Settings checked once, at the call that gives them: one wording for each kind of mistake."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable
from typing import Final, NamedTuple, final

from ._describe import describe
from .backends._base import Backend
from .backends._local import LocalBackend


@final
class Unset:
    """The type of :data:`UNSET`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


#: The default of per-call ``timeout=`` arguments: use the queue's timeout.
#: (``None`` means no time limit.)
UNSET: Final = Unset()


def check_seconds(name: str, value: float | None, *, zero: bool) -> float | None:
    """A time limit in seconds, or None (also for infinity); ``zero``: 0 is allowed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"inturn: {name} must be a number of seconds or None, got {describe(value)}"
        )
    if math.isnan(value) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"inturn: {name} must be {bound} seconds or None, got {describe(value)}")
    return None if math.isinf(value) else float(value)


def check_timeout(timeout: float | None) -> float | None:
    return check_seconds("timeout", timeout, zero=True)


def check_hold(max_hold: float | None) -> float | None:
    return check_seconds("max_hold", max_hold, zero=False)


def check_count(name: str, value: int | None, none: bool, least: int = 1) -> int | None:
    """A count of at least ``least``; None allowed if ``none``."""
    if value is None and none:
        return None
    also = " or None" if none else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"inturn: {name} must be an int{also}, got {describe(value)}")
    if value < least:
        raise ValueError(f"inturn: {name} must be >= {least}{also}, got {describe(value)}")
    return value


class Waited(enum.Enum):
    """What a turn was waiting for when its time ran out (see missed): its words, and the fix."""

    LINE = ("its place in the key's line", "")
    SLOT = ("a running slot", "Raise max_running")
    CONNECTION = ("a connection of the pool", "Raise max_sessions")
    ANSWER = ("an answer", "Check the network and the server")


#: Where missed() keeps its parts on the error it makes, for restated(): plain strings, so
#: the error pickles as it did, and keeps no key alive.
_PARTS: Final = "_inturn_missed"


def missed(
    keys: tuple[Hashable, ...],
    waited: Waited,
    limit: float | None,
    detail: str = "",
    fix: str | None = None,
) -> TimeoutError:
    """The one wording of every turn whose time ran out: what it waited for, and that nothing ran.

    ``keys``: the turn's keys waited for; ``detail`` follows waited's words
    (`` (the key was busy, ...)``, `` from Redis``); ``fix`` replaces waited's
    fix. ``limit`` is the limit that ran out (0: the call would not wait, and
    waited was not there at once), or None where it is not known; a driver
    puts its caller's in (see restated): a backend knows only the time left.
    Built only once the time ran out: nothing is spent on a turn that is reached.
    """
    turn = f"key {describe(keys[0])}" if len(keys) == 1 else f"keys {describe(keys)}"
    words, default = waited.value
    fix = default if fix is None else fix
    parts = (
        turn,
        words + detail,
        f"; the work did not run. {fix}" if fix else "; the work did not run",
    )
    error = TimeoutError(_wording(*parts, limit))
    vars(error)[_PARTS] = parts
    return error


def restated(error: BaseException, limit: float | None) -> BaseException:
    """error; if missed() made it, worded with limit, the caller's (not the time left)."""
    if limit is not None and isinstance(error, TimeoutError):
        parts = vars(error).get(_PARTS)
        if parts is not None:
            turn, words, ran = parts
            error.args = (_wording(turn, words, ran, limit),)
    return error


def _wording(turn: str, words: str, ran: str, limit: float | None) -> str:
    if limit is None:
        within, verb = "in time", "it was waiting for"
    elif limit <= 0:
        within, verb = "at once (timeout=0)", "it needed"
    else:
        within, verb = f"within {limit:g} s", "it was waiting for"
    return f"inturn: the turn for {turn} was not reached {within}: {verb} {words}{ran}"


def others(waiting: int) -> str:
    """How many other turns waited too, for missed()'s detail."""
    if not waiting:
        return "no other turn waiting"
    return f"{waiting} other turn{'s' if waiting != 1 else ''} waiting"


@final
class Deadline:
    """One time limit spent across the waits of one call: how long each may still wait."""

    __slots__ = ("at", "clock")

    def __init__(self, limit: float, clock: Callable[[], float], start: float = 0.0) -> None:
        self.clock = clock  # the clock the waits are timed on (a loop's, or monotonic)
        self.at = (start or clock()) + limit  # (start: when the limit began, on clock, if not now)

    def left(self) -> float:
        """The seconds left, never below 0."""
        return max(0.0, self.at - self.clock())


def check_name(name: str | None) -> str | None:
    """A queue's name= (for its repr, logs and metrics), checked."""
    if name is not None and (type(name) is not str or not name or not name.isprintable()):
        raise (TypeError if not isinstance(name, str) else ValueError)(
            f"inturn: name= takes a short printable str naming the queue (in its repr, "
            f"logs and metrics), or None; got {describe(name)}"
        )
    return name


def check_backend(backend: object, concurrency: int) -> Backend | None:
    """A queue's backend= (None for the in-process lines), checked against its concurrency."""
    if backend is None or isinstance(backend, LocalBackend):
        return None
    if not isinstance(backend, Backend):
        raise TypeError(
            f"inturn: backend= takes a backend from inturn.backends (LocalBackend, "
            f"FileBackend, RedisBackend, PostgresBackend) or None, got {describe(backend)}; a "
            "backend of your own needs every member of inturn.backends.Backend, "
            "`capabilities` and `thread_loop()` included"
        )
    if concurrency > 1:
        raise ValueError(
            f"inturn: concurrency={concurrency} needs the in-process lines; "
            f"{describe(backend)} grants one holder per key"
        )
    return backend


def check_transaction(transaction: object, backend: Backend | None) -> None:
    """Refuse keyed(transaction=...) that is not True, or on a backend without transactions."""
    if transaction is not True:
        raise TypeError(f"inturn: transaction must be True or False, got {describe(transaction)}")
    if backend is None or not backend.capabilities.transactions:
        raise TypeError(
            f"inturn: keyed(..., transaction=True) needs a backend that takes turns in a "
            f"database (PostgresBackend); this queue's is {describe(backend)}"
        )


class Policy(NamedTuple):
    """A call's conflation settings, checked once (see KeyedQueue's ``pending``)."""

    latest: bool  # pending="latest": a busy key keeps one waiting work
    join: bool  # on_superseded="join": a replaced caller gets the newer work's outcome
    debounce: float | None  # the quiet period, seconds
    max_wait: float | None  # the longest a debounced work waits for quiet, seconds
    across: bool = False  # across="processes": the latest is the key's, on its backend

    @property
    def shared(self) -> bool:
        """Whether a call's work may be replaced by newer work of another process."""
        return self.latest and self.across

    @property
    def conflates(self) -> bool:
        """Whether a call with these settings may be replaced, or debounced."""
        return self.latest or self.debounce is not None

    def given(
        self,
        pending: object,
        on_superseded: object,
        debounce: object,
        max_wait: object,
        concurrency: int,
    ) -> Policy:
        """These settings with those given (not UNSET) instead, checked: a decorator's, on a
        queue of that concurrency."""
        given = (pending, on_superseded, debounce, max_wait)
        if all(setting is UNSET for setting in given):
            return self
        ours = (
            "latest" if self.latest else "all",
            "join" if self.join else "raise",
            self.debounce,
            self.max_wait,
        )
        chosen = [o if g is UNSET else g for g, o in zip(given, ours, strict=True)]
        policy = check_policy(chosen[0], chosen[1], chosen[2], chosen[3], concurrency)
        return policy._replace(across=self.across)  # (the queue's: see check_across)


#: The settings of a queue that does not conflate.
ALL: Final = Policy(False, True, None, None)


def check_policy(
    pending: object, on_superseded: object, debounce: object, max_wait: object, concurrency: int = 1
) -> Policy:
    """The Policy of these settings (a queue's, of that concurrency); ValueError or TypeError
    naming a wrong one."""
    if pending not in ("all", "latest") or not isinstance(pending, str):
        raise ValueError(f'inturn: pending must be "all" or "latest", got {describe(pending)}')
    if on_superseded not in ("join", "raise") or not isinstance(on_superseded, str):
        raise ValueError(
            f'inturn: on_superseded must be "join" or "raise", got {describe(on_superseded)}'
        )
    quiet = check_seconds("debounce", debounce, zero=False)  # type: ignore[arg-type]
    most = check_seconds("max_wait", max_wait, zero=False)  # type: ignore[arg-type]
    if most is not None and quiet is None:
        raise ValueError("inturn: max_wait bounds a debounce; give debounce= too, or leave it out")
    if most is not None and quiet is not None and most < quiet:
        raise ValueError(f"inturn: max_wait ({most:g} s) must be at least debounce ({quiet:g} s)")
    policy = Policy(pending == "latest", on_superseded == "join", quiet, most)
    if policy.conflates and concurrency != 1:
        raise ValueError(
            "inturn: pending='latest' and debounce keep one waiting work per key, "
            f"and concurrency={concurrency} lets several hold it; use one or the other"
        )
    return policy


def check_across(across: object, backend: Backend | None) -> bool:
    """Whether a queue's latest work is the key's across processes (``across="processes"``);
    ValueError naming a wrong setting, or a backend that cannot share it."""
    if across not in ("process", "processes") or not isinstance(across, str):
        raise ValueError(f'inturn: across must be "process" or "processes", got {describe(across)}')
    if across == "process":
        return False
    if backend is None or not backend.capabilities.latest:
        has = "has no backend" if backend is None else f"has {describe(backend)}, which does not"
        raise ValueError(
            'inturn: across="processes" keeps one latest work per key among every process '
            "that shares the key's line, which needs a backend that keeps it (FileBackend, "
            f"RedisBackend, PostgresBackend); this queue {has}. Leave across out (each process "
            "then conflates its own calls), or use one of those backends"
        )
    return True


def no_transaction(keys: tuple[Hashable, ...]) -> RuntimeError:
    """A transaction turn with no key of its own to take: nothing to run it on."""
    return RuntimeError(
        "inturn: keyed(..., transaction=True) runs its block in a transaction on the "
        f"connection that takes its keys, and {describe(keys)} are held by the turn around "
        "it already: ask for the transaction there, or add a key of this turn's own; the "
        "work did not run"
    )
