"""A Redis stream consumer group: bounded parallelism, per-account order, XACK after the batch.

The partitioned_batch.py pattern on a real Redis stream. Messages keyed by
account (a field ``account`` in each entry) are XADDed to a stream; a
consumer of a consumer group reads them in batches (``XREADGROUP ... COUNT
100``) and submits each one to a ``KeyedQueue(max_running=32)`` under its
account: an account's messages are applied one at a time in stream-ID order,
other accounts in parallel, never more than 32 at once.

Each batch runs in a ``queue.batch()`` scope, and its entries are XACKed only
after the scope exits, and only those that were applied. One write fails
once (a database blip): the scope raises an ExceptionGroup, the consumer acks
the batch's successes anyway, and the failed entry stays in the group's
Pending Entries List, with the account's later entries of that batch, held
back rather than applied past the gap. The next round reads the consumer's
own pending entries first (``XREADGROUP ... STREAMS s 0``) and applies them;
a consumer taking over a dead one's entries would ``XAUTOCLAIM`` them.

Later, one batch's XACK is lost (as if the consumer died between applying
and acknowledging), so the whole batch is delivered again. The ledger lives
in Redis with the stream ID it applied last per account, written in one
transaction with the balance, so those redelivered entries are skipped, not
applied twice. At the end every entry was applied exactly once, none pending.

Run: python examples/redis_stream_consumer.py [redis://localhost:6379/0] [--keep]
(the URL defaults to $REDIS_URL; --keep leaves the stream and ledger for a look)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from inturn import Handle, KeyedQueue

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

MAX_RUNNING = 32
BATCH = 100  # entries per XREADGROUP
MESSAGES = 600
ACCOUNTS = [f"acct-{i:02}" for i in range(60)]
HOT = ACCOUNTS[0]  # a tenth of the messages: it has several in every batch
GROUP, CONSUMER = "appliers", "consumer-1"


@dataclass(frozen=True)
class Message:
    id: str  # the stream entry's ID: "<ms>-<seq>", in the order Redis gave them
    account: str
    amount: int


@dataclass
class Consumer:
    redis: aioredis.Redis
    stream: str
    failing: str  # the entry whose first write fails
    running: int = 0  # messages being applied right now
    peak: int = 0
    halted: set[str] = field(default_factory=set)  # accounts with a failed message in this try
    failed: int = 0  # writes that failed
    held: int = 0  # messages held back behind a failed one
    duplicates: int = 0  # messages skipped as applied in an earlier delivery
    redelivered: int = 0  # pending entries read again


class DatabaseBlip(Exception):
    """A transient failure: the message is fine, the write did not happen."""


def order(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


async def apply(consumer: Consumer, message: Message) -> bool:
    """Apply one message to the ledger, once; False: held back behind a failed one."""
    consumer.running += 1
    consumer.peak = max(consumer.peak, consumer.running)
    try:
        if message.account in consumer.halted:
            consumer.held += 1
            return False  # an earlier message of the account failed: not past the gap
        r, ledger = consumer.redis, consumer.stream
        last = await r.hget(f"{ledger}:last", message.account)
        if last is not None and order(last) >= order(message.id):
            consumer.duplicates += 1
            return True  # applied in an earlier delivery
        await asyncio.sleep(random.uniform(0, 0.002))  # the rest of the work
        if message.id == consumer.failing and consumer.failed == 0:
            consumer.failed += 1
            consumer.halted.add(message.account)
            raise DatabaseBlip(f"write of {message.account} at {message.id} failed")
        async with r.pipeline(transaction=True) as tx:  # MULTI/EXEC: all or nothing
            tx.hincrby(f"{ledger}:balance", message.account, message.amount)
            tx.hset(f"{ledger}:last", message.account, message.id)
            tx.rpush(f"{ledger}:applied", message.id)
            await tx.execute()
        return True
    finally:
        consumer.running -= 1


async def produce(r: aioredis.Redis, stream: str) -> list[Message]:
    """XADD MESSAGES entries, a tenth of them for HOT; the messages, in stream order."""
    rng = random.Random(11)
    drafts = [
        (HOT if rng.random() < 0.1 else rng.choice(ACCOUNTS), rng.randint(-50, 100))
        for _ in range(MESSAGES)
    ]
    async with r.pipeline(transaction=False) as pipe:
        for account, amount in drafts:
            pipe.xadd(stream, {"account": account, "amount": amount})
        ids = await pipe.execute()
    return [Message(i, a, n) for i, (a, n) in zip(ids, drafts, strict=True)]


async def next_batch(consumer: Consumer) -> list[Message]:
    """This consumer's pending entries first (a redelivery), else up to BATCH new ones."""
    for start in ("0", ">"):
        reply = await consumer.redis.xreadgroup(
            GROUP, CONSUMER, {consumer.stream: start}, count=BATCH
        )
        batch = [
            Message(entry_id, fields["account"], int(fields["amount"]))
            for _, entries in reply or []
            for entry_id, fields in entries
        ]
        if batch:
            if start == "0":
                consumer.redelivered += len(batch)
            return batch
    return []


async def consume(consumer: Consumer) -> None:
    """Read, apply and acknowledge batch by batch until the group has nothing for us."""
    queue = KeyedQueue(max_running=MAX_RUNNING)
    rounds = 0
    while messages := await next_batch(consumer):
        rounds += 1
        consumer.halted.clear()
        handles: list[tuple[Message, Handle[bool]]] = []
        unexpected: Exception | None = None
        try:
            async with queue.batch() as batch:
                for m in messages:
                    handle = await batch.submit(m.account, apply, consumer, m)
                    handles.append((m, handle))  # (one at a time: a failed submit keeps these)
        except ExceptionGroup as group:  # raised after every submission finished
            blips, unexpected = group.split(DatabaseBlip)
            if blips is not None:
                print(f"{len(blips.exceptions)} failed ({blips.exceptions[0]}): left pending")
        # the scope exited: every submission has finished; ack those that were applied
        done = [m.id for m, h in handles if h.exception() is None and h.result()]
        if rounds == 3:  # (1: the blip; 2: its redelivery; 3: a batch of new entries)
            print(f"XACK of {len(done)} entries lost, as if the consumer died before it")
            done = []
        if done:
            await consumer.redis.xack(consumer.stream, GROUP, *done)
        print(f"acked {len(done)} of {len(messages)} entries")
        if unexpected is not None:
            raise unexpected  # not a transient failure: its entries stay pending


async def check(consumer: Consumer, messages: list[Message]) -> list[str]:
    """What went wrong, from the ledger and the group in Redis (nothing, if all is well)."""
    r, ledger = consumer.redis, consumer.stream
    problems = []
    applied = await r.lrange(f"{ledger}:applied", 0, -1)
    by_id = {m.id: m for m in messages}
    if sorted(applied, key=order) != [m.id for m in messages]:
        problems.append(f"{len(applied)} applications for {len(messages)} messages")
    balances = await r.hgetall(f"{ledger}:balance")
    for account in ACCOUNTS:
        mine = [m for m in messages if m.account == account]
        if [i for i in applied if by_id[i].account == account] != [m.id for m in mine]:
            problems.append(f"{account}: not applied once each in stream-ID order")
        if int(balances.get(account, 0)) != sum(m.amount for m in mine):
            problems.append(f"{account}: balance {balances.get(account)} is wrong")
    pending = (await r.xpending(ledger, GROUP))["pending"]
    if pending:
        problems.append(f"{pending} entries still pending")
    if not 1 < consumer.peak <= MAX_RUNNING:
        problems.append(f"peak of {consumer.peak} running at once")
    if consumer.failed != 1 or consumer.held == 0:
        problems.append(f"{consumer.failed} failed, {consumer.held} held back: expected 1, some")
    if consumer.duplicates != BATCH:
        problems.append(f"{consumer.duplicates} skipped as applied before: expected {BATCH}")
    return problems


async def main() -> int:
    parser = argparse.ArgumentParser(description="A Redis stream consumer with inturn.")
    parser.add_argument("url", nargs="?", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--keep", action="store_true", help="leave the stream and the ledger")
    args = parser.parse_args()
    url = args.url or "redis://localhost:6379/0"
    r = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        await r.ping()
    except aioredis.ConnectionError as error:
        await r.aclose()
        print(f"no Redis server at {url} ({error}): give its URL or set REDIS_URL", file=sys.stderr)
        return 2
    stream = f"inturn-example:{uuid.uuid4().hex[:12]}"
    try:
        await r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        messages = await produce(r, stream)
        # the one blip: HOT's third message, which has later ones in the first batch
        failing = [m.id for m in messages[:BATCH] if m.account == HOT][2]
        consumer = Consumer(r, stream, failing)
        await consume(consumer)
        problems = await check(consumer, messages)
        applications = await r.llen(f"{stream}:applied")
        pending = (await r.xpending(stream, GROUP))["pending"]
    finally:
        if not args.keep:
            await r.delete(stream, f"{stream}:balance", f"{stream}:last", f"{stream}:applied")
        await r.aclose()
    print(f"stream {stream}: {len(messages)} messages of {len(ACCOUNTS)} accounts")
    print(f"applied {applications} times, at most {consumer.peak} at once (max {MAX_RUNNING})")
    print(
        f"redelivered {consumer.redelivered} pending entries: {consumer.failed} that failed, "
        f"{consumer.held} held back behind it, {consumer.duplicates} applied before"
    )
    print(f"pending at the end: {pending}")
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    if problems:
        return 1
    print("every message applied once, in stream-ID order per account; nothing pending")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
