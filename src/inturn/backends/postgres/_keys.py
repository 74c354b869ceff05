"""Keys to PostgreSQL advisory lock ids, for the PostgreSQL backend.

An advisory lock is named by one signed 64-bit integer. A key's id is the
first 8 bytes of a BLAKE2b digest of the namespace and the key's portable
name (:func:`inturn._keys.portable_name`, as the Redis backend names lines),
read as a big-endian signed integer: the same in every process, on every
host and Python version (no ``hash()``, which is salted per process).

Two keys share an id with probability about n**2 / 2**65 for n keys in use
at once: those two keys then share one line (they take turns with each
other), which never breaks exclusion. The namespace and the key are
length-delimited before hashing, so ("a", "bc") and ("ab", "c") differ.

``pg_locks`` shows an id as ``classid`` (the high 32 bits, unsigned),
``objid`` (the low 32 bits, unsigned) and ``objsubid = 1``: :func:`lock_parts`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Hashable

from ..._order import portable_name

#: BLAKE2b's personalisation: a new mapping (which would move every key) gets a new one.
_PERSON = b"inturn-pg-lock-1"


#: How many keys' ids are kept (a turn on a key used lately digests nothing: about 0.7 µs
#: less per turn); a bounded number, so idle keys cost nothing more.
_KEPT = 1024


@functools.lru_cache(maxsize=_KEPT, typed=True)
def lock_id(namespace: str, key: Hashable) -> int:
    """The advisory lock id of ``key`` in ``namespace``: a signed 64-bit integer.

    :raises TypeError: the key is not a ``str``, ``bytes`` or ``int``.
    """
    space = namespace.encode("utf-8")
    name = portable_name(key)
    digest = hashlib.blake2b(digest_size=8, person=_PERSON)
    digest.update(len(space).to_bytes(4, "big"))
    digest.update(space)
    digest.update(name)
    return int.from_bytes(digest.digest(), "big", signed=True)


def lock_parts(lock: int) -> tuple[int, int]:
    """``(classid, objid)``: how ``pg_locks`` shows the advisory lock ``lock`` (objsubid 1)."""
    unsigned = lock & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


#: The fate locks' personalisation (see fate_id).
_FATE = b"inturn-pg-fate-1"


def fate_id(lock: int, pid: int) -> int:
    """The advisory lock id of the *fate lock* of server session pid's turn of latest work
    on lock (see _latest): a signed 64-bit integer, apart from every key's (a digest of its
    own, as likely to meet a key's id as two keys are)."""
    digest = hashlib.blake2b(digest_size=8, person=_FATE)
    digest.update(lock.to_bytes(8, "big", signed=True))
    digest.update(pid.to_bytes(4, "big"))
    return int.from_bytes(digest.digest(), "big", signed=True)
