"""Latest work shared across processes in a file backend's line (``across="processes"``).

A process's turn of latest work joins the key's line as any turn does, with
a post beside its ticket (``W``, see ``_linefile.py``): when its process's
newest work for the key was called, on the host's monotonic clock. When its
turn comes (every ticket before it has left), it reads the line file under
the shared lock, asks its process when its newest work was called now
(``me``), and judges:

- Newer work ran since (the newest ``R`` record is at least ``me``): its
  work is not to run; it hands the key on, and its callers are answered.
- Newer work waits behind it (a live ticket's post called after ``me``), or,
  at its first turn, work whose post is not fresh waits behind it (posted
  before its process's turn came: that process may hold newer work by now):
  it joins the line again, behind them all, with a fresh post of ``me``,
  then hands the key on.
- Else its work runs; the release records what ran (``R``) before it hands
  the key on.

Why a burst spread over processes costs one run: every process's post is
judged once, fresh, by the others' turns; the newest of them then finds
nobody newer behind it and runs; every other one finds then that newer work
ran. Why a death loses nothing: a post counts only while its ticket has a
writer (the kernel closes a dead process's files), and work counts as run
only once its holder recorded it, after its work ended: so if the newer
work's process dies before that, the live turns behind it judge again, and
the newest of them runs. Why it ends: a turn joins again for posts that are
not fresh at its first turn only, and at most _AGAIN times in all; after
that it runs, unless newer work ran.
"""

from __future__ import annotations

from collections.abc import Callable

from ._linefile import Ran, newest_ran, post_of, record_of

#: The most times a turn joins its line again before it runs (unless newer work ran):
#: so that calls that keep coming in other processes never keep a key from running.
_AGAIN = 3


def judge(
    records: list[str], ticket: str, me: int, again: int, alive: Callable[[str], bool]
) -> Ran | bool:
    """What ticket's turn of latest work does, its turn come (see the module).

    records: the key's line file; me: when its process's newest work was
    called; again: how many times it joined again already; alive(ticket):
    whether another ticket is still in line. Returns what ran if newer work
    did (its work is not to run), True if it runs, False if it joins again.

    (A record of work that ran "later than now" is left out: see newest_ran.)
    """
    ran = newest_ran(records)
    if ran is not None and ran.called >= me:
        return ran
    if again >= _AGAIN:
        return True
    mine = record_of(ticket)
    behind = records[records.index(mine) + 1 :] if mine in records else []
    for record in behind:
        post = post_of(record)
        if post is None or post.ticket == ticket:
            continue
        unsure = again == 0 and not post.fresh
        if (post.called > me or unsure) and alive(post.ticket):
            return False
    return True
