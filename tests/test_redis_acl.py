"""The Redis backend under a least-privilege ACL user: the docs' ACL line, run as
written against a real server, and each permission it grants, taken away in turn.

The line is read from the Backends page itself, so the documented grant and the
tested one cannot drift apart; the backend's own list of what it calls is read from
its scripts.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from inturn import BackendUnavailable, KeyedQueue
from inturn.backends.redis import RedisBackend, _scripts

from support.helpers import PATIENCE

BACKENDS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "backends.md"
#: A lease short enough that a held turn is renewed within a test.
LEASE = 0.5
#: What the backend sends itself, beside its scripts' commands: its script calls, their
#: load on each connection and reload after SCRIPT FLUSH, the subscription and its
#: liveness check, lines()' SCAN, and INFO (inside the greeting, to tell a restarted or
#: failed-over server).
OWN_CALLS = {"evalsha", "script|load", "eval", "subscribe", "ping", "scan", "info"}
#: Grants whose loss the first turn does not meet (see the tests of each).
NOT_AT_FIRST_TURN = {"script|load", "eval", "scan", "ping", "info"}


def documented_acl_line() -> list[str]:
    """The Backends page's ``ACL SETUSER`` line, as words (there is exactly one)."""
    lines = [ln.strip() for ln in BACKENDS_PAGE.read_text().splitlines() if "ACL SETUSER" in ln]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def granted(words: list[str]) -> set[str]:
    """The commands an ACL line's words grant (``+name``), lower-case."""
    return {word[1:].lower() for word in words if word.startswith("+")}


#: The page's line's grants, each taken away in a test below.
GRANTS = sorted(granted(documented_acl_line()))


def test_the_documented_acl_line_grants_what_the_backend_calls_and_nothing_more() -> None:
    called = {name.lower() for name in _scripts.CALLED}
    assert granted(documented_acl_line()) == called | OWN_CALLS


def test_the_greeting_tries_every_command_the_scripts_call() -> None:
    # (so that a user lacking one is told at the first call: see the per-grant tests)
    tried = set(re.findall(r"try\('([A-Z]+)'", _scripts.HELLO.body.decode()))
    assert tried == _scripts.CALLED - {"INFO"}


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client of the session's server with every right, to make (and drop) users."""
    client = aioredis.Redis.from_url(redis_url)
    made: list[str] = []
    client.made = made  # type: ignore[attr-defined]
    yield client
    for user in made:
        await client.acl_deluser(user)
    await client.aclose()


async def make_user(
    admin: aioredis.Redis, redis_url: str, namespace: str, without: str | None = None
) -> str:
    """A user made with the page's ACL line for namespace (less ``+without``); its URL."""
    user, password = f"u{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    words = documented_acl_line()
    assert words[:3] == ["ACL", "SETUSER", "worker"]
    rules = []
    for word in words[3:]:
        word = word.replace("secret", password).replace("orders", namespace)
        if without is None or word.lower() != f"+{without}":
            rules.append(word)
    assert len(rules) == len(words) - 3 - (without is not None)
    await admin.execute_command("ACL", "SETUSER", user, *rules)
    admin.made.append(user)  # type: ignore[attr-defined]
    return redis_url.replace("redis://", f"redis://{user}:{password}@", 1)


async def refusals(admin: aioredis.Redis, user_url: str) -> list[Any]:
    """What ACL LOG recorded against the user of user_url (redis-py parses each entry)."""
    user = user_url.split("//", 1)[1].split(":", 1)[0]
    return [entry for entry in await admin.acl_log() if entry["username"] == user]


async def waited_for(backend: RedisBackend) -> list[Any]:
    """backend's lines, once one has a waiter (polled: the waiter is another backend's)."""
    while not (lines := await backend.lines()) or not lines[0].waiters:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    return lines


async def test_a_user_made_with_the_documented_acl_line_takes_turns_and_runs_inspect(
    admin: aioredis.Redis, redis_url: str, namespace: str
) -> None:
    url = await make_user(admin, redis_url, namespace)
    first = RedisBackend.from_url(url, namespace=namespace, lease=LEASE)
    second = RedisBackend.from_url(url, namespace=namespace, lease=LEASE)
    queue, other = KeyedQueue(backend=first), KeyedQueue(backend=second)
    order: list[str] = []
    holding, release = asyncio.Event(), asyncio.Event()
    try:

        async def hold() -> None:
            holding.set()
            await release.wait()
            order.append("holder")

        holder = asyncio.create_task(queue.run("k", hold))
        await holding.wait()
        waiter = asyncio.create_task(other.run("k", order.append, "waiter"))
        lines = await asyncio.wait_for(waited_for(first), PATIENCE)
        assert [line.key for line in lines] == ["k"]
        # held past two leases: renewed, not lost
        await asyncio.sleep(2 * LEASE)
        printed = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "inturn", "inspect", "--redis", url, "--namespace", namespace],
            capture_output=True,
            text=True,
            timeout=PATIENCE,
        )
        assert printed.returncode == 0, printed.stderr
        assert "'k'" in printed.stdout, printed.stdout
        assert re.search(r"\n    1\. .* waiting ", printed.stdout), printed.stdout
        with pytest.raises(TimeoutError):  # a waiter that gives up leaves the line
            async with other.keyed("k", timeout=0.05):
                order.append("gave up")
        release.set()
        await asyncio.wait_for(asyncio.gather(holder, waiter), PATIENCE)
        assert order == ["holder", "waiter"]
        # threads' turns, on connections of their own
        ran: list[int] = []

        def turns(n: int) -> None:
            for i in range(10):
                queue.run_sync("t", ran.append, n * 100 + i)

        threads = [threading.Thread(target=turns, args=(n,)) for n in range(3)]
        for thread in threads:
            thread.start()
        await asyncio.to_thread(lambda: [t.join(PATIENCE) for t in threads])
        assert len(ran) == 30
        assert await first.lines() == []
    finally:
        release.set()  # (a failure above must not leave the holder holding)
        await queue.aclose()
        await other.aclose()
    assert await refusals(admin, url) == []


@pytest.mark.parametrize("grant", [g for g in GRANTS if g not in NOT_AT_FIRST_TURN])
async def test_a_user_lacking_one_grant_is_told_which_at_the_first_turn(
    admin: aioredis.Redis, redis_url: str, namespace: str, grant: str
) -> None:
    url = await make_user(admin, redis_url, namespace, without=grant)
    queue = KeyedQueue(backend=RedisBackend.from_url(url, namespace=namespace, lease=LEASE))
    ran: list[int] = []
    try:
        with pytest.raises(BackendUnavailable) as caught:
            await asyncio.wait_for(queue.run("k", ran.append, 1), PATIENCE)
    finally:
        await queue.aclose()
    assert ran == []
    message = str(caught.value)
    assert f"grant it +{grant} " in message, message
    assert "the work did not run" in message


async def test_a_user_lacking_scan_takes_turns_and_is_told_at_lines(
    admin: aioredis.Redis, redis_url: str, namespace: str
) -> None:
    url = await make_user(admin, redis_url, namespace, without="scan")
    backend = RedisBackend.from_url(url, namespace=namespace, lease=LEASE)
    queue = KeyedQueue(backend=backend)
    try:
        assert await asyncio.wait_for(queue.run("k", lambda: "ran"), PATIENCE) == "ran"
        with pytest.raises(BackendUnavailable, match=r"grant it \+scan "):
            await asyncio.wait_for(backend.lines(), PATIENCE)
    finally:
        await queue.aclose()


async def test_a_user_lacking_eval_is_told_when_the_scripts_were_flushed(
    admin: aioredis.Redis, redis_url: str, namespace: str
) -> None:
    url = await make_user(admin, redis_url, namespace, without="eval")
    queue = KeyedQueue(backend=RedisBackend.from_url(url, namespace=namespace, lease=LEASE))
    try:
        assert await asyncio.wait_for(queue.run("k", lambda: "ran"), PATIENCE) == "ran"
        await admin.script_flush()  # (the connection's scripts are reloaded by EVAL)
        with pytest.raises(BackendUnavailable, match=r"grant it \+eval "):
            await asyncio.wait_for(queue.run("k", lambda: None), PATIENCE)
    finally:
        await queue.aclose()


@pytest.mark.parametrize("grant", ["ping", "info", "script|load"])
async def test_a_user_lacking_an_optional_grant_still_takes_turns(
    admin: aioredis.Redis, redis_url: str, namespace: str, grant: str
) -> None:
    url = await make_user(admin, redis_url, namespace, without=grant)
    queue = KeyedQueue(backend=RedisBackend.from_url(url, namespace=namespace, lease=LEASE))
    try:
        for _ in range(3):
            assert await asyncio.wait_for(queue.run("k", lambda: "ran"), PATIENCE) == "ran"
    finally:
        await queue.aclose()


async def test_a_grant_revoked_after_the_greeting_is_named_from_redis_reply(
    admin: aioredis.Redis, redis_url: str, namespace: str
) -> None:
    # Redis 7.0 names no command when a script's call is refused, only the script and
    # its line; later versions name it. Either way the grant to add is named.
    url = await make_user(admin, redis_url, namespace)
    queue = KeyedQueue(backend=RedisBackend.from_url(url, namespace=namespace, lease=LEASE))
    try:
        assert await queue.run("k", lambda: "first") == "first"
        user = url.split("//", 1)[1].split(":", 1)[0]
        await admin.execute_command("ACL", "SETUSER", user, "-time")
        with pytest.raises(BackendUnavailable, match=r"grant it \+time ") as caught:
            await asyncio.wait_for(queue.run("k", lambda: None), PATIENCE)
        assert "the work did not run" in str(caught.value)
    finally:
        await queue.aclose()
