"""examples/redis_stream_consumer.py against the session's Redis server, checked from the side.

The example checks its own claims and exits non-zero if one fails; these
tests also read the stream, its consumer group and the example's ledger in
Redis after the run (``--keep``), so an example that checked the wrong
thing would not pass either.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from support.servers import free_port

EXAMPLE = Path(__file__).parent.parent / "examples" / "redis_stream_consumer.py"
GROUP = "appliers"


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=60
    )


def order(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def found(pattern: str, text: str) -> re.Match[str]:
    match = re.search(pattern, text, re.MULTILINE)
    assert match is not None, f"no line matching {pattern!r} in:\n{text}"
    return match


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def test_acks_only_what_was_applied_and_applies_redeliveries_once(
    redis_url: str, client: redis.Redis
) -> None:
    result = run_example(redis_url, "--keep")
    out = result.stdout
    header = found(r"^stream (inturn-example:\w+): (\d+) messages", out)
    stream, n = header[1], int(header[2])
    try:
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""
        assert found(r"^applied (\d+) times", out)[1] == str(n)
        peak = int(found(r"at most (\d+) at once \(max 32\)", out)[1])
        assert 1 < peak <= 32
        redelivered = found(
            r"^redelivered (\d+) pending entries: (\d+) that failed, "
            r"(\d+) held back behind it, (\d+) applied before$",
            out,
        )
        assert redelivered[2] == "1"
        assert found(r"^pending at the end: (\d+)$", out)[1] == "0"
        failed_line = found(r"^1 failed \(write of (\S+) at (\S+) failed\): left pending$", out)
        account, failed = failed_line[1], failed_line[2]

        # the stream and its group: every entry delivered and acknowledged
        entries = client.xrange(stream)
        assert len(entries) == n
        ids = [entry_id for entry_id, _ in entries]
        accounts = {entry_id: fields["account"] for entry_id, fields in entries}
        [info] = client.xinfo_groups(stream)
        assert info["name"] == GROUP
        assert info["last-delivered-id"] == ids[-1]
        assert info["pending"] == 0
        assert client.xpending(stream, GROUP)["pending"] == 0

        # the ledger: each entry applied once, an account's in stream-ID order
        applied = client.lrange(f"{stream}:applied", 0, -1)
        assert sorted(applied, key=order) == ids
        for name in set(accounts.values()):
            mine = [i for i in ids if accounts[i] == name]
            assert [i for i in applied if accounts[i] == name] == mine, name
        balances = client.hgetall(f"{stream}:balance")
        for name, total in balances.items():
            assert int(total) == sum(
                int(fields["amount"]) for _, fields in entries if fields["account"] == name
            )
        assert set(balances) == set(accounts.values())

        # the first batch: its entries were applied but for the failed one and
        # its account's later ones, which were held back, then redelivered in order
        size = int(found(r"^acked \d+ of (\d+) entries", out)[1])
        first = ids[:size]
        held = [i for i in first if accounts[i] == account and order(i) >= order(failed)]
        assert len(held) > 1, "the failed entry should have later ones of its account"
        assert found(r"^acked (\d+) of", out)[1] == str(size - len(held))
        assert set(applied[: size - len(held)]) == set(first) - set(held)
        assert applied[size - len(held) : size] == held
        assert redelivered[3] == str(len(held) - 1)

        # a later batch whose XACK was lost came again whole, and was not applied twice
        lost = int(found(r"^XACK of (\d+) entries lost", out)[1])
        assert lost == size
        assert redelivered[4] == str(lost)
        assert redelivered[1] == str(len(held) + lost)  # the failed one, held back, lost XACK
    finally:
        client.delete(stream, f"{stream}:balance", f"{stream}:last", f"{stream}:applied")


def test_leaves_nothing_behind(redis_url: str, client: redis.Redis) -> None:
    result = run_example(redis_url)
    assert result.returncode == 0, result.stderr
    stream = found(r"^stream (inturn-example:\w+):", result.stdout)[1]
    assert client.keys(f"{stream}*") == []


def test_without_a_server_says_so_in_one_sentence() -> None:
    result = run_example(f"redis://127.0.0.1:{free_port()}/0")
    assert result.returncode == 2
    assert result.stderr.startswith("no Redis server at redis://127.0.0.1:")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
