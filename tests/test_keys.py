"""Key ordering for several keys, and key specs compiled at decoration."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from inturn import KeyedQueue
from inturn._keyspec import compile_key
from inturn._order import order_keys, order_portable, portable_key, portable_name


def test_order_drops_duplicates_and_is_stable() -> None:
    keys = ("b", "a", "c", "a", 3, (1, 2))
    ordered = order_keys(keys)
    assert sorted(map(repr, ordered)) == sorted(map(repr, {"a", "b", "c", 3, (1, 2)}))
    assert order_keys(reversed(keys)) == ordered


async def test_a_turns_keys_come_in_the_global_order_not_the_callers() -> None:
    # One order for every caller is what keeps two holders of overlapping keys
    # from deadlocking: turn.keys shows that order, whatever order was given.
    queue = KeyedQueue()
    keys = [f"acct-{n}" for n in range(20)]
    async with queue.keyed(*keys) as forward:
        pass
    async with queue.keyed(*reversed(keys), keys[0]) as backward:
        pass
    assert forward.keys == backward.keys == order_keys(keys)
    assert sorted(forward.keys) == sorted(keys)  # each once

    def in_a_thread() -> tuple[Any, ...]:
        with queue.keyed(*reversed(keys)) as turn:
            return turn.keys

    assert await asyncio.to_thread(in_a_thread) == forward.keys


async def test_on_a_backend_a_turns_keys_come_in_the_order_every_process_computes(
    tmp_path: Path,
) -> None:
    from inturn.backends.file import FileBackend

    queue = KeyedQueue(backend=FileBackend(tmp_path / "lines"))
    async with queue.keyed("b", 2, "a", b"a") as turn:
        pass
    assert turn.keys == order_portable(("a", b"a", "b", 2)) != ("b", 2, "a", b"a")


def test_equal_keys_of_different_types_are_one_key_in_one_place() -> None:
    # 1, 1.0 and True name the same line; the order must not depend on which
    # of them a caller wrote, or two callers could take the lines in opposite
    # orders and deadlock.
    assert len(order_keys([1, 1.0, True])) == 1
    others = ["x", b"y", 2, ("t", 1), -7]
    for one in (1, 1.0, True):
        ordered = order_keys([one, *others])
        assert ordered.index(one) == order_keys([1, *others]).index(1)


def test_order_refuses_unhashable_keys() -> None:
    with pytest.raises(TypeError):
        order_keys(["a", ["b"]])


def f(product_id: str, n: int = 1, *, tag: str = "t") -> None: ...


@pytest.mark.parametrize(
    ("spec", "args", "kwargs", "key"),
    [
        ("stock-{product_id}", ("p",), {}, "stock-p"),
        ("stock-{product_id}-{n}", ("p",), {}, "stock-p-1"),
        ("{tag}:{product_id}", ("p",), {"tag": "x"}, "x:p"),
        ("constant", ("p",), {}, "constant"),
        ("a{{b}}c", ("p",), {}, "a{b}c"),
        ("{{{product_id}}}", ("p",), {}, "{p}"),
        ("{n:>3}|", ("p", 7), {}, "  7|"),
        (lambda a: (a["product_id"], a["n"], a["tag"]), ("p",), {"n": 2}, ("p", 2, "t")),
        (None, ("p",), {}, f"{__name__}.f"),
        (42, ("p",), {}, 42),
    ],
)
def test_single_key_specs(
    spec: Any, args: tuple[Any, ...], kwargs: dict[str, Any], key: Any
) -> None:
    extract, several = compile_key(f, spec, None)
    assert not several
    assert extract(args, kwargs) == key


def test_keys_spec_mixes_constants_and_templates() -> None:
    extract, several = compile_key(f, None, ["all", "p-{product_id}", 3])
    assert several
    assert extract(("x",), {}) == ("all", "p-x", 3)


def test_missing_argument_raises_pythons_type_error() -> None:
    extract, _ = compile_key(f, "stock-{product_id}", None)
    with pytest.raises(TypeError, match="missing a required argument: 'product_id'"):
        extract((), {})


# -- keys shared between processes: their portable names ------------------------------------


PORTABLE = ["", "k", "é/𝄞", "\ud800", b"", b"\0\xff", 0, 1, -1, True, 10**602, -(10**602)]
HUGE = [2**2000, 2**2000 - 1, 10**5000, -(10**5000), 10**5000 + 1]


@pytest.mark.parametrize("key", [*PORTABLE, *HUGE], ids=lambda key: type(key).__name__)
def test_a_portable_name_turns_back_into_its_key(key: Any) -> None:
    name = portable_name(key)
    assert isinstance(name, bytes)
    back = portable_key(name)
    assert back == key
    assert type(back) is (int if isinstance(key, bool) else type(key))
    if not isinstance(key, bytes):  # (its text, as Redis keeps it)
        assert portable_key(name.decode("utf-8", "surrogatepass")) == key


def test_portable_names_are_distinct_and_keep_str_bytes_and_int_apart() -> None:
    big = [key for key in HUGE if key > 0]
    keys = ["1", b"1", 1, "", b"", 0, -1, *big, *(-key for key in big)]
    assert len({portable_name(key) for key in keys}) == len(keys)
    assert portable_name(True) == portable_name(1)
    assert len(order_portable([*keys, *reversed(keys)])) == len(keys)


def test_an_int_of_any_size_has_one_name_whatever_the_process_allows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = [portable_name(key) for key in HUGE]
    monkeypatch.setattr(sys, "set_int_max_str_digits", sys.set_int_max_str_digits)
    for limit in (640, 0, 100_000):
        sys.set_int_max_str_digits(limit)
        try:
            assert [portable_name(key) for key in HUGE] == names
            assert [portable_key(name) for name in names] == HUGE
        finally:
            sys.set_int_max_str_digits(4300)
    assert portable_name(12345) == b"i:12345"  # as it always was: older processes agree


@pytest.mark.parametrize("name", [b"", b"x:1", b"i:", b"i:12a", b"i:x", b"i:x-1", b"i: 1", "q"])
def test_what_is_no_portable_name_is_refused(name: bytes | str) -> None:
    with pytest.raises(ValueError, match="not the portable name"):
        portable_key(name)
