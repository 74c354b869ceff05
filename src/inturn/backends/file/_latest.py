"""Latest work shared across processes in a file backend's line (``across="processes"``).

The rule is the backends' (``backends/_judge.py``); here is how a line
file keeps what it judges. A process's turn of latest work joins the key's
line as any turn does, with a post beside its ticket (``W``, see
``_linefile.py``): when its process's newest work for the key was called,
on the host's monotonic clock. When its turn comes (every ticket before it
has left), it reads the line file under the shared lock, asks its process
when its newest work was called now, and judges. A post counts only while
its ticket has a writer (the kernel closes a dead process's files); what
ran is the newest ``R`` record, written by a release under the shared lock
before it hands the key on.
"""

from __future__ import annotations

from collections.abc import Callable

from .._judge import judge as _judge
from ._linefile import Post, Ran, newest_ran, post_of, record_of


def judge(
    records: list[str], ticket: str, me: int, again: int, alive: Callable[[str], bool]
) -> Ran | bool:
    """What ticket's turn of latest work does, its turn come (see ``_judge.judge``).

    records: the key's line file; me: when its process's newest work was
    called; again: how many times it joined again already; alive(ticket):
    whether another ticket is still in line. Returns what ran if newer work
    did (its work is not to run), True if it runs, False if it joins again.

    (A record of work that ran "later than now" is left out: see newest_ran.)
    """
    return _judge(
        newest_ran(records), me, again, _behind(records, ticket), lambda post: alive(post.ticket)
    )


def _behind(records: list[str], ticket: str) -> list[Post]:
    """The posts of other tickets behind ticket's record, in line order."""
    mine = record_of(ticket)
    after = records[records.index(mine) + 1 :] if mine in records else []
    return [
        post for record in after if (post := post_of(record)) is not None and post.ticket != ticket
    ]
