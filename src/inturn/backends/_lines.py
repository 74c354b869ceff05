"""Snapshots of shared lines, for people: who holds each key, and who waits for it, in order.

What ``lines()`` of a backend that shares lines returns (the Redis, the
file and the PostgreSQL backends), and what ``python -m inturn inspect``
shows. A field that a backend does not know is ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HolderInfo:
    """Who holds a line's key."""

    #: Its host's name; None on the file backend (every process is on this host), and
    #: where the backend could not record it (PostgreSQL).
    host: str | None
    #: Its process id; 0 where the backend could not record it (PostgreSQL).
    pid: int
    #: Seconds since it was granted the key.
    held_for: float
    #: Its fencing token, where the backend records it (Redis).
    token: int | None = None
    #: Seconds until its lease runs out unless renewed, where there is a lease (Redis).
    lease_left: float | None = None
    #: The server process of the session that holds the key (PostgreSQL), as
    #: ``pg_stat_activity`` and ``pg_terminate_backend()`` know it.
    server_pid: int | None = None
    #: Seconds since the latest work it holds for was called, if it is a process's latest
    #: work shared across processes (``across="processes"``); else None.
    latest_called: float | None = None


@dataclass(frozen=True)
class WaiterInfo:
    """One waiter of a line, in turn order."""

    #: Its host's name; None on the file backend, and where the backend could not
    #: record it (PostgreSQL).
    host: str | None
    #: Its process id; 0 where the backend could not record it (PostgreSQL).
    pid: int
    #: Seconds since it joined the line.
    waiting_for: float
    #: Seconds until its lease runs out unless renewed, where there is a lease (Redis).
    lease_left: float | None = None
    #: The server process of the session that waits (PostgreSQL).
    server_pid: int | None = None
    #: Seconds since the latest work it waits for was called, if it is a process's latest
    #: work shared across processes (``across="processes"``); else None.
    latest_called: float | None = None


@dataclass(frozen=True)
class LineInfo:
    """A snapshot of one key's line."""

    #: The key, as the user gave it.
    key: str | bytes | int
    #: None while the key is being handed over.
    holder: HolderInfo | None
    #: The line's waiters, in turn order.
    waiters: tuple[WaiterInfo, ...]
