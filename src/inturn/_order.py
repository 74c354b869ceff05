"""One total order of keys: in process (any hashable), and portable across processes.

Every holder of several keys takes them in this order, so two holders of
overlapping keys never wait for each other in a cycle.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import Counter
from collections.abc import Hashable, Iterable
from typing import Final, final

from ._describe import DECIMAL_BITS, describe


def unhashable(key: object) -> TypeError:
    """Build the error for a key that cannot name a line."""
    return TypeError(
        f"inturn: key {describe(key)} is unhashable ({type(key).__name__}); a key must be "
        "hashable, for example a str, int, bytes, or a tuple of those"
    )


@final
class _Rank:
    """Where a line stands among the lines that share its hash."""

    __slots__ = ("__weakref__", "value")

    def __init__(self, value: int) -> None:
        self.value = value


class _Ordered(tuple[Hashable, ...]):
    """Keys in order, keeping alive the ranks their order used (see :func:`order_keys`)."""

    ranks: list[_Rank]


# line (any of its equal keys) -> its rank, while some order still uses it
_RANKS: weakref.WeakValueDictionary[Hashable, _Rank] = weakref.WeakValueDictionary()
_RANKING: Final = threading.Lock()  # makes finding or giving a rank one step
_NEXT_RANK: Final = itertools.count()


def order_keys(keys: Iterable[Hashable]) -> tuple[Hashable, ...]:
    """Drop duplicate keys and sort the rest into the queue's global order.

    The invariant: two keys that name different lines (``a != b``) are put
    the same way round by every call in this process while any order that
    put them so is in use (by a turn waiting for or holding its keys); equal
    keys (``1 == 1.0 == True``) are one line, in one place whichever a caller
    names. Keys are sorted by ``hash()``, which equal keys share; lines whose
    keys share a hash, by a rank each line gets on first sight, found by
    equality (never by type or repr(), which differ between equal keys and
    coincide between unequal ones). The tuple returned keeps its ranks alive
    (a turn keeps it as its ``keys``); a rank no tuple keeps, which no turn
    relies on, is dropped. Not across processes (see :func:`order_portable`).

    :raises TypeError: a key is unhashable, or its ``==`` failed against a
        key that shares its hash.
    """
    try:
        unique = dict.fromkeys(keys)  # raises TypeError for an unhashable key
    except TypeError:
        raise
    except Exception as error:  # a key's == failed against one that shares its hash
        raise TypeError(
            f"inturn: the keys {describe(keys)} cannot be told apart: comparing two that "
            f"share a hash raised {describe(error)}, so duplicates cannot be dropped; give "
            "the keys an __eq__ that does not fail"
        ) from error
    if len(unique) < 2:
        return tuple(unique)
    if len(unique) == 2:  # the common case of several: a transfer between two accounts
        first, second = unique
        one, other = hash(first), hash(second)
        if one != other:
            return (first, second) if one < other else (second, first)
        return _ranked([first, second])
    by_hash = {hash(key): key for key in unique}
    if len(by_hash) == len(unique):  # no two share a hash: the common case
        return tuple(map(by_hash.__getitem__, sorted(by_hash)))
    return _ranked(list(unique))


def _ranked(keys: list[Hashable]) -> _Ordered:
    """Sort keys, some of which share a hash, by hash and then by rank."""
    hashes = [hash(key) for key in keys]
    shared = {value for value, count in Counter(hashes).items() if count > 1}
    ranks: list[_Rank] = []
    places: list[tuple[int, int, int]] = []  # (hash, rank or -1, position in keys)
    with _RANKING:
        for at, (key, value) in enumerate(zip(keys, hashes, strict=True)):
            if value not in shared:
                places.append((value, -1, at))
                continue
            try:
                rank = _RANKS.get(key)
                if rank is None:
                    rank = _RANKS[key] = _Rank(next(_NEXT_RANK))
            except Exception as error:  # its == failed against a key ranked already
                raise TypeError(
                    f"inturn: key {describe(key)} cannot be told apart from the keys that "
                    f"share its hash ({describe(error)}), so it has no place in the order "
                    "of several keys; give it an __eq__ that does not fail"
                ) from error
            ranks.append(rank)
            places.append((value, rank.value, at))
    ordered = _Ordered(keys[at] for _, _, at in sorted(places))
    ordered.ranks = ranks
    return ordered


def portable_name(key: Hashable) -> bytes:
    """The bytes that name key's line outside this process, the same in every process.

    Only ``str``, ``bytes`` and ``int`` keys (``bool`` as ``int``) have one,
    whatever their size. The type is part of the name, so ``1`` and ``"1"``
    stay different lines; distinct keys have distinct names.
    """
    if isinstance(key, str):
        return b"s:" + key.encode("utf-8", "surrogatepass")
    if isinstance(key, bytes):
        return b"b:" + key
    if isinstance(key, int):
        if key.bit_length() <= DECIMAL_BITS:
            return b"i:%d" % key
        return b"i:-x%x" % -key if key < 0 else b"i:x%x" % key
    raise TypeError(
        f"inturn: key {describe(key)} ({type(key).__name__}) cannot name a line shared between "
        "processes; use a str, bytes or int key (for example f'order-{order_id}')"
    )


def portable_key(name: bytes | str) -> str | bytes | int:
    """The key that :func:`portable_name` gave name (or its UTF-8 text); a bool comes back an int.

    :raises ValueError: name is not a portable name.
    """
    if isinstance(name, str):
        name = name.encode("utf-8", "surrogatepass")
    kind, rest = name[:2], name[2:]
    if kind == b"s:":
        return rest.decode("utf-8", "surrogatepass")
    if kind == b"b:":
        return rest
    if kind == b"i:":
        sign, digits = (-1, rest[1:]) if rest.startswith(b"-") else (1, rest)
        hexadecimal = digits.startswith(b"x")
        digits = digits[1:] if hexadecimal else digits
        if digits.isalnum() and digits.isascii():
            try:
                return sign * int(digits, 16 if hexadecimal else 10)
            except ValueError:
                pass
    raise ValueError(f"inturn: {name[:80]!r} is not the portable name of a key")


def order_portable(keys: Iterable[Hashable]) -> tuple[Hashable, ...]:
    """Drop duplicate keys and sort the rest into an order every process computes alike.

    The order of :func:`portable_name`, never ``hash()``, which is salted per process.
    """
    if type(keys) is tuple and len(keys) == 1:  # (a turn's usual: nothing to sort)
        portable_name(keys[0])  # (checks its kind)
        return keys
    named = {portable_name(key): key for key in keys}
    return tuple(named[name] for name in sorted(named))
