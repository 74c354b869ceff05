"""The session's PostgreSQL server answers (the fixture of tests/support/pg_server.py)."""

from __future__ import annotations

import pytest

psycopg = pytest.importorskip("psycopg")


def test_the_server_answers(postgres_url: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        assert connection.execute("SELECT 1").fetchone() == (1,)


def test_a_server_of_its_own_takes_settings_and_restarts() -> None:
    from support.pg_server import new_server

    server = new_server({"idle_session_timeout": "2s", "tcp_keepalives_idle": "1"})
    try:
        with psycopg.connect(server.url, autocommit=True) as connection:
            row = connection.execute("SHOW idle_session_timeout").fetchone()
            assert row == ("2s",)
        port = server.port
        server.stop(mode="immediate")
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(server.url, connect_timeout=2)
        server.start()
        assert server.port == port
        with psycopg.connect(server.url, autocommit=True) as connection:
            assert connection.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.remove()
