"""Ordered chat: each conversation's messages are handled in order, conversations in parallel.

A bot answers messages; handling one takes a variable time (a model call, a
database write). Messages of one conversation must be handled in the order
they arrived, or replies contradict each other; messages of different
conversations should not wait for each other. The method's key template
reads the conversation id from ``self``.

Run: python examples/chat.py
"""

from __future__ import annotations

import asyncio
import random
import time

from inturn import queue_by_key


class Conversation:
    def __init__(self, conversation_id: str) -> None:
        self.conversation_id = conversation_id
        self.handled: list[int] = []

    @queue_by_key(key="conv-{self.conversation_id}")
    async def handle(self, seq: int, text: str) -> str:
        await asyncio.sleep(random.uniform(0, 0.01))  # thinking
        self.handled.append(seq)
        return f"[{self.conversation_id}] re: {text}"


async def main() -> None:
    conversations = [Conversation(f"c{i}") for i in range(10)]
    incoming = [(conv, seq) for seq in range(20) for conv in conversations]  # interleaved arrival
    start = time.perf_counter()
    replies = await asyncio.gather(*(c.handle(seq, f"message {seq}") for c, seq in incoming))
    elapsed = time.perf_counter() - start
    for conv in conversations:
        assert conv.handled == list(range(20)), f"{conv.conversation_id} out of order"
    print(f"{len(replies)} messages in {len(conversations)} conversations, each in arrival order")
    print(f"took {elapsed * 1000:.0f} ms: conversations ran in parallel")
    print("last reply:", replies[-1])


if __name__ == "__main__":
    asyncio.run(main())
