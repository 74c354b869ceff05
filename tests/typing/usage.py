"""What type checkers see of inturn's public API: checked by mypy --strict, never run."""

from __future__ import annotations

from collections.abc import Coroutine, Hashable, Mapping
from typing import Any

from typing_extensions import assert_type

import inturn
from inturn import KeyedQueue, QueuedFunction, SyncQueuedFunction, Turn

queue = KeyedQueue(timeout=1.5, max_pending=10)


@inturn.queue_by_key
async def bare(n: int) -> str:
    return str(n)


@inturn.queue_by_key(key="stock-{product_id}")
async def take(product_id: str, n: int = 1) -> int:
    return n


@queue.queue_by_key(key=lambda args: args["user_id"], timeout=None, coalesce=True)
async def charge(user_id: int, cents: int) -> bool:
    return True


def key_of_args(args: Mapping[str, Any]) -> Hashable:
    return str(args["src"])


@queue.queue_by_key(key=key_of_args)
async def by_function(src: str) -> None: ...


@queue.queue_by_key(keys=["acct-{src}", "acct-{dst}"])
async def transfer(src: str, dst: str) -> None: ...


def a_key_by_position_is_a_type_error() -> None:
    # (refused at run time too; the unused-ignore check makes this line fail if it type-checks)
    queue.queue_by_key("stock-{id}")  # type: ignore[call-overload]


class Repository:
    @queue.queue_by_key(key="row-{self.table}-{row_id}")
    async def update(self, row_id: int, value: str) -> bytes:
        return value.encode()

    table = "t"


async def usage() -> None:
    decorated: QueuedFunction[[int], str] = bare
    del decorated
    assert_type(await bare(1), str)
    assert_type(await take("sku"), int)
    assert_type(await take("sku", n=2), int)
    coroutine: Coroutine[Any, Any, int] = take("sku")
    coroutine.close()
    assert_type(await charge(1, 2), bool)
    assert_type(take.queue, KeyedQueue)
    take.key_of("sku", 3)
    await transfer("a", "b")

    repo = Repository()
    assert_type(await repo.update(1, "v"), bytes)
    repo.update.key_of(1, "v")
    assert_type(await Repository.update(repo, 1, "v"), bytes)

    async with queue.keyed("a", "b", timeout=2) as turn:
        assert_type(turn, Turn)
        assert_type(turn.keys, tuple[Hashable, ...])
        assert_type(turn.token, int)
    async with inturn.keyed("system-log"):
        pass

    def add(a: int, b: int) -> int:
        return a + b

    async def add_later(a: int, b: int) -> int:
        return a + b

    assert_type(await queue.run("k", add, 1, 2), int)
    assert_type(await queue.run("k", add_later, 1, 2), int)
    assert_type(await inturn.run("k", add, 1, 2), int)

    assert_type(queue.is_active("k"), bool)
    assert_type(queue.pending("k"), int)
    assert_type(queue.active_keys, frozenset[Hashable])
    assert_type(queue.active_count, int)
    current = queue.current("k")
    if current is not None:
        await current
    await queue.drain()
    queue.close()
    await queue.aclose()


@inturn.queue_by_key
def bare_sync(n: int) -> str:
    return str(n)


@queue.queue_by_key(key="invoice-{invoice_id}", timeout=2)
def render(invoice_id: int) -> bytes:
    return b""


class SyncRepository:
    @queue.queue_by_key(keys=["row-{row_id}", "table"])
    def update(self, row_id: int) -> float:
        return 1.0


def sync_usage() -> None:
    decorated: SyncQueuedFunction[[int], str] = bare_sync
    del decorated
    assert_type(bare_sync(1), str)
    assert_type(render(3), bytes)
    assert_type(render.queue, KeyedQueue)
    render.key_of(3)
    assert_type(SyncRepository().update(1), float)

    def add(a: int, b: int) -> int:
        return a + b

    assert_type(queue.run_sync("k", add, 1, 2), int)
    assert_type(inturn.run_sync("k", add, 1, 2), int)
    with queue.keyed("a", "b") as turn:
        assert_type(turn, Turn)
    with inturn.keyed("system-log"):
        pass
    assert_type(queue.drain_sync(timeout=1), bool)


async def flow_control_is_typed() -> None:
    flow = KeyedQueue(max_running=8, concurrency=2, max_hold=1.5)
    assert_type(flow.max_running, int | None)
    assert_type(flow.concurrency, int)
    assert_type(flow.max_hold, float | None)

    async def fetch(sku: str) -> int:
        return len(sku)

    handle = await flow.submit("k", fetch, "sku")
    assert_type(handle, inturn.Handle[int])
    assert_type(await handle, int)
    assert_type(handle.cancel(), bool)
    assert_type(handle.result(), int)
    assert_type(handle.exception(), BaseException | None)
    handle.add_done_callback(lambda done: assert_type(done, inturn.Handle[int]))
    assert_type(handle.remove_done_callback(print), int)
    async with flow.batch(on_error="cancel") as batch:
        assert_type(batch, inturn.Batch)
        assert_type(await batch.submit("k", fetch, "sku"), inturn.Handle[int])
    await flow.drain(raise_errors=True)
    stats = flow.stats()
    assert_type(stats, inturn.QueueStats)
    assert_type(stats.running, int)
    assert_type(stats.hold_time, float | None)
    async with flow.keyed("k", max_hold=2.0):
        pass

    @flow.queue_by_key(key="sku-{sku}", max_hold=0.5)
    async def cut(sku: str) -> None: ...

    await cut("a")


def errors_are_exceptions() -> None:
    error: inturn.InturnError = inturn.QueueFull("full")
    error = inturn.QueueClosed("closed")
    del error


async def mistakes_type_checkers_catch() -> None:
    await take(42)  # type: ignore[arg-type]
    await take("sku", "many")  # type: ignore[arg-type]
    await Repository().update("not an int", "v")  # type: ignore[arg-type]
    await queue.run("k", lambda a: a, 1, 2)  # type: ignore[call-overload]
    render("not an int")  # type: ignore[arg-type]
    await render(1)  # type: ignore[misc]
    await queue.keyed("k")  # type: ignore[misc]  # (async with, not await)
    await queue.submit("k", take, 42)  # type: ignore[call-overload]
    queue.batch(on_error="ignore")  # type: ignore[arg-type]


latest = KeyedQueue(pending="latest", on_superseded="raise", debounce=0.5, max_wait=5.0)


@latest.queue_by_key(key="manifest-{server}", pending="latest", on_superseded="join")
async def sync_manifest(server: str, version: int) -> int:
    return version


@inturn.queue_by_key(key="prefs-{user_id}", debounce=0.2, max_wait=None)
def push_prefs(user_id: int) -> None:
    pass


async def latest_wins_is_typed() -> None:
    assert_type(await sync_manifest("a", 3), int)
    push_prefs(1)
    try:
        await latest.run("k", sync_manifest, "a", 1)
    except inturn.Superseded as error:
        assert_type(error, inturn.Superseded)
    assert_type(latest.stats().superseded, int)
    KeyedQueue(pending="newest")  # type: ignore[arg-type]
    latest.queue_by_key(key="k", on_superseded="drop")  # type: ignore[call-overload]
