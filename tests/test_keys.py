"""Key ordering for several keys, and key specs compiled at decoration."""

from __future__ import annotations

from typing import Any

import pytest

from inturn._keys import compile_key, order_keys


def test_order_drops_duplicates_and_is_stable() -> None:
    keys = ("b", "a", "c", "a", 3, (1, 2))
    ordered = order_keys(keys)
    assert sorted(map(repr, ordered)) == sorted(map(repr, {"a", "b", "c", 3, (1, 2)}))
    assert order_keys(reversed(keys)) == ordered


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
