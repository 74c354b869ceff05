"""A partitioned consumer: bounded parallelism, per-account order, commit after the batch.

Messages keyed by account arrive on 3 partitions (as from a Kafka topic
partitioned by account: an account's messages are always on one partition,
in offset order). The consumer polls a batch from every partition and
submits each message to a ``KeyedQueue(max_running=4)``: messages of one
account are applied one at a time in offset order, other accounts in
parallel, never more than 4 at once, and a producer that gets ahead of the
workers waits in ``submit()`` instead of piling up tasks.

Each batch runs in a ``queue.batch()`` scope, and its offsets are committed
only after the scope exits, so after every one of its messages was applied.
One message fails the first time it is delivered (a database blip): the
scope raises the error, nothing is committed, and the consumer polls the same
offsets again. The account's later messages in that batch are held back
rather than applied past the gap, and applying is idempotent (each account
remembers the last offset it applied), so the redelivered batch applies
every message exactly once, in order.

Run: python examples/partitioned_batch.py
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass, field

from inturn import KeyedQueue

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

PARTITIONS = 3
MAX_RUNNING = 4
BATCH = 40  # messages per partition per poll


@dataclass(frozen=True)
class Message:
    partition: int
    offset: int
    account: str
    amount: int


@dataclass
class Ledger:
    balances: dict[str, int] = field(default_factory=dict)
    last_offset: dict[str, int] = field(default_factory=dict)  # per account: applied up to
    applied: dict[str, list[int]] = field(default_factory=dict)  # per account: offsets, in order
    running: int = 0  # messages being applied right now
    peak: int = 0
    halted: set[str] = field(default_factory=set)  # accounts whose message failed in this try
    blip_pending: bool = True  # the one transient failure still to come


class DatabaseBlip(Exception):
    """A transient failure: the message is fine, the write did not happen."""


async def apply(ledger: Ledger, message: Message) -> None:
    """Apply one message to its account's balance, once (a redelivery is skipped)."""
    ledger.running += 1
    ledger.peak = max(ledger.peak, ledger.running)
    try:
        if ledger.last_offset.get(message.account, -1) >= message.offset:
            return  # applied in an earlier delivery of this batch
        if message.account in ledger.halted:
            return  # an earlier message of the account failed: not past the gap
        balance = ledger.balances.get(message.account, 0)
        await asyncio.sleep(random.uniform(0, 0.002))  # the ledger write
        if ledger.blip_pending and message.offset == 57:
            ledger.blip_pending = False
            ledger.halted.add(message.account)
            raise DatabaseBlip(f"write of {message.account} at offset {message.offset} failed")
        ledger.balances[message.account] = balance + message.amount
        ledger.last_offset[message.account] = message.offset
        ledger.applied.setdefault(message.account, []).append(message.offset)
    finally:
        ledger.running -= 1


def make_topic(rng: random.Random, accounts: list[str], n: int) -> list[list[Message]]:
    """n messages on PARTITIONS partitions; an account always goes to the same one."""
    topic: list[list[Message]] = [[] for _ in range(PARTITIONS)]
    for _ in range(n):
        account = rng.choice(accounts)
        partition = accounts.index(account) % PARTITIONS
        log = topic[partition]
        log.append(Message(partition, len(log), account, rng.randint(-50, 100)))
    return topic


def poll(topic: list[list[Message]], committed: list[int]) -> list[Message]:
    """The next batch: up to BATCH messages after each partition's committed offset."""
    fetched = [log[committed[p] + 1 : committed[p] + 1 + BATCH] for p, log in enumerate(topic)]
    # interleave the partitions, as a consumer's fetches arrive
    return [f[i] for i in range(BATCH) for f in fetched if i < len(f)]


async def consume(topic: list[list[Message]], ledger: Ledger) -> tuple[list[int], int]:
    """Process the topic batch by batch; return the committed offsets and the redeliveries."""
    queue = KeyedQueue(max_running=MAX_RUNNING)
    committed = [-1] * PARTITIONS
    redelivered = 0
    while batch_messages := poll(topic, committed):
        ledger.halted.clear()
        try:
            async with queue.batch() as batch:
                for message in batch_messages:
                    await batch.submit(message.account, apply, ledger, message)
        except ExceptionGroup as group:
            # not committed: the same offsets come again with the next poll
            redelivered += 1
            print(f"batch failed ({', '.join(map(str, group.exceptions))}); redelivering")
            continue
        # the scope exited: every message of the batch was applied, none is running
        assert ledger.running == 0
        for m in batch_messages:
            assert ledger.last_offset[m.account] >= m.offset, f"{m} not applied before commit"
        for m in batch_messages:
            committed[m.partition] = max(committed[m.partition], m.offset)
        print(f"committed offsets {committed} after {len(batch_messages)} messages")
    return committed, redelivered


async def main() -> None:
    rng = random.Random(7)
    accounts = [f"acct-{i}" for i in range(12)]
    topic = make_topic(rng, accounts, 450)
    ledger = Ledger()
    committed, redelivered = await consume(topic, ledger)

    assert committed == [len(log) - 1 for log in topic], "a partition was not consumed to its end"
    assert redelivered == 1, "the blip should have made exactly one batch come again"
    messages = [m for log in topic for m in log]
    for account in accounts:
        mine = [m for m in messages if m.account == account]
        assert ledger.balances.get(account, 0) == sum(m.amount for m in mine), f"{account}: total"
        # applied once each, in offset order
        assert ledger.applied.get(account, []) == [m.offset for m in mine], f"{account}: order"
    assert 1 < ledger.peak <= MAX_RUNNING, f"peak of {ledger.peak} running at once"
    print(
        f"{len(messages)} messages on {PARTITIONS} partitions applied once each, "
        f"in order per account, at most {ledger.peak} at once (max_running={MAX_RUNNING}); "
        f"{redelivered} batch redelivered; balances exact"
    )


if __name__ == "__main__":
    asyncio.run(main())
