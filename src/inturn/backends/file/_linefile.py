"""A line file's records: how a key's line is written down, and read back whatever a crash left.

A ticket is ``<pid>.<12 hex digits>``; its named pipe is
``<digest>.<ticket>.t`` beside the line file. A line file holds one record
per text line, in ASCII, each starting with a letter found nowhere else in
a record:

- ``T<ticket>``: a ticket in line, in arrival order.
- ``?<ticket>``: a ticket about to be made. Its process holds the file's
  shared lock from before this record until after the ticket's own record,
  so under the exclusive lock a ``?`` record without its ticket's record
  means that process died joining: its pipe, if made, is removed.
- ``K<hex digits>``: the key's portable name, written by whoever found the
  file empty, for ``inspect``.
- ``W<ticket>:<called>:<fresh>``: ticket carries a process's latest work
  (``across="processes"``), called at ``called`` (``time.monotonic_ns()``);
  ``fresh`` is 1 if it was written when its process's turn came (see
  ``_latest.py``). Written with the ticket's own record, in one append.
- ``R<called>:<ok>``: latest work called at ``called`` ran in its turn, and
  returned (``ok`` 1) or not (0); written by its holder before it hands the
  key on. Only the newest counts (a compaction keeps it, after the key's),
  but for one called "later than now" (see newest_ran).

A compaction writes the new records over the old ones from the start,
then cuts the file to their length. A process killed between the two
leaves the old records' tail behind the new ones: it starts with a cut-off
piece, which lacks the starting letter and is skipped, and then lists
tickets that are listed before (a ticket counts once, where it is first
listed) or that have left. Whatever the cut, the tickets still in line are
read back in their order.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from dataclasses import dataclass, field
from typing import NamedTuple

_LINE = ".line"
_PIPE = ".t"
_TICKET = "T"
_JOINING = "?"
_KEY = "K"
_POST = "W"
_RAN = "R"
#: A ticket: a process id, a dot, 48 random bits in hex.
_A_TICKET = re.compile(r"[0-9]{1,10}\.[0-9a-f]{12}")
#: A post of latest work: its ticket, when it was called, whether it is fresh.
_A_POST = re.compile(r"W([0-9]{1,10}\.[0-9a-f]{12}):([0-9]{1,20}):([01])")
#: What latest work ran: when it was called, whether it returned.
_A_RAN = re.compile(r"R([0-9]{1,20}):([01])")
#: Bytes read from a line file at once.
_READ = 65536
#: The random part of a ticket: 48 bits.
_RANDOM = (1 << 48) - 1


def _new_process() -> None:
    """Start this process's tickets (again in a forked child): its pid, and a random count."""
    global _pid, _counts
    _pid = f"{os.getpid()}."
    _counts = itertools.count(int.from_bytes(os.urandom(6), "big"))


_pid: str
_counts: itertools.count[int]
_new_process()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_process)


def line_name(digest: str) -> str:
    """The line file of the key whose portable name has this SHA-256 digest."""
    return digest + _LINE


def new_ticket() -> str:
    """A ticket for this process: its pid and 48 bits, unique in every line.

    The 48 bits count on from a random start, drawn once per process: no
    system call a turn, and no two of this process's tickets alike; a later
    process with the same pid, whose start is drawn anew, repeats one left in
    a line by a dead one with a chance of about 2**-48 per ticket.
    """
    return f"{_pid}{next(_counts) & _RANDOM:012x}"


def pipe_name(digest: str, ticket: str) -> str:
    """The named pipe of ticket in the line of digest."""
    return f"{digest}.{ticket}{_PIPE}"


def ticket_of(record: str) -> str | None:
    """The ticket that record lists in line; None for any other record."""
    if record.startswith(_TICKET) and _A_TICKET.fullmatch(record, 1):
        return record[1:]
    return None


def queued_in(record: str) -> str | None:
    """The ticket that record lists in line or as about to be made; None for any other record."""
    if record.startswith((_TICKET, _JOINING)) and _A_TICKET.fullmatch(record, 1):
        return record[1:]
    return None


def pid_of(ticket: str) -> int:
    """The process id in ticket."""
    return int(ticket.partition(".")[0])


def joining(ticket: str, key: bytes | None) -> bytes:
    """The record that ticket is about to be made (after key's, if given)."""
    return _key_record(key) + f"{_JOINING}{ticket}\n".encode("ascii")


def record_of(ticket: str) -> str:
    """The record that lists ticket in line."""
    return _TICKET + ticket


def alone_in(records: list[str], ticket: str) -> bool:
    """Whether records are just ticket's mark and record (and its post, if it posted latest
    work), after the key's record if any.

    So a line file reads that only a turn on a free key joined: anything else
    (another ticket, a piece that a compaction cut short left) reads as somebody.
    """
    if records and (post := post_of(records[-1])) is not None and post.ticket == ticket:
        records = records[:-1]
    first = len(records) - 2  # (where ticket's mark is: the key's record may come before it)
    return (
        first in (0, 1)
        and records[first:] == [_JOINING + ticket, _TICKET + ticket]
        and (first == 0 or records[0].startswith(_KEY))
    )


def joined(ticket: str, post: Post | None = None) -> bytes:
    """The record of ticket, in line, as written; with post, the post's record after it."""
    if post is None:
        return f"{_TICKET}{ticket}\n".encode("ascii")
    return f"{_TICKET}{ticket}\n{_post_record(post)}\n".encode("ascii")


class Post(NamedTuple):
    """A ticket that carries a process's latest work (see the ``W`` record)."""

    ticket: str
    called: int  #: when the work was called: time.monotonic_ns(), the host's clock
    fresh: bool  #: written when its process's turn came (see _latest.py)


def _post_record(post: Post) -> str:
    return f"{_POST}{post.ticket}:{post.called}:{int(post.fresh)}"


class Ran(NamedTuple):
    """Latest work that ran in its turn (see the ``R`` record)."""

    called: int  #: when the work was called: time.monotonic_ns()
    ok: bool  #: whether it returned


def ran_record(ran: Ran) -> bytes:
    """The record of what ran, as written."""
    return f"{_RAN}{ran.called}:{int(ran.ok)}\n".encode("ascii")


def ran_of(record: str) -> Ran | None:
    """What ran, if record says it."""
    if not record.startswith(_RAN):
        return None
    found = _A_RAN.fullmatch(record)
    return None if found is None else Ran(int(found[1]), found[2] == "1")


def newest_ran(records: list[str]) -> Ran | None:
    """The newest latest work that records say ran, if any.

    A record of work called "later than now" is left out: it comes from
    before the host restarted (its monotonic clock with it), in a line file
    that a process killed then left behind.
    """
    now = time.monotonic_ns()
    ran = [
        found for record in records if (found := ran_of(record)) is not None and found.called <= now
    ]
    return max(ran) if ran else None


def post_of(record: str) -> Post | None:
    """The post that record is, if it is one."""
    if not record.startswith(_POST):
        return None
    found = _A_POST.fullmatch(record)
    if found is None:
        return None  # (a piece that a crash left)
    return Post(found[1], int(found[2]), found[3] == "1")


def read_records(fd: int) -> list[str]:
    """The complete records of the line file open at fd (one being written is left out)."""
    chunks = []
    offset = 0
    while chunk := os.pread(fd, _READ, offset):
        chunks.append(chunk)
        offset += len(chunk)
        if len(chunk) < _READ:  # the end (an append since is not ours to see)
            break
    return b"".join(chunks).decode("latin-1").split("\n")[:-1]


@dataclass
class Records:
    """A line file's records, read back."""

    #: The key's portable name, if the file records it.
    key: bytes | None = None
    #: Tickets, in line order, each once.
    tickets: list[str] = field(default_factory=list)
    #: Tickets with a ``?`` record and no record of their own.
    unfinished: list[str] = field(default_factory=list)
    #: The posts of latest work, by ticket.
    posts: dict[str, Post] = field(default_factory=dict)
    #: The newest latest work that ran, if any.
    ran: Ran | None = None


def parse(records: list[str]) -> Records:
    """Read the records of a line file back (see the module docstring for what is skipped)."""
    found = Records()
    tickets: dict[str, None] = {}
    marked: dict[str, None] = {}
    for record in records:
        if record.startswith(_KEY):
            if found.key is None:
                try:
                    found.key = bytes.fromhex(record[1:])
                except ValueError:
                    pass  # a torn piece
        elif record.startswith(_JOINING):
            if _A_TICKET.fullmatch(record, 1):
                marked[record[1:]] = None
        elif (ticket := ticket_of(record)) is not None:
            tickets[ticket] = None
        elif (post := post_of(record)) is not None:
            found.posts.setdefault(post.ticket, post)
    found.ran = newest_ran(records)
    found.tickets = list(tickets)
    found.unfinished = [ticket for ticket in marked if ticket not in tickets]
    return found


def render(
    key: bytes | None,
    tickets: list[str],
    posts: dict[str, Post] | None = None,
    ran: Ran | None = None,
) -> bytes:
    """A line file's whole content: key's record, if given, what ran, if given, then
    tickets in order, each with its post (of posts), if it has one."""
    posts = posts or {}
    head = _key_record(key) + (b"" if ran is None else ran_record(ran))
    return head + b"".join(joined(ticket, posts.get(ticket)) for ticket in tickets)


def _key_record(key: bytes | None) -> bytes:
    return b"" if key is None else f"{_KEY}{key.hex()}\n".encode("ascii")
