"""PostgresBackend behind a real PgBouncer (tests/support/pg_bouncer.py), in session and
transaction mode.

Session locks need one server session per client: PgBouncer's session mode
keeps that, its transaction mode does not (it runs each transaction on any
server session). The backend cannot see the mode, but it sees a pooler (the
server session is not the one the connection was told of), and catches a
turn's statements moving between server sessions.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator

import pytest

psycopg = pytest.importorskip("psycopg")

from inturn import KeyedQueue, LeaseLost  # noqa: E402
from inturn.backends.postgres import PostgresBackend  # noqa: E402

from support.helpers import PATIENCE  # noqa: E402
from support.pg_bouncer import bouncer  # noqa: E402


@pytest.fixture
def session_mode(postgres_url: str) -> Iterator[str]:
    with bouncer(postgres_url, "session") as url:
        yield url


@pytest.fixture
def transaction_mode(postgres_url: str) -> Iterator[str]:
    with bouncer(postgres_url, "transaction") as url:
        yield url


def _backend(url: str) -> PostgresBackend:
    return PostgresBackend.from_url(url, namespace=f"t-{uuid.uuid4().hex[:12]}")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "inturn.postgres" and record.levelno >= logging.WARNING
    ]


async def test_behind_a_pooler_in_session_mode_turns_hold_and_a_warning_says_so(
    session_mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _backend(session_mode)
    queue = KeyedQueue(backend=backend)
    inside: list[int] = []
    order: list[int] = []

    async def turn(n: int) -> None:
        async with queue.keyed("k"):
            inside.append(n)
            assert len(inside) == 1, "two turns inside at once"
            await asyncio.sleep(0)
            order.append(n)
            inside.remove(n)

    try:
        await asyncio.wait_for(asyncio.gather(*(turn(n) for n in range(6))), PATIENCE)
        assert sorted(order) == list(range(6))
    finally:
        await backend.aclose()
    warned = _warnings(caplog)
    assert len(warned) == 1  # once per backend, not per connection or turn
    assert "a connection pooler sits between" in warned[0]
    assert "pool_mode = session" in warned[0]


async def test_behind_a_pooler_in_transaction_mode_a_moved_turn_is_caught(
    transaction_mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The turn's lock lands on one server session; another client then pins that one,
    so the unlock runs on another: the turn is lost, and the log names the mode."""
    backend = _backend(transaction_mode)
    queue = KeyedQueue(backend=backend)
    other = await psycopg.AsyncConnection.connect(transaction_mode)  # not autocommit

    async def work() -> None:
        # the turn's server session is idle in the pooler's pool now: the newest
        # there, so the next transaction, this one's, gets it and keeps it
        await other.execute("SELECT 1")

    try:
        with pytest.raises(LeaseLost):
            await queue.run("k", work)
        logged = [message for message in _warnings(caplog) if "transaction" in message]
        assert logged, _warnings(caplog)
        assert "connect inturn to PostgreSQL directly" in logged[-1]
    finally:
        await other.rollback()
        await other.close()
        await backend.aclose()
