"""How one loop share's script calls reach Redis: on one server its Link, on a cluster the client.

On one server, a share's calls ride its Link, which runs them in the order
made; a RedisCluster client routes each call to its keys' node and runs them
concurrently, so a call that must follow another waits for it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..._order import portable_name
from ..._tasks import retrieve
from ._latest import ran, sent
from ._lease import Member
from ._link import Call, Link
from ._resp import bulk
from ._scripts import AGAIN, ENQUEUE, HELLO, JUDGE, LEAVE, LOOK, RENEW, SCRIPTS, Script

#: A leave's argument: whether its member's enqueue may still come (see Calls.leave).
_MARKS = (b"0", b"1")
_MARK_BULKS = (bulk(b"0"), bulk(b"1"))
#: An argument of latest work's (a post, what ran) for a member of other work: none.
_NONE = bulk(b"")


@dataclass(frozen=True)
class Config:
    """What every loop share of one backend has in common (see _loop)."""

    make: Callable[[], Any]  #: makes a connection of the share's own
    client: Any  #: the client, for a cluster's script calls (None on one server)
    namespace: str
    lease: float
    channels: str  #: the prefix of every process's channel
    host: str
    server: str | None = None  #: where the client connects (host:port), for messages

    @property
    def lease_ms(self) -> bytes:
        return b"%d" % int(self.lease * 1000)

    @property
    def ttl_ms(self) -> bytes:
        return b"%d" % int(self.lease * 3000)


class Calls:
    """One loop share's script calls (and SCAN): on its Link, or through a cluster client."""

    __slots__ = (
        "_channel",
        "_cluster",
        "_greeted",
        "_info",
        "_probe",
        "_tails",
        "config",
        "link",
    )

    def __init__(
        self, config: Config, channel: str, greeted: Callable[[asyncio.Future[Any]], None]
    ) -> None:
        self.config = config
        self._channel = channel
        self._greeted = greeted  # called with each greeting, once answered
        self._info = f"{config.host} {os.getpid()}"
        # One server: the share's pipelined connection for its calls; a cluster: its client.
        self.link: Link | None = None
        self._cluster: _ClusterCalls | None = None
        #: The greeting's probe (see _scripts): a key of the namespace's own.
        self._probe = f"inturn:{{{config.namespace}:probe}}"
        if config.client is None:
            greeting = bulk(self._probe.encode()) + bulk(channel.encode())
            self.link = Link(config.make, greeting, greeted, config.lease)
        else:
            self._cluster = _ClusterCalls(config.client)
        # by script: its arguments after the member's id that never change, packed
        lease_ms, ttl_ms, channels = (
            bulk(config.lease_ms),
            bulk(config.ttl_ms),
            bulk(config.channels.encode()),
        )
        self._tails = (
            lease_ms + ttl_ms + channels,
            ttl_ms + channels,
            lease_ms + ttl_ms + channels,
        )

    def greet(self) -> asyncio.Future[Any]:
        """Greet Redis (on one server, connecting the Link); the answer's future, also greeted's."""
        if self.link is not None:
            return self.link.open()
        greeting = self._cluster_call(HELLO, (self._probe,), (self._channel,)).future
        greeting.add_done_callback(self._greeted)
        return greeting

    def pack(self, names: Sequence[str]) -> bytes:
        """A line's key names as a script call's keys, packed for the Link (b"" on a cluster)."""
        return b"" if self.link is None else b"".join([bulk(name.encode()) for name in names])

    def enqueue(self, member: Member, member_id: str) -> Call:
        """Call the enqueue script for member: join its line, or take the key if free."""
        if self.link is not None:
            return self.link.call(ENQUEUE, self.enqueue_rest(member, member_id))
        config = self.config
        info = f"{self._info} {int(time.time() * 1000)}".encode()
        args = (member_id, config.lease_ms, config.ttl_ms, config.channels, info)
        post = b"" if member.called is None else sent(member.called)
        return self._cluster_call(ENQUEUE, member.names, (*args, portable_name(member.key), post))

    def enqueue_rest(self, member: Member, member_id: str) -> bytes:
        """The enqueue's keys and arguments, packed (for a Link, or a thread's own connection)."""
        info = f"{self._info} {int(time.time() * 1000)}".encode()
        post = _NONE if member.called is None else bulk(sent(member.called))
        return (
            member.packed
            + bulk(member_id.encode())
            + self._tails[0]
            + bulk(info)
            + member.given
            + post
        )

    def leave(self, member: Member, member_id: str, marked: bool = False) -> Call:
        """Call the leave script for member (after the share's earlier calls, on a Link).

        ``marked``: no answer to member's enqueue was read, so it may come after
        this leave; if it does, it does nothing (see _scripts._LEAVE).
        """
        if self.link is not None:
            return self.link.call(LEAVE, self.leave_rest(member, member_id, marked))
        config = self.config
        done = b"" if member.ran is None else ran(*member.ran)
        args = (member_id, config.ttl_ms, config.channels, _MARKS[marked], done)
        return self._cluster_call(LEAVE, member.names, args)

    def leave_rest(self, member: Member, member_id: str, marked: bool = False) -> bytes:
        """The leave's keys and arguments, packed (for a Link, or a thread's own connection).

        Latest work that ran (``member.ran``) is recorded as what ran (see _latest).
        """
        done = _NONE if member.ran is None else bulk(ran(*member.ran))
        tail = self._tails[1] + _MARK_BULKS[marked] + done
        return member.packed + bulk(member_id.encode()) + tail

    def judge(self, member: Member, member_id: str) -> Call:
        """Call the judge script for member, whose turn of latest work came (see _latest)."""
        if self.link is not None:
            return self.link.call(JUDGE, self.judge_rest(member, member_id))
        config = self.config
        return self._cluster_call(JUDGE, member.names, (member_id, config.ttl_ms, config.channels))

    def judge_rest(self, member: Member, member_id: str) -> bytes:
        """The judge's keys and arguments, packed (for a Link, or a thread's own connection)."""
        return member.packed + bulk(member_id.encode()) + self._tails[1]

    def again(self, member: Member, member_id: str) -> Call:
        """Call the script by which member's turn of latest work joins its line again, with a
        fresh post of ``member.called``, and hands the key on (see _latest)."""
        if self.link is not None:
            return self.link.call(AGAIN, self.again_rest(member, member_id))
        config = self.config
        assert member.called is not None
        args = (member_id, config.lease_ms, config.ttl_ms, config.channels, sent(member.called))
        return self._cluster_call(AGAIN, member.names, args)

    def again_rest(self, member: Member, member_id: str) -> bytes:
        """Its call's keys and arguments, packed (for a Link, or a thread's own connection)."""
        assert member.called is not None
        return member.packed + bulk(member_id.encode()) + self._tails[0] + bulk(sent(member.called))

    def renew(self, member: Member, member_id: str) -> Call:
        """Call the renew script for member: extend its lease (and learn whether it holds)."""
        if self.link is not None:
            return self.link.call(RENEW, member.packed + bulk(member_id.encode()) + self._tails[2])
        config = self.config
        args = (member_id, config.lease_ms, config.ttl_ms, config.channels)
        return self._cluster_call(RENEW, member.names, args)

    def _cluster_call(self, script: Script, names: Sequence[str], args: Sequence[Any]) -> Call:
        assert self._cluster is not None
        return self._cluster.call(script, names, args)

    async def scan(self, pattern: str) -> list[bytes]:
        """Every key name of this server (or cluster) that matches pattern."""
        if self.link is None:
            return [name async for name in self.config.client.scan_iter(match=pattern)]
        found: list[bytes] = []
        cursor = b"0"
        while True:
            cursor, names = await self.link.command(
                b"SCAN", cursor, b"MATCH", pattern.encode(), b"COUNT", b"1000"
            ).future
            found += names
            if cursor in (b"0", 0):
                return found

    async def look(self, names: Sequence[str]) -> Any:
        """One line's state as the LOOK script returns it."""
        if self.link is not None:
            return await self.link.call(LOOK, self.pack(names)).future
        return await self._cluster_call(LOOK, names, ()).future

    async def aclose(self) -> None:
        """Close the Link once the calls on their way (releases) are answered, a lease at most."""
        link = self.link
        if link is not None:
            last = link.last
            if last is not None and not last.done():  # releases still on their way
                await asyncio.wait((last,), timeout=self.config.lease)
            await link.aclose()


class _ClusterCalls:
    """Script calls through a RedisCluster client, which routes each to its keys' node.

    Calls run concurrently, not in the order made: a caller that needs one
    after another awaits the first.
    """

    __slots__ = ("_scripts",)

    def __init__(self, client: Any) -> None:
        self._scripts = tuple(client.register_script(s.body.decode()) for s in SCRIPTS)

    def call(self, script: Script, names: Sequence[str], args: Sequence[Any]) -> Call:
        loop = asyncio.get_running_loop()
        call = Call(script.index, b"", loop.create_future())
        call.sent = time.monotonic()  # no later than Redis runs it
        task = loop.create_task(self._scripts[script.index](keys=names, args=args))

        def done(task: asyncio.Task[Any]) -> None:
            if call.future.done():
                retrieve(task)
            elif task.cancelled():
                call.future.cancel()
            elif (error := task.exception()) is not None:
                call.future.set_exception(error)
            else:
                call.future.set_result(task.result())

        task.add_done_callback(done)
        return call
