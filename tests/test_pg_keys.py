"""Keys to advisory lock ids (src/inturn/backends/postgres/_keys.py): a sketch for issue 20."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from inturn.backends.postgres._keys import lock_id, lock_parts

#: lock_id("shop", "order-1") as the sketch computes it.
PINNED = -2450914393569313720

KEYS: list[Any] = ["order-1", "", "ünïcödé", b"order-1", b"\x00\xff", 1, "1", -1, 0, 2**200, True]


def test_ids_are_signed_64_bit_integers() -> None:
    for key in KEYS:
        assert -(2**63) <= lock_id("shop", key) < 2**63


def test_ids_are_pinned() -> None:
    """The mapping is shared by every process of every version: changing it moves every key."""
    assert lock_id("shop", "order-1") == PINNED


def test_ids_are_the_same_in_another_process_with_another_hash_seed() -> None:
    program = (
        "import sys\n"
        "from inturn.backends.postgres._keys import lock_id\n"
        "print(lock_id('shop', 'order-1'), lock_id('shop', b'order-1'), lock_id('shop', 7))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [int(x) for x in out] == [
        lock_id("shop", "order-1"),
        lock_id("shop", b"order-1"),
        lock_id("shop", 7),
    ]


def test_namespaces_and_key_types_give_distinct_ids() -> None:
    ids = {
        (namespace, key): lock_id(namespace, key)
        for namespace in ("a", "b", "ab")
        for key in KEYS[:-1]
    }
    assert len(set(ids.values())) == len(ids)
    # length-delimited: the namespace's end is not the key's start
    assert lock_id("ab", "c") != lock_id("a", "bc")
    # as in process, True is the line of 1
    assert lock_id("shop", True) == lock_id("shop", 1)


def test_keys_that_cannot_be_shared_are_refused() -> None:
    with pytest.raises(TypeError):
        lock_id("shop", ("a", 1))


def test_pg_locks_shows_an_id_as_its_two_halves(postgres_url: str) -> None:
    psycopg = pytest.importorskip("psycopg")
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        for key in ("order-1", 7, b"x", "negative?"):
            lock = lock_id("shop", key)
            connection.execute("SELECT pg_advisory_lock(%s)", (lock,))
            row = connection.execute(
                "SELECT classid::oid::bigint, objid::oid::bigint, objsubid FROM pg_locks"
                " WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
            ).fetchone()
            connection.execute("SELECT pg_advisory_unlock(%s)", (lock,))
            assert row == (*lock_parts(lock), 1)
    assert lock_parts(-1) == (0xFFFF_FFFF, 0xFFFF_FFFF)
    assert lock_parts(2**32 + 5) == (1, 5)
