"""Latest work shared across processes on PostgreSQL, in one process: queues with a
PostgresBackend of their own on one namespace, as processes (the server cannot tell them
apart: each has its own connections, so its own server sessions), and a view of a key's line
on the server from the side.

The PostgreSQL twin of redis_latest.py. Each backend made here names its sessions
``TAG-name`` (``application_name``), so that a test can find a "process"'s server session
(to terminate it, or to see it wait) without computing anything of the backend's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Hashable
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from inturn import KeyedQueue
from inturn.backends.postgres import PostgresBackend
from inturn.backends.postgres._keys import fate_id, lock_id, lock_parts

from .helpers import PATIENCE
from .latest_across import Holder

#: The table of latest work (what a test looks at, as the backend names it).
LATEST = "inturn_latest"


def named(url: str, name: str) -> str:
    """url (or conninfo), with the sessions it opens named ``name`` in pg_stat_activity."""
    return make_conninfo(url, application_name=name)


class Seen:
    """A namespace's lines on the server as they are now, read on a connection of its own
    (synchronous, so that a predicate of settle(), until() or wait_until() can ask it).

    Besides the key's lock (``objsubid = 1``) and its intent lock (``objsubid = 2``), a turn
    of latest work holds a *fate lock* (an int8 advisory lock, ``_keys.fate_id(lock, pid)``)
    from its first post to its end, and a turn that stands by waits for another turn's fate
    lock (shared): neither is the key's, so neither is in ``holders()``/``waiting()``. Every
    server session seen here is remembered (``known``), so that a fate lock of a turn that
    ended since is still recognised.
    """

    def __init__(self, url: str, namespace: str, tag: str) -> None:
        self.url = url
        self.namespace = namespace
        self.tag = tag
        self.connection = psycopg.connect(url, autocommit=True)
        self.known: set[int] = set()

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        """sql's rows; none before a backend made the tables (a server's first turn)."""
        try:
            cursor = self.connection.execute(sql.encode(), params)
        except psycopg.errors.UndefinedTable:
            return []
        return [] if cursor.description is None else list(cursor.fetchall())

    def parts(self, key: Hashable) -> tuple[int, int]:
        return lock_parts(lock_id(self.namespace, key))

    def _seen(self, pids: list[int]) -> list[int]:
        self.known.update(pids)
        return pids

    def _locks(self, key: Hashable, subid: int, granted: bool) -> list[int]:
        return self._seen(
            [
                int(pid)
                for (pid,) in self.rows(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s::oid"
                    " AND objid = %s::oid AND objsubid = %s AND granted = %s ORDER BY pid",
                    *self.parts(key),
                    subid,
                    granted,
                )
            ]
        )

    def holders(self, key: Hashable = "k") -> list[int]:
        """The server sessions that hold key's advisory lock."""
        return self._locks(key, 1, True)

    def waiting(self, key: Hashable = "k") -> list[int]:
        """The server sessions that wait for key's advisory lock (in its line: not those
        that stand by)."""
        return self._locks(key, 1, False)

    def intents(self, key: Hashable = "k") -> list[int]:
        """The server sessions that hold key's intent lock (``objsubid = 2``)."""
        return self._locks(key, 2, True)

    def fate(self, key: Hashable, pid: int) -> int:
        """The id of the fate lock of server session pid's turn on key."""
        return fate_id(lock_id(self.namespace, key), pid)

    def _int8_locks(self) -> list[tuple[int, int, bool, str]]:
        """Every int8 advisory lock of this database held or waited for: its session, its
        id, whether granted, its mode."""
        locks = []
        for pid, classid, objid, granted, mode in self.rows(
            "SELECT pid, classid::int8, objid::int8, granted, mode FROM pg_locks"
            " WHERE locktype = 'advisory' AND objsubid = 1 AND pid IS NOT NULL"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ):
            unsigned = (int(classid) << 32) | int(objid)
            signed = unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned
            locks.append((int(pid), signed, bool(granted), str(mode)))
        return locks

    def fate_locks(self, key: Hashable = "k", *pids: int) -> list[tuple[int, int, bool, str]]:
        """Every fate lock of a turn on key held or waited for, by any session: (session,
        the session whose turn's fate lock it is, granted, mode). The turns looked for: of
        every session seen here, or now on the server, or in the table, and of pids."""
        locks = self._int8_locks()
        sessions = {pid for pid, *_ in locks} | self.known | set(pids)
        sessions.update(
            int(pid) for (pid,) in self.rows("SELECT pid FROM pg_stat_activity WHERE pid > 0")
        )
        sessions.update(
            int(pid)
            for (pid,) in self.rows(
                f"SELECT pid FROM {LATEST} WHERE namespace = %s AND pid <> 0", self.namespace
            )
        )
        whose = {self.fate(key, session): session for session in sessions}
        return [
            (pid, whose[lock], granted, mode) for pid, lock, granted, mode in locks if lock in whose
        ]

    def fated(self, key: Hashable = "k") -> list[int]:
        """The sessions that hold their own turn's fate lock on key (exclusive)."""
        return self._seen(
            sorted(
                pid
                for pid, whose, granted, mode in self.fate_locks(key)
                if pid == whose and granted and mode == "ExclusiveLock"
            )
        )

    def standbys(self, key: Hashable = "k") -> dict[int, int]:
        """The turns that stand by on key: each one's session, and the session of the turn
        it stands by behind (whose fate lock it waits for, shared)."""
        found = {
            pid: whose
            for pid, whose, granted, mode in self.fate_locks(key)
            if pid != whose and not granted and mode == "ShareLock"
        }
        self._seen([*found, *found.values()])
        return found

    def posts(self, key: Hashable = "k") -> dict[int, bool]:
        """The posts of live sessions on key: whether each is fresh, by server session."""
        found = {
            int(pid): bool(fresh)
            for pid, fresh in self.rows(
                f"SELECT pid, fresh FROM {LATEST} WHERE namespace = %s AND lock_id = %s"
                " AND pid <> 0 AND pid IN (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)",
                self.namespace,
                lock_id(self.namespace, key),
            )
        }
        self._seen(list(found))
        return found

    def counted(self, key: Hashable = "k") -> list[int]:
        """The sessions whose post on key counts: it holds the key's intent lock."""
        intents = self.intents(key)
        return sorted(pid for pid in self.posts(key) if pid in intents)

    def fresh(self, key: Hashable = "k") -> int:
        """How many live sessions' posts on key are fresh (written as they joined again)."""
        return sum(self.posts(key).values())

    def ran(self, key: Hashable = "k") -> bool:
        """Whether what ran on key is recorded."""
        return bool(
            self.rows(
                f"SELECT 1 FROM {LATEST} WHERE namespace = %s AND lock_id = %s AND pid = 0",
                self.namespace,
                lock_id(self.namespace, key),
            )
        )

    def holds_nothing(self, pid: int, key: Hashable = "k") -> bool:
        """Whether session pid has nothing of key: neither its lock (held or waited for), nor
        its intent lock, nor any fate lock (its own, or another's it stands by on), nor a
        post."""
        return (
            pid not in self.holders(key) + self.waiting(key) + self.intents(key)
            and all(session != pid for session, *_ in self.fate_locks(key, pid))
            and pid not in self.posts(key)
        )

    def nothing_left(self, key: Hashable = "k", *pids: int) -> bool:
        """Nobody holds or waits for key's lock, nobody holds its intent lock, no fate lock of
        a turn on key is held or waited for (of every session seen, and of pids), and no live
        session's post on it is left."""
        (count,) = self.rows(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            " AND classid = %s::oid AND objid = %s::oid",
            *self.parts(key),
        )[0]
        return count == 0 and not self.fate_locks(key, *pids) and not self.posts(key)

    def sessions(self, name: str) -> list[int]:
        """The server sessions of the backend made as ``name``."""
        return [
            int(pid)
            for (pid,) in self.rows(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s ORDER BY pid",
                f"{self.tag}-{name}",
            )
        ]

    def name_of(self, pid: int) -> str | None:
        """The name of the backend whose session pid is (None: not one of this test's)."""
        rows = self.rows("SELECT application_name FROM pg_stat_activity WHERE pid = %s", pid)
        if not rows or not str(rows[0][0]).startswith(f"{self.tag}-"):
            return None
        return str(rows[0][0]).removeprefix(f"{self.tag}-")

    def alive(self, pid: int) -> bool:
        return bool(self.rows("SELECT 1 FROM pg_stat_activity WHERE pid = %s", pid))

    def started(self, pid: int) -> Any:
        """When session pid's statement (running, or its last) started; None if it is gone."""
        rows = self.rows("SELECT query_start FROM pg_stat_activity WHERE pid = %s", pid)
        return None if not rows else rows[0][0]

    def query(self, pid: int) -> str | None:
        """The statement session pid runs (or ran last); None if it is gone."""
        rows = self.rows("SELECT query FROM pg_stat_activity WHERE pid = %s", pid)
        return None if not rows else str(rows[0][0])

    def blocked_on_table(self) -> list[int]:
        """The sessions that wait for a lock of the table of latest work (an owner's LOCK
        TABLE holds them: a JUDGE, a post or a leave)."""
        return [
            int(pid)
            for (pid,) in self.rows(
                "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'relation' AND NOT l.granted"
                f" AND l.relation = to_regclass('{LATEST}') ORDER BY 1"
            )
        ]

    def blocked_on_row(self) -> list[int]:
        """The sessions that wait for a row's lock (a transaction's, or a tuple's): another
        transaction holds a row of the table of latest work they write."""
        return [
            int(pid)
            for (pid,) in self.rows(
                "SELECT pid FROM pg_locks WHERE locktype IN ('transactionid', 'tuple')"
                " AND NOT granted ORDER BY 1"
            )
        ]

    def deleting(self, pid: int) -> bool:
        """Whether session pid, standing by no more, runs a statement that deletes from the
        table of latest work (a replaced turn takes its post away: in the JUDGE behind its
        standby, or in a statement of its own), held up by another transaction's row lock."""
        return (
            f"DELETE FROM {LATEST}" in (self.query(pid) or "")
            and pid not in self.standbys()
            and pid in self.blocked_on_row()
        )

    def terminate(self, pid: int) -> None:
        """End server session pid (as an administrator does); returns once it is gone."""
        self.rows("SELECT pg_terminate_backend(%s, 5000)", pid)

    def cancel(self, pid: int) -> None:
        """Cancel the statement session pid runs (pg_cancel_backend)."""
        self.rows("SELECT pg_cancel_backend(%s)", pid)

    def close(self) -> None:
        self.connection.close()


class PgProcesses:
    """Makes queues on one server and namespace, each with a PostgresBackend of its own (one
    "process" each), named ``TAG-name`` on the server; all closed by close()."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url = url
        self.namespace = namespace
        self.tag = namespace.replace("-", "")
        self.backends: list[PostgresBackend] = []
        self.made: list[KeyedQueue] = []
        self.processes: list[LatestProcess] = []
        self.seen = Seen(url, namespace, self.tag)
        self._count = 0

    def _name(self, name: str | None) -> str:
        self._count += 1
        return name or f"p{self._count}"

    def backend(self, name: str | None = None, **options: Any) -> PostgresBackend:
        """A backend of its own (a process's) whose sessions are named ``TAG-name``."""
        url = named(self.url, f"{self.tag}-{self._name(name)}")
        made = PostgresBackend.from_url(url, namespace=self.namespace, **options)
        self.backends.append(made)
        return made

    def latest(
        self, name: str | None = None, *, options: Any = None, **settings: Any
    ) -> KeyedQueue:
        """A queue of latest work shared across processes, on a backend of its own."""
        backend = self.backend(name, **(options or {}))
        return self.keep(
            KeyedQueue(backend=backend, pending="latest", across="processes", **settings)
        )

    def plain(self, name: str | None = None, **settings: Any) -> KeyedQueue:
        """A queue of plain turns, on a backend of its own."""
        return self.keep(KeyedQueue(backend=self.backend(name), **settings))

    def holder(self, name: str | None = None) -> Holder:
        """A process whose plain turn holds key k until released."""
        holder = Holder(self.backend(name))
        self.keep(holder.queue)
        return holder

    async def process(self, name: str | None = None) -> LatestProcess:
        """A real process of its own with a latest queue on this namespace, warmed (its
        connection made and readied), whose sessions are named ``TAG-name``."""
        url = named(self.url, f"{self.tag}-{self._name(name)}")
        started = await LatestProcess.start(url, self.namespace)
        self.processes.append(started)
        await started.expect("ready")
        return started

    def keep(self, queue: KeyedQueue) -> KeyedQueue:
        self.made.append(queue)
        return queue

    async def nothing_left(self, *keys: Hashable) -> bool:
        """Whether nothing is left of keys (k by default) on the server, waited for within
        PATIENCE (a release ends in a task of its own, a closed session a moment later)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PATIENCE
        while not all(self.seen.nothing_left(key) for key in keys or ("k",)):
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    async def close(self) -> None:
        """Close every queue made here, and its backend (what still waits gets
        BackendUnavailable: a test that failed half way)."""
        for process in self.processes:
            await process.end()
        for queue in self.made:
            queue.close()
        for backend in self.backends:
            await asyncio.wait_for(backend.aclose(), PATIENCE)
        self.seen.close()


#: A process of latest work on key k (``python -c LATEST_PROCESS URL NAMESPACE``): it warms its
#: queue's connection up on another key and says ``ready``; then, for each stdin line ``run``,
#: it calls latest work on k, whose work says ``started`` and waits for a stdin line, and says
#: ``answered RESULT`` (the work's result, ``done``, or None).
LATEST_PROCESS = """
import asyncio, sys
from inturn import KeyedQueue
from inturn.backends.postgres import PostgresBackend

def line():
    return sys.stdin.readline().strip()

async def main(url, namespace):
    backend = PostgresBackend.from_url(url, namespace=namespace)
    queue = KeyedQueue(backend=backend, pending="latest", across="processes")
    await queue.run("warm", lambda: None)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()

    async def work():
        print("started", flush=True)
        await loop.run_in_executor(None, line)
        return "done"

    while await loop.run_in_executor(None, line) == "run":
        print("answered", await queue.run("k", work), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


class LatestProcess:
    """A real process of latest work on key k (see LATEST_PROCESS), driven over its stdin."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, url: str, namespace: str) -> LatestProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            LATEST_PROCESS,
            url,
            namespace,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(process)

    async def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()

    async def expect(self, word: str) -> list[str]:
        """The process's next report, which must be ``word ...``: its other words."""
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), PATIENCE)
        words = line.decode().split()
        assert words[:1] == [word], f"the process said {words}, expected {word!r}"
        return words[1:]

    def kill(self) -> None:
        """SIGKILL: the process dies at once, its sockets closed by the kernel."""
        try:
            os.kill(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    async def end(self) -> None:
        self.kill()
        await asyncio.wait_for(self.process.wait(), PATIENCE)
