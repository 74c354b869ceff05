"""The rule by which a turn of latest work shared across processes judges, its turn come.

Shared by the backends that keep one latest work per key among every
process (``across="processes"``; see :class:`~inturn.backends.LatestBackend`):
each keeps, in the key's line, a *post* beside each such turn's place (when
its process's newest work for the key was called, and whether the post is
*fresh*: written when that process's turn came, rather than when it joined),
and a record of the newest work that *ran*. How each stores them, and
compares two calls' times, is its own (the file backend: the host's
monotonic clock; Redis: the host's clock on one host, Redis's across hosts).
When a turn reaches the head of the line, its process says when its newest
work was called now (``me``), and :func:`judge` decides:

- Newer work ran since (what ran was called at ``me`` or later): its work
  is not to run; it hands the key on, and its callers are answered.
- Newer work waits behind it (a live post called after ``me``), or, at its
  first turn, a post behind it is not fresh (its process may hold newer
  work by now): it joins the line again, behind them all, with a fresh post
  of ``me``, then hands the key on.
- Else its work runs; its release records what ran, for the turns behind.

Why a burst spread over processes costs one run: every process's post is
judged once, fresh, by the others' turns; the newest of them then finds
nobody newer behind it and runs; every other one then finds that newer work
ran. Why a death loses nothing: a post counts only while its process lives
(the backend says: ``alive``), and work counts as run only once its holder
recorded it, after its work ended; so if the newer work's process dies
before that, the live turns behind it judge again, and the newest of them
runs. Why it ends: a turn joins again for posts that are not fresh at its
first turn only, and at most :data:`AGAIN` times in all; after that it runs,
unless newer work ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final, Protocol, TypeVar

#: The most times a turn joins its line again before it runs (unless newer work ran):
#: so that calls that keep coming in other processes never keep a key from running.
AGAIN: Final = 3


class Called(Protocol):
    """When a call was made, as a backend compares two (an ``int`` on one host's clock)."""

    def __ge__(self, other: Any, /) -> bool: ...
    def __gt__(self, other: Any, /) -> bool: ...


class Posted(Protocol):
    """A post of a turn waiting behind the one judged."""

    @property
    def called(self) -> Called: ...
    @property
    def fresh(self) -> bool: ...


class Ran(Protocol):
    """The record of the newest work that ran."""

    @property
    def called(self) -> Called: ...


P = TypeVar("P", bound=Posted)
R = TypeVar("R", bound=Ran)


def judge(
    ran: R | None, me: Called, again: int, behind: Iterable[P], alive: Callable[[P], bool]
) -> R | bool:
    """What a turn of latest work does, its turn come (see the module).

    ran: the newest work that ran, if any; me: when its process's newest work
    was called; again: how many times it joined again already; behind: the
    posts behind it in line, in line order; alive(post): whether that post's
    process still waits. Returns ran if newer work ran (its work is not to
    run), True if it runs, False if it joins again.
    """
    if ran is not None and ran.called >= me:
        return ran
    if again >= AGAIN:
        return True
    for post in behind:
        unsure = again == 0 and not post.fresh
        if (post.called > me or unsure) and alive(post):
            return False
    return True
