"""A keyed-message consumer: same key in order, others in parallel, drain before acknowledging.

A consumer reads batches of messages keyed by account (as from a Kafka topic
partitioned by account). Each message starts processing at once; messages of
one account run in arrival order; the batch is acknowledged (its offset
committed) only after ``drain()`` saw every message of the batch finish, so a
crash before the commit redelivers the batch instead of losing messages.

Run: python examples/batch.py
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from inturn import KeyedQueue

queue = KeyedQueue()
balances: dict[str, int] = {}
applied: list[int] = []  # message offsets, in the order they were applied


@dataclass(frozen=True)
class Message:
    offset: int
    account: str
    amount: int


@queue.queue_by_key(key="account-{message.account}")
async def apply(message: Message) -> None:
    balance = balances.get(message.account, 0)
    await asyncio.sleep(random.uniform(0, 0.003))  # the ledger write
    balances[message.account] = balance + message.amount
    applied.append(message.offset)


async def consume(batches: list[list[Message]]) -> int:
    committed = -1
    failures: list[BaseException] = []

    def collect(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())  # type: ignore[arg-type]

    for batch in batches:
        tasks = [asyncio.create_task(apply(message)) for message in batch]
        for task in tasks:
            task.add_done_callback(collect)
        await queue.drain()  # every message of this batch has finished
        assert all(task.done() for task in tasks)
        if failures:
            raise RuntimeError(f"not committing: {failures}")
        committed = batch[-1].offset  # acknowledge the whole batch
        print(f"committed offset {committed} after {len(batch)} messages")
    return committed


async def main() -> None:
    accounts = [f"acct-{i}" for i in range(8)]
    messages = [Message(n, random.choice(accounts), random.randint(-50, 100)) for n in range(400)]
    batches = [messages[i : i + 100] for i in range(0, len(messages), 100)]
    committed = await consume(batches)
    assert committed == messages[-1].offset
    for account in accounts:
        expected = sum(m.amount for m in messages if m.account == account)
        assert balances.get(account, 0) == expected, f"{account}: a message was lost"
        offsets = [o for o in applied if messages[o].account == account]
        assert offsets == sorted(offsets), f"{account}: applied out of order"
    print(f"{len(messages)} messages applied, each account's in order; balances exact")


if __name__ == "__main__":
    asyncio.run(main())
