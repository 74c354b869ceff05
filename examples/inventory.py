"""Inventory: concurrent orders decrement stock with no lost update.

Each order reads a product's stock, waits for the database, and writes the
new count: a read-modify-write. Without a line per product, two orders that
read the same count both write count - n, and one sale vanishes from the
books. With ``@queue_by_key(key="stock-{product_id}")`` on the repository
method, orders of one product run one at a time, in arrival order, while
orders of different products still run concurrently.

Run: python examples/inventory.py
"""

from __future__ import annotations

import asyncio
import random

from inturn import queue_by_key


class StockRepository:
    """A stand-in for a database table of stock counts, with I/O latency."""

    def __init__(self, stock: dict[str, int]) -> None:
        self._rows = dict(stock)

    async def _read(self, product_id: str) -> int:
        await asyncio.sleep(random.uniform(0, 0.002))  # the round trip
        return self._rows[product_id]

    async def _write(self, product_id: str, count: int) -> None:
        await asyncio.sleep(random.uniform(0, 0.002))
        self._rows[product_id] = count

    @queue_by_key(key="stock-{product_id}")
    async def take(self, product_id: str, n: int) -> bool:
        """Take n items of a product; False (and nothing taken) if too few are left."""
        count = await self._read(product_id)
        if count < n:
            return False
        await self._write(product_id, count - n)
        return True

    def count(self, product_id: str) -> int:
        return self._rows[product_id]


async def main() -> None:
    products = {"sku-apple": 500, "sku-pear": 500, "sku-plum": 500}
    repo = StockRepository(products)
    orders = [(random.choice(list(products)), random.randint(1, 3)) for _ in range(600)]
    accepted = await asyncio.gather(*(repo.take(p, n) for p, n in orders))
    for product, initial in products.items():
        sold = sum(n for (p, n), ok in zip(orders, accepted, strict=True) if ok and p == product)
        left = repo.count(product)
        print(f"{product}: {initial} in stock, {sold} sold, {left} left")
        assert left == initial - sold, "an update was lost"
        assert left >= 0
    print("no update lost")


if __name__ == "__main__":
    asyncio.run(main())
