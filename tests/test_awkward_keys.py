"""Keys the README allows but that are awkward: a repr() that raises, a huge int, a shared hash.

Any hashable is a key, so every message that names a key must be built
without failing (a repr() may raise; an int beyond ``sys.get_int_max_str_digits()``
cannot become a str) and without flooding (a repr may be megabytes).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Hashable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from inturn import HoldTimeout, KeyedQueue, LeaseLost, QueueClosed, QueueFull, _order
from inturn._order import order_keys
from inturn.backends.file import FileBackend

from support.file_checks import line_file
from support.helpers import PATIENCE, settle, wait_until


class Unshowable:
    """A hashable key whose repr() raises."""

    def __repr__(self) -> str:
        raise RuntimeError("this key cannot be shown")


class UnshowableList(list[int]):
    """An unhashable value whose repr() raises."""

    def __repr__(self) -> str:
        raise RuntimeError("this value cannot be shown")


#: Beyond the 4,300 digits str() converts by default: repr() raises ValueError.
HUGE = 10**5000

AWKWARD = [
    pytest.param(Unshowable(), "Unshowable object at 0x", id="repr-raises"),
    pytest.param(HUGE, "0x", id="5000-digit-int"),
    pytest.param("x" * 100_000, "'xxx", id="100k-char-str"),
]


def assert_shown(message: str, shown: str) -> None:
    """The message names the key as ``shown`` starts, and is not flooded by it."""
    assert shown in message
    assert len(message) < 600


async def hold(queue: KeyedQueue, key: Hashable, release: asyncio.Event) -> asyncio.Task[None]:
    """Start a task holding key until release is set; return once it holds it."""
    held = asyncio.Event()

    async def holder() -> None:
        async with queue.keyed(key):
            held.set()
            await release.wait()

    task = asyncio.create_task(holder())
    await held.wait()
    return task


@pytest.mark.parametrize(("key", "shown"), AWKWARD)
async def test_a_waiter_on_an_awkward_key_times_out_at_its_deadline(
    key: Hashable, shown: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue = KeyedQueue()
    release = asyncio.Event()
    holder = await hold(queue, key, release)
    # The waiter's own timer ends it; wait_for only bounds a failure (it would hang).

    async def wait() -> None:
        async with queue.keyed(key, timeout=0.01):
            pass

    with pytest.raises(TimeoutError) as raised:
        await asyncio.wait_for(wait(), PATIENCE)
    assert str(raised.value).startswith("inturn: the turn for key ")
    assert_shown(str(raised.value), shown)
    assert "Exception in callback" not in caplog.text
    assert queue.stats().waiting == {}
    release.set()
    await holder


@pytest.mark.parametrize(("key", "shown"), AWKWARD)
def test_a_thread_waiting_on_an_awkward_key_times_out(key: Hashable, shown: str) -> None:
    queue = KeyedQueue()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            with queue.keyed(key, timeout=0.01):
                pass
        except BaseException as error:
            errors.append(error)

    with queue.keyed(key):
        thread = threading.Thread(target=wait)
        thread.start()
        wait_until(lambda: bool(errors), "the thread's turn timed out")
    thread.join()
    assert type(errors[0]) is TimeoutError
    assert_shown(str(errors[0]), shown)


@pytest.mark.parametrize(("key", "shown"), AWKWARD)
async def test_refusals_of_an_awkward_key_keep_their_type(key: Hashable, shown: str) -> None:
    queue, bounded = KeyedQueue(), KeyedQueue(max_pending=0)
    release = asyncio.Event()
    holders = [await hold(queue, key, release), await hold(bounded, key, release)]
    with pytest.raises(QueueFull) as full:
        await bounded.run(key, lambda: "ran")
    assert_shown(str(full.value), shown)
    with pytest.raises(TimeoutError) as busy:
        async with queue.keyed(key, timeout=0):
            pass
    assert_shown(str(busy.value), shown)
    queue.close()
    with pytest.raises(QueueClosed) as closed:
        await queue.submit(key, lambda: "ran")
    assert_shown(str(closed.value), shown)
    release.set()
    await asyncio.gather(*holders)


@pytest.mark.parametrize(("key", "shown"), AWKWARD)
async def test_reprs_show_an_awkward_key(key: Hashable, shown: str) -> None:
    queue = KeyedQueue()
    turn = queue.keyed(key)
    assert_shown(repr(turn), shown)
    async with turn:
        assert_shown(repr(turn), shown)
        assert_shown(repr(queue), shown)
    release = asyncio.Event()
    handle = await queue.submit(key, release.wait)
    assert_shown(repr(handle), shown)
    release.set()
    await handle


@pytest.mark.parametrize(("key", "shown"), AWKWARD)
async def test_max_hold_names_an_awkward_key(key: Hashable, shown: str) -> None:
    queue = KeyedQueue(max_hold=0.01)
    never = asyncio.Event()
    with pytest.raises(HoldTimeout) as cut:
        await asyncio.wait_for(queue.run(key, never.wait), PATIENCE)
    assert_shown(str(cut.value), shown)


async def test_an_unhashable_key_whose_repr_raises_is_refused_with_a_type_error() -> None:
    queue = KeyedQueue()
    key = UnshowableList([1])
    for attempt in (
        lambda: queue.keyed(key),
        lambda: queue.keyed("a", key),
    ):
        with pytest.raises(TypeError, match=r"UnshowableList object at 0x.*is unhashable"):
            attempt()
    with pytest.raises(TypeError, match="is unhashable"):
        await queue.run(key, lambda: "ran")


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        pytest.param(Unshowable(), "Unshowable object at 0x", id="repr-raises"),
        pytest.param(("x" * 100_000,), "('xxx", id="100k-char-tuple"),
    ],
)
async def test_a_key_a_backend_cannot_share_is_refused_with_a_type_error(
    directory: Path, key: Hashable, shown: str
) -> None:
    queue = KeyedQueue(backend=FileBackend(directory))
    with pytest.raises(TypeError, match="cannot name a line shared between processes") as refused:
        queue.keyed(key)
    assert_shown(str(refused.value), shown)


async def test_a_file_backend_names_a_huge_int_key_in_its_messages(directory: Path) -> None:
    backend = FileBackend(directory)
    holder_queue, waiter_queue = KeyedQueue(backend=backend), KeyedQueue(backend=backend)
    release = asyncio.Event()
    holder = await hold(holder_queue, HUGE, release)
    with pytest.raises(TimeoutError) as missed:
        async with waiter_queue.keyed(HUGE, timeout=0.01):
            pass
    assert_shown(str(missed.value), "0x")
    release.set()
    await holder

    async def lose() -> None:
        async with holder_queue.keyed(HUGE) as turn:
            assert_shown(repr(turn), "0x")
            line_file(directory, HUGE).unlink()  # as another process of this user might
            await settle(lambda: turn.lease_lost)

    with pytest.raises(LeaseLost) as lost:
        await lose()
    assert_shown(str(lost.value), "0x")


def test_redis_messages_name_a_huge_int_key() -> None:
    from inturn.backends.redis._calls import Config
    from inturn.backends.redis._steps import _unanswered

    config = Config(make=lambda: None, client=None, namespace="n", lease=10.0, channels="", host="")
    assert_shown(str(_unanswered(HUGE, 0.5, config, connecting=True)), "0x")


@pytest.mark.skipif(not hasattr(sys, "set_int_max_str_digits"), reason="no str() limit")
@pytest.mark.parametrize("limit", [4300, 0])
def test_an_int_is_shown_whatever_str_allows(limit: int) -> None:
    from inturn._describe import describe

    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        assert describe(HUGE).startswith("0x")
        assert describe(-HUGE).startswith("-0x")
        assert len(describe(HUGE)) <= 200
        assert describe(12345) == "12345"
        assert describe(True) == "True"
    finally:
        sys.set_int_max_str_digits(before)


def test_describe_never_raises_and_bounds_what_it_writes() -> None:
    from inturn._describe import describe

    assert describe("k") == "'k'"
    assert describe(("a", 1)) == "('a', 1)"
    assert describe(Unshowable()).startswith(f"<{__name__}.Unshowable object at 0x")
    long = describe("x" * 10_000)
    assert len(long) == 200
    assert long.startswith("'xxx")
    assert long.endswith("…")
    # a tuple whose repr fails still shows its parts
    assert describe(("a", Unshowable())).startswith("('a', <")
    assert describe(("a", HUGE)).startswith("('a', 0x")
    assert len(describe((HUGE, HUGE, HUGE))) <= 200


class Nameless:
    """A callable whose qualified name cannot be read: reading it raises."""

    def __call__(self) -> None: ...

    def __getattribute__(self, name: str) -> Any:
        if name == "__qualname__":
            raise RuntimeError("no names here")
        return object.__getattribute__(self, name)


def test_function_name_never_raises_and_bounds_what_it_writes() -> None:
    from inturn._describe import function_name

    def work() -> None: ...

    assert function_name(work).endswith(".<locals>.work()")
    assert function_name(Nameless()).startswith(f"<{__name__}.Nameless object at 0x")
    work.__qualname__ = "w" * 10_000
    assert len(function_name(work)) == 200
    assert function_name(work).endswith("…")


# -- one total order for several keys -----------------------------------------------------


class Twin:
    """Distinct twins are unequal keys that share their type, hash and repr."""

    def __hash__(self) -> int:
        return 7

    def __repr__(self) -> str:
        return "Twin()"


def _twins() -> tuple[tuple[Hashable, ...], tuple[Hashable, ...]]:
    a, b = Twin(), Twin()
    return (a, b), (b, a)


def _colliding_numbers() -> tuple[tuple[Hashable, ...], tuple[Hashable, ...]]:
    # 1 == Fraction(1): one line. Decimal(2**61) is another line with the same
    # hash (numbers hash modulo 2**61 - 1), and its type sorts between theirs.
    return (1, Decimal(2**61)), (Fraction(1), Decimal(2**61))


@pytest.mark.parametrize("keys", [_twins, _colliding_numbers], ids=["twins", "numbers"])
async def test_two_turns_on_the_same_keys_never_deadlock(
    keys: Any,
) -> None:
    first_keys, second_keys = keys()
    queue = KeyedQueue()
    release = asyncio.Event()
    # Hold both lines, so that each turn below waits at the first key of its order.
    holder = await hold_all(queue, first_keys, release)
    first = asyncio.create_task(enter(queue, first_keys))
    await settle(lambda: sum(queue.stats().waiting.values()) == 1)
    second = asyncio.create_task(enter(queue, second_keys))
    await settle(lambda: sum(queue.stats().waiting.values()) == 2)
    # Both lines are handed on at once. Taken in one order, the first turn
    # gets both; in opposite orders, each gets one and waits for the other.
    release.set()
    await holder
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert queue.active_count == 0


async def hold_all(
    queue: KeyedQueue, keys: tuple[Hashable, ...], release: asyncio.Event
) -> asyncio.Task[None]:
    held = asyncio.Event()

    async def holder() -> None:
        async with queue.keyed(*keys):
            held.set()
            await release.wait()

    task = asyncio.create_task(holder())
    await held.wait()
    return task


async def enter(queue: KeyedQueue, keys: tuple[Hashable, ...]) -> None:
    async with queue.keyed(*keys):
        pass


def test_the_order_of_lines_sharing_a_hash_is_the_same_for_every_caller() -> None:
    a, b, c = Twin(), Twin(), Twin()
    ordered = order_keys([a, b, c, "x"])
    assert order_keys([c, "x", b, a]) == ordered
    assert order_keys([b, a]) == tuple(key for key in ordered if key in (a, b))
    # equal keys are one line, in one place, whichever of them a caller names
    d = Decimal(2**61)
    assert order_keys([1, d]).index(1) == order_keys([Fraction(1), d]).index(Fraction(1))
    assert order_keys([d, True]).index(True) == order_keys([1.0, d]).index(1.0)


def test_ranks_of_lines_sharing_a_hash_are_kept_only_while_an_order_uses_them() -> None:
    gc.collect()
    before = len(_order._RANKS)
    kept = order_keys([Twin(), Twin()])
    for _ in range(1000):
        order_keys([Twin(), Twin()])
    gc.collect()
    assert len(_order._RANKS) == before + 2  # kept's two: no turn uses the others
    twins = kept
    del kept
    gc.collect()
    assert len(_order._RANKS) == before + 2  # twins still uses them
    del twins
    gc.collect()
    assert len(_order._RANKS) == before


async def test_several_awkward_keys_are_ordered_without_their_repr() -> None:
    queue = KeyedQueue()
    async with queue.keyed(HUGE, Unshowable(), "x", HUGE + 1) as turn:
        assert len(turn.keys) == 4


class Touchy:
    """A key whose == fails against a Twin: it cannot be placed among the twins."""

    def __hash__(self) -> int:
        return hash(Twin())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Touchy):
            return self is other
        raise RuntimeError(f"cannot compare with {type(other).__name__}")


def test_a_key_whose_equality_fails_is_refused_with_a_type_error() -> None:
    twins = order_keys([Twin(), Twin()])
    with pytest.raises(TypeError, match=r"key <.*Touchy object at 0x.*cannot be told apart"):
        order_keys([Touchy(), Touchy()])
    assert len(twins) == 2


class Flooding:
    """A value whose repr() is a megabyte long."""

    def __repr__(self) -> str:
        return "x" * 1_000_000


HOSTILE = [Unshowable(), Flooding()]


def _refuse(place: str, bad: object) -> None:
    """Give bad to one public place that refuses it and names it in its message."""
    from inturn import __main__ as command
    from inturn import otel

    queue = KeyedQueue()
    if place == "name":
        KeyedQueue(name=bad)  # type: ignore[arg-type]
    elif place == "backend":
        KeyedQueue(backend=bad)  # type: ignore[arg-type]
    elif place == "coalesce":
        queue.queue_by_key(coalesce=bad)  # type: ignore[call-overload]
    elif place == "decorate":
        queue.queue_by_key()(bad)  # type: ignore[call-overload]
    elif place == "instrument":
        otel.instrument(bad)  # type: ignore[arg-type]
    elif place == "inspect --redis":  # a URL without its scheme, a megabyte long (bad's part)
        command._open_lines(type("Options", (), {"redis": "h" * 1_000_000, "namespace": None})())
    elif place == "redis url":  # a URL whose scheme is a megabyte long
        from inturn.backends.redis import RedisBackend

        RedisBackend.from_url("h" * 1_000_000 + "://me:secret@host/0")
    else:  # a URL whose path is a megabyte long, that libpq cannot read
        from inturn.backends.postgres import PostgresBackend

        PostgresBackend.from_url("postgresql://me:secret@[::1/" + "h" * 1_000_000)


@pytest.mark.parametrize("bad", HOSTILE, ids=["repr-raises", "repr-floods"])
@pytest.mark.parametrize(
    "place",
    [
        "name",
        "backend",
        "coalesce",
        "decorate",
        "instrument",
        "inspect --redis",
        "redis url",
        "postgres url",
    ],
)
def test_a_refusal_names_a_hostile_value_briefly(place: str, bad: object) -> None:
    """A value whose repr() raises or floods is refused with its own error, briefly named."""
    with pytest.raises((TypeError, ValueError)) as refused:
        _refuse(place, bad)
    message = str(refused.value)
    assert message.startswith("inturn: "), message
    assert len(message) < 1_000, message[:300]
