"""The Redis backend: one FIFO line per key across processes and hosts.

::

    from inturn import KeyedQueue
    from inturn.backends.redis import RedisBackend

    orders = KeyedQueue(backend=RedisBackend.from_url("redis://localhost:6379/0", namespace="shop"))

Installed with ``pip install "inturn[redis]"`` (redis-py's asyncio client).
Works with Redis 6.2+, Valkey, Redis Sentinel and Redis Cluster.

How a line is kept. Each key's line is four Redis keys that share one hash
slot (the hash tag ``{namespace:digest}``, the digest a SHA-256 of the key),
so every script touches one slot and runs on a cluster:

- ``inturn:{ns:d}:line``, a hash: the holder, the last fencing token, when
  the holder got the key, the key as it was given, and what latest work
  shared across processes ran last (``ran``; see ``_latest``);
- ``inturn:{ns:d}:q``, a sorted set of the waiters by arrival;
- ``inturn:{ns:d}:lease``, a sorted set of every member's lease expiry
  (holder and waiters), by Redis's own clock;
- ``inturn:{ns:d}:info``, a hash: each member's host, pid and arrival time,
  and a post of latest work shared across processes: when its process's
  newest work was called;
- ``inturn:{ns:d}:gone``, a sorted set, rarely there: the members that gave
  up before Redis answered their joining, by when the mark expires.

Every change is one Lua script (``_scripts``), loaded once and called
by SHA: *enqueue* (join the line, take the key if free), *leave* (release,
or give up waiting) and *renew* (extend a lease). Each first drops members
whose lease expired, and each grants a free key to the head of the line,
with a token one above the last (or Redis's clock in microseconds when a
line starts anew), then publishes the grant on the new holder's channel.
When a line empties, its keys are deleted; all five carry a TTL besides.
A waiter that gives up before Redis answered its joining (a timeout, an
interrupt) may send its leave on another connection than its enqueue, and
Redis may run the leave first: the leave, finding it in neither place,
marks it gone, and the enqueue, when it comes, does nothing. So a leave
never leaves a member behind, whatever the order the two arrive in.

Who talks to Redis. Each process, and in it each event loop that uses the
backend, has a *share* (``_loop``) of its own: an id (so its own
channel and member ids), a connection that carries its calls in the order
made (on one server; a cluster's client routes them: ``_calls``), a
subscription that wakes its waiters (the release pushes the turn, nothing
polls), and a heartbeat that renews every lease it has every ``lease / 3``
seconds (``_lease``). The heartbeat's reply also hands a waiter a
grant whose message was lost, and tells a holder that its lease is gone. A
forked child starts afresh (a turn it inherited ends in it alone); a share
ends with its event loop. The connections are made by redis-py
(``pool.make_connection()``: TLS, AUTH, HELLO, Sentinel discovery stay
redis-py's) and then read and written by this process (``_wire``;
the calls ride ``_link``, the subscription ``_inbox``). A
thread writes its own calls, each one round trip on a blocking connection
(redis-py's sync ``Connection``, made with the client's settings;
``_threads``), and is handed a busy key's grant by the share of the
process's backend loop, which keeps its subscription and heartbeat.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading
import weakref
from collections.abc import Hashable
from typing import Any, Final, cast, final

from ..._bridge import acquire_there, backend_loop, release_sync
from ..._describe import describe as show
from ..._errors import BackendUnavailable
from ..._order import order_portable, portable_key, portable_name
from .._base import Capabilities, Grant, Newest
from .._lines import HolderInfo, LineInfo, WaiterInfo

try:
    import redis.asyncio as aioredis
    from redis.exceptions import ResponseError
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "inturn's Redis backend needs redis-py: pip install 'inturn[redis]'"
    ) from error

from .._urls import refused_redis_url, slashless_redis_url
from ._calls import Config
from ._errors import UNREACHABLE, describe, server_of
from ._latest import seen as latest_seen
from ._loop import LoopShare
from ._scripts import Line
from ._steps import RedisGrant, owner
from ._threads import Blocking, sync_connector

__all__ = ("HolderInfo", "LineInfo", "RedisBackend", "RedisGrant", "WaiterInfo")

_NAMESPACE = re.compile(r"[A-Za-z0-9_.:\-]{1,100}")

#: Every backend of this process, so that a forked child can give each a fresh start.
_BACKENDS: weakref.WeakSet[RedisBackend] = weakref.WeakSet()
#: Loop shares a forked child inherited: their connections are the parent's, never to
#: be used (the child closes its copies of their sockets: see _forked), kept here.
_INHERITED: list[object] = []


def _after_fork_in_child() -> None:
    for backend in list(_BACKENDS):
        backend._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@final
class RedisBackend:
    """Lines shared by every process and host that uses the same Redis and namespace.

    Guarantees, each tested against a real server:

    - Mutual exclusion per key across every process and host, while leases hold.
    - Strict FIFO: turns are granted in the order submissions reached Redis
      (each queue submits, per key, its own next task in line, so a
      process's own submissions keep their local order).
    - Push, not poll: a release hands the key over in one script and wakes
      the next holder through its process's subscription.
    - Crash safety: each holder and waiter has a lease, renewed by a
      heartbeat that never stops while the backend is open. A process that
      dies holding a key loses it within the lease (plus one heartbeat of
      the waiter that notices); one that dies waiting is skipped.
    - Nothing hangs: ``timeout`` covers connecting, joining and waiting;
      without one, a waiter whose place is lost, or whose process cannot
      reach Redis for longer than the lease, gets
      :exc:`~inturn.BackendUnavailable` within about a lease. A short
      timeout fails for a busy key, not for a slow connection: an event
      loop's first call, which sets up its connections, waits for that up
      to 3 s (half the lease at most) whatever its timeout, and Redis's
      answer to joining gets one round trip from there, up to a tenth of
      the lease (``timeout=0``, a try-lock, asks once whether the key is
      free); a thread that must open a new connection for it gets as long
      (then TimeoutError, saying it was connecting). With Redis unreachable,
      a call with a timeout ends after the larger of its timeout and those.
    - Errors tell the truth: :exc:`~inturn.BackendUnavailable` means the
      work did not run (with what Redis said: unreachable, a missing
      permission, out of memory, wrong credentials); a holder whose lease
      could not be vouched for learns it (``turn.lease_lost``), and its call
      raises :exc:`~inturn.LeaseLost` after the work ran.
    - Fencing tokens from Redis that only grow per key.
    - Latest wins across processes (``pending="latest",
      across="processes"``): one latest work per key among every process
      and host that shares the line (see :meth:`acquire_latest`); a killed
      or frozen process's work stops counting when its lease runs out.
    - No stale state: a line's keys are deleted when it empties, and all of
      them carry a TTL.
    - Fork and event loops: a process forked from one that made or used the
      backend gets an identity, connections and heartbeat of its own, and
      never touches its parent's; any event loop may use it, one after
      another or at once (each gets its own), and a loop that ends
      (``asyncio.run``) closes its share. A turn held across a raw
      ``os.fork()`` stays the parent's: the child's copy ends in the child
      without a word to Redis (nor is it renewed there), and the parent
      keeps the key until it leaves the turn itself.
    - Threads: a thread's turn (``acquire_sync``) is its own round trips to
      Redis, on a connection no other thread uses meanwhile, with the same
      steps (``_steps``), scripts, leases, grants and errors as a
      task's; wherever an interrupt lands while it takes its turn, no member
      of it stays in Redis (a leave that may overtake its enqueue makes the
      enqueue a no-op); the subscription and
      heartbeat that serve threads run on one backend thread per process.
      On a Sentinel client, threads' connections go to the master a sync
      twin of its Sentinel discovers. With a cluster client, a replica's, or
      a connection class of the user's (which this backend cannot make a
      blocking twin of), threads' calls run on that thread's event loop
      instead (``capabilities.blocking`` is then False).

    Not guaranteed: exclusion across a Redis failover or restart that loses
    the line's data. The holders learn it (their leases count as lost, so
    their calls raise :exc:`~inturn.LeaseLost`), but another process may
    have been granted the key meanwhile; use persistence or fencing tokens
    where that matters.

    :param client: a ``redis.asyncio.Redis`` (also from
        ``Sentinel.master_for()``) or ``RedisCluster`` client, configured as
        you need (TLS, AUTH). The backend makes connections of its own with
        its settings and never uses its pooled ones; a ``RedisCluster``
        client routes the backend's calls, and so serves one event loop.
    :param namespace: keeps the lines of different apps apart (letters,
        digits and ``_.:-``).
    :param lease: seconds a holder or waiter stays in line without a
        heartbeat; a crashed process's place is freed after this long, and
        a Redis that does not answer for this long fails the wait.
    :param owns_client: close ``client`` in :meth:`aclose`.
    :raises ValueError: a bad namespace or lease.
    """

    __slots__ = (
        "__weakref__",
        "_client",
        "_config",
        "_current",
        "_lines",
        "_lock",
        "_namespace",
        "_owns_client",
        "_shares",
        "_threads",
        "_threads_share",
        "capabilities",
    )

    def __init__(
        self,
        client: Any,
        *,
        namespace: str = "inturn",
        lease: float = 10.0,
        owns_client: bool = False,
    ) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise ValueError(
                "inturn: namespace must be 1 to 100 letters, digits or '_.:-', "
                f"got {show(namespace)}"
            )
        if isinstance(lease, bool) or not isinstance(lease, int | float) or not lease >= 0.1:
            raise ValueError(f"inturn: lease must be at least 0.1 seconds, got {show(lease)}")
        if not hasattr(client, "pubsub"):  # redis-py's asyncio RedisCluster before 8.0
            raise TypeError(
                f"inturn: the client {show(client)} has no pub/sub, which wakes the waiters; "
                "for Redis Cluster, install redis-py 8.0 or newer"
            )
        self._client = client
        self._namespace = namespace
        self._lines: dict[tuple[type, Hashable], Line] = {}  # see _line_for
        self._owns_client = owns_client
        single = isinstance(client, aioredis.Redis)
        self._config = Config(
            make=_connector(client),
            client=None if single else client,
            namespace=namespace,
            lease=float(lease),
            channels=f"inturn:{namespace}:wake:",
            host=socket.gethostname(),
            server=server_of(client),
        )
        # By event loop: this process's share on it (see _loop).
        self._shares: dict[asyncio.AbstractEventLoop, LoopShare] = {}
        self._current: LoopShare | None = None  # the last one used: most calls come from it
        self._threads_share: LoopShare | None = None  # the backend loop's, for threads
        self._lock = threading.Lock()  # held to change _shares
        connector = sync_connector(client, float(lease))
        #: Threads' own blocking connections (None: the client's kind has none; see below).
        self._threads = None if connector is None else Blocking(connector)
        #: Each event loop it serves costs a share (connections, a subscription, a
        #: heartbeat): a queue serves its first loop directly, and every other one
        #: through one loop of the process (see Capabilities). Threads block on
        #: connections of their own (one round trip per call), but with a cluster
        #: client, a replica's, or a connection class of the user's, go through that loop.
        self.capabilities: Final[Capabilities] = Capabilities(
            blocking=self._threads is not None, one_loop=True, latest=True
        )
        _BACKENDS.add(self)

    @classmethod
    def from_url(
        cls, url: str, *, namespace: str = "inturn", lease: float = 10.0, **options: Any
    ) -> RedisBackend:
        """A backend on a new client for ``url`` (``redis://``, ``rediss://``, ``unix://``).

        ``options`` go to ``redis.asyncio.Redis.from_url`` (``password``,
        ``ssl_ca_certs``, ``socket_timeout``, ...). The backend owns the
        client and closes it in :meth:`aclose`. Nothing connects yet: a
        server that cannot be reached is found at the first turn.

        :raises TypeError: url is not a ``str``.
        :raises ValueError: redis-py cannot read url (no scheme, another
            scheme, a port that is not a number, ...), or would read no host
            in it (``redis:/host``, one slash: redis-py would connect to
            localhost): the message says what is wrong and how a right URL
            looks, without the password.
        """
        if not isinstance(url, str):
            raise TypeError(f"inturn: a Redis URL must be a str, got {show(url)}")
        if (slashless := slashless_redis_url(url)) is not None:
            raise slashless
        try:
            client = aioredis.Redis.from_url(url, **options)
        except ValueError as error:
            # (from None: redis-py's message is in ours, but its error may show the password)
            raise refused_redis_url(url, str(error)) from None
        return cls(client, namespace=namespace, lease=lease, owns_client=True)

    @property
    def namespace(self) -> str:
        """The namespace of this backend's lines."""
        return self._namespace

    @property
    def lease(self) -> float:
        """Seconds a member stays in line without a heartbeat."""
        return self._config.lease

    def order(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        """Sort keys into the order every process computes (by their portable names).

        :raises TypeError: a key is not a ``str``, ``bytes`` or ``int``.
        """
        return order_portable(keys)

    def _line_for(self, key: Hashable) -> Line:
        """key's line in Redis (its keys' names, packed), kept for the keys used last.

        A digest and five names packed cost a turn more than the rest of its
        own work here; the last _LINES_KEPT keys' are kept (then forgotten
        at once, and made again as they are used).
        """
        kept = self._lines.get((type(key), key))  # (1 and True name one line; 1.0 none)
        if kept is None:
            kept = Line(self._namespace, key)
            if len(self._lines) >= _LINES_KEPT:
                self._lines.clear()
            self._lines[(type(key), key)] = kept
        return kept

    # -- loop shares ----------------------------------------------------------------------

    def _session(self) -> LoopShare:
        """This process's share on the running event loop (made on its first call)."""
        loop = asyncio.get_running_loop()
        share = self._current
        if share is not None and share.loop is loop and not share.closing:
            return share
        share = self._current = self._share_on(loop)
        return share

    def _share_on(self, loop: asyncio.AbstractEventLoop) -> LoopShare:
        """This process's share on loop (made on its first use)."""
        with self._lock:
            share = self._shares.get(loop)
            if share is None or share.closing:
                for other, old in list(self._shares.items()):
                    if _ended(old):  # its loop ended without closing it
                        del self._shares[other]
                        old.abandon()
                if self._config.client is not None and self._shares:
                    raise RuntimeError(
                        "inturn: a RedisBackend on a RedisCluster client serves one event loop "
                        "(redis-py's cluster client does); make one backend per event loop"
                    )
                share = self._shares[loop] = LoopShare(self._config, loop)
        return share

    def thread_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop threads' calls must run on: a cluster client's, once it has one.

        redis-py's cluster client serves one event loop, so threads take
        their turns through the loop that uses the backend already (while it
        runs). Other clients: None, any loop will do.
        """
        if self._config.client is None:
            return None
        with self._lock:
            for share in self._shares.values():
                if not share.closing and share.loop.is_running():
                    return share.loop
        return None

    def _forked(self) -> None:
        """In a forked child: forget the parent's shares; the next call starts afresh.

        The child's copies of their sockets are closed (their descriptors
        only: the parent's connections go on), so that Redis sees the
        parent's connections end when the parent closes them, not when its
        last child exits.
        """
        _INHERITED.append(self._shares)
        for share in self._shares.values():
            share.abandon()  # (the child never runs their loops)
        self._shares = {}
        self._threads_share = None
        if self._threads is not None:
            self._threads = self._threads.forked()
        self._current = None
        self._lock = threading.Lock()

    async def aclose(self) -> None:
        """Close every share: leave the lines waited in, stop heartbeats, close connections.

        Waiters still waiting get :exc:`~inturn.BackendUnavailable`; a holder
        keeps its lease until it runs out. The backend may be used again
        afterwards (it starts anew); the client is closed if the backend owns it.
        """
        with self._lock:
            shares = list(self._shares.values())
            self._shares.clear()
            self._current = self._threads_share = None
        loop = asyncio.get_running_loop()
        for share in shares:
            if share.loop is loop:
                await share.close()
            elif _ended(share):
                share.abandon()
            elif share.loop.is_running():  # another thread's loop: close it there
                closing = asyncio.run_coroutine_threadsafe(share.close(), share.loop)
                await asyncio.wait((asyncio.wrap_future(closing),), timeout=share.config.lease)
            # (else a loop that waits to run again in a thread that lives: it closes
            # its share when it shuts down)
        if self._threads is not None:
            self._threads.close()
        if self._owns_client:
            # A cluster client serves one loop: if only threads used it, the backend loop's
            there = [s.loop for s in shares if s.loop is not loop and s.loop.is_running()]
            if self._config.client is not None and there:
                closing = asyncio.run_coroutine_threadsafe(self._client.aclose(), there[0])
                await asyncio.wait((asyncio.wrap_future(closing),), timeout=self._config.lease)
            else:
                await self._client.aclose()

    # -- taking and giving back turns ------------------------------------------------

    async def acquire(self, key: Hashable, timeout: float | None) -> RedisGrant:
        """Join key's line in Redis; return once this process holds the key.

        ``timeout`` covers connecting, joining the line and waiting in it; 0
        asks once whether the key is free (one round trip to Redis). However
        short it is, an event loop's first call (and the next, if that one
        failed to connect) waits up to 3 s (half the lease at most) for its
        connections to be set up, and then up to a tenth of the lease for
        Redis's answer to joining.

        :raises TimeoutError: the turn was not reached within ``timeout``, or
            the connections were not set up within those 3 s (the message
            says which); this process's place was given up, and the work did
            not run.
        :raises ~inturn.BackendUnavailable: Redis could not be reached, or
            refused (a missing permission, out of memory, wrong credentials),
            or lost the place; the turn was not taken.
        """
        return await self._session().acquire(key, self._line_for(key), timeout)

    async def acquire_latest(
        self, key: Hashable, timeout: float | None, newest: Newest
    ) -> RedisGrant:
        """As :meth:`acquire`, for latest work shared across processes (``across="processes"``).

        The member posts when its process's newest work was called
        (``newest()``); once its turn comes, it runs only if no newer work
        waits behind it in the line or ran since; else it joins the line
        again behind the newer work, or raises Replaced once newer work
        ran (see :class:`~inturn.backends.LatestBackend`). A call's time is
        exact among the processes of one host, and Redis's clock (to within
        a call's latency) among hosts.

        :raises ~inturn.backends.Replaced: newer work of another process ran
            in this work's place.
        :raises TimeoutError: as :meth:`acquire`.
        :raises ~inturn.BackendUnavailable: as :meth:`acquire`.
        """
        return await self._session().acquire(key, self._line_for(key), timeout, newest)

    def release(self, grant: Grant) -> asyncio.Future[None]:
        """End grant's turn: Redis hands the key to the next in line and wakes it.

        The call to leave is written at once (on one server) and the answer
        is a Future that completes by itself, whatever becomes of its
        awaiter. It never fails: a release Redis did not take is logged (the
        key frees itself within the lease).
        """
        return self._owner(grant).release(grant)  # type: ignore[arg-type]

    def _owner(self, grant: Grant) -> LoopShare:
        """The share that granted grant, which this backend made."""
        if isinstance(grant, RedisGrant):
            share = owner(grant)
            if isinstance(share, LoopShare) and share.config is self._config:
                return share
        raise TypeError(f"inturn: {self!r} cannot release {show(grant)}, which it did not grant")

    def acquire_sync(
        self, key: Hashable, timeout: float | None, into: list[Grant] | None = None
    ) -> RedisGrant:
        """As :meth:`acquire`, for a thread: its calls block on a connection of its own.

        Each call is one round trip from the thread (no event loop in
        between); the wait for a busy key blocks on the grant, which this
        process's subscription hands over. The subscription and the
        heartbeat run on one event loop of the process (a daemon thread,
        ``inturn-backend-loop``), which a thread's first turn sets up (as
        an event loop's first turn does).

        An exception that a signal handler raises while the thread waits
        (``KeyboardInterrupt``; ``SystemExit`` from a server's handler)
        propagates, and the place is given up, as at a timeout. ``into``:
        see :meth:`inturn.backends.BlockingBackend.acquire_sync`.

        :raises TimeoutError: as :meth:`acquire`.
        :raises ~inturn.BackendUnavailable: as :meth:`acquire`.
        """
        return self._acquire_sync(key, timeout, into, None)

    def acquire_latest_sync(
        self,
        key: Hashable,
        timeout: float | None,
        newest: Newest,
        into: list[Grant] | None = None,
    ) -> RedisGrant:
        """As :meth:`acquire_latest`, blocking this thread (see :meth:`acquire_sync`)."""
        return self._acquire_sync(key, timeout, into, newest)

    def _acquire_sync(
        self, key: Hashable, timeout: float | None, into: list[Grant] | None, newest: Newest | None
    ) -> RedisGrant:
        threads = self._threads
        if threads is not None:
            share = self._threads_share
            if share is None or share.closing:  # (a forked child resets it: see _forked)
                share = self._threads_share = self._share_on(backend_loop())
            if share.ready:
                return threads.acquire(share, key, self._line_for(key), timeout, into, newest)
        # (its first: the share starts there)
        source = self if newest is None else cast("RedisBackend", _Latest(self, newest))
        return acquire_there(self, source, key, timeout, into)  # type: ignore[return-value]

    def release_sync(self, grant: Grant) -> None:
        """As :meth:`release`, for a thread: returns once Redis answered (or failed, logged)."""
        threads = self._threads
        share = self._owner(grant)
        if threads is not None:
            threads.release(share, grant)  # type: ignore[arg-type]
        else:
            release_sync(self, self, grant)

    # -- looking at the lines --------------------------------------------------------------

    async def lines(self) -> list[LineInfo]:
        """A snapshot of every line of this namespace in Redis: holder and waiters in order.

        For operators (``python -m inturn inspect``) and tests; the answer
        may be stale by the time it returns. It shows every change this
        backend sent before the call from this event loop.

        :raises ~inturn.BackendUnavailable: Redis could not be reached, or refused.
        """
        share = self._session()
        await share.guard()  # (a loop that only looks, asyncio.run(lines()), closes it too)
        try:
            # the digest's 40 hex digits: not a namespace that begins with this one and ':'
            names = await share.calls.scan(f"inturn:{{{self._namespace}:{_DIGEST}}}:line")
            found = [await self._line(share, name) for name in names]
        except (*UNREACHABLE, ResponseError) as error:
            raise BackendUnavailable(f"inturn: {describe(error)}") from error
        lines = [line for line in found if line is not None]
        return sorted(lines, key=lambda line: portable_name(line.key))

    async def namespaces(self) -> list[str]:
        """The namespaces that have lines in this Redis now (any backend's), sorted.

        For operators: ``python -m inturn inspect`` names them when the
        namespace it was given has none (a misspelt one, say).

        :raises ~inturn.BackendUnavailable: Redis could not be reached, or refused.
        """
        share = self._session()
        await share.guard()
        try:
            names = await share.calls.scan(f"inturn:{{*:{_DIGEST}}}:line")
        except (*UNREACHABLE, ResponseError) as error:
            raise BackendUnavailable(f"inturn: {describe(error)}") from error
        # "inturn:{<namespace>:<40 hex digits>}:line"
        start, end = len("inturn:{"), -len(":") - 40 - len("}:line")
        return sorted({_text(name)[start:end] for name in names})

    async def _line(self, share: LoopShare, name: bytes | str) -> LineInfo | None:
        """The line whose ``line`` key is name, as LineInfo; None if it emptied meanwhile."""
        prefix = _text(name)[: -len("line")]
        now_text, line_flat, waiting, lease_flat, info_flat = await share.calls.look(
            [prefix + part for part in _PARTS]
        )
        if not line_flat:
            return None  # emptied meanwhile
        fields = dict(zip(line_flat[::2], line_flat[1::2], strict=True))
        given: bytes | str = fields.get(b"key") or fields.get("key") or b"s:?"  # (str: decoded)
        line = _pairs(line_flat)
        now = int(now_text)
        leases = {member: float(score) for member, score in _pairs(lease_flat).items()}
        info = _pairs(info_flat)

        def about(member: str) -> tuple[str, int, float, float, float | None]:
            seen, called = latest_seen(info.get(member, "? 0 0"))
            host, pid, since = seen.rsplit(" ", 2)
            left = (leases.get(member, now) - now) / 1000
            ago = None if called is None else max(0.0, (now * 1000 - called) / 1e6)
            return host, int(pid), (now - int(since)) / 1000, left, ago

        holder = None
        if "holder" in line:
            host, pid, _, left, ago = about(line["holder"])
            held_for = (now - int(line["since"])) / 1000
            holder = HolderInfo(host, pid, held_for, int(line["token"]), left, latest_called=ago)
        waiters = []
        for member in waiting:
            host, pid, waited, left, ago = about(_text(member))
            waiters.append(WaiterInfo(host, pid, waited, left, latest_called=ago))
        return LineInfo(portable_key(given), holder, tuple(waiters))

    def __repr__(self) -> str:
        # Where, not the client's own repr: that names every connection
        # setting, and this one goes into error messages.
        return f"RedisBackend({_where(self._client)!r}, namespace={self._namespace!r})"


@final
class _Latest:
    """A backend's acquire_latest as an acquire (for the backend loop: see acquire_there)."""

    __slots__ = ("_backend", "_newest")

    def __init__(self, backend: RedisBackend, newest: Newest) -> None:
        self._backend = backend
        self._newest = newest

    async def acquire(self, key: Hashable, timeout: float | None) -> RedisGrant:
        return await self._backend.acquire_latest(key, timeout, self._newest)

    def release(self, grant: Grant) -> asyncio.Future[None]:
        return self._backend.release(grant)


#: The Redis keys of a line that LOOK reads, after its prefix (see _names, and the module's
#: docstring).
_PARTS: Final = ("line", "q", "lease", "info")
#: Lines whose Redis keys a backend keeps named and packed (see RedisBackend._line_for).
_LINES_KEPT: Final = 1024
#: A SCAN pattern for the 40 hex digits of a key's digest.
_DIGEST: Final = "[0-9a-f]" * 40


def _where(client: Any) -> str:
    """The server a client talks to, briefly: a URL without credentials, or the client's kind."""
    pool = getattr(client, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    if service is not None:
        return f"sentinel service {service}"
    settings = getattr(pool, "connection_kwargs", None) or {}
    if "path" in settings:
        return f"unix://{settings['path']}"
    if "host" in settings:
        return f"{settings['host']}:{settings.get('port', 6379)}/{settings.get('db', 0)}"
    return type(client).__name__


def _ended(share: LoopShare) -> bool:
    """Whether share's loop will never run again: closed, or idle in a thread that ended."""
    loop = share.loop
    return loop.is_closed() or (not loop.is_running() and not share.thread.is_alive())


def _connector(client: Any) -> Any:
    """What makes a connection of the backend's own (a cluster's: to its default node)."""
    if isinstance(client, aioredis.Redis):
        return client.connection_pool.make_connection

    def make() -> Any:
        node = client.get_default_node()
        return node.connection_class(**node.connection_kwargs)

    return make


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


def _pairs(flat: list[Any]) -> dict[str, str]:
    """A flat [k1, v1, k2, v2, ...] reply as a dict of str."""
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
